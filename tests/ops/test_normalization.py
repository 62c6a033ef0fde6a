"""The normalization family (runtime/ops/normalization.py, compiler/lowering/normalization.py):
LayerNormalization (opset 17: last axis, several axes, with and without bias), the patterns of
older exports (ReduceMean / Sub / Pow / ReduceMean / Add / Sqrt / Div; Mul c * c, ReduceSum /
D and c * Reciprocal(Sqrt)), torch.nn.LayerNorm exported at opsets 13 and 17, and the
kernel's IBP and CROWN lines alone on boxes of every width (exact IBP, sound lines, never NaN)."""

from __future__ import annotations

import io
import os
import tempfile

import numpy as np
import pytest
import torch

from harness import OpCase, generate
from test_movement import ints, twice


def _layer_norm(axis=-1, bias=True, eps=1e-5):
    def apply(b, x, full, opset):
        shape = full[axis:]
        ins = [x, b.const(b.rng.uniform(0.5, 1.5, shape))]
        if bias:
            ins.append(b.const(b.rng.normal(0, 0.5, shape)))
        return b.op("LayerNormalization", ins, axis=axis, epsilon=eps)
    return apply


def _pattern(square="pow", mean="mean", root="div"):
    """What torch exports before opset 17 (and its variants), over the last axis."""
    def apply(b, x, full, opset):
        axes = {"axes": [-1]}
        mu = b.op("ReduceMean", [x], keepdims=1, **axes)
        c = b.op("Sub", [x, mu])
        sq = (b.op("Pow", [c, b.const(np.float32(2.0))]) if square == "pow"
              else b.op("Mul", [c, c]))
        if mean == "mean":
            var = b.op("ReduceMean", [sq], keepdims=1, **axes)
        else:                                   # ReduceSum / D
            var = b.op("Div", [b.op("ReduceSum", [sq, b.const(ints(-1))], keepdims=1),
                               b.const(np.float32(full[-1]))])
        std = b.op("Sqrt", [b.op("Add", [var, b.const(np.float32(1e-5))])])
        n = (b.op("Div", [c, std]) if root == "div"
             else b.op("Mul", [b.op("Reciprocal", [std]), c]))
        n = b.op("Mul", [n, b.const(b.rng.uniform(0.5, 1.5, full[-1:]))])
        return b.op("Add", [n, b.const(b.rng.normal(0, 0.5, full[-1:]))])
    return apply


def _case(name, op, apply, shape, opsets, **kw):
    return OpCase(name, op, lambda rng, o: twice(rng, o, shape, lambda b, x, f: apply(b, x, f, o)),
                  opsets=opsets, **kw)


CASES = [
    _case("layer_norm", "LayerNormalization", _layer_norm(), (3, 4), (17,)),
    _case("layer_norm_two_axes_no_bias", "LayerNormalization", _layer_norm(-2, bias=False),
          (2, 3, 4), (17,), boxes=("wide", "degenerate"), reference=False),
    _case("layer_norm_pattern", "Div", _pattern(), (3, 4), (13,), reference=False,
          boxes=("narrow", "wide", "saturated")),
    _case("layer_norm_pattern_mul_sum_rsqrt", "Mul", _pattern("mul", "sum", "rsqrt"), (2, 5),
          (13,), boxes=("kinks",), reference=False),
]

generate(CASES, globals())


def _kinds(case_model_ops):
    return [n.kind for n in case_model_ops]


def test_patterns_become_one_normalize_node():
    """Each case compiles to one `normalize` per LayerNorm use (reading c and the mean
    square v = mean(c^2) + eps, which CROWN bounds), and the pattern's Sqrt (and Reciprocal)
    are gone."""
    from harness import compiled

    for case in CASES:
        verifier, _ = compiled(case, case.opsets[0])
        kinds = _kinds(verifier.network.nodes)
        assert kinds.count("normalize") == 2, (case.name, kinds)
        assert not {"sqrt", "reciprocal"} & set(kinds), (case.name, kinds)
        for n in verifier.network.nodes:
            if n.kind == "normalize":
                assert verifier.network.by_name[n.inputs[0]].kind == "add"     # x - mean(x)


@pytest.fixture(scope="module")
def torch_layer_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Unflatten(1, (3, 4)),
                                torch.nn.LayerNorm(4), torch.nn.Flatten(), torch.nn.Linear(12, 3))
    with torch.no_grad():
        model[2].weight.uniform_(0.5, 1.5)
        model[2].bias.normal_()
    return model.eval()


@pytest.mark.parametrize("opset", [13, 17])
def test_torch_layer_norm_export(torch_layer_norm, opset):
    """torch.nn.LayerNorm exported with dynamo=False at opset 13 (the pattern) and 17 (the op)
    compiles to the same nodes and agrees with onnxruntime; CROWN bounds are sound and
    tighter than IBP."""
    ort = pytest.importorskip("onnxruntime")
    import warnings

    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from soundness import assert_sound

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ln.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(torch_layer_norm, torch.randn(1, 6), path, opset_version=opset,
                              dynamo=False)
        compile_model(path, os.path.join(d, "out"), PassOptions())
        verifier = load(os.path.join(d, "out"))
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [n.kind for n in verifier.network.nodes] == [
        "input", "linear", "reshape", "reduce_sum", "move", "add", "pow", "reduce_sum", "affine",
        "normalize", "reshape", "linear"]
    x = np.random.default_rng(3).normal(size=(1, 6)).astype(np.float32)
    want = session.run(None, {session.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(verifier.forward(torch.from_numpy(x)).numpy(), want,
                               rtol=1e-5, atol=1e-5)
    lo, hi = torch.from_numpy(x - 0.05), torch.from_numpy(x + 0.05)
    il, iu = verifier.bounds(lo, hi, method="ibp")
    cl, cu = verifier.bounds(lo, hi, method="crown")
    assert bool(((cu - cl) < (iu - il)).all())
    assert_sound(verifier.network.forward, lo, hi, cl.reshape(-1), cu.reshape(-1), n=2000)


# -- the kernel alone ---------------------------------------------------------------------------------
def _kernel(shape=(3, 5), axes=(1,), eps=1e-5):
    from shardbound.runtime.ops.normalization import Normalize

    reduced = tuple(1 if a in axes else d for a, d in enumerate(shape))
    return Normalize("n", ["c", "v"], [shape, reduced], axes=axes, eps=eps, order="blocked")


def _v_bounds(op, lo, hi):
    """Sound bounds of v = mean(c^2) + eps (IBP through the square and the mean)."""
    sq_hi = torch.maximum(lo * lo, hi * hi)
    sq_lo = torch.where((lo <= 0) & (hi >= 0), torch.zeros_like(lo), torch.minimum(lo * lo, hi * hi))
    return (sq_lo.mean(-1, keepdim=True) * (1 - 1e-6) + op.eps,
            sq_hi.mean(-1, keepdim=True) * (1 + 1e-6) + op.eps)


def _boxes(rng, shape, n=6):
    """Boxes (B, *shape) of every kind: narrow, wide, huge, degenerate, across 0, mixed."""
    B = 6 * n
    center = rng.normal(0, 1, (B, *shape)) * np.where(rng.uniform(size=(B, 1, 1)) < 0.3, 1e3, 1)
    width = np.concatenate([
        np.full((n, *shape), 1e-6), rng.uniform(0.5, 3, (n, *shape)),
        rng.uniform(1e2, 1e3, (n, *shape)), np.zeros((n, *shape)),
        rng.uniform(0, 1, (n, *shape)) * (rng.uniform(size=(n, *shape)) < 0.5),
        10.0 ** rng.uniform(-7, 3, (n, *shape))])
    lo = (center - width / 2).astype(np.float32)
    hi = np.maximum((center + width / 2).astype(np.float32), lo)
    return torch.from_numpy(lo), torch.from_numpy(hi)


def test_kernel_ibp_is_exact_and_lines_are_sound():
    """On 36 boxes (widths 0 .. 1e3, centres up to 1e3): sampled outputs (float64) lie in
    the IBP bounds, which the corners reach to 1e-4 of the width; the CROWN lines, applied
    to random A-matrices, bound A . y at every sample; nothing is NaN."""
    rng = np.random.default_rng(0)
    op = _kernel()
    lo, hi = _boxes(rng, op.in_shapes[0])
    il, iu = op.ibp((lo, hi), _v_bounds(op, lo, hi))
    assert bool(torch.isfinite(il).all() and torch.isfinite(iu).all())
    g = torch.Generator().manual_seed(1)
    u = torch.rand(1500, *lo.shape, generator=g, dtype=torch.float64)
    u[:400] = (u[:400] > 0.5).double()
    x = lo.double() + u * (hi.double() - lo.double())
    x64 = x.reshape(-1, *lo.shape[1:])
    v64 = (x64 * x64).mean(-1, keepdim=True) + op.eps
    y64 = (x64 / torch.sqrt(v64)).reshape(x.shape)
    v64 = v64.reshape(*x.shape[:-1], 1)
    tol = 1e-6 * (1 + y64.abs())
    assert bool((y64 >= il.double() - tol).all() and (y64 <= iu.double() + tol).all())
    # IBP is exact: the extremes lie at corners with the other coordinates at their least
    # or greatest square, which sampling of corners (and of zero crossings) nearly reaches.
    reach = (y64.amin(0) - il.double()).abs() / (iu.double() - il.double() + 1e-9)
    assert float(reach.median()) < 0.05
    A = torch.randn(lo.shape[0], 7, *lo.shape[1:], generator=g)
    true = torch.einsum("bsgd,nbgd->nbs", A.double(), y64)
    # v's bounds from IBP, and (as CROWN's may be) tighter: the sampled range itself.
    for v_bounds in (_v_bounds(op, lo, hi), (v64.amin(0).float(), v64.amax(0).float())):
        (lA, lV), (uA, uV), lb, ub = op.crown_backward(A, A, [(lo, hi), v_bounds])
        assert all(bool(torch.isfinite(t).all()) for t in (lA, lV, uA, uV, lb, ub))
        low = (torch.einsum("bsgd,nbgd->nbs", lA.double(), x)
               + torch.einsum("bsgd,nbgd->nbs", lV.double(), v64) + lb.double())
        up = (torch.einsum("bsgd,nbgd->nbs", uA.double(), x)
              + torch.einsum("bsgd,nbgd->nbs", uV.double(), v64) + ub.double())
        slack = 1e-5 * (1 + true.abs())
        assert bool((low <= true + slack).all()), float((low - true).max())
        assert bool((up >= true - slack).all()), float((true - up).max())


def test_kernel_infinite_and_point_boxes():
    """Infinite bounds give |y| <= sqrt(D) (never NaN); a point box gives bounds that hold
    the point's value to rounding, and CROWN lines exact there."""
    op = _kernel((2, 4), (1,))
    lo = torch.tensor([[[-np.inf, 0.0, 1.0, 2.0], [0.5, 0.5, 0.5, -1.0]]], dtype=torch.float32)
    hi = torch.tensor([[[np.inf, 1.0, 1.0, 3.0], [0.5, 0.5, 0.5, -1.0]]], dtype=torch.float32)
    vb = _v_bounds(op, lo, hi)
    il, iu = op.ibp((lo, hi), vb)
    assert not bool(torch.isnan(il).any() or torch.isnan(iu).any())
    assert bool((il >= -2.0001).all() and (iu <= 2.0001).all())
    y = op.forward(lo[:, 1:], vb[0][:, 1:])
    assert torch.allclose(il[:, 1], y[:, 0], atol=1e-6) and torch.allclose(iu[:, 1], y[:, 0],
                                                                           atol=1e-6)
    A = torch.ones(1, 1, 2, 4)
    _, _, lb, ub = op.crown_backward(A, A, [(lo, hi), vb])
    assert bool(torch.isfinite(lb).all() and torch.isfinite(ub).all())


def test_tp_zones_the_mlp_between_layer_norms(tmp_path):
    """tp: in a transformer MLP block the column MatMul, Gelu and row MatMul form one zone;
    the LayerNorms (centring, mean square, normalize) are replicated and their gamma / beta
    fold into the column layer. (Bitwise single mode in fsdp and tp: tests/ops/test_gated.py's
    multirank job runs its Relu twin.)"""
    import onnx
    import zoo
    from shardbound.compiler.driver import inspect_model
    from shardbound.passes.manager import PassOptions

    model, _ = zoo.build("ln_mlp_block")
    onnx.save(model, tmp_path / "m.onnx")
    text = inspect_model(str(tmp_path / "m.onnx"), PassOptions(mode="tp", nproc=2))
    roles = [(line.split("= ")[1].split("(")[0], line.split("tp=")[1].split()[0:2])
             for line in text.splitlines()[1:] if "tp=" in line]
    zone = [(k, r) for k, r in roles if r[0] == "zone0"]
    assert [(k, r[1]) for k, r in zone] == [("linear", "column:"), ("gelu", "elementwise:"),
                                            ("linear", "row:")], text
    assert all(r[0] == "Replicate" for k, r in roles if k in ("normalize", "pow", "reduce_sum")), text


def test_epsilon_must_be_positive():
    from shardbound.compiler.errors import ShardboundError
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    case = _case("eps0", "LayerNormalization", _layer_norm(eps=0.0), (3, 4), (17,))
    model, _ = case.build(np.random.default_rng(0), 17)
    import onnx

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "eps0.onnx")
        onnx.save(model, path)
        with pytest.raises(ShardboundError, match="epsilon is 0.0; it must be a positive"):
            compile_model(path, os.path.join(d, "out"), PassOptions())
