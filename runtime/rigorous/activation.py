"""Rigorous steps of the activation family: `relu` (its lines rounded here so they hold in
exact arithmetic), the piecewise-linear kernels (LeakyRelu, PRelu, Abs, Clip / Max / Min with
constants: their exact-intercept lines) and `sign` (constant lines)."""

from __future__ import annotations

import torch

from shardbound.runtime.ops.activation import PiecewiseLinear, Relu, Sign
from shardbound.runtime.rigorous.core import (DT, TINY, U32, U64, down, gamma, nan_vacuous,
                                              product_charge, rigorous_step, rowdot, up)
from shardbound.runtime.rigorous.relaxation import LinesStep


def relu_lines(lo, hi):
    """(lower slope, upper slope, upper intercept) of ReLU over [lo, hi], each sound in exact
    arithmetic for every point of the interval (the lower line has no intercept): the upper
    slope s = u / (u - l) rounded up (the denominator rounded down first), t = -s l rounded
    up, so the line lies above the chord."""
    zero, one = torch.zeros_like(lo), torch.ones_like(lo)
    active, inactive = lo >= 0, hi <= 0
    unstable = ~(active | inactive)
    s_low = torch.where(active, one, torch.where(inactive, zero, (hi > -lo).to(lo.dtype)))
    width = down(hi - lo)
    s = up(hi / torch.where(unstable, width, one))
    t = up(s * (-lo))
    # Infinite ends: relu <= max(0, hi) (flat line) or relu <= z - lo (slope 1).
    s = torch.where(torch.isinf(lo) & unstable, zero, s)
    t = torch.where(torch.isinf(lo) & unstable, hi.clamp(min=0), t)
    s = torch.where(torch.isinf(hi) & unstable, one, s)
    t = torch.where(torch.isinf(hi) & unstable, up(-lo), t)
    s_up = torch.where(active, one, torch.where(inactive, zero, s))
    t_up = torch.where(unstable, t, zero)
    return s_low, s_up, t_up, unstable


@rigorous_step(Relu)
class ReluStep(LinesStep):
    """Exact in float32; the lower line (slope 0 or 1, or alpha's in [0, 1] on unstable
    neurons) has no intercept."""

    window = "elementwise"

    def forward(self, xs):
        return xs[0].clamp(min=0)

    def ibp(self, bounds, float32):
        lo, hi = bounds[0]
        return lo.clamp(min=0), hi.clamp(min=0)

    def f32_delta(self, mags, out):
        return None

    def back(self, L, in_bounds, mags, alpha=None):
        return self.back_lines(L, self.full_lines(in_bounds[0]), mags, alpha)

    def full_lines(self, bounds):
        """The lines over the input's bounds, per element (window.py crops them to a
        row's window, computed once per node for all its windowed rows)."""
        return relu_lines(*bounds)

    def back_lines(self, L, lines, mags, alpha=None):
        """`back` with the lines given (`full_lines`, or a window of them)."""
        B, S = L.shape[:2]
        s_low, s_up, t_up, unstable = lines
        # positive coefficients take the lower line, negative ones the upper line (rounded
        # products: charged)
        Ln = L.clamp(max=0)
        Lp = L - Ln
        low = s_low.unsqueeze(1)
        if alpha is not None:
            low = torch.where(unstable.unsqueeze(1), alpha.to(DT).clamp(0, 1), low)
        L_in = Lp * low + Ln * s_up.unsqueeze(1)
        Lna = (-Ln).reshape(B, S, -1)
        k = Lna.shape[-1]
        tv = t_up.reshape(t_up.shape[0], 1, -1)
        bias = -up(rowdot(Lna, tv) * (1.0 + gamma(k + 1)) + k * TINY)
        m = mags[0]
        sm = up(s_up.unsqueeze(1) * m).reshape(B, 1, -1)
        charge = up(up(rowdot(Lna, sm) * (1.0 + gamma(k + 1)) + k * TINY) * (1.01 * U64))
        if alpha is not None:           # alpha's slopes: rounded products on the positive side
            charge = up(charge + product_charge(Lp * low, m))
        return [(L_in, charge)], bias


@rigorous_step(PiecewiseLinear)
class PiecewiseLinearStep(LinesStep):
    """IBP: f at the ends and the kinks inside (where a piecewise-linear f has its extremes),
    each value one rounded product at most (a x), moved one ulp outward."""

    def forward(self, xs):
        return self.op.value(xs[0].to(DT))

    def f32_delta(self, mags, out):
        lo, hi = out
        return up(torch.maximum(lo.abs(), hi.abs()) * U32 + 2.0 ** -149)

    def ibp(self, bounds, float32):
        lo, hi = bounds[0]
        values = [self.op.value(p) for p in self.op.points(lo, hi)]
        low, high = down(values[0]), up(values[0])
        for v in values[1:]:
            low, high = torch.minimum(low, down(v)), torch.maximum(high, up(v))
        if float32:
            d = self.f32_delta(None, (low, high))
            low, high = down(low - d), up(high + d)
        return nan_vacuous(low, high)


@rigorous_step(Sign)
class SignStep(LinesStep):
    """Constant lines sign(l) <= sign(x) <= sign(u); exact in float32."""

    def f32_delta(self, mags, out):
        return None

    def ibp(self, bounds, float32):
        lo, hi = bounds[0]
        return torch.sign(lo), torch.sign(hi)


