"""Hostile inputs: every malformed file or flag gets exit code 2 and one `error:` line naming
the file and the field, node or tensor -- no traceback, no file written outside the output
directory -- and inputs that are merely extreme (huge boxes, huge weights) give bounds that
are infinite where they must be, never nan.

The cases run the real entry points in this process (`shardbound`, `compile`, `program.py`
with their arguments, as tests/test_cli_errors.py does): an uncaught exception fails the test
as a traceback would, and the exit code is the one the command gives. Every case runs in a
fresh directory with its own TMPDIR; afterwards only the case's output directory may have
changed and TMPDIR must be empty (temporary directories removed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import zoo

SHARDBOUND = [sys.executable, "-m", "shardbound.compiler.cli"]
TORCH_CACHES = ("torchinductor_",)   # torch's own cache folder (torch.optim imports it)


# -- running a case ---------------------------------------------------------------------------

def _snapshot(root) -> dict:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (st.st_mtime_ns, st.st_size)
    return out


class Case:
    """One command in a scratch directory that holds copies of the shared inputs."""

    def __init__(self, base, tmp_path, monkeypatch, capsys):
        self.dir = tmp_path / "case"
        shutil.copytree(base, self.dir)
        self.tmp = tmp_path / "tmpdir"
        self.tmp.mkdir()
        self.monkeypatch, self.capsys = monkeypatch, capsys
        monkeypatch.chdir(self.dir)
        monkeypatch.setattr(tempfile, "tempdir", str(self.tmp))

    def run(self, entry, argv, out=None):
        """(exit code, stdout, stderr); checks that only `out` (relative) changed."""
        from shardbound.compiler.cli import compile_main, main
        from shardbound.runtime.program.main import program_main

        before = _snapshot(self.dir)
        fn = {"shardbound": main, "compile": compile_main,
              "program": lambda a: program_main(str(self.dir / "prog"), a)}[entry]
        threads = torch.get_num_threads()
        self.capsys.readouterr()
        try:
            fn(list(argv))
            code = 0
        except SystemExit as e:
            code = e.code
        finally:
            torch.set_num_threads(threads)
        stdout, stderr = self.capsys.readouterr()
        after = _snapshot(self.dir)
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        allowed = (out.rstrip("/") + os.sep) if out else None
        stray = sorted(k for k in changed if not (allowed and (k + os.sep).startswith(allowed)))
        assert not stray, f"files written outside the output directory: {stray}"
        left = [n for n in os.listdir(self.tmp) if not n.startswith(TORCH_CACHES)]
        assert not left, f"left in TMPDIR: {left}"
        return code, stdout, stderr


def assert_one_error(code, stdout, stderr, *needles):
    lines = stderr.strip().splitlines()
    where = f"rc={code}\nstderr: {stderr!r}\nstdout: {stdout!r}"
    assert code == 2, where
    assert len(lines) == 1 and lines[0].startswith("error: "), where
    assert "Traceback" not in stderr + stdout, where
    assert "\x1b" not in stderr, where
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


# -- inputs -----------------------------------------------------------------------------------

def _write_property(path, lower, upper, rows, d, n_out=None):
    n_out = n_out or rows.shape[1]
    lines = [f"(declare-const X_{i} Real)" for i in range(len(lower))]
    lines += [f"(declare-const Y_{j} Real)" for j in range(n_out)]
    for i, (lo, hi) in enumerate(zip(lower, upper)):
        lines += [f"(assert (>= X_{i} {float(lo)!r}))", f"(assert (<= X_{i} {float(hi)!r}))"]
    for row, bound in zip(rows, d):
        terms = " ".join(f"(* {float(c)!r} Y_{j})" for j, c in enumerate(row) if c != 0)
        lines.append(f"(assert (<= (+ {terms} 0.0) {float(bound)!r}))")
    path.write_text("\n".join(lines) + "\n")


def _declared_input(dims) -> onnx.ModelProto:
    """A tiny model whose input declares `dims` (a Relu: no weights at all)."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "big",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _huge_weights() -> onnx.ModelProto:
    b = zoo.Builder(np.random.default_rng(0), (4,))
    h = b.relu(b.op("Gemm", ["x", b.const(np.full((6, 4), 3e38, np.float32)),
                             b.const(np.zeros(6, np.float32))], transB=1))
    return b.build(b.gemm(h, 6, 2))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Models, boxes, properties and compiled programs every case copies."""
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime.verification.spec import spec_from_property

    d = tmp_path_factory.mktemp("hostile")
    model, shape = zoo.build("mlp")                                  # 6 inputs, 5 outputs
    onnx.save(model, d / "mlp.onnx")
    n = int(np.prod(shape))
    for order in ("blocked", "exact", "fast"):
        compile_model(str(d / "mlp.onnx"), str(d / f"prog_{order}"), PassOptions(summation=order))
    shutil.copytree(d / "prog_blocked", d / "prog")
    onnx.save(_huge_weights(), d / "huge_weights.onnx")
    compile_model(str(d / "huge_weights.onnx"), str(d / "prog_huge"), PassOptions())
    (d / "box.json").write_text(json.dumps({"lower": [-0.5] * n, "upper": [0.5] * n}))
    (d / "huge_box.json").write_text(json.dumps({"lower": [-1e19] * n, "upper": [1e19] * n}))
    (d / "box4.json").write_text(json.dumps({"lower": [-1.0] * 4, "upper": [1.0] * 4}))
    _write_property(d / "prop.vnnlib", [-0.5] * n, [0.5] * n, np.array([[1.0, -1, 0, 0, 0]]),
                    [-100.0])
    _write_property(d / "prop_7_outputs.vnnlib", [-0.5] * n, [0.5] * n,
                    np.array([[1.0, 0, 0, 0, 0, 0, -1]]), [0.0])
    (d / "spec.json").write_text(spec_from_property(parse_vnnlib(d / "prop.vnnlib")).to_json())
    return d


@pytest.fixture
def case(base, tmp_path, monkeypatch, capsys):
    return Case(base, tmp_path, monkeypatch, capsys)


def _deep(n: int) -> str:
    return "[" * n + "1" + "]" * n


# -- malformed inputs: exit 2, one line naming the culprit ------------------------------------

def test_property_with_more_outputs_than_the_model(case):
    r = case.run("shardbound", ["verify", "mlp.onnx", "prop_7_outputs.vnnlib", "-q"])
    assert_one_error(*r, "prop_7_outputs.vnnlib", "7 outputs", "model has 5")


def test_vnnlib_nested_1000_deep(case):
    body = "(assert " + "(and " * 1000 + "(<= X_0 1.0)" + ")" * 1000 + ")"
    (case.dir / "deep.vnnlib").write_text("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n"
                                          + body + "\n")
    r = case.run("shardbound", ["verify", "mlp.onnx", "deep.vnnlib"])
    assert_one_error(*r, "deep.vnnlib:3:", "nested more than")


def test_vnnlib_error_does_not_echo_terminal_escapes(case):
    (case.dir / "esc.vnnlib").write_text("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n"
                                         "(assert (\x1b[2J\x1b[31m X_0 1))\n")
    r = case.run("shardbound", ["verify", "mlp.onnx", "esc.vnnlib"])
    assert_one_error(*r, "esc.vnnlib:3:", "\\x1b")


@pytest.mark.parametrize("what", ["box", "plan"])
def test_json_nested_1000_deep(case, what):
    if what == "box":
        (case.dir / "deep.json").write_text('{"lower": ' + _deep(1000) + ', "upper": [1]}')
        r = case.run("shardbound", ["run", "prog", "--box", "deep.json"])
        assert_one_error(*r, "deep.json", "nested")
    else:
        (case.dir / "prog" / "plan.json").write_text(_deep(1000))
        r = case.run("shardbound", ["run", "prog", "--box", "box.json"])
        assert_one_error(*r, "plan.json", "nested too deeply")


@pytest.mark.parametrize("value,needle", [("true", "true"), ("false", "false"),
                                          ('"0.5"', '"0.5"'), ("null", "null")])
def test_box_values_that_are_not_numbers(case, value, needle):
    (case.dir / "bad.json").write_text('{"lower": [0, 0, 0, 0, 0, %s], "upper": [1, 1, 1, 1, 1, 1]}'
                                       % value)
    r = case.run("shardbound", ["run", "prog", "--box", "bad.json"])
    assert_one_error(*r, "bad.json", "'lower'", needle, "not a number")


@pytest.mark.parametrize("problem", ["wrong shape", "nan", "float64", "int32", "missing"])
def test_tampered_weights(case, problem):
    from safetensors.torch import load_file, save_file

    path = case.dir / "prog" / "weights.safetensors"
    tensors = load_file(str(path))
    key = sorted(k for k in tensors if k.endswith(".weight"))[0]
    t = tensors[key]
    tensors[key] = {"wrong shape": lambda: t[:-1].clone(),
                    "nan": lambda: t.clone().fill_(float("nan")),
                    "float64": lambda: t.double(),
                    "int32": lambda: t.to(torch.int32),
                    "missing": lambda: None}[problem]()
    if tensors[key] is None:
        del tensors[key]
    save_file(tensors, str(path))
    r = case.run("shardbound", ["run", "prog", "--box", "box.json"])
    assert_one_error(*r, "weights.safetensors", repr(key))


@pytest.mark.parametrize("edit,needles", [
    (lambda p: p.update(mode="evil"), ["field 'mode'", "'evil'", "single, fsdp, tp"]),
    (lambda p: p.pop("mode"), ["field 'mode' is missing"]),
    (lambda p: p.update(format="shardbound-plan/9"), ["unknown plan format"]),
    (lambda p: p.update(summation=True), ["field 'summation'"]),
    (lambda p: p["input"].update(shape=[7]), ["input.shape", "program.py"]),
    (lambda p: p["nodes"].reverse(), ["field 'nodes' does not match program.py"]),
    (lambda p: p.update(mode="fsdp"), ["field 'mode' is 'fsdp' but program.py"]),
], ids=["evil-mode", "no-mode", "version", "bool-summation", "input-shape", "node-list",
        "other-mode"])
def test_plan_is_validated(case, edit, needles):
    path = case.dir / "prog" / "plan.json"
    plan = json.loads(path.read_text())
    edit(plan)
    path.write_text(json.dumps(plan))
    r = case.run("shardbound", ["run", "prog", "--box", "box.json"])
    assert_one_error(*r, "plan.json", *needles)


def test_unwritable_output_directory(case):
    (case.dir / "afile").write_text("x")
    r = case.run("compile", ["mlp.onnx", "-o", "afile/prog"])
    assert_one_error(*r, "afile/prog", "cannot write", "-o")


def test_result_file_that_is_a_directory(case):
    (case.dir / "res").mkdir()
    r = case.run("shardbound", ["verify", "mlp.onnx", "prop.vnnlib", "--result", "res", "-q",
                                "--timeout", "60"])
    assert_one_error(*r, "res", "cannot write the result")


@pytest.mark.parametrize("dims,count", [([1, 20000, 20000], 400_000_000),
                                        ([1, 100000, 100000], 10_000_000_000)])
def test_huge_declared_input_is_refused_before_any_allocation(case, dims, count):
    onnx.save(_declared_input(dims), case.dir / "big.onnx")
    assert os.path.getsize(case.dir / "big.onnx") < 200
    r = case.run("compile", ["big.onnx", "-o", "out"])
    assert_one_error(*r, "big.onnx", f"{count} elements", "--max-elements")


def test_max_elements_lets_a_large_model_through(case):
    onnx.save(_declared_input([1, 300, 400]), case.dir / "wide.onnx")
    r = case.run("compile", ["wide.onnx", "-o", "out", "--max-elements", "100000"])
    assert_one_error(*r, "120000 elements")
    code, _, stderr = case.run("compile", ["wide.onnx", "-o", "out", "-q",
                                           "--max-elements", "120000"], out="out")
    assert code == 0, stderr


@pytest.mark.parametrize("flag", [["--timeout", "nan"], ["--timeout", "-5"],
                                  ["--timeout", "inf"], ["--timeout", "0"]])
@pytest.mark.parametrize("command", ["verify", "run"])
def test_timeouts_that_are_not_a_budget(case, flag, command):
    argv = (["verify", "mlp.onnx", "prop.vnnlib"] if command == "verify"
            else ["run", "prog", "--box", "box.json"])
    r = case.run("shardbound", argv + flag)
    assert_one_error(*r, "--timeout", "positive number of seconds")


@pytest.mark.parametrize("edit,needle", [
    (lambda s: s.pop("num_outputs"), "num_outputs"),
    (lambda s: s["cases"][0]["conjunctions"][0].update(C=[1.0, 2.0]), "conjunctions[0].C"),
    (lambda s: s.update(cases=[]), "cases"),
    (lambda s: s["cases"][0].update(lower=[True] * 6), "cases[0].lower"),
    (lambda s: s["cases"][0].update(lower=s["cases"][0]["upper"][:1] * 6,
                                    upper=[-1.0] * 6), "lower <= upper"),
], ids=["no-outputs", "C-size", "no-cases", "bool-box", "empty-box"])
def test_spec_files_are_validated(case, edit, needle):
    spec = json.loads((case.dir / "spec.json").read_text())
    edit(spec)
    (case.dir / "spec.json").write_text(json.dumps(spec))
    r = case.run("program", ["--verify", "spec.json", "--verify-timeout", "30"])
    assert_one_error(*r, "spec.json", needle)


def test_not_an_onnx_file(case):
    (case.dir / "junk.onnx").write_bytes(b"\x08\x07" + os.urandom(64))
    r = case.run("compile", ["junk.onnx", "-o", "out"])
    assert_one_error(*r, "junk.onnx")


# -- extreme but valid inputs: bounds, never nan ----------------------------------------------

@pytest.mark.parametrize("order", ["blocked", "exact", "fast"])
@pytest.mark.parametrize("method", ["ibp", "crown", "alpha-crown"])
def test_huge_box_gives_infinite_or_finite_bounds_never_nan(case, order, method):
    (case.dir / "out").mkdir()
    code, stdout, stderr = case.run("shardbound", ["run", f"prog_{order}", "--box",
                                                   "huge_box.json", "--method", method,
                                                   "--json", "out/o.json"], out="out")
    assert code == 0 and stderr == "", stderr
    assert "nan" not in stdout.lower()
    res = json.loads((case.dir / "out" / "o.json").read_text())
    lo, hi = np.array(res["lower"]), np.array(res["upper"])
    assert not np.isnan(lo).any() and not np.isnan(hi).any()
    assert (lo <= hi).all()


def test_huge_weights_compile_and_give_bounds_never_nan(case):
    for method in ("ibp", "crown", "alpha-crown"):
        code, stdout, stderr = case.run("shardbound", ["run", "prog_huge", "--box", "box4.json",
                                                       "--method", method])
        assert code == 0 and stderr == "", stderr
        assert "nan" not in stdout.lower() and "inf" in stdout


def test_huge_box_bounds_hold_on_samples(base):
    """Where bounds through a huge box stay finite they must still be sound."""
    from shardbound.runtime import load

    v = load(str(base / "prog_blocked"))
    n = int(np.prod(v.input_shape))
    for scale in (1e6, 1e12, 1e19):
        lo, hi = torch.full((n,), -scale), torch.full((n,), scale)
        g = torch.Generator().manual_seed(0)
        x = lo + torch.rand(2000, n, generator=g) * (hi - lo)
        x = torch.cat([x, torch.where(torch.rand(2000, n, generator=g) < 0.5, lo, hi)])
        y = v.forward(x)
        for method in ("ibp", "crown", "alpha-crown"):
            lb, ub = v.bounds(lo, hi, method=method)
            assert not torch.isnan(lb).any() and not torch.isnan(ub).any()
            ok = torch.isfinite(y).all(dim=1)
            assert (y[ok] >= lb - 1e-5 * lb.abs()).all() and (y[ok] <= ub + 1e-5 * ub.abs()).all()


# -- counterexamples: the point evaluated, inside the box -------------------------------------

def _onnx_forward(model, x):
    ort = pytest.importorskip("onnxruntime")
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: np.asarray(x, np.float32).reshape(1, -1)})[0][0]


def _result_values(text):
    lines = text.strip().splitlines()
    body = " ".join(lines[1:]).replace("(", " ").replace(")", " ").split()
    return lines[0], {k: float(v) for k, v in zip(body[0::2], body[1::2])}


def test_counterexample_is_the_evaluated_point_inside_the_box(case, base):
    """Bounds that float32 cannot represent (0.1, 1/3): a sat answer's X must lie in the real
    box and be the float32 point whose output is reported; a box holding no float32 point
    in some input cannot be confirmed at all (not sat)."""
    model = onnx.load(base / "mlp.onnx")
    lo = [0.1, 1 / 3, -0.7, 0.2, 0.3, -0.1]
    hi = [0.1 + 1e-3, 1 / 3 + 1e-3, -0.7 + 1e-3, 0.2 + 1e-3, 0.3 + 1e-3, -0.1 + 1e-3]
    _write_property(case.dir / "p.vnnlib", lo, hi, np.array([[1.0, 0, 0, 0, 0]]), [1e6])
    (case.dir / "out").mkdir()
    code, stdout, stderr = case.run("shardbound", ["verify", "mlp.onnx", "p.vnnlib", "-q",
                                                   "--result", "out/r.txt"], out="out")
    assert code == 0, stderr
    verdict, values = _result_values((case.dir / "out" / "r.txt").read_text())
    assert verdict == "sat"
    x = np.array([values[f"X_{i}"] for i in range(6)])
    assert (x >= lo).all() and (x <= hi).all(), x - np.array(lo)
    assert (x.astype(np.float32).astype(np.float64) == x).all()       # a float32 point
    y = _onnx_forward(model, x)
    assert np.allclose([values[f"Y_{j}"] for j in range(5)], y, rtol=1e-5, atol=1e-6)
    lo[0] = hi[0] = 0.1                                      # no float32 equals 0.1
    _write_property(case.dir / "p.vnnlib", lo, hi, np.array([[1.0, 0, 0, 0, 0]]), [1e6])
    code, stdout, stderr = case.run("shardbound", ["verify", "mlp.onnx", "p.vnnlib", "-q",
                                                   "--timeout", "5", "--result", "out/r.txt"],
                                    out="out")
    assert code == 0, stderr
    assert (case.dir / "out" / "r.txt").read_text().split()[0] in ("unknown", "timeout")


# -- the real processes: no traceback from the console scripts themselves ----------------------

def test_console_script_user_errors_are_one_line(base, tmp_path):
    """A few of the cases above through real processes (exit codes, streams, TMPDIR)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("WORLD_SIZE", None)
    (tmp_path / "deep.json").write_text('{"lower": ' + _deep(1000) + ', "upper": [1]}')
    runs = [
        SHARDBOUND + ["verify", str(base / "mlp.onnx"), str(base / "prop_7_outputs.vnnlib")],
        SHARDBOUND + ["run", str(base / "prog"), "--box", str(tmp_path / "deep.json")],
        SHARDBOUND + ["run", str(base / "prog"), "--box", str(base / "box.json"), "--timeout",
                      "nan"],
    ]
    for argv in runs:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env,
                           cwd=tmp_path)
        assert_one_error(r.returncode, r.stdout, r.stderr)
    assert sorted(os.listdir(tmp_path)) == ["deep.json"]


def test_a_call_from_python_counts_its_budget_from_the_call(case, monkeypatch):
    """`verify` called from a long-lived Python process (a notebook, this test session) gets
    its whole --timeout: the budget counts from the process start only for the command
    itself (an hour-old pytest process answered `timeout` at once)."""
    from shardbound.runtime.program import verify_main

    monkeypatch.setattr(verify_main, "process_age", lambda: 3600.0)
    lo, hi = [0.0] * 6, [0.1] * 6
    _write_property(case.dir / "p.vnnlib", lo, hi, np.array([[1.0, 0, 0, 0, 0]]), [1e6])
    (case.dir / "out").mkdir()
    code, stdout, stderr = case.run("shardbound", ["verify", "mlp.onnx", "p.vnnlib", "-q",
                                                   "--timeout", "600", "--result", "out/r.txt"],
                                    out="out")
    assert code == 0, stderr
    assert (case.dir / "out" / "r.txt").read_text().splitlines()[0] == "sat"


@pytest.mark.parametrize("C, needle", [
    ([[1.0, float("nan"), 0.0, 0.0, 0.0]], "non-finite"),
    ([[float("inf"), 0.0, 0.0, 0.0, 0.0]], "non-finite"),
    ([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2, "shape (2, 6)"),          # as given, not reshaped
])
def test_python_spec_matrix_is_validated(base, C, needle):
    """A C row with inf or nan gave (-inf, inf) bounds silently; now a one-line error."""
    from shardbound.compiler.errors import ShardboundError
    from shardbound.runtime import load

    v = load(str(base / "prog_blocked"))
    lo = torch.zeros(6)
    with pytest.raises(ShardboundError, match=re.escape(needle)):
        v.bounds(lo, lo + 0.1, C=torch.tensor(C))
