"""The exponential family: Exp, Log, Softplus, Elu (Selu, Celu), Reciprocal, Sqrt and Pow with a
constant exponent, bounded through chosen slopes and computed intercepts
(`InterceptRelaxation`, runtime/ops/intercepts.py). Lowered in compiler/lowering/exponential.py.

Each kernel declares its function piece by piece (convex / concave / linear), its domain and
its range on an interval; the intercepts, the IBP bounds, CROWN's and alpha-CROWN's slopes
follow from the shared machinery. Domains: Log needs x > 0 (log 0 = -inf: the lower bound is
-inf where the interval reaches 0), Sqrt x >= 0, a Reciprocal or a negative power an interval
that does not hold 0, a fractional power x >= 0 (x > 0 when negative); an interval that
reaches where f is NaN gets the vacuous bound [-inf, +inf] (no finite bound holds a NaN, and
a verifier must not prove anything about it). Overflow (exp of large bounds, 1 / x near 0)
gives infinite bounds and constant lines, never NaN.

Position-independent numerics (see intercepts.py): softplus is max(x, 0) + log1p(e^-|x|) with
log1p(e) = log(u) e / (u - 1), u = 1 + e (accurate to a few ulps with log alone: torch's
log1p and softplus are position-dependent); a fractional power is exp(p log x) in float64
(torch.pow with a fractional exponent is position-dependent), with the relative error
|p log x| ulps that this costs in `err64`.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.base import register_op
from shardbound.runtime.ops.intercepts import EPS, F64, INF, InterceptRelaxation, Pointwise

TINY_W = 1e-300         # slopes closer to 0 than this have no touching point worth finding


def _sig(x):
    return 1.0 / (1.0 + torch.exp(-x))


def _log1p(e):
    """log(1 + e) for e >= 0 to a few ulps, from log alone."""
    u = 1.0 + e
    return torch.where(u == 1.0, e, torch.log(u) * e / (u - 1.0))


def _vacuous(lo):
    return torch.full_like(lo, -INF), torch.full_like(lo, INF)


@register_op
class Exp(InterceptRelaxation):
    """e^x: convex and increasing. Exponent overflow (x > 88.7 in float32) gives infinite
    bounds, and lines whose slope or intercept would overflow fall back to the constant ones."""

    kind = "exp"
    pieces = ((-INF, INF, "convex"),)
    global_curvature = "convex"
    value_range = (0.0, INF)

    def forward(self, x):
        return torch.exp(x)

    def f64(self, x):
        return torch.exp(x)

    def df64(self, x):
        return torch.exp(x)

    def touch64(self, w, index, a, c):
        return torch.log(w.clamp(min=TINY_W))


@register_op
class Log(InterceptRelaxation):
    """log x: concave and increasing on x > 0; [l, u] with l = 0 has lower bound -inf, with
    l < 0 the vacuous bound (log is NaN there)."""

    kind = "log"
    pieces = ((0.0, INF, "concave"),)
    global_curvature = "concave"
    probe = (1.0, 2.0)

    def forward(self, x):
        return torch.log(x)

    def f64(self, x):
        return torch.log(x)

    def df64(self, x):
        return 1.0 / x

    def touch64(self, w, index, a, c):
        return 1.0 / w.clamp(min=TINY_W)

    def domain64(self, lo, hi):
        return lo > 0

    def range64(self, lo, hi):
        low, high = torch.log(lo.clamp(min=0)), torch.log(hi.clamp(min=0))
        nan = lo < 0
        return torch.where(nan, -INF, low), torch.where(nan, INF, high)


@register_op
class Reciprocal(InterceptRelaxation):
    """1 / x: concave on x < 0, convex on x > 0, decreasing on each side; an interval that
    holds 0 (or touches it: 1 / -0 = -inf) gets the vacuous bound."""

    kind = "reciprocal"
    pieces = ((-INF, 0.0, "concave"), (0.0, INF, "convex"))
    increasing, decreasing = False, True
    probe = (1.0, 2.0)

    def forward(self, x):
        return torch.reciprocal(x)

    def f64(self, x):
        return 1.0 / x

    def df64(self, x):
        return -1.0 / (x * x)

    def touch64(self, w, index, a, c):
        t = torch.sqrt(-1.0 / w.clamp(max=-TINY_W))
        return -t if index == 0 else t

    def domain64(self, lo, hi):
        return (lo > 0) | (hi < 0)

    def range64(self, lo, hi):
        ok = self.domain64(lo, hi)
        return torch.where(ok, 1.0 / hi, -INF), torch.where(ok, 1.0 / lo, INF)


@register_op
class Sqrt(InterceptRelaxation):
    """sqrt x: concave and increasing on x >= 0 (f' infinite at 0: those tangents are
    dropped); l < 0 gets the vacuous bound (sqrt is NaN there)."""

    kind = "sqrt"
    pieces = ((0.0, INF, "concave"),)
    global_curvature = "concave"
    probe = (1.0, 2.0)

    def forward(self, x):
        return torch.sqrt(x)

    def f64(self, x):
        return torch.sqrt(x)

    def df64(self, x):
        return 0.5 / torch.sqrt(x)

    def touch64(self, w, index, a, c):
        w = w.clamp(min=TINY_W)
        return 0.25 / (w * w)

    def domain64(self, lo, hi):
        return lo >= 0

    def range64(self, lo, hi):
        nan = lo < 0
        return (torch.where(nan, -INF, torch.sqrt(lo.clamp(min=0))),
                torch.where(nan, INF, torch.sqrt(hi.clamp(min=0))))


@register_op
class Pow(InterceptRelaxation):
    """x ** p for a constant p other than 0 and 1 (the lowering folds those).

    - integer p > 0: even: convex, minimum at 0; odd: concave on x <= 0, convex on x >= 0,
      increasing;
    - integer p < 0: undefined at 0 (an interval that holds 0: the vacuous bound when p is odd,
      [min of the ends, +inf] when even); on each side convex, or concave for odd p on x < 0;
    - fractional p: x >= 0 only (x > 0 when p < 0; NaN below: the vacuous bound); convex
      when p > 1 or p < 0, concave when 0 < p < 1.
    """

    kind = "pow"

    def setup(self, exponent=2.0):
        p = float(exponent)
        if p in (0.0, 1.0) or not math.isfinite(p):
            raise ValueError(f"pow exponent {p} (0 and 1 are folded by the lowering)")
        self.exponent = p
        self.integer = p == round(p)
        n = int(p) if self.integer else None
        if self.integer and p > 0:
            self.even = n % 2 == 0
            self.pieces = (((-INF, INF, "convex"),) if self.even else
                           ((-INF, 0.0, "concave"), (0.0, INF, "convex")))
            self.global_curvature = "convex" if self.even else None
            self.increasing = not self.even
            self.critical_points = (0.0,) if self.even else ()
        elif self.integer:
            self.even = n % 2 == 0
            self.pieces = ((-INF, 0.0, "convex" if self.even else "concave"), (0.0, INF, "convex"))
            self.increasing = False
            self.probe = (1.0, 2.0)
        else:
            self.pieces = ((0.0, INF, "concave" if 0 < p < 1 else "convex"),)
            self.global_curvature = self.pieces[0][2]
            self.increasing, self.decreasing = p > 0, p < 0
            self.probe = (1.0, 2.0)

    def forward(self, x):
        if self.integer:
            return torch.pow(x, int(self.exponent))
        return Pointwise.apply(x, self)

    def f64(self, x):
        p = self.exponent
        if self.integer:
            return torch.pow(x, int(p))
        return torch.exp(p * torch.log(x))

    def df64(self, x):
        p = self.exponent
        if self.integer:
            return p * torch.pow(x, int(p) - 1)
        return p * torch.exp((p - 1) * torch.log(x))

    def err64(self, x, fx):
        """exp(p log x) (and pow) lose |p log |x|| ulps to the rounding of the exponent."""
        lost = (self.exponent * torch.log(x.abs())).abs()
        return EPS * fx.abs() * (1 + torch.where(torch.isfinite(lost), lost, torch.zeros_like(lost)))

    def touch64(self, w, index, a, c):
        """f'(s t) = p s^(p-1) t^(p-1) = w with s = -1 on x < 0, +1 on x > 0, t > 0."""
        p = self.exponent
        if self.integer and p > 0 and self.even:    # one piece: x = sign(w) (|w| / p)^(1/(p-1))
            t = torch.exp(torch.log((w.abs() / p).clamp(min=TINY_W)) / (p - 1))
            return torch.where(w < 0, -t, t)
        s = -1.0 if self.pieces[index][1] <= 0 else 1.0
        ratio = w / (p * (s ** (p - 1) if self.integer else 1.0))
        t = torch.exp(torch.log(ratio.clamp(min=TINY_W)) / (p - 1))
        return s * t

    def domain64(self, lo, hi):
        p = self.exponent
        if self.integer:
            return (lo > 0) | (hi < 0) if p < 0 else torch.ones_like(lo, dtype=torch.bool)
        return lo > 0 if p < 0 else lo >= 0

    def range64(self, lo, hi):
        p = self.exponent
        if self.integer and p > 0:
            return super().range64(lo, hi)
        f = self.f64
        ok = self.domain64(lo, hi)
        if self.integer:            # monotone on each side; across 0 it is unbounded
            ends = torch.stack([f(lo), f(hi)])
            low, high = torch.amin(ends, dim=0), torch.amax(ends, dim=0)
            if self.even:           # x^-2n > 0: the far end is the smallest value
                return low, torch.where(ok, high, INF)
            return torch.where(ok, low, -INF), torch.where(ok, high, INF)
        low, high = (f(lo), f(hi)) if p > 0 else (f(hi), f(lo))
        if p < 0:                   # x = 0 gives +inf, x < 0 NaN
            return torch.where(lo < 0, -INF, low), torch.where(ok, high, INF)
        return torch.where(ok, low, -INF), torch.where(ok, high, INF)


@register_op
class Softplus(InterceptRelaxation):
    """log(1 + e^x): convex and increasing, f' = sigmoid(x)."""

    kind = "softplus"
    pieces = ((-INF, INF, "convex"),)
    global_curvature = "convex"
    value_range = (0.0, INF)

    def forward(self, x):
        return Pointwise.apply(x, self)

    def f64(self, x):
        return x.clamp(min=0) + _log1p(torch.exp(-x.abs()))

    def df64(self, x):
        return _sig(x)

    def touch64(self, w, index, a, c):
        w = w.clamp(TINY_W, 1 - 2.0 ** -53)
        return torch.log(w) - torch.log(1 - w)


@register_op
class Elu(InterceptRelaxation):
    """gamma * (x for x > 0, alpha (e^x - 1) for x <= 0): Elu (gamma = 1), Selu, and Celu
    (through affine maps). A kink at 0 unless alpha = 1 (slopes gamma alpha and gamma); convex
    when 0 <= alpha <= 1, the left piece concave when alpha < 0."""

    kind = "elu"

    def setup(self, alpha=1.0, gamma=1.0):
        self.alpha, self.gamma = float(alpha), float(gamma)
        left = self.alpha * self.gamma       # slope at 0 from the left, and sign of f'' there
        curv = "convex" if left > 0 else "concave" if left < 0 else "linear"
        self.pieces = ((-INF, 0.0, curv), (0.0, INF, "linear"))
        g = self.gamma
        self.global_curvature = ("convex" if 0 <= left <= g else
                                 "concave" if g <= left <= 0 else None)
        self.increasing = g >= 0 and left >= 0
        self.decreasing = g <= 0 and left <= 0

    def forward(self, x):
        y = torch.where(x > 0, x, self.alpha * torch.expm1(x.clamp(max=0)))
        return y if self.gamma == 1.0 else self.gamma * y

    def f64(self, x):
        return self.gamma * torch.where(x > 0, x, self.alpha * torch.expm1(x.clamp(max=0)))

    def df64(self, x):
        return torch.where(x > 0, torch.full_like(x, self.gamma),
                           self.gamma * self.alpha * torch.exp(x.clamp(max=0)))

    def piece_df64(self, x, index):
        if index == 1:
            return torch.full_like(x, self.gamma)
        return self.gamma * self.alpha * torch.exp(x.clamp(max=0))

    def touch64(self, w, index, a, c):
        return torch.log((w / (self.gamma * self.alpha)).clamp(min=TINY_W))
