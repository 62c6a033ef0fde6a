"""The smooth family (runtime/ops/smooth.py, compiler/lowering/smooth.py): Sigmoid, Tanh, Erf,
Softsign (and torch's export of it, Div(x, Add(Abs(x), 1))).

- the harness cases (forward vs onnxruntime / onnx.reference per opset, IBP / CROWN /
  alpha-CROWN sound on every box kind), once at unit input scale and once at scale 4 (deep
  saturation: pre-activations past +-30);
- the relaxation itself, without CROWN: for thousands of intervals of every kind (narrow,
  wide, saturated, crossing 0, degenerate, infinite) and random feasible alphas, the float32
  lines hold below / above f on a dense float64 grid with the endpoints and touching points
  (no tolerance beyond float64 evaluation error), touch f (the intercepts are the tightest for
  their slopes) and are tight on narrow intervals;
- alpha-CROWN's gradients reach the intercepts under every summation order, and it beats
  CROWN on the zoo models;
- the Sigmoid sits inside a tp zone (its models run bitwise in fsdp and tp in
  tests/test_op_zoo.py, with the rest of OP_ZOO).

`python tests/ops/test_smooth.py [RADIUS ...]` prints the IBP / CROWN / alpha-CROWN margin
lower bounds of the zoo models on boxes of those radii.
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

from harness import OpCase, generate, sandwich  # noqa: E402

from shardbound.runtime.ops.smooth import ALPHA_SPAN, Erf, Sigmoid, Softsign, Tanh  # noqa: E402


def _unary(op):
    def apply(b, x, shape):
        return b.op(op, [x]), shape
    return apply


def _softsign_export(b, x, shape):      # torch: Div(x, Add(Abs(x), 1))
    return b.op("Div", [x, b.op("Add", [b.op("Abs", [x]), b.const(np.float32(1))])]), shape


CASES = [
    OpCase("sigmoid", "Sigmoid", lambda rng, o: sandwich(rng, o, (8,), _unary("Sigmoid")),
           opsets=(7, 13)),
    OpCase("tanh", "Tanh", lambda rng, o: sandwich(rng, o, (8,), _unary("Tanh")),
           opsets=(7, 13)),
    OpCase("sigmoid_x4", "Sigmoid", lambda rng, o: sandwich(rng, o, (8,), _unary("Sigmoid")),
           scale=4.0),
    OpCase("tanh_x4", "Tanh", lambda rng, o: sandwich(rng, o, (8,), _unary("Tanh")), scale=4.0),
    OpCase("erf", "Erf", lambda rng, o: sandwich(rng, o, (8,), _unary("Erf")), opsets=(9, 13)),
    OpCase("erf_x4", "Erf", lambda rng, o: sandwich(rng, o, (8,), _unary("Erf")), scale=4.0),
    OpCase("softsign", "Softsign", lambda rng, o: sandwich(rng, o, (8,), _unary("Softsign")),
           opsets=(7, 22)),
    OpCase("softsign_export", "Div", lambda rng, o: sandwich(rng, o, (8,), _softsign_export),
           scale=4.0),
]

generate(CASES, globals())

KERNELS = {"sigmoid": Sigmoid, "tanh": Tanh, "erf": Erf, "softsign": Softsign}


def _sigmoid_reference(x):
    """float64 sigmoid with relative accuracy in both tails (numpy, not the kernel's code)."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _erf_reference(x):
    import math

    return np.asarray(np.frompyfunc(math.erf, 1, 1)(x), dtype=np.float64)


REFERENCE = {"sigmoid": _sigmoid_reference, "tanh": np.tanh, "erf": _erf_reference,
             "softsign": lambda x: x / (1 + np.abs(x))}


def _kernel(name):
    return KERNELS[name]("node", ["x"], [(1,)], shape=(1,))


def _intervals(rng, n=400):
    """(lo, hi) float32 of every kind, n of each (degenerate, infinite ones included)."""
    kinds = []
    c = rng.uniform(-6, 6, n)
    kinds.append((c, c + rng.uniform(0, 1, n) * 1e-7 * np.maximum(1, np.abs(c))))   # narrow
    kinds.append((c - 1e-7, c + 1e-7))                                              # narrow
    kinds.append((-rng.uniform(0, 1e4, n), rng.uniform(0, 1e4, n)))                 # wide
    kinds.append((np.full(n, -1e4), np.full(n, 1e4)))
    for side in (-30.0, 30.0):                                                      # saturated
        c = side + rng.uniform(-3, 3, n)
        kinds.append((c - rng.uniform(0, 5, n), c + rng.uniform(0, 5, n)))
    kinds.append((-rng.uniform(0, 5, n), rng.uniform(0, 5, n)))                     # crossing 0
    kinds.append((-rng.uniform(0, 1e-3, n), rng.uniform(0, 50, n)))
    c = rng.uniform(-8, 8, n)
    kinds.append((c - rng.uniform(0, 4, n), c + rng.uniform(0, 4, n)))              # any
    kinds.append((c, c))                                                            # degenerate
    kinds.append((np.concatenate([np.full(n // 2, -np.inf), rng.uniform(-3, 3, n - n // 2)]),
                  np.concatenate([rng.uniform(-3, 3, n // 2), np.full(n - n // 2, np.inf)])))
    lo = np.concatenate([k[0] for k in kinds]).astype(np.float32)
    hi = np.concatenate([k[1] for k in kinds]).astype(np.float32)
    return lo, np.maximum(lo, hi)


def _lines(kernel, lo, hi, alpha=None):
    """(lower slope, lower icpt, upper slope, upper icpt) as float64 numpy, one per interval."""
    t = lambda a: torch.from_numpy(a).reshape(1, 1, -1)
    with torch.no_grad():
        lines = kernel.relax(t(lo), t(hi), None if alpha is None else
                             torch.from_numpy(alpha).reshape(1, 1, 2, -1))
    return [np.asarray(v.to(torch.float64).reshape(-1).numpy()) for v in
            (lines.lower_slope, lines.lower_icpt, lines.upper_slope, lines.upper_icpt)]


def _grid(lo, hi, kernel, slopes, points=801):
    """float64 points per interval (rows): a dense grid with both endpoints, 0 and the
    points where f' equals each slope (where the lines touch); infinite ends cut at 1e5."""
    a, b = np.clip(lo.astype(np.float64), -1e5, 1e5), np.clip(hi.astype(np.float64), -1e5, 1e5)
    grid = [a[:, None] + (b - a)[:, None] * np.linspace(0, 1, points)[None]]
    extra = [np.zeros_like(a)]
    for w in slopes:
        w64 = torch.from_numpy(np.clip(w, 1e-300, None))
        x = kernel.touch_positive64(w64.clamp(max=kernel.max_slope)).numpy()
        extra += [x, -x]
    grid.append(np.clip(np.stack(extra, axis=1), a[:, None], b[:, None]))
    return np.concatenate(grid, axis=1)


def _check_lines(name, lo, hi, lines):
    """Sound on the grid up to float64 evaluation error; each line touches f (up to its
    float32 rounding); returns the largest gap between the lines per interval."""
    kernel = _kernel(name)
    wl, bl, wu, bu = lines
    for v in lines:
        assert np.isfinite(v).all(), name
    x = _grid(lo, hi, kernel, (wl, wu))
    f = REFERENCE[name](x)
    low = wl[:, None] * x + bl[:, None]
    up = wu[:, None] * x + bu[:, None]
    err = 2.0 ** -50 * (np.abs(f) + np.abs(wl[:, None] * x) + np.abs(bl[:, None]) +
                        np.abs(wu[:, None] * x) + np.abs(bu[:, None])) + 1e-300
    bad_low, bad_up = low > f + err, up < f - err
    for bad, what in ((bad_low, "lower"), (bad_up, "upper")):
        if bad.any():
            i = int(np.nonzero(bad.any(axis=1))[0][0])
            raise AssertionError(f"{name}: {what} line above/below f on [{lo[i]!r}, {hi[i]!r}] "
                                 f"(lines {wl[i]!r} {bl[i]!r} / {wu[i]!r} {bu[i]!r})")
    # touching: a tightest intercept leaves no more than its rounding (a few float32 ulps of
    # the terms) between the line and f somewhere on the interval
    finite = np.isfinite(lo) & np.isfinite(hi)
    ulps = 8 * 2.0 ** -24 * (np.abs(x) * np.maximum(np.abs(wl), np.abs(wu))[:, None] +
                             np.abs(f) + 1e-30).max(axis=1) + 2e-38
    grid_step = np.where(finite, (hi.astype(np.float64) - lo) / 800, 0)
    slack = ulps + grid_step * np.maximum(np.abs(wl), np.abs(wu)) * 2
    for gap, what in (((f - low).min(axis=1), "lower"), ((up - f).min(axis=1), "upper")):
        loose = finite & (gap > slack)
        assert not loose.any(), (name, what, lo[loose][:3], hi[loose][:3], gap[loose][:3])
    return (up - low).max(axis=1)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_relaxation_lines_are_sound_and_tight(name):
    rng = np.random.default_rng(zlib_seed(name))
    lo, hi = _intervals(rng)
    kernel = _kernel(name)
    gaps = _check_lines(name, lo, hi, _lines(kernel, lo, hi))
    # random feasible alphas, and the corners of the feasible box
    alpha_sets = [rng.uniform(0, ALPHA_SPAN, (2, lo.size)).astype(np.float32)]
    alpha_sets += [np.full((2, lo.size), v, np.float32) for v in (0.0, ALPHA_SPAN)]
    alpha_sets.append(np.stack([np.zeros(lo.size), np.full(lo.size, ALPHA_SPAN)])
                      .astype(np.float32))
    for alpha in alpha_sets:
        _check_lines(name, lo, hi, _lines(kernel, lo, hi, alpha))
    # narrow intervals (the first two kinds): the lines are a few float32 ulps apart
    narrow = slice(0, 800)
    scale = 1 + np.abs(lo[narrow]).astype(np.float64)
    assert (gaps[narrow] <= 2e-6 * scale).all(), gaps[narrow].max()
    # a degenerate interval is the point itself: slope 0 and an ulp-wide band
    wl, bl, wu, bu = _lines(kernel, lo, hi)
    point = lo == hi
    assert point.sum() >= 400 and (wl[point] == 0).all() and (wu[point] == 0).all()
    assert (bu[point] - bl[point] <= 4 * 2.0 ** -23).all()


def zlib_seed(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode())


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_crown_default_lines(name):
    """CROWN's choices: convex interval: tangent at the midpoint below, chord above;
    concave: the mirror; mixed: the upper line is the tangent through (l, f(l)) or, where
    the midpoint lies beyond its tangent point, the tangent at the midpoint (the lower line
    likewise through (u, f(u))); and IBP is [f(l), f(u)] rounded outward within f's range."""
    kernel = _kernel(name)
    f = REFERENCE[name]
    lo = np.array([-3, 1, -2, -1e4, -0.5, -0.2, -5], np.float32)
    hi = np.array([-1, 3, 5, 1e4, 0.5, 6, 0.2], np.float32)
    wl, bl, wu, bu = _lines(kernel, lo, hi)
    l64, h64 = lo.astype(np.float64), hi.astype(np.float64)
    m = (l64 + h64) / 2
    chord = (f(h64) - f(l64)) / (h64 - l64)
    df = kernel.df64(torch.from_numpy(m)).numpy()
    np.testing.assert_allclose([wl[0], wu[0], wl[1], wu[1]], [df[0], chord[0], chord[1], df[1]],
                               rtol=1e-6)
    midpoint_tangent = {"upper": 0, "lower": 0}
    for i in range(2, len(lo)):     # mixed
        for w, b, end, side in ((wu[i], bu[i], l64[i], "upper"), (wl[i], bl[i], h64[i], "lower")):
            through_end = abs(w * end + b - f(end)) < 1e-6
            at_mid = abs(w - df[i]) < 1e-6 * df[i] and abs(w * m[i] + b - f(m[i])) < 1e-6
            assert through_end or at_mid, (name, side, lo[i], hi[i])
            midpoint_tangent[side] += at_mid and not through_end
    assert midpoint_tangent["upper"] and midpoint_tangent["lower"], midpoint_tangent
    with torch.no_grad():
        ilo, ihi = kernel.ibp((torch.tensor([-1e4, -1.0, 30.0]), torch.tensor([-1e4, 2.0, 1e4])))
    r0, r1 = kernel.value_range
    assert (ilo >= r0).all() and (ihi <= r1).all()
    truth_lo, truth_hi = f(np.array([-1e4, -1.0, 30.0])), f(np.array([-1e4, 2.0, 1e4]))
    assert (ilo.double().numpy() <= truth_lo).all() and (ihi.double().numpy() >= truth_hi).all()


def test_position_does_not_change_bits():
    """Relaxation and IBP bits of an element do not depend on where it sits in the tensor (tp
    zones hold channel slices, fsdp rows): torch.sigmoid's would (vector body vs tail)."""
    rng = np.random.default_rng(3)
    lo, hi = _intervals(rng, n=50)
    for kernel in (_kernel(name) for name in KERNELS):
        whole = _lines(kernel, lo, hi)
        for start in (1, 7, 333):
            part = _lines(kernel, lo[start:start + 37], hi[start:start + 37])
            for a, b in zip(whole, part):
                assert np.array_equal(a[start:start + 37], b)
        x = torch.from_numpy(lo[np.isfinite(lo)])
        assert torch.equal(kernel.forward(x)[5:45], kernel.forward(x[5:45].clone()))


def test_cached_lines_follow_the_bounds():
    """CROWN's lines are kept for the last bounds seen: an in-place change of those bounds,
    or other bounds, gives new lines; lower > upper (an empty branch-and-bound domain) gives
    finite ones."""
    kernel = _kernel("tanh")
    lo, hi = torch.tensor([[[-1.0, 0.5]]]), torch.tensor([[[2.0, 0.7]]])
    first = kernel.relax(lo, hi)
    assert kernel.relax(lo, hi) is first
    hi[0, 0, 0] = 3.0
    again = kernel.relax(lo, hi)
    assert again is not first and not torch.equal(again.upper_icpt, first.upper_icpt)
    empty = kernel.relax(torch.tensor([[[1.0]]]), torch.tensor([[[0.5]]]))
    for t in (empty.lower_slope, empty.lower_icpt, empty.upper_slope, empty.upper_icpt):
        assert bool(torch.isfinite(t).all())


# -- alpha-CROWN -------------------------------------------------------------------------------
def _compiled(tmp_path, name, **options):
    import zoo
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    model, shape = zoo.build(name)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    out = tmp_path / f"{name}_{'_'.join(f'{k}-{v}' for k, v in options.items())}"
    compile_model(str(path), str(out), PassOptions(**options))
    return load(str(out)), shape


def _margin_spec(verifier, lo, hi):
    """C rows f_c - f_j (c the class at the box centre, j the others)."""
    y = verifier.forward(torch.from_numpy((lo + hi) / 2).reshape(-1))
    c, n = int(y.argmax()), y.numel()
    rows = [j for j in range(n) if j != c]
    C = torch.zeros(len(rows), n)
    for r, j in enumerate(rows):
        C[r, c], C[r, j] = 1.0, -1.0
    return C


def _box(shape, radius, seed=0):
    rng = np.random.default_rng(seed)
    centre = rng.uniform(-1, 1, shape).astype(np.float32)
    return centre - np.float32(radius), centre + np.float32(radius)


def margins(tmp_path, names=("sigmoid_mlp", "tanh_mlp", "tp_sigmoid"), radius=0.1):
    """{model: {method: lower bounds of the margins}} on one box per model."""
    out = {}
    for name in names:
        verifier, shape = _compiled(tmp_path, name)
        lo, hi = _box(shape, radius)
        C = _margin_spec(verifier, lo, hi)
        out[name] = {m: verifier.bounds(lo, hi, C=C, method=m)[0].reshape(-1)
                     for m in ("ibp", "crown", "alpha-crown")}
    return out


def test_alpha_crown_beats_crown_on_the_zoo(tmp_path):
    got = margins(tmp_path, names=("sigmoid_mlp", "tanh_mlp"))
    better = False
    for name, m in got.items():
        assert bool((m["crown"] >= m["ibp"]).all()), name
        assert bool((m["alpha-crown"] >= m["crown"]).all()), name
        better |= bool((m["alpha-crown"] > m["crown"] + 1e-4).any())
    assert better, got


@pytest.mark.parametrize("order", ["fast", "blocked", "exact"])
def test_intercept_gradients_reach_alpha(tmp_path, order):
    """The bias terms A . intercept carry a gradient to alpha under every order (the
    intercepts follow the slopes). (The orders' gradients are not compared: a chord's
    intercept is a tie between both endpoints, so last-bit differences in the intermediate
    bounds pick the one or the other subgradient.)"""
    from shardbound.runtime.engine.optimise import initial_alphas

    verifier, shape = _compiled(tmp_path, "sigmoid_mlp", summation=order)
    net = verifier.network
    lo, hi = (torch.from_numpy(v).reshape(1, -1) for v in _box(shape, 0.3))
    with torch.no_grad():
        ibp, known = net.intermediate_bounds(lo, hi)
    alphas = initial_alphas(net, known, 1, 4)
    lb = net.final_crown(ibp, known, lo, hi, None, alphas, lower_only=True, gather=False)[0]
    lb.sum().backward()
    grads = [a.grad for a in alphas.values()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    # intercept-only path: with slopes frozen, the gradient comes through the intercepts
    node = net.optimisable_nodes()[-1]
    a = alphas[node.name].detach().clone().requires_grad_(True)
    in_lo, in_hi = (t.unsqueeze(1) for t in known[node.inputs[0]])
    lines = node.relax(in_lo, in_hi, a)
    coef = torch.ones_like(lines.lower_icpt).reshape(1, 4, -1)
    from shardbound.runtime.numerics import contract

    contract.dot_last(coef, lines.lower_icpt.reshape(1, 4, -1), order).sum().backward()
    assert a.grad is not None and float(a.grad.abs().sum()) > 0


# -- fsdp and tp --------------------------------------------------------------------------------
# sigmoid_mlp, tanh_mlp and tp_sigmoid (a Sigmoid inside a Megatron zone) are OP_ZOO models:
# tests/test_op_zoo.py checks them bitwise against single mode in fsdp P = 1..4 and tp
# (--tp-intermediate crown) P = 2, 3 under `blocked` (IBP, CROWN, alpha-CROWN).
def test_tp_zone_holds_the_sigmoid(tmp_path):
    import zoo
    from shardbound.compiler.driver import inspect_model
    from shardbound.passes.manager import PassOptions

    model, _ = zoo.build("tp_sigmoid")
    onnx.save(model, tmp_path / "m.onnx")
    text = inspect_model(str(tmp_path / "m.onnx"), PassOptions(mode="tp", nproc=3))
    line = next(x for x in text.splitlines() if x.strip().startswith("sigmoid"))
    assert "tp=zone0 elementwise" in line, text


if __name__ == "__main__":          # the margins table of the report: [radius ...]
    import pathlib
    import tempfile

    print(f"{'model':12s} {'radius':>6s} {'method':12s} margin lower bounds (rows f_c - f_j)")
    for radius in [float(r) for r in sys.argv[1:]] or [0.1]:
        with tempfile.TemporaryDirectory() as tmp:
            table = margins(pathlib.Path(tmp), radius=radius)
        for name, m in table.items():
            for method, lb in m.items():
                print(f"{name:12s} {radius:6.2f} {method:12s} "
                      + " ".join(f"{v:+.5f}" for v in lb.tolist()))
