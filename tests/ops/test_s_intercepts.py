"""The S-shaped kernels' closed-form intercepts (runtime/ops/smooth.py `SShaped._intercept64`:
one touching point per line, instead of the shared machinery's six candidates over two
pieces), sampled and attacked, without CROWN or a compile (about a second).

- sound: for every interval kind (narrow, wide, saturated, crossing 0, ending exactly at 0,
  touching 0 from a denormal, huge) and slopes anywhere in the range of f' plus its ends, 0,
  the largest slope and slopes just off them, the bound lies below side (f - w x) on a dense
  grid with the ends, 0 and the touching points, f from an independent numpy reference (the
  only slack: that reference's float64 error);
- tight: it is the generic computation's bound (`InterceptRelaxation._intercept64`, kept for
  every other kernel) up to float64 rounding of the terms, so the lines alpha-CROWN optimises
  are as tight as before;
- the candidate it returns (the intercept's gradient is minus it) attains the least h among
  the generic candidates, up to the same rounding;
- soundness does not rest on the touching point: with touching points made wrong on
  purpose (off by 30%), the bounds still hold (they are looser, never unsound).
"""

from __future__ import annotations

import math

import shardbound  # noqa: F401  (first: sets MKL_CBWR before any BLAS call)
import numpy as np
import pytest
import torch

from shardbound.runtime.ops import smooth
from shardbound.runtime.ops.intercepts import F64, InterceptRelaxation

S_SHAPED = (smooth.Sigmoid, smooth.Tanh, smooth.Erf, smooth.Softsign)


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


REFERENCE = {"sigmoid": _sigmoid, "tanh": np.tanh,
             "erf": np.vectorize(math.erf, otypes=[np.float64]),
             "softsign": lambda x: x / (1 + np.abs(x))}


def _intervals(seed, n=60):
    """float32-representable (lo, hi), lo < hi, of the kinds the closed form branches on."""
    g = np.random.default_rng(seed)
    c = g.uniform(-6, 6, n)
    kinds = [
        (c, c + g.uniform(1e-6, 1e-3, n)),                          # narrow, either side
        (-g.uniform(0, 1e-4, n), g.uniform(0, 1e-4, n)),            # narrow around 0
        (np.zeros(n), g.uniform(1e-6, 20, n)),                      # ending exactly at 0
        (-g.uniform(1e-6, 20, n), np.zeros(n)),
        (np.full(n, -1e-40), g.uniform(0, 5, n)),                   # a denormal end
        (-g.uniform(0, 5, n), g.uniform(0, 5, n)),                  # crossing 0
        (-g.uniform(0, 40, n), g.uniform(0, 0.5, n)),               # lopsided
        (-g.uniform(0, 0.5, n), g.uniform(0, 40, n)),
        (c - g.uniform(0, 4, n), c + g.uniform(0, 4, n)),           # anywhere
        (30 + g.uniform(-3, 0, n), 30 + g.uniform(0, 3, n)),        # saturated
        (-30 + g.uniform(-3, 0, n), -30 + g.uniform(0, 3, n)),
        (-g.uniform(1e3, 1e4, n), g.uniform(1e3, 1e4, n)),          # wide
    ]
    lo = np.concatenate([k[0] for k in kinds]).astype(np.float32).astype(np.float64)
    hi = np.concatenate([k[1] for k in kinds]).astype(np.float32).astype(np.float64)
    hi = np.where(hi > lo, hi, np.nextafter(lo.astype(np.float32), np.float32(np.inf)))
    return torch.from_numpy(lo), torch.from_numpy(hi.astype(np.float64))


def _slopes(k, lo, hi, seed):
    """float32 slopes per interval (columns): random in the range of f', its ends, one
    float32 ulp beyond them, 0 and the largest slope."""
    smin, smax = k.slope_range64(lo, hi)
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(lo.shape[0], 4, generator=g, dtype=F64)
    cols = [smin[:, None] + r * (smax - smin)[:, None], smin[:, None], smax[:, None]]
    w = torch.cat(cols, dim=1).float()
    off = torch.stack([torch.nextafter(w[:, 4], torch.tensor(-1.0)),
                       torch.nextafter(w[:, 5], torch.tensor(2.0)),
                       torch.zeros_like(w[:, 0]), torch.full_like(w[:, 0], k.max_slope)], 1)
    return torch.cat([w, off.float()], dim=1).to(F64)


def _check(k, tight: bool):
    lo, hi = _intervals(5)
    w = _slopes(k, lo, hi, 6)                           # (n, m)
    L, U = lo[:, None], hi[:, None]
    x = L + (U - L) * torch.linspace(0, 1, 401, dtype=F64)[None]
    f = REFERENCE[k.kind]
    for s in (1.0, -1.0):
        got, at = k._intercept64(L, U, w, s)
        ref, ref_at = InterceptRelaxation._intercept64(k, L, U, w, s)
        assert bool(torch.isfinite(got).all()), k.kind
        # tight: the generic bound, up to rounding of the terms
        scale = 1e-12 * (1 + (w * torch.maximum(L.abs(), U.abs())).abs())
        assert not tight or bool((s * (got - ref) >= -scale).all()), (k.kind, s)
        # sound: side (f - w x) >= side bound at the grid, the ends, 0 and touching points
        touch = k.touch_positive64(w.clamp(1e-300, k.max_slope))
        pts = torch.cat([x, torch.zeros_like(L), touch, -touch], dim=1)
        pts = torch.minimum(torch.maximum(pts, L), U).numpy()
        fp = f(pts)
        for j in range(w.shape[1]):
            h = s * (fp - w[:, j:j + 1].numpy() * pts)
            slack = 2.0 ** -50 * (np.abs(fp) + np.abs(w[:, j:j + 1].numpy() * pts))
            low = s * got[:, j:j + 1].numpy()
            bad = low > h.min(axis=1, keepdims=True) + slack.max(axis=1, keepdims=True)
            assert not bad.any(), (k.kind, s, j, lo[bad[:, 0]][:3], hi[bad[:, 0]][:3])
        # the returned candidate attains the least h of the generic candidates
        fx = lambda v: s * (k.f64(v) - w * v)
        assert not tight or bool((fx(at) <= fx(ref_at) + scale + 1e-15).all()), (k.kind, s)


@pytest.mark.parametrize("cls", S_SHAPED, ids=lambda c: c.kind)
def test_closed_form_intercepts_are_sound_and_as_tight_as_the_generic_ones(cls):
    _check(cls("k", ["x"], [(1,)]), tight=True)


@pytest.mark.parametrize("cls", (smooth.Sigmoid, smooth.Tanh), ids=lambda c: c.kind)
def test_wrong_touching_points_stay_sound(cls):
    class Off(cls):
        def touch_positive64(self, w):
            return 1.3 * super().touch_positive64(w) + 0.05

    _check(Off("k", ["x"], [(1,)]), tight=False)
