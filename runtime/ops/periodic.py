"""The periodic family: Sin and Cos, bounded through chosen slopes and computed intercepts
(`InterceptRelaxation`, runtime/ops/intercepts.py). Lowered in compiler/lowering/periodic.py.

f(x) = sin(x + phase) (phase 0: sin, pi/2: cos) is neither convex nor concave over a wide
interval: it is concave where f >= 0 and convex where f <= 0, alternating on the pieces
between its zeros x = k pi - phase. An interval of width below 2 pi meets at most three of
them, so the pieces are found per element (`pieces64`: the zero at or below l, then the next
two) and the shared machinery bounds f - w x on each; CROWN's slopes on an interval across a
zero are the envelopes' supporting lines at the midpoint. Wider intervals, and |x| > 2^20
(where a float64 zero is off by more than we account for), get constant lines, the range of
f over the interval ([-1, 1] once it spans a period).

The zeros are known to float64 precision only: k pi - phase is off by delta <= 2^-31 for |x|
<= 2^20 (k pi rounded, the product rounded). A piece taken convex may then hold a sliver of
width delta beyond the true zero, where |f''| = |f| <= delta; the tangent bound errs there by
at most width * delta^2 < 2^-62 width: `piece_err` allows 2^-60 per unit of width. The
extrema (IBP) are computed likewise and lose a second-order amount, which the EPS margin covers.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.base import register_op
from shardbound.runtime.ops.intercepts import INF, InterceptRelaxation

PI = math.pi
LIMIT = 2.0 ** 20
MAX_WIDTH = 2 * PI - 2.0 ** -10     # three pieces hold any interval narrower than a period


class Sinusoid(InterceptRelaxation):
    """sin(x + phase); subclasses set phase and give f, f' with torch's own sin / cos."""

    increasing = False
    value_range = (-1.0, 1.0)
    sloped_limit = LIMIT
    piece_err = 2.0 ** -60
    phase = 0.0

    def _zero_index(self, x):
        """k with k pi - phase <= x < (k + 1) pi - phase (up to rounding)."""
        return torch.floor((x + self.phase) / PI)

    def pieces64(self, lo, hi):
        k = self._zero_index(lo)
        b1, b2 = (k + 1) * PI - self.phase, (k + 2) * PI - self.phase
        # sin z is concave on [2m pi, (2m + 1) pi]: the piece from zero k is convex when k is odd
        first_convex = torch.remainder(k, 2) == 1
        return ((-INF, b1, first_convex), (b1, b2, ~first_convex), (b2, INF, first_convex))

    def touch64(self, w, index, a, c):
        """On the piece from zero n: z = x + phase in [n pi, (n + 1) pi], f'(x) = cos z =
        (-1)^n cos(z - n pi): z = n pi + acos((-1)^n w)."""
        n = self._zero_index((a + c) / 2)
        sign = 1.0 - 2.0 * torch.remainder(n, 2)
        return n * PI + torch.acos((sign * w).clamp(-1.0, 1.0)) - self.phase

    def domain64(self, lo, hi):
        return hi - lo <= MAX_WIDTH

    def range64(self, lo, hi):
        """The ends and the extrema z = (n + 1/2) pi inside; [-1, 1] over a period or
        beyond |x| = 2^20."""
        k = self._zero_index(lo)
        points = [lo, hi]
        for j in range(3):
            c = (k + j + 0.5) * PI - self.phase
            points.append(torch.minimum(torch.maximum(c, lo), hi))
        values = torch.stack([self.f64(p) for p in points])
        low, high = torch.amin(values, dim=0), torch.amax(values, dim=0)
        exact = (torch.isfinite(lo) & torch.isfinite(hi) & (lo.abs() <= LIMIT)
                 & (hi.abs() <= LIMIT) & (hi - lo < 2 * PI))
        return torch.where(exact, low, -1.0), torch.where(exact, high, 1.0)


@register_op
class Sin(Sinusoid):
    kind = "sin"

    def forward(self, x):
        return torch.sin(x)

    def f64(self, x):
        return torch.sin(x)

    def df64(self, x):
        return torch.cos(x)


@register_op
class Cos(Sinusoid):
    """cos x = sin(x + pi/2)."""

    kind = "cos"
    phase = PI / 2

    def forward(self, x):
        return torch.cos(x)

    def f64(self, x):
        return torch.cos(x)

    def df64(self, x):
        return -torch.sin(x)
