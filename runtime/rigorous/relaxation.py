"""The rigorous step of an elementwise relaxation: the kernel's own lines, applied with an
error account.

A kernel that declares a rigorous step of this kind promises that its float32 lines
(runtime/ops/relaxation.py `Lines`) hold at every real point of [l, u] for float32 bounds
l, u (relaxation lines computed in float64 and rounded outward: activation.py's exact
intercepts, intercepts.py's computed ones). The rigorous bounds are float64, so the lines are
asked for over the float32 interval that contains them (`to_float32_outward`). Applying them
is then the only rounding: each coefficient of the input is one rounded product (charged u
|L_in| . max |x|), the intercepts a dot product (gamma allowance, one ulp down). IBP comes
from the lines at the interval's ends unless the family gives a tighter rigorous one.
float32 mode: the float32 evaluation of f is allowed `F32_ULPS` float32 ulps of max |f|
(library elementwise functions are within a few ulps; ReLU and max are exact).
"""

from __future__ import annotations

import torch

from shardbound.runtime.rigorous.core import (DT, U32, Step, dot_lower, down, nan_vacuous,
                                              product_charge, to_float32_outward, up)

F32_ULPS = 16


def _f64(t):
    return None if t is None else t.detach().to("cpu", DT)


def masked_dot_lower(coef, icpt, B, S):
    """A lower bound of sum(coef * icpt) per row, 0 * inf = 0 (an infinite intercept is a line
    that does not exist; a nonzero coefficient on it gives an infinite term)."""
    if icpt is None:
        return None
    a = coef.reshape(B, S, -1)
    v = icpt.reshape(icpt.shape[0], icpt.shape[1], -1)
    if not bool(torch.isfinite(v).all()):
        v = torch.where(a == 0, torch.zeros_like(a), v.expand_as(a))
    return dot_lower(a, v)


def cached(step, lo, hi, compute):
    """compute() for the bounds (lo, hi) last seen by `step` (the same tensor objects: the
    engine's bounds of the input node, which it never changes in place)."""
    got = getattr(step, "_cached", None)
    if got is None or got[0] is not lo or got[1] is not hi:
        got = step._cached = (lo, hi, compute())
    return got[2]


class LinesStep(Step):
    """Lines from `op.relax`, applied rigorously (see the module docstring)."""

    def lines(self, lo, hi, alpha=None):
        """(lower slope, lower intercept or None, upper slope, upper intercept or None),
        float64, broadcast against (B, S, *shape), sound over [lo, hi]. Without alpha, the
        last bounds' lines are kept: every backward pass through the node asks for them."""
        if alpha is None:
            return cached(self, lo, hi, lambda: self._lines(lo, hi, None))
        return self._lines(lo, hi, alpha)

    def _lines(self, lo, hi, alpha):
        l32, h32 = to_float32_outward(lo, hi)
        a = None if alpha is None else alpha.to(torch.float32)
        with torch.no_grad():
            ln = self.op.relax(l32.unsqueeze(1), h32.unsqueeze(1), a)
        return (_f64(ln.lower_slope), _f64(ln.lower_icpt), _f64(ln.upper_slope),
                _f64(ln.upper_icpt))

    def forward(self, xs):
        return self.op.forward(xs[0].to(DT)).to(DT)

    def exact_range(self, lo, hi):
        """An interval holding f over [lo, hi] in exact arithmetic: from the lines' values at
        the ends (min of the lower line, max of the upper one)."""
        sl, tl, su, tu = (t if t is None else t.squeeze(1) for t in self.lines(lo, hi))

        def at(s, t, x, rnd):
            v = torch.where(s == 0, torch.zeros_like(x), rnd(s * x))
            return v if t is None else rnd(v + t)
        low = torch.minimum(at(sl, tl, lo, down), at(sl, tl, hi, down))
        high = torch.maximum(at(su, tu, lo, up), at(su, tu, hi, up))
        return low, high

    def f32_delta(self, mags, out):
        lo, hi = out
        m = torch.maximum(lo.abs(), hi.abs())
        return up(m * (F32_ULPS * 2 * U32) + F32_ULPS * 2.0 ** -149)

    def ibp(self, bounds, float32):
        lo, hi = bounds[0]
        low, high = self.exact_range(lo, hi)
        if float32:
            d = self.f32_delta(None, (low, high))
            low, high = down(low - d), up(high + d)
        return nan_vacuous(low, high)

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        lo, hi = in_bounds[0]
        sl, tl, su, tu = self.lines(lo, hi, alpha)
        pos = L.clamp(min=0)
        neg = L - pos
        L_in = pos * sl + neg * su              # one of the two products is 0 per element
        charge = product_charge(L_in, mags[0])
        bias = None
        for coef, icpt in ((pos, tl), (neg, tu)):
            term = masked_dot_lower(coef, icpt, B, S)
            if term is not None:
                bias = term if bias is None else down(bias + term)
        return [(L_in, charge)], bias
