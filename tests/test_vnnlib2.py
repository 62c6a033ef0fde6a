"""VNN-LIB 2.0 properties (shardbound.compiler.vnnlib2): parsed to the same boxes and output
rows as their 1.0 twins, told apart from 1.0 by content, with one-line errors.

Twins: tests/data/vnnlib2/acasxu/ holds 2.0 twins of the ten ACAS Xu properties (written by
tests/vnnlib_twins.py); each is compared with its 1.0 original in ../shared/benchmarks when
that folder is there, and always with the 1.0 text got back from the twin by renaming its
elements. Random 1.0 properties built here (boxes, alternatives of boxes, linear rows,
equalities, several tensor shapes) are converted to 2.0 and must parse identically.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest

import zoo
from conftest import SHARED
from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.vnnlib import parse_vnnlib, parse_vnnlib_text
from test_verify import _verify_in_process
from vnnlib_twins import to_vnnlib2

TWINS = Path(__file__).parent / "data" / "vnnlib2" / "acasxu"
TWIN_FILES = sorted(TWINS.glob("prop_*.vnnlib"))


def assert_same_property(a, b):
    """Same inputs, outputs, boxes (in order) and output rows, bit for bit."""
    assert (a.num_inputs, a.num_outputs, len(a.cases)) == (b.num_inputs, b.num_outputs,
                                                           len(b.cases))
    for ca, cb in zip(a.cases, b.cases):
        assert np.array_equal(ca.lower, cb.lower) and np.array_equal(ca.upper, cb.upper)
        assert len(ca.disjuncts) == len(cb.disjuncts)
        for da, db in zip(ca.disjuncts, cb.disjuncts):
            assert np.array_equal(da.C, db.C) and np.array_equal(da.d, db.d)


def _back_to_1_0(text: str) -> str:
    """A 2.0 twin with one input and one output tensor, as VNN-LIB 1.0."""
    shapes = dict(re.findall(r"\(declare-(?:input|output)\s+([XY])\s+\S+\s+\[([\d,]*)\]", text))
    dims = {k: [int(d) for d in v.split(",") if d] for k, v in shapes.items()}

    def flat(m):
        index = [int(i) for i in m.group(2).split(",")]
        pos = 0
        for i, d in zip(index, dims[m.group(1)]):
            pos = pos * d + i
        return f"{m.group(1)}_{pos}"

    body = re.sub(r"\(vnnlib-version[^)]*\)", "", text)
    body = re.sub(r"\(declare-network\s+\w+\s*(\(declare-[^)]*\)\s*)+\)", "", body)
    body = re.sub(r"\b([XY])\[([\d,]+)\]", flat, body).replace("(== ", "(= ")
    sizes = {k: int(np.prod(v)) for k, v in dims.items()}
    decls = "".join(f"(declare-const {k}_{i} Real)\n" for k in "XY" for i in range(sizes[k]))
    return decls + body


def test_twins_are_committed():
    assert [p.name for p in TWIN_FILES] == sorted(f"prop_{i}.vnnlib" for i in range(1, 11))


@pytest.mark.parametrize("twin", TWIN_FILES, ids=lambda p: p.name)
def test_acasxu_twin_matches_its_1_0_text(twin):
    text = twin.read_text(encoding="utf-8")
    prop2 = parse_vnnlib(twin)
    assert (prop2.num_inputs, prop2.num_outputs) == (5, 5)
    assert_same_property(prop2, parse_vnnlib_text(_back_to_1_0(text), "twin-1.0"))


@pytest.mark.parametrize("twin", TWIN_FILES, ids=lambda p: p.name)
def test_acasxu_twin_matches_the_shared_1_0_file(twin):
    original = Path(SHARED) / "acasxu" / twin.name
    if not original.is_file():
        pytest.skip(f"shared benchmark acasxu/{twin.name} not present")
    assert_same_property(parse_vnnlib(twin), parse_vnnlib(original))
    assert to_vnnlib2(original.read_text(encoding="utf-8"), (1, 1, 1, 5), (1, 5),
                      network="acasxu") == twin.read_text(encoding="utf-8")


def _random_1_0(rng, n_in, n_out) -> str:
    lines = [f"(declare-const X_{i} Real)" for i in range(n_in)]
    lines += [f"(declare-const Y_{j} Real)" for j in range(n_out)]
    lo = rng.uniform(-2, 1, n_in).round(6)
    hi = (lo + rng.uniform(0.01, 2, n_in)).round(6)
    split = int(rng.integers(n_in))
    for i in range(n_in):
        if i == split:
            mid = round(float((lo[i] + hi[i]) / 2), 6)
            lines.append(f"(assert (or (and (>= X_{i} {float(lo[i])!r}) (<= X_{i} {mid!r})) "
                         f"(and (>= X_{i} {mid!r}) (<= X_{i} {float(hi[i])!r}))))")
        else:
            lines += [f"(assert (<= {float(lo[i])!r} X_{i}))", f"(assert (>= {float(hi[i])!r} X_{i}))"]
    alternatives = []
    for _ in range(int(rng.integers(1, 4))):
        j, k = rng.choice(n_out, 2, replace=n_out < 2)
        c = round(float(rng.uniform(-3, 3)), 4)
        kind = int(rng.integers(3))
        if kind == 0:
            alternatives.append(f"(and (<= Y_{j} Y_{k}))")
        elif kind == 1:
            alternatives.append(f"(and (>= (+ (* {c!r} Y_{j}) (- Y_{k}) 0.5) 1.25) "
                                f"(< Y_{j} 3))")
        else:
            alternatives.append(f"(= (- Y_{j} (* 2 Y_{k})) {c!r})")
    lines.append(f"(assert (or {' '.join(alternatives)}))")
    return "\n".join(lines) + "\n"


SHAPES = [((4,), (3,)), ((1, 2, 3), (2, 2)), ((2, 1, 1, 2), (1,)), ((3,), ())]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: f"{list(s[0])}->{list(s[1])}")
def test_random_properties_parse_like_their_1_0_twin(seed, shapes):
    in_shape, out_shape = shapes
    rng = np.random.default_rng(seed)
    text = _random_1_0(rng, int(np.prod(in_shape)), int(np.prod(out_shape)))
    twin = to_vnnlib2(text, in_shape, out_shape)
    assert_same_property(parse_vnnlib_text(twin, "twin.vnnlib"),
                         parse_vnnlib_text(text, "orig.vnnlib"))


def test_spacing_onnx_names_comments_and_scalars():
    text = """; a 2.0 property written by hand
(vnnlib-version <2.0>)
(declare-network f
    (declare-input X Real [1, 2] "input 0")   ; an ONNX name with a space
    (declare-output Y float64 [])
)
(assert (and (>= X [0, 0] -1) (<= X[0,0] 1.5) (>= X[0, 1] 0.0) (<= X [0,1] 0.25)))
(assert (or (<= Y -3.0) (>= Y 0.0)))
"""
    prop = parse_vnnlib_text(text, "hand.vnnlib")
    assert (prop.num_inputs, prop.num_outputs) == (2, 1)
    (case,) = prop.cases
    assert case.lower.tolist() == [-1.0, 0.0] and case.upper.tolist() == [1.5, 0.25]
    assert [(c.C.tolist(), c.d.tolist()) for c in case.disjuncts] == [
        ([[1.0]], [-3.0]), ([[-1.0]], [0.0])]


BASE = ("(vnnlib-version <2.0>)\n"
        "(declare-network f (declare-input X float32 [1,2]) (declare-output Y float32 [2]))\n")
BOX = "(assert (and (>= X[0,0] 0) (<= X[0,0] 1) (>= X[0,1] 0) (<= X[0,1] 1)))\n"


@pytest.mark.parametrize("text,line,needle", [
    ("(vnnlib-version 2.0)\n", 1, "malformed version"),
    ("(vnnlib-version <1.0>)\n", 1, "not supported"),
    ("(vnnlib-version <2.0>)\n(assert (<= 1 2))\n", 1, "no (declare-network"),
    (BASE + BOX + "(assert (<= X[0,2] 1))\n", 4, "index out of range in 'X[0,2]'"),
    (BASE + BOX + "(assert (<= X[0] 1))\n", 4, "bad index in 'X[0]'"),
    (BASE + BOX + "(assert (<= Y 1))\n", 4, "'Y' is a tensor of shape [2]"),
    (BASE + BOX + "(assert (<= Z[0] 1))\n", 4, "unknown variable 'Z[0]'"),
    (BASE + BOX + "(assert (!= Y[0] 1))\n", 4, "'!='"),
    (BASE + BOX + "(assert (= Y[0] 1))\n", 4, "'=='"),
    (BASE + BOX + "(assert (<= Y[0] Y[1] 3))\n", 4, "exactly two terms"),
    (BASE + "(assert (<= X[0,0] 1))\n", 2, "input X[0,0] has no lower bound"),
    (BASE + "(declare-network g (equal-to f) (declare-input A float32 [2])"
     " (declare-output B float32 [2]))\n", 3, "several networks"),
    ("(vnnlib-version <2.0>)\n(declare-network f (declare-input X int8 [2])"
     " (declare-output Y float32 [2]))\n", 2, "element type 'int8'"),
    ("(vnnlib-version <2.0>)\n(declare-network f (declare-input X float32 [2])\n"
     " (declare-hidden H float32 [2] \"h\") (declare-output Y float32 [2]))\n", 3,
     "declare-hidden"),
    ("(vnnlib-version <2.0>)\n(declare-network f (declare-input X float32 [2])\n"
     " (declare-input X2 float32 [2]) (declare-output Y float32 [2]))\n", 3,
     "second input tensor"),
    ("(vnnlib-version <2.0>)\n(declare-network f (declare-input X float32 [2,0])"
     " (declare-output Y float32 [2]))\n", 2, "bad shape '[2,0]'"),
    ("(vnnlib-version <2.0>)\n(declare-network f (declare-output Y float32 [2]))\n", 2,
     "declares no input"),
    (BASE + BOX + "(declare-const X_0 Real)\n", 4, "unsupported command 'declare-const'"),
])
def test_errors_are_one_line_with_file_and_line(text, line, needle):
    with pytest.raises(ShardboundError) as info:
        parse_vnnlib_text(text, "bad.vnnlib")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"bad.vnnlib:{line}: "), message
    assert needle in message, message


def test_verify_answers_a_2_0_property_like_its_1_0_twin(tmp_path):
    model, _ = zoo.mlp(np.random.default_rng(5), sizes=(3, 12, 12, 2))
    onnx.save(model, tmp_path / "net.onnx")
    text = "".join(f"(declare-const X_{i} Real)\n" for i in range(3))
    text += "(declare-const Y_0 Real)\n(declare-const Y_1 Real)\n"
    text += "".join(f"(assert (>= X_{i} -0.1))\n(assert (<= X_{i} 0.1))\n" for i in range(3))
    text += "(assert (>= Y_0 1000.0))\n"
    (tmp_path / "p1.vnnlib").write_text(text)
    (tmp_path / "p2.vnnlib").write_text(to_vnnlib2(text, (1, 3), (1, 2)))
    answers = []
    for name in ("p1", "p2"):
        # `shardbound verify` called in this process (the parsers' agreement is the claim;
        # test_verify.py and test_cli_experience.py run the real command)
        res = _verify_in_process([str(tmp_path / "net.onnx"), str(tmp_path / f"{name}.vnnlib"),
                                  "-q", "--result", str(tmp_path / f"{name}.txt")])
        assert res.returncode == 0, res.stderr
        answers.append((res.stdout, (tmp_path / f"{name}.txt").read_text()))
    assert answers[0] == answers[1] == ("unsat\n", "unsat\n")
