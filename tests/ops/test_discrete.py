"""The discrete family (runtime/ops/discrete.py, compiler/lowering/discrete.py): Floor, Ceil,
Round, Cast to integer types and bool, comparisons, logic, ArgMax / ArgMin, OneHot and Where
with a computed condition.

Besides the harness's forward checks (onnxruntime, onnx.reference) and soundness checks
(sampling + PGD, IBP and CROWN) on every case: each kernel's interval rule, checked directly
on intervals with ends on a half-integer grid (so ties, points and touching intervals occur),
contains every value its forward gives at the grid points inside them and is exact where the
rule says so; the CROWN step hands no A-matrix back (zero) and no NaN for infinite bounds; a
pixel-count model (scores -> ArgMax -> Equal -> Cast -> ReduceSum, as carvana's) is
verified unsat and sat."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

import zoo
from harness import OpCase, generate, sandwich

F32 = np.float32
SOUND = ("narrow", "wide", "degenerate")        # the boxes that matter for constant lines
ONE_HOT_BOXES = ("narrow", "degenerate")


def _to_float(b, t):
    return b.op("Cast", [t], to=TensorProto.FLOAT)


def _unary(op, **attrs):
    def apply(b, x, shape):
        return _to_float(b, b.op(op, [x], **attrs)), shape
    return apply


def _cast(to):
    def apply(b, x, shape):
        return _to_float(b, b.op("Cast", [x], to=to)), shape
    return apply


def _compare(op, layout):
    """x op c (constant right or left), or x op x' (two computed operands, one broadcast)."""
    def apply(b, x, shape):
        n = shape[1]
        if layout == "computed":
            other = b.op("Mul", [x, b.const(F32(-0.5))])
            other = b.op("ReduceMean", [other], axes=[1], keepdims=1)    # (1, 1): broadcast
            return _to_float(b, b.op(op, [x, other])), shape
        c = b.const(np.round(b.rng.uniform(-1, 1, size=(n,)), 1).astype(F32))
        ins = [x, c] if layout == "right" else [c, x]
        return _to_float(b, b.op(op, ins)), shape
    return apply


def _logic(op):
    def apply(b, x, shape):
        p = b.op("Less", [x, b.const(F32(0.3))])
        q = b.op("Greater", [x, b.const(F32(-0.2))])
        return _to_float(b, b.op(op, [p, q])), shape
    return apply


def _not(b, x, shape):
    return _to_float(b, b.op("Not", [b.op("Less", [x, b.const(F32(0.0))])])), shape


def _arg(op, **attrs):
    def apply(b, x, shape):
        y = b.op(op, [x], axis=1, keepdims=1, **attrs)
        return _to_float(b, y), (1, 1)
    return apply


def _one_hot(b, x, shape):
    idx = b.op("ArgMax", [x], axis=1, keepdims=0)
    depth = b.const(np.array(shape[1], np.int64))    # (onnx.reference: a scalar)
    values = b.const(np.array([-1.0, 2.0], F32))
    return b.op("OneHot", [idx, depth, values], axis=-1), shape


def _where(b, x, shape):
    cond = b.op("Less", [x, b.const(F32(0.1))])
    y = b.op("Mul", [x, b.const(F32(2.0))])
    return b.op("Where", [cond, x, y]), shape


def _net(apply, n=6):
    return lambda rng, o: sandwich(rng, o, (n,), apply, width=6, outputs=2)


CASES = [
    OpCase("floor", "Floor", _net(_unary("Floor")), opsets=(13,), boxes=SOUND, scale=3.0,
           methods=("ibp", "crown")),
    OpCase("ceil", "Ceil", _net(_unary("Ceil")), boxes=("wide",), scale=3.0,
           methods=("crown",)),
    OpCase("round", "Round", _net(_unary("Round")), boxes=("wide", "degenerate"), scale=3.0,
           methods=("crown",)),
    OpCase("cast_int32", "Cast", _net(_cast(TensorProto.INT32)),
           boxes=SOUND, scale=3.0, methods=("crown",)),
    OpCase("cast_bool", "Cast", _net(_cast(TensorProto.BOOL)), boxes=("degenerate",),
           methods=("crown",)),
    OpCase("less", "Less", _net(_compare("Less", "right")), boxes=SOUND,
           methods=("ibp", "crown")),
    OpCase("greater_left", "Greater", _net(_compare("Greater", "left")), boxes=("wide",),
           methods=("crown",)),
    OpCase("less_equal", "LessOrEqual", _net(_compare("LessOrEqual", "computed")),
           boxes=("wide",), methods=("crown",)),
    OpCase("greater_equal", "GreaterOrEqual", _net(_compare("GreaterOrEqual", "right")),
           boxes=("degenerate",), methods=("crown",)),
    OpCase("equal", "Equal", _net(_compare("Equal", "computed")), boxes=("degenerate",),
           methods=("crown",)),
    OpCase("and", "And", _net(_logic("And")), boxes=("wide",), methods=("crown",)),
    OpCase("or", "Or", _net(_logic("Or")), boxes=("degenerate",), methods=("crown",)),
    OpCase("xor", "Xor", _net(_logic("Xor")), boxes=("wide",), methods=("crown",)),
    OpCase("not", "Not", _net(_not), boxes=("wide",), methods=("crown",)),
    OpCase("argmax", "ArgMax", _net(_arg("ArgMax")), boxes=SOUND,
           methods=("ibp", "crown")),
    OpCase("argmax_last", "ArgMax", _net(_arg("ArgMax", select_last_index=1)),
           boxes=("wide",), methods=("crown",)),
    OpCase("argmin", "ArgMin", _net(_arg("ArgMin")), boxes=("narrow",), methods=("crown",)),
    OpCase("one_hot", "OneHot", _net(_one_hot), opsets=(11,), boxes=ONE_HOT_BOXES,
           methods=("crown",)),
    OpCase("where_computed", "Where", _net(_where), boxes=SOUND, methods=("ibp", "crown")),
]

generate(CASES, globals())


# -- the interval rules, directly, on a half-integer grid (ties and points occur) ------------------
GRID = np.arange(-3.0, 3.01, 0.5)


def _op(kind, in_shapes, **attrs):
    from shardbound.runtime.ops import OP_TYPES

    return OP_TYPES[kind]("t", [f"i{k}" for k in range(len(in_shapes))], in_shapes, **attrs)


def _intervals(rng, shape, B=40):
    """B boxes with ends on GRID: a third points, the rest any order of two grid values."""
    a = rng.choice(GRID, size=(B, *shape))
    b = rng.choice(GRID, size=(B, *shape))
    b = np.where(rng.uniform(size=a.shape) < 0.33, a, b)
    return torch.tensor(np.minimum(a, b), dtype=torch.float32), \
        torch.tensor(np.maximum(a, b), dtype=torch.float32)


def _points(lo, hi):
    """Every grid point of each box (boxes hold at most len(GRID) of them; the rest repeat
    the upper end)."""
    steps = ((hi - lo) / 0.5).round()
    return [lo + 0.5 * torch.minimum(steps, torch.full_like(steps, k)) for k in range(len(GRID))]


def _random_points(lo, hi, k, seed=0):
    """The box's ends, k random grid points, and for each j along the last axis the vertex
    with element j at its upper end and the others at their lower ends (and its mirror)."""
    steps = ((hi - lo) / 0.5).round()
    g = torch.Generator().manual_seed(seed)
    out = [lo, hi]
    for _ in range(k):
        out.append(lo + 0.5 * (torch.rand(lo.shape, generator=g) * (steps + 1)).floor()
                   .clamp(max=steps))
    for j in range(lo.shape[-1]):
        for base, end in ((lo, hi), (hi, lo)):     # ArgMax's vertex, and ArgMin's
            v = base.clone()
            v[..., j] = end[..., j]
            out.append(v)
    return out


ELEMENTWISE = [("floor", {}), ("ceil", {}), ("round", {}), ("cast_int", {"to": "int32"}),
               ("cast_int", {"to": "uint8"}), ("cast_bool", {})]
BINARY = ["equal", "less", "less_or_equal", "and", "or", "xor"]


@pytest.mark.parametrize("kind,attrs", ELEMENTWISE, ids=[k + str(a.get("to", ""))
                                                         for k, a in ELEMENTWISE])
def test_unary_rules_hold_and_are_attained(kind, attrs):
    op = _op(kind, [(5,)], **attrs)
    lo, hi = _intervals(np.random.default_rng(1), (5,))
    L, H = op.ibp((lo, hi))
    vals = torch.stack([op.forward(p) for p in _points(lo, hi)])
    assert bool(((vals >= L) & (vals <= H)).all()), kind
    if attrs.get("to") == "uint8":          # a wrap (negatives) gives the whole range
        return
    # monotone rules and cast_bool are exact: both ends are values at points of the box
    assert bool((vals.amin(0) == L).all() and (vals.amax(0) == H).all()), kind


@pytest.mark.parametrize("kind", BINARY)
def test_binary_rules_hold_and_are_attained(kind):
    rng = np.random.default_rng(2)
    op = _op(kind, [(6,), (6,)])
    a, b = _intervals(rng, (6,)), _intervals(rng, (6,))
    if kind in ("and", "or", "xor"):            # bool operands: boxes within {0, 1}
        a, b = [tuple(t.clamp(0, 1).round() for t in box) for box in (a, b)]
    L, H = op.ibp(a, b)
    pa, pb = _points(*a), _points(*b)
    vals = torch.stack([op.forward(x, y) for x, y in itertools.product(pa, pb)])
    assert bool(((vals >= L) & (vals <= H)).all()), kind
    assert bool((vals.amin(0) == L).all() and (vals.amax(0) == H).all()), kind


@pytest.mark.parametrize("kind,last", [("argmax", False), ("argmax", True), ("argmin", False)])
def test_arg_rules_hold_with_ties(kind, last):
    """Ties everywhere (grid values): every point's index lies in the interval, point boxes
    give a point, and the interval's ends are indices some point of the box attains."""
    op = _op(kind, [(3, 4)], axis=1, keepdims=False, select_last_index=last)
    lo, hi = _intervals(np.random.default_rng(3), (3, 4), B=60)
    L, H = op.ibp((lo, hi))
    vals = torch.stack([op.forward(p) for p in _random_points(lo, hi, 100)])
    assert bool(((vals >= L) & (vals <= H)).all())
    point = (lo == hi).all(-1)
    assert bool((L[point] == H[point]).all()) and bool((L[point] == vals[0][point]).all())
    assert bool((vals.amin(0) == L).all() and (vals.amax(0) == H).all())
    ort = pytest.importorskip("onnxruntime")           # tie rules as onnxruntime's
    x = vals.new_tensor(np.random.default_rng(4).choice([0.0, 1.0, 2.0], size=(50, 3, 4)))
    node = onnx.helper.make_node("ArgMax" if kind == "argmax" else "ArgMin", ["x"], ["y"],
                                 axis=2, keepdims=0, select_last_index=int(last))
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [50, 3, 4])],
        [onnx.helper.make_tensor_value_info("y", TensorProto.INT64, [50, 3])]),
        opset_imports=[onnx.helper.make_opsetid("", 13)])
    model.ir_version = 8
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]
                                ).run(None, {"x": x.numpy()})[0]
    assert np.array_equal(op.forward(x).numpy(), want.astype(F32))


def test_cast_int_matches_onnxruntime_out_of_range():
    """Truncation, the integer-indefinite value past int32 / int64, the 8-bit wrap; the
    interval rule holds on boxes that leave the range."""
    ort = pytest.importorskip("onnxruntime")
    x = np.array([-3e9, -2147483904., -1e9, -2.7, -0.5, 0.5, 2.7, 2.1e9, 2147483648., 3e9,
                  1e20, np.inf, -np.inf, 300.7, -129.5, 65535.9], F32)
    for to, name in ((TensorProto.INT32, "int32"), (TensorProto.INT64, "int64"),
                     (TensorProto.INT8, "int8"), (TensorProto.UINT16, "uint16")):
        g = onnx.helper.make_graph(
            [onnx.helper.make_node("Cast", ["x"], ["y"], to=to)], "g",
            [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(x)])],
            [onnx.helper.make_tensor_value_info("y", to, [len(x)])])
        m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 13)])
        m.ir_version = 8
        want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]
                                    ).run(None, {"x": x})[0].astype(np.float64)
        op = _op("cast_int", [(len(x),)], to=name)
        got = op.forward(torch.from_numpy(x)[None]).double().numpy()[0]
        assert np.array_equal(got, want.astype(F32).astype(np.float64)), (name, got, want)
        lo = torch.from_numpy(np.sort(x)[None, :-1].copy())
        hi = torch.from_numpy(np.sort(x)[None, 1:].copy())
        L, H = op.ibp((lo, hi))
        for p in (lo, hi, lo + (hi - lo) / 2):
            v = op.forward(torch.where(torch.isfinite(p), p, lo))
            assert bool(((v >= L) & (v <= H)).all()), name


def test_crown_step_passes_nothing_back_and_no_nan_on_infinite_bounds():
    op = _op("floor", [(4,)])
    lo = torch.tensor([[-np.inf, -1.5, 0.0, 2.0]])
    hi = torch.tensor([[0.5, np.inf, 0.0, 2.5]])
    A = torch.tensor([[[1.0, 0.0, -2.0, 3.0], [0.0, 0.0, 1.0, -1.0]]])
    (lA,), (uA,), lb, ub = op.crown_backward(A, A, [(lo, hi)])
    assert lA is None and uA is None            # zero: the engine propagates nothing further
    assert lb.tolist() == [[-np.inf, -2.0]] and ub.tolist() == [[6.0, -2.0]]
    assert op.inexact_inputs([(lo, hi)])[0].tolist() == [[True, True, False, False]]


# -- a pixel count, end to end ---------------------------------------------------------------------
def _pixel_count(rng):
    """x (1, 6) -> Gemm -> scores (1, 3, 4) (3 classes, 4 pixels) -> ArgMax over classes ->
    Equal(label 1) -> Cast -> ReduceSum: how many pixels are class 1."""
    b = zoo.Builder(rng, (6,), opset=13)
    s = b.gemm("x", 6, 12)
    s = b.op("Reshape", [s, b.const(np.array([1, 3, 4], np.int64))])
    idx = b.op("ArgMax", [s], axis=1, keepdims=0)
    hit = b.op("Equal", [idx, b.const(np.array(1, np.int64))])
    count = b.op("Cast", [hit], to=TensorProto.FLOAT)
    return b.build(b.op("ReduceSum", [count, b.const(np.array([1], np.int64))], keepdims=1))


def test_pixel_count_compiles_bounds_and_verifies(tmp_path):
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.verification.spec import spec_from_property
    from shardbound.runtime.verification.verdict import verify

    ort = pytest.importorskip("onnxruntime")
    model = _pixel_count(np.random.default_rng(5))
    onnx.save(model, tmp_path / "m.onnx")
    compile_model(str(tmp_path / "m.onnx"), str(tmp_path / "prog"), PassOptions())
    verifier = load(str(tmp_path / "prog"))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(6)
    xs = rng.uniform(-1, 1, size=(64, 6)).astype(F32)
    got = verifier.forward(torch.from_numpy(xs)).numpy().reshape(-1)
    want = np.array([session.run(None, {"x": x[None]})[0].item() for x in xs], F32)
    assert np.array_equal(got, want)
    c = xs[int(np.argmax(want))]
    count = float(want.max())
    lo, hi = c - F32(0.001), c + F32(0.001)
    lb, ub = verifier.bounds(lo, hi, method="crown")
    assert float(lb) == count == float(ub)          # a box this small fixes every pixel
    lo, hi = c - F32(0.5), c + F32(0.5)
    lb, ub = verifier.bounds(lo, hi, method="crown")
    samples = rng.uniform(lo, hi, size=(2000, 6)).astype(F32)
    vals = verifier.forward(torch.from_numpy(samples)).numpy().reshape(-1)
    assert float(lb) <= vals.min() and vals.max() <= float(ub) and float(lb) < float(ub)

    def run(lo, hi, threshold, tag):        # property: count <= threshold (violation region)
        lines = [f"(declare-const X_{i} Real)" for i in range(6)] + ["(declare-const Y_0 Real)"]
        for i, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
            lines += [f"(assert (>= X_{i} {a!r}))", f"(assert (<= X_{i} {b!r}))"]
        lines.append(f"(assert (<= Y_0 {threshold!r}))")
        path = tmp_path / f"{tag}.vnnlib"
        path.write_text("\n".join(lines) + "\n")
        return verify(verifier, spec_from_property(parse_vnnlib(str(path))), 30, SingleComm())

    small = (c - F32(0.001), c + F32(0.001))
    assert run(*small, count - 0.5, "unsat").verdict == "unsat"
    res = run(lo, hi, float(vals.min()), "sat")
    assert res.verdict == "sat", res
    y = session.run(None, {"x": res.x.astype(F32).reshape(1, 6)})[0].item()
    assert y <= float(vals.min()) and bool(((res.x >= lo) & (res.x <= hi)).all())
