"""The gated family (runtime/ops/gated.py, compiler/lowering/gated.py): Gelu (erf and tanh),
SiLU / Swish, HardSwish, HardSigmoid, and the product patterns that fuse their exports.

- the harness cases: the ONNX ops (Gelu-20 both ways, HardSwish, HardSigmoid, Swish-24) and the
  exports torch writes (Mul(x, Sigmoid(x)); the Erf and Tanh Gelu formulas, with x ** 3 as
  Mul(x, Mul(x, x)) or Pow; Mul(x, HardSigmoid(x))): forward vs onnxruntime / onnx.reference,
  IBP / CROWN / alpha-CROWN sound on every box kind, at unit scale and at scale 3;
- the relaxation itself (tests/ops/lines_check.py), and the inflection points and minima;
- which exports fuse (and into what), and which products stay an error;
- position independence of the bits.
"""

from __future__ import annotations

import math
import os
import sys

import shardbound  # noqa: F401  (first: sets MKL_CBWR before any BLAS call)
import numpy as np
import onnx
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lines_check as lc  # noqa: E402
from harness import OpCase, generate, sandwich  # noqa: E402

from shardbound.runtime.ops import gated as G  # noqa: E402

SQRT2 = np.float32(math.sqrt(2.0))


def _op(op, **attrs):
    def apply(b, x, shape):
        return b.op(op, [x], **attrs), shape
    return apply


def _const(b, v):
    return b.const(np.float32(v))


def silu_export(b, x, shape):
    return b.op("Mul", [x, b.op("Sigmoid", [x])]), shape


def quick_gelu(b, x, shape):
    return b.op("Mul", [x, b.op("Sigmoid", [b.op("Mul", [x, _const(b, 1.702)])])]), shape


def gelu_erf_export(b, x, shape):       # torch: Mul(Mul(x, Add(Erf(Div(x, c)), 1)), 0.5)
    e = b.op("Add", [b.op("Erf", [b.op("Div", [x, b.const(SQRT2)])]), _const(b, 1.0)])
    return b.op("Mul", [b.op("Mul", [x, e]), _const(b, 0.5)]), shape


def gelu_hf(b, x, shape):               # x * 0.5 * (1 + erf(x / sqrt 2))
    e = b.op("Add", [_const(b, 1.0), b.op("Erf", [b.op("Div", [x, b.const(SQRT2)])])])
    return b.op("Mul", [b.op("Mul", [x, _const(b, 0.5)]), e]), shape


def _tanh_gelu(b, x, cube):
    inner = b.op("Add", [x, b.op("Mul", [_const(b, 0.044715), cube])])
    t = b.op("Tanh", [b.op("Mul", [_const(b, math.sqrt(2 / math.pi)), inner])])
    return b.op("Mul", [_const(b, 0.5), b.op("Mul", [x, b.op("Add", [_const(b, 1.0), t])])])


def gelu_tanh_export(b, x, shape):      # torch: x ** 3 as Mul(x, Mul(x, x))
    return _tanh_gelu(b, x, b.op("Mul", [x, b.op("Mul", [x, x])])), shape


def gelu_tanh_pow(b, x, shape):         # HF NewGELU: torch.pow(x, 3.0)
    return _tanh_gelu(b, x, b.op("Pow", [x, _const(b, 3.0)])), shape


def hardswish_export(b, x, shape):      # torch before opset 14
    return b.op("Mul", [x, b.op("HardSigmoid", [x], alpha=1 / 6)]), shape


SOME_BOXES = ("wide", "kinks")     # exports of a kernel the op cases test on every box kind


def _case(name, op, apply, **kw):
    return OpCase(name, op, lambda rng, o: sandwich(rng, o, (6,), apply), **kw)


CASES = [
    _case("gelu", "Gelu", _op("Gelu"), opsets=(20, 22)),
    _case("gelu_tanh", "Gelu", _op("Gelu", approximate="tanh"), opsets=(20,)),
    _case("gelu_x3", "Gelu", _op("Gelu"), opsets=(20,), scale=3.0),
    _case("gelu_erf_export", "Mul", gelu_erf_export),
    _case("gelu_hf", "Mul", gelu_hf, boxes=SOME_BOXES),
    _case("gelu_tanh_export", "Mul", gelu_tanh_export),
    _case("gelu_tanh_pow", "Mul", gelu_tanh_pow, scale=3.0, boxes=SOME_BOXES),
    _case("silu", "Mul", silu_export),
    _case("silu_x3", "Mul", silu_export, scale=3.0),
    _case("quick_gelu", "Mul", quick_gelu, boxes=SOME_BOXES),
    _case("swish", "Swish", _op("Swish", alpha=1.5), opsets=(24,)),
    _case("hardswish", "HardSwish", _op("HardSwish"), opsets=(14, 22), scale=3.0),
    _case("hardswish_export", "Mul", hardswish_export, scale=3.0, boxes=SOME_BOXES),
    _case("hardsigmoid", "HardSigmoid", _op("HardSigmoid", alpha=0.3, beta=0.4),
          opsets=(7, 13, 22), scale=3.0),
]

generate(CASES, globals())


# -- the relaxation itself --------------------------------------------------------------------
_erfc = np.frompyfunc(math.erfc, 1, 1)


def _gelu(x):
    x = np.asarray(x, dtype=np.float64)
    return x * 0.5 * np.asarray(_erfc(-x / math.sqrt(2)), dtype=np.float64)


def _gelu_tanh(x):
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    return x / (1 + np.exp(-2 * u))


KERNELS = {
    "gelu": (G.Gelu, {}, _gelu),
    "gelu_tanh": (G.GeluTanh, {}, _gelu_tanh),
    "silu": (G.Silu, {}, lambda x: x / (1 + np.exp(-x))),
    "hard_swish": (G.HardSwish, {}, lambda x: x * np.clip((x + 3) / 6, 0, 1)),
    "hard_swish_0.2": (G.HardSwish, {"alpha": 0.2, "beta": 0.3},
                       lambda x: x * np.clip((x + 1.5) / 5, 0, 1)),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_relaxation_lines_are_sound_and_tight(name):
    cls, attrs, ref = KERNELS[name]
    kernel = lc.make_kernel(cls, **attrs)
    rng = np.random.default_rng(sum(map(ord, name)))
    lo, hi = lc.intervals(rng, "real", n=50)
    c = np.array(kernel._boundaries() + kernel.critical_points, np.float64)
    near = rng.choice(c, 300)                   # around the inflections, kinks and minimum
    lo = np.concatenate([lo, (near - rng.uniform(0, 0.5, 300)).astype(np.float32)])
    hi = np.concatenate([hi, (near + rng.uniform(0, 0.5, 300)).astype(np.float32)])
    with np.errstate(all="ignore"):
        gaps = lc.check_all(kernel, ref, lo, hi, rng, points=201)
    narrow = slice(0, 100)
    assert (gaps[narrow] <= 1e-5 * (1 + np.abs(lo[narrow]))).all(), gaps[narrow].max()
    lc.position_independent(kernel, lo, hi)


def test_inflections_and_minima():
    """f'' changes sign at +-inflection and f' at the minimum (float64 central differences)."""
    for cls, ref in ((G.Gelu, _gelu), (G.GeluTanh, _gelu_tanh),
                     (G.Silu, lambda x: x / (1 + np.exp(-x)))):
        k = lc.make_kernel(cls)
        h = 1e-3
        second = lambda x: (ref(np.float64(x + h)) - 2 * ref(np.float64(x)) + ref(np.float64(x - h)))
        c = k.inflection
        assert second(c - 0.01) > 0 > second(c + 0.01), cls
        assert second(-c + 0.01) > 0 > second(-c - 0.01), cls
        x0 = k.minimum
        assert ref(np.float64(x0)) <= min(ref(np.float64(x0 - 1e-4)), ref(np.float64(x0 + 1e-4)))
    assert G.Gelu.inflection == math.sqrt(2)


def test_crown_lines_reproduce_the_classic_choices():
    """On a convex interval (inside [-c, c]): tangent at the midpoint and chord."""
    k = lc.make_kernel(G.Gelu)
    lo, hi = np.array([-1.0], np.float32), np.array([1.2], np.float32)
    wl, bl, wu, bu = lc.lines(k, lo, hi)
    chord = (_gelu(np.float64(1.2)) - _gelu(np.float64(-1.0))) / 2.2
    np.testing.assert_allclose([wl[0], wu[0]], [k.df64(__import__("torch").tensor(0.1,
                               dtype=__import__("torch").float64)).item(), chord], rtol=1e-5)


# -- which exports fuse --------------------------------------------------------------------------
def _ops(tmp_path, build, input_shape=(4,)):
    import zoo
    from shardbound.compiler.driver import plan_model
    from shardbound.passes.manager import PassOptions

    b = zoo.Builder(np.random.default_rng(0), input_shape, opset=13)
    h = b.gemm("x", input_shape[0], 5)
    out, _ = build(b, h, (1, 5))
    onnx.save(b.build(b.gemm(out, 5, 2)), tmp_path / "m.onnx")
    graph, _ = plan_model(str(tmp_path / "m.onnx"), PassOptions())
    return [n.op for n in graph.nodes]


@pytest.mark.parametrize("build,kernel", [
    (silu_export, "silu"), (quick_gelu, "silu"), (gelu_erf_export, "gelu"), (gelu_hf, "gelu"),
    (gelu_tanh_export, "gelu_tanh"), (gelu_tanh_pow, "gelu_tanh"), (hardswish_export, "hard_swish")])
def test_exports_fuse_into_one_kernel(tmp_path, build, kernel):
    """The whole export becomes linear -> kernel -> linear (the affines fold, the gate's
    nodes are dropped)."""
    assert _ops(tmp_path, build) == ["input", "linear", kernel, "linear"]


@pytest.mark.parametrize("build", [
    lambda b, x, s: (b.op("Mul", [x, b.op("Sigmoid", [b.op("Add", [x, _const(b, 1.0)])])]), s),
    lambda b, x, s: (b.op("Mul", [x, b.op("Add", [b.op("Erf", [x]), _const(b, 2.0)])]), s),
    lambda b, x, s: (b.op("Mul", [x, b.op("Tanh", [b.op("Mul", [x, x])])]), s),
    lambda b, x, s: (b.op("Mul", [b.op("Exp", [x]), b.op("Sigmoid", [x])]), s)])
def test_other_products_are_general_products(tmp_path, build):
    """Products that are no fused form lower to the bilinear family's McCormick product."""
    assert "product" in _ops(tmp_path, build)


def test_a_product_of_two_layers_is_a_general_product(tmp_path):
    """x * sigmoid(y) with y another layer of the same input is not x * f(x)."""
    def build(b, x, s):
        y = b.gemm(x, 5, 5)
        return b.op("Mul", [x, b.op("Sigmoid", [y])]), s

    ops = _ops(tmp_path, build)
    assert "product" in ops and "silu" not in ops


# -- fsdp and tp: bitwise single mode ----------------------------------------------------------
# tp_smooth_chain and ln_relu_block are guests of tests/test_op_zoo.py's jobs (fsdp and tp on
# P = 2, 3 and 4, IBP, CROWN and alpha-CROWN, bitwise single mode): one job per P for the
# whole op zoo instead of three more of their own.


def test_tp_zone_holds_the_smooth_chain(tmp_path):
    import zoo
    from shardbound.compiler.driver import inspect_model
    from shardbound.passes.manager import PassOptions

    model, _ = zoo.build("tp_smooth_chain")
    onnx.save(model, tmp_path / "m.onnx")
    text = inspect_model(str(tmp_path / "m.onnx"), PassOptions(mode="tp", nproc=3))
    kinds = ("silu", "sin", "hard_swish", "softplus", "log")
    lines = [x for x in text.splitlines() if any(f"= {k}(" in x for k in kinds)]
    assert len(lines) == len(kinds) and all("tp=zone0 elementwise" in x for x in lines), text


def test_alpha_crown_beats_crown_on_the_zoo(tmp_path):
    lc.assert_alpha_beats_crown(tmp_path, ("gelu_mlp", "silu_hardswish_mlp"))
