"""The fast searches of runtime/ops/intercepts.py and smooth.py, against the slow ones they
replace (no CROWN, no compile: a fraction of a second).

- S-shaped CROWN slopes on mixed intervals (the tangent through the far endpoint) by Newton's
  method on the slope agree with a 100-step float64 bisection to 1e-9 relative, on intervals
  of widths 1e-6 .. 1e3 and beyond; any slope is sound, so this is the tightness claim;
- both lines' intercepts in one stacked evaluation (`_relax`: a side tensor, every piece at
  once where the class allows) are bitwise the per-side, piece-by-piece ones, and the
  touching points `_argmin64` finds (the envelope search's steps) are bitwise those
  `_intercept64` returns, for every smooth, exponential, periodic and gated kernel, at
  slopes anywhere in the range of f'.
"""

from __future__ import annotations

import math

import shardbound  # noqa: F401  (first: sets MKL_CBWR before any BLAS call)
import pytest
import torch

from shardbound.runtime.ops import exponential, gated, intercepts, periodic, smooth
from shardbound.runtime.ops.intercepts import ALPHA_SPAN, F64, InterceptRelaxation, bisect

S_SHAPED = (smooth.Sigmoid, smooth.Tanh, smooth.Erf, smooth.Softsign)
KERNELS = (*S_SHAPED, exponential.Exp, exponential.Log, exponential.Reciprocal,
           exponential.Sqrt, exponential.Softplus, (exponential.Pow, {"exponent": 3.0}),
           (exponential.Pow, {"exponent": -1.5}), (exponential.Elu, {"alpha": 0.5}),
           gated.Gelu, gated.GeluTanh, gated.Silu, gated.HardSwish, periodic.Sin, periodic.Cos)


def _kernel(spec, n):
    cls, attrs = spec if isinstance(spec, tuple) else (spec, {})
    return cls("k", ["x"], [(n,)], **attrs)


def _intervals(n, seed, low=1e-6, high=1e3):
    g = torch.Generator().manual_seed(seed)
    centre = torch.empty(n, dtype=F64).uniform_(-3, 3, generator=g)
    width = torch.exp(torch.empty(n, dtype=F64).uniform_(math.log(low), math.log(high),
                                                         generator=g))
    lo = (centre - width / 2).float().to(F64)
    return lo, torch.maximum((centre + width / 2).float().to(F64), lo)


def _reference_far_tangent(k, lo, hi):
    """The search the Newton iteration replaced: the tangent point d in [0, u] whose tangent
    passes through (l, f(l)), by bisection (100 steps), or the midpoint beyond it."""
    f, df = k.f64, k.df64
    flo = f(lo)
    d = bisect(lambda d: f(d) + df(d) * (lo - d) - flo, torch.zeros_like(hi), hi, 100)
    return df(torch.maximum(d, (lo + hi) / 2))


@pytest.mark.parametrize("cls", S_SHAPED, ids=lambda c: c.kind)
def test_far_tangent_matches_bisection(cls):
    k = _kernel(cls, 1)
    lo, hi = _intervals(4000, 15, high=1e4)
    lo, hi = torch.minimum(lo, -lo.abs().clamp(min=1e-7)), torch.maximum(hi, hi.abs())
    f, df = k.f64, k.df64
    far = f(hi) + df(hi) * (lo - hi) - f(lo) > 0         # the chord is not itself sound
    lo, hi = lo[far], hi[far]
    assert len(lo) > 1000
    _, upper = k.default_slopes64(lo, hi)
    ref = _reference_far_tangent(k, lo, hi)
    keep = ref > 1e-200                                 # (slopes that underflow: both ~0)
    assert bool(keep.float().mean() > 0.9)
    rel = ((upper - ref).abs() / ref)[keep]
    assert float(rel.max()) < 1e-9, float(rel.max())
    # the lower line is the mirror's upper line
    lower, _ = k.default_slopes64(-hi, -lo)
    assert torch.equal(lower, upper)


@pytest.mark.parametrize("spec", KERNELS, ids=lambda s: (s[0] if isinstance(s, tuple) else s).kind
                         + ("_" + "_".join(f"{v:g}" for v in s[1].values())
                            if isinstance(s, tuple) else ""))
def test_stacked_intercepts_are_bitwise_per_side(spec):
    n = 160
    k = _kernel(spec, n)
    lo, hi = _intervals(n, 16, high=30.0)
    if k.domain64(torch.ones(1, dtype=F64), torch.full((1,), 2.0, dtype=F64)).all() and not \
            bool(k.domain64(-hi.abs() - 1, -hi.abs() / 2 - 0.5).any()):
        lo, hi = lo.abs() + 1e-3, hi.abs() + lo.abs() + 2e-3     # a positive domain
        lo, hi = lo.float().to(F64), hi.float().to(F64)
    lo, hi = lo.reshape(1, 1, n), torch.maximum(hi.reshape(1, 1, n), lo.reshape(1, 1, n))
    sloped = k.sloped64(lo, hi)
    L, U = k._probe(sloped, lo, hi)
    # slopes anywhere in the range of f' (alpha-CROWN's; CROWN's envelope search is slow
    # for the gated kernels and checked through `_argmin64` below)
    g = torch.Generator().manual_seed(17)
    alpha = torch.rand(1, 1, 2, n, generator=g) * ALPHA_SPAN
    span = k.slope_range64(L, U)
    w = torch.stack([k.alpha_slopes64(L, U, alpha[:, :, i].to(F64), span)
                     for i in range(2)]).float().to(F64)
    side = torch.tensor([1.0, -1.0], dtype=F64).reshape(2, 1, 1, 1)
    both, x_both = k._intercept64(L, U, w, side)
    for i, s in enumerate((1.0, -1.0)):
        one, x_one = k._intercept64(L, U, w[i], s)
        assert torch.equal(both[i], one) and torch.equal(x_both[i], x_one), (k.kind, s)
        assert torch.equal(k._argmin64(L, U, w[i:i + 1], side[i:i + 1])[0], x_one)
    # the relaxation's lines hold at the interval's ends and midpoint (a smoke check; the
    # soundness checks proper are the harness's and lines_check's)
    lines = k._relax(lo.float(), hi.float(), alpha)
    for x in (L, U, (L + U) / 2):
        fx, ok = k.f64(x), sloped & torch.isfinite(k.f64(x))
        low = lines.lower_slope.to(F64) * x + lines.lower_icpt.to(F64)
        up = lines.upper_slope.to(F64) * x + lines.upper_icpt.to(F64)
        assert bool((low <= fx + 1e-9 * (1 + fx.abs()))[ok].all()), k.kind
        assert bool((up >= fx - 1e-9 * (1 + fx.abs()))[ok].all()), k.kind


def test_every_intercept_kernel_is_listed():
    """A new kernel of the shared machinery joins the bitwise check above."""
    listed = {(s[0] if isinstance(s, tuple) else s) for s in KERNELS}
    seen, todo = set(), [InterceptRelaxation]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if getattr(sub, "kind", None) and "kind" in sub.__dict__:
                seen.add(sub)
    assert seen <= listed, sorted(c.__name__ for c in seen - listed)


def test_envelope_search_is_bitwise_the_per_piece_one():
    """CROWN's envelope slopes (one stacked touching-point bisection over the pieces, the
    slope-independent candidates computed once per interval) are bitwise those of the same
    bisection on the slope whose every step asks the per-piece, per-side search (Gelu: the
    ViT's; the other gated kernels share the code path, and the reference costs ~0.5 s
    each)."""
    n = 64
    cls = gated.Gelu
    k = _kernel(cls, n)
    lo, hi = _intervals(n, 18, low=0.5, high=30.0)
    mixed = k.curvature64(lo, hi) == 0
    lo, hi = lo[mixed], hi[mixed]
    assert len(lo) > 10
    got = k.envelope_slopes64(lo, hi)
    m = (lo + hi) / 2
    smin, smax = k.slope_range64(lo, hi)
    ref = []
    for s in (1.0, -1.0):
        a, b = smin.clone(), smax.clone()
        for _ in range(intercepts.ENVELOPE_STEPS):
            w = (a + b) / 2
            x = k._intercept64(lo, hi, w, s)[1]         # a float side: piece by piece
            grow = x < m if s > 0 else x > m
            a, b = torch.where(grow, w, a), torch.where(grow, b, w)
        ref.append((a + b) / 2)
    assert torch.equal(got, torch.stack(ref)), cls.kind
