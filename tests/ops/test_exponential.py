"""The exponential family (runtime/ops/exponential.py, compiler/lowering/exponential.py): Exp,
Log, Reciprocal, Sqrt, Pow, Softplus, Elu, Selu, Celu, and the x^m * x^n pattern.

- the harness cases: forward vs onnxruntime / onnx.reference per opset, IBP / CROWN /
  alpha-CROWN sound on every box kind (inside the op's domain: `OpCase.domain`);
- the relaxation itself (tests/ops/lines_check.py): thousands of intervals of every kind
  (narrow, wide, huge, near 0, degenerate, infinite, and leaving the domain), random feasible
  alphas: sound on a dense float64 grid with the touching points, tight, never NaN;
- out of the domain at run time: an input box that reaches log's 0 or a reciprocal's pole
  gives infinite bounds, never NaN, in every method; a certain one is a compile-time error;
- position independence of every kernel's bits (tp holds channel slices).
"""

from __future__ import annotations

import os
import sys

import shardbound  # noqa: F401  (first: sets MKL_CBWR before any BLAS call)
import numpy as np
import onnx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lines_check as lc  # noqa: E402
from harness import OpCase, generate, into_domain, sandwich  # noqa: E402

from shardbound.runtime.ops import exponential as E  # noqa: E402


def _unary(op, **attrs):
    def apply(b, x, shape):
        return b.op(op, [x], **attrs), shape
    return apply


def _pow(p):
    def apply(b, x, shape):
        return b.op("Pow", [x, b.const(np.float32(p))]), shape
    return apply


def _base_pow(c):
    def apply(b, x, shape):
        return b.op("Pow", [b.const(np.float32(c)), x]), shape
    return apply


def _square_mul(b, x, shape):          # x * x * x as torch exports it: Mul(x, Mul(x, x))
    return b.op("Mul", [x, b.op("Mul", [x, x])]), shape


def _case(name, op, apply, domain="real", between=None, **kw):
    """An OpCase on sandwich models whose boxes and hidden layer stay in `domain`."""
    prepare = into_domain(between or domain)
    return OpCase(name, op, lambda rng, o: sandwich(rng, o, (6,), apply, prepare=prepare),
                  domain=domain, **kw)


CASES = [
    _case("exp", "Exp", _unary("Exp"), between="bounded", opsets=(7, 13)),
    _case("exp_x3", "Exp", _unary("Exp"), between="bounded", scale=3.0, rtol=2e-4),
    _case("log", "Log", _unary("Log"), "positive", opsets=(7, 13)),
    _case("reciprocal", "Reciprocal", _unary("Reciprocal"), "positive", opsets=(7, 13)),
    _case("reciprocal_neg", "Reciprocal", _unary("Reciprocal"), "negative"),
    _case("sqrt", "Sqrt", _unary("Sqrt"), "positive", opsets=(7, 13)),
    _case("pow2", "Pow", _pow(2.0), opsets=(7, 13, 15)),
    _case("pow3", "Pow", _pow(3.0)),
    _case("pow3_mul", "Mul", _square_mul),
    _case("pow_m2", "Pow", _pow(-2.0), "positive"),
    _case("pow_m3_neg", "Pow", _pow(-3.0), "negative"),
    _case("pow_half", "Pow", _pow(0.5), "positive"),
    _case("pow_2_5", "Pow", _pow(2.5), "positive"),
    _case("pow_m0_5", "Pow", _pow(-0.5), "positive"),
    _case("pow_base", "Pow", _base_pow(2.0), between="bounded"),
    _case("softplus", "Softplus", _unary("Softplus"), opsets=(13, 22)),
    _case("softplus_x4", "Softplus", _unary("Softplus"), scale=4.0),
    _case("elu", "Elu", _unary("Elu"), opsets=(7, 13, 22)),
    _case("elu_half", "Elu", _unary("Elu", alpha=0.5)),
    _case("elu_2", "Elu", _unary("Elu", alpha=2.0)),
    _case("selu", "Selu", _unary("Selu"), opsets=(7, 22)),
    _case("celu", "Celu", _unary("Celu", alpha=0.7), opsets=(12, 13)),
]

generate(CASES, globals())


# -- the relaxation itself --------------------------------------------------------------------
def _elu_ref(alpha, gamma=1.0):
    return lambda x: gamma * np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0)))


def _pow_ref(p):
    return lambda x: np.power(x, p)


KERNELS = {   # name: (class, attrs, float64 reference, interval domains)
    "exp": (E.Exp, {}, np.exp, ("real",)),
    "log": (E.Log, {}, np.log, ("positive", "real")),
    "reciprocal": (E.Reciprocal, {}, lambda x: 1 / x, ("positive", "negative", "real")),
    "sqrt": (E.Sqrt, {}, np.sqrt, ("positive", "real")),
    "softplus": (E.Softplus, {}, lambda x: np.logaddexp(0, x), ("real",)),
    "elu": (E.Elu, {}, _elu_ref(1.0), ("real",)),
    "elu_0.3": (E.Elu, {"alpha": 0.3}, _elu_ref(0.3), ("real",)),
    "elu_-0.5": (E.Elu, {"alpha": -0.5}, _elu_ref(-0.5), ("real",)),
    "selu": (E.Elu, {"alpha": 1.6732632, "gamma": 1.050701}, _elu_ref(1.6732632, 1.050701),
             ("real",)),
}
for _p in (2, 3, 4, -1, -2, -3, 0.5, 2.5, -0.5, 0.3):
    KERNELS[f"pow_{_p}"] = (E.Pow, {"exponent": _p}, _pow_ref(_p),
                            ("real",) if _p == round(_p) and _p > 0 else ("positive", "real"))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_relaxation_lines_are_sound_and_tight(name):
    cls, attrs, ref, domains = KERNELS[name]
    kernel = lc.make_kernel(cls, **attrs)
    rng = np.random.default_rng(sum(map(ord, name)))
    for domain in domains:
        lo, hi = lc.intervals(rng, domain, n=60)
        gaps = lc.check_all(kernel, ref, lo, hi, rng, points=201)
        # narrow intervals (the first two kinds) inside the domain: lines a few ulps apart
        narrow = slice(0, 120)
        with np.errstate(all="ignore"):
            scale = 1 + np.abs(ref(lo[narrow].astype(np.float64))) + np.abs(lo[narrow])
        ok = np.isfinite(scale)
        assert (gaps[narrow][ok] <= 1e-4 * scale[ok]).all(), (name, domain, gaps[narrow].max())
    lc.position_independent(kernel, *lc.intervals(rng, domains[0], n=20))


def test_crown_default_lines_on_one_curvature():
    """Convex interval: tangent at the midpoint below, chord above; concave: the mirror."""
    lo = np.array([0.5, -3.0], np.float32)
    hi = np.array([2.0, 1.0], np.float32)
    wl, bl, wu, bu = lc.lines(lc.make_kernel(E.Exp), lo, hi)
    m = (lo.astype(np.float64) + hi) / 2
    chord = (np.exp(hi.astype(np.float64)) - np.exp(lo.astype(np.float64))) / (hi - lo)
    np.testing.assert_allclose(wl, np.exp(m), rtol=1e-6)
    np.testing.assert_allclose(wu, chord, rtol=1e-6)
    wl, bl, wu, bu = lc.lines(lc.make_kernel(E.Log), np.array([0.5], np.float32),
                              np.array([4.0], np.float32))
    np.testing.assert_allclose([wl[0], wu[0]], [np.log(8) / 3.5, 1 / 2.25], rtol=1e-6)


def test_out_of_domain_lines_are_infinite_not_nan():
    """log on [0, u]: lower line -inf, upper finite; on [l < 0, u]: both infinite (NaN is
    possible there); a reciprocal across 0: both infinite; exp of huge bounds: infinite upper
    bound, never an overflowing slope."""
    cases = [(E.Log, 0.0, 2.0, (-np.inf, None)), (E.Log, -1.0, 2.0, (-np.inf, np.inf)),
             (E.Reciprocal, -1.0, 2.0, (-np.inf, np.inf)), (E.Reciprocal, 0.0, 2.0, (-np.inf, np.inf)),
             (E.Sqrt, -1.0, 4.0, (-np.inf, np.inf)), (E.Exp, 80.0, 100.0, (None, np.inf)),
             (E.Pow, -1.0, 1.0, (None, np.inf))]
    for cls, lo, hi, (want_lo, want_hi) in cases:
        attrs = {"exponent": -2.0} if cls is E.Pow else {}
        kernel = lc.make_kernel(cls, **attrs)
        lo_, hi_ = np.array([lo], np.float32), np.array([hi], np.float32)
        wl, bl, wu, bu = lc.lines(kernel, lo_, hi_)
        il, iu = (t.item() for t in kernel.ibp((torch.from_numpy(lo_), torch.from_numpy(hi_))))
        for v in (wl[0], bl[0], wu[0], bu[0], il, iu):
            assert not np.isnan(v), cls
        assert np.isfinite(wl[0]) and np.isfinite(wu[0])
        for want, icpt, ibp in ((want_lo, bl[0], il), (want_hi, bu[0], iu)):
            if want is None:
                assert np.isfinite(ibp), (cls, lo, hi)
            else:
                assert icpt == want and ibp == want, (cls, lo, hi, icpt, ibp)


# -- run time: bounds through the network ----------------------------------------------------------
def _compile(tmp_path, model, name):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    compile_model(str(path), str(tmp_path / f"{name}_prog"), PassOptions())
    return load(str(tmp_path / f"{name}_prog"))


def _net(op, weight_sign=None, relu=False):
    """x -> op -> Gemm (weights of one sign if asked) -> [Relu -> Gemm]."""
    import zoo

    rng = np.random.default_rng(3)
    b = zoo.Builder(rng, (4,))
    h = b.op(op, ["x"])
    w = rng.normal(0, 0.5, (5, 4)).astype(np.float32)
    if weight_sign is not None:
        w = np.abs(w) * weight_sign
    h = b.op("Gemm", [h, b.const(w), b.const(np.zeros(5, np.float32))], transB=1)
    if relu:
        h = b.gemm(b.relu(h), 5, 2)
    return b.build(h)


@pytest.mark.parametrize("op,lo,hi,finite_upper", [
    ("Log", 0.0, 2.0, True), ("Log", -0.5, 2.0, False), ("Reciprocal", -1.0, 1.0, False),
    ("Sqrt", -0.2, 1.0, False)])
def test_bounds_leaving_the_domain_are_infinite_never_nan(tmp_path, op, lo, hi, finite_upper):
    """An input box that reaches where the op is -inf or NaN: bounds infinite (where the op's
    output can be), never NaN, in every method and through a ReLU layer after it; with
    positive weights after log on [0, u], the upper bound stays finite."""
    verifier = _compile(tmp_path, _net(op, weight_sign=1.0), f"{op}_pos")
    deep = _compile(tmp_path, _net(op, relu=True), f"{op}_deep")
    box_lo = np.full(4, 0.5, np.float32)
    box_hi = np.full(4, 1.5, np.float32)
    box_lo[0], box_hi[0] = lo, hi
    for v in (verifier, deep):
        for method in ("ibp", "crown", "alpha-crown"):
            lb, ub = v.bounds(box_lo, box_hi, method=method)
            assert not (torch.isnan(lb).any() or torch.isnan(ub).any()), (op, method)
            assert bool((lb <= ub).all())
    for method in ("ibp", "crown", "alpha-crown"):
        lb, ub = verifier.bounds(box_lo, box_hi, method=method)
        assert bool((lb == -np.inf).all()), (op, method)
        # IBP's centre-radius form loses the finite side (-inf + inf); CROWN keeps it
        assert bool(torch.isfinite(ub).all()) == (finite_upper and method != "ibp"), (op, method)
    # sound where the network is finite: points inside the domain
    inside = box_lo.copy()
    inside[0] = max(lo, 0.0) + 0.25
    y = verifier.forward(torch.from_numpy(inside)[None]).reshape(-1)
    lb, ub = verifier.bounds(box_lo, box_hi, method="crown")
    assert bool((lb.reshape(-1) <= y).all() and (y <= ub.reshape(-1)).all())


def test_certain_domain_errors_at_compile_time(tmp_path):
    """Log of -sigmoid(x) is never defined: one line naming the node."""
    import zoo
    from shardbound.compiler.errors import ShardboundError

    b = zoo.Builder(np.random.default_rng(0), (3,))
    h = b.op("Neg", [b.op("Sigmoid", ["x"])])
    model = b.build(b.op("Log", [h], name="the_log"))
    with pytest.raises(ShardboundError, match=r"the_log.*log is undefined") as e:
        _compile(tmp_path, model, "neglog")
    assert "\n" not in str(e.value)


def test_products_of_powers_fuse(tmp_path):
    """x * x -> pow 2, x * (x * x) -> pow 3, (2x) * x^2 -> 2 pow 3; x * y stays an error."""
    import zoo
    from shardbound.compiler.driver import plan_model
    from shardbound.compiler.errors import ShardboundError
    from shardbound.passes.manager import PassOptions

    def ops(build):
        b = zoo.Builder(np.random.default_rng(0), (3,))
        model = b.build(build(b))
        onnx.save(model, tmp_path / "m.onnx")
        graph, _ = plan_model(str(tmp_path / "m.onnx"), PassOptions())
        return [(n.op, dict(n.attrs).get("exponent")) for n in graph.nodes]

    assert ("pow", 2.0) in ops(lambda b: b.op("Mul", ["x", "x"]))
    cube = ops(lambda b: b.op("Mul", ["x", b.op("Mul", ["x", "x"])]))
    assert ("pow", 3.0) in cube and ("pow", 2.0) not in cube     # the square is dropped
    assert ("pow", 3.0) in ops(lambda b: b.op("Mul", [b.op("Mul", ["x", b.const(np.float32(2))]),
                                                      b.op("Pow", ["x", b.const(np.float32(2))])]))
    assert ("product", None) in ops(lambda b: b.op("Mul", [b.op("Exp", ["x"]), b.op("Sin", ["x"])]))


def test_alpha_crown_beats_crown_on_the_zoo(tmp_path):
    lc.assert_alpha_beats_crown(tmp_path, ("exp_log_mlp",))


@pytest.fixture(scope="module")
def order_margins(tmp_path_factory):
    """{order: (margins, margins of a second compile)} of exp_log_mlp: two programs per order
    (blocked's first one is the reference every order is compared with)."""
    def margins(order, i):
        return lc.zoo_margins(tmp_path_factory.mktemp(f"{order}{i}"), "exp_log_mlp",
                              summation=order)[0]

    return {order: (margins(order, 1), margins(order, 2)) for order in ("fast", "blocked", "exact")}


@pytest.mark.parametrize("order", ["fast", "blocked", "exact"])
def test_every_summation_order(order_margins, order):
    """exp_log_mlp under each order: bounds repeat bit for bit (a second compile of the
    same model), agree across orders to rounding (alpha-CROWN's to its optimisation path:
    last bits of a slope can pick another subgradient where an intercept ties between two
    ends), and alpha-CROWN's gradients reach the intercepts (alpha moves the bound)."""
    m1, m2 = order_margins[order]
    for method in m1:
        assert torch.equal(m1[method], m2[method]), (order, method)
    ref = order_margins["blocked"][0]
    for method, tol in (("ibp", 1e-5), ("crown", 1e-5), ("alpha-crown", 1e-3)):
        assert torch.allclose(m1[method], ref[method], rtol=tol, atol=tol), (order, method)
    assert bool((m1["alpha-crown"] > m1["crown"] + 1e-5).any())


def test_exp_overflow_gives_an_infinite_upper_bound(tmp_path):
    """exp on [80, 100] overflows float32: the upper bound is +inf in every method; CROWN's
    lower one stays finite (no overflowing slope on the way: a constant line; IBP's centre-
    radius form loses it to inf - inf); nothing is NaN."""
    verifier = _compile(tmp_path, _net("Exp", weight_sign=1.0), "exp_overflow")
    box_lo, box_hi = np.full(4, 0.5, np.float32), np.full(4, 1.5, np.float32)
    box_lo[0], box_hi[0] = 80.0, 100.0
    for method in ("ibp", "crown", "alpha-crown"):
        lb, ub = verifier.bounds(box_lo, box_hi, method=method)
        assert not bool(torch.isnan(lb).any()) and bool((ub == np.inf).all()), (method, lb, ub)
        assert bool(torch.isfinite(lb).all()) == (method != "ibp"), (method, lb)
