"""The gated family: x times a gate of itself -- Gelu (x Phi(x), Phi the normal CDF), its tanh
approximation, SiLU (x sigmoid(x)) and HardSwish (x clamp(alpha x + beta, 0, 1)) -- bounded
through chosen slopes and computed intercepts (`InterceptRelaxation`, runtime/ops/intercepts.py).
Lowered in compiler/lowering/gated.py, which also fuses their exports (Mul(x, Sigmoid(x)), the
Erf / Tanh formulas, Mul(x, HardSigmoid(x))) into these kernels.

Each is convex on [-c, c] and concave outside (HardSwish: linear outside [k1, k2], with concave
kinks), with one minimum at x0 < 0: IBP takes it as a candidate (`critical_points`), and
CROWN's slopes on an interval across an inflection point are the envelopes' supporting lines
at the midpoint. The inflection points and minima are computed once, by float64 bisection on
closed forms of f'' and f' (60 steps: to a few ulps, delta <= 2^-50). A piece taken convex may
then hold a sliver of width delta where |f''| <= delta max|f'''| (< 1 for these functions):
the tangent bound errs by at most width * delta^2 < 2^-98 width there; `piece_err` allows
2^-90 per unit of width. Gelu's sqrt 2 is the float64 one (the same argument).

Numerics: f64 keeps relative accuracy in the tails (Phi through erfc, the gates through e^-x),
with the relative error the argument's rounding costs there in `err64`; f' is a sum of terms
of both signs (it crosses 0 at x0), so its error is bounded by the terms (`derr64`). The
forwards are computed in float64 and rounded (torch's gelu is position-dependent).
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.base import register_op
from shardbound.runtime.ops.intercepts import EPS, F64, INF, InterceptRelaxation, Pointwise

SQRT2 = math.sqrt(2.0)
INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)
TANH_BETA = math.sqrt(2.0 / math.pi)
TANH_KAPPA = 0.044715


def _sig(x):
    return 1.0 / (1.0 + torch.exp(-x))


def _root(fn, a: float, b: float, steps: int = 60) -> float:
    """The sign change of fn on [a, b] (float64 bisection; fn(a) < 0 < fn(b) or the reverse)."""
    lo, hi = torch.tensor(a, dtype=F64), torch.tensor(b, dtype=F64)
    rising = bool(fn(hi) > fn(lo))
    for _ in range(steps):
        m = (lo + hi) / 2
        if bool(fn(m) > 0) == rising:
            hi = m
        else:
            lo = m
    return float((lo + hi) / 2)


def _finite_limits(x, value, at_minus_inf: float = 0.0):
    """value with the limits at -inf (x -> -inf: at_minus_inf) and +inf (x itself)."""
    out = torch.where(x == -INF, torch.full_like(x, at_minus_inf), value)
    return torch.where(x == INF, x, out)


class Gate(InterceptRelaxation):
    """x g(x) with g rising from 0 to 1: convex on [-c, c], concave outside, minimum at x0."""

    increasing = False
    piece_err = 2.0 ** -90
    alpha_saved = (14.5, 14.5)      # measured (Gelu, both approximations)
    inflection = 1.0
    minimum = -1.0

    @property
    def pieces(self):
        c = self.inflection
        return ((-INF, -c, "concave"), (-c, c, "convex"), (c, INF, "concave"))

    @property
    def critical_points(self):
        return (self.minimum,)

    def forward(self, x):
        return Pointwise.apply(x, self)


@register_op
class Gelu(Gate):
    """x Phi(x); f' = Phi(x) + x phi(x); f'' = phi(x) (2 - x^2): inflections at +-sqrt 2."""

    kind = "gelu"
    inflection = SQRT2

    def f64(self, x):
        return _finite_limits(x, x * (0.5 * torch.erfc(x * (-1.0 / SQRT2))))

    @staticmethod
    def _terms(x):
        """(Phi(x), x phi(x)): the two terms of f'."""
        return 0.5 * torch.erfc(x * (-1.0 / SQRT2)), x * (INV_SQRT2PI * torch.exp(-0.5 * x * x))

    def df64(self, x):
        cdf, xpdf = self._terms(x)
        return cdf + xpdf

    def err64(self, x, fx):
        """erfc(-x / sqrt 2) loses ~ x^2 ulps to the rounding of its argument."""
        return EPS * fx.abs() * (1 + x * x)

    def derr64(self, x, df):
        cdf, xpdf = self._terms(x)
        return EPS * (cdf + xpdf.abs()) * (1 + x * x)


Gelu.minimum = _root(lambda x: sum(Gelu._terms(x)), -1.0, -0.5)


@register_op
class GeluTanh(Gate):
    """Gelu's tanh approximation x (1 + tanh(u)) / 2 = x sigmoid(2u), u = b (x + k x^3) with
    b = sqrt(2 / pi), k = 0.044715."""

    kind = "gelu_tanh"

    @staticmethod
    def _u(x):
        return TANH_BETA * (x + TANH_KAPPA * x * x * x)

    def f64(self, x):
        return _finite_limits(x, x * _sig(2 * self._u(x)))

    @staticmethod
    def _terms(x):
        u = GeluTanh._u(x)
        s, t = _sig(2 * u), _sig(-2 * u)
        du = TANH_BETA * (1 + 3 * TANH_KAPPA * x * x)
        return s, x * s * t * 2 * du

    def df64(self, x):
        a, b = self._terms(x)
        return _finite_limits(x, a + b, 0.0).nan_to_num(0.0)

    def err64(self, x, fx):
        return EPS * fx.abs() * (1 + 2 * self._u(x).abs())

    def derr64(self, x, df):
        a, b = self._terms(x)
        return (EPS * (a + b.abs()) * (1 + 2 * self._u(x).abs())).nan_to_num(0.0)

    @classmethod
    def second64(cls, x):
        """f'' = 2 s' + x s'', s = sigmoid(2u): s' = 2 s t u', s'' = 2 (s' (t - s) u' + s t u'')."""
        u = cls._u(x)
        s, t = _sig(2 * u), _sig(-2 * u)
        du = TANH_BETA * (1 + 3 * TANH_KAPPA * x * x)
        ddu = TANH_BETA * 6 * TANH_KAPPA * x
        ds = 2 * s * t * du
        dds = 2 * (ds * (t - s) * du + s * t * ddu)
        return 2 * ds + x * dds


GeluTanh.inflection = _root(GeluTanh.second64, 1.0, 2.0)
GeluTanh.minimum = _root(lambda x: sum(GeluTanh._terms(x)), -1.0, -0.5)


@register_op
class Silu(Gate):
    """x sigmoid(x) (SiLU, Swish with beta = 1); f' = s + x s (1 - s); f'' = s (1 - s)
    (2 + x (1 - 2 s)): inflections where x tanh(x / 2) = 2."""

    kind = "silu"

    def f64(self, x):
        return _finite_limits(x, x * _sig(x))

    @staticmethod
    def _terms(x):
        s, t = _sig(x), _sig(-x)
        return s, x * s * t

    def df64(self, x):
        a, b = self._terms(x)
        return (a + b).nan_to_num(0.0)

    def err64(self, x, fx):
        return EPS * fx.abs() * (1 + x.abs())

    def derr64(self, x, df):
        a, b = self._terms(x)
        return (EPS * (a + b.abs()) * (1 + x.abs())).nan_to_num(0.0)


Silu.inflection = _root(lambda x: 2 - x * torch.tanh(x / 2), 2.0, 3.0)
Silu.minimum = _root(lambda x: sum(Silu._terms(x)), -2.0, -1.0)


@register_op
class HardSwish(InterceptRelaxation):
    """x clamp(alpha x + beta, 0, 1) with alpha > 0 (ONNX HardSwish: 1/6, 1/2): 0 left of
    k1 = -beta / alpha, x right of k2 = (1 - beta) / alpha, the convex x (x - k1) / (k2 - k1)
    between; concave kinks at k1 and k2, minimum at k1 / 2 (when beta > 0). Computed from k1
    and k2 (float64), so its kinks are exactly the pieces' boundaries."""

    kind = "hard_swish"
    increasing = False

    def setup(self, alpha=1.0 / 6.0, beta=0.5):
        self.alpha, self.beta = float(alpha), float(beta)
        if not self.alpha > 0:
            raise ValueError(f"hard_swish alpha {alpha} (the lowering maps alpha <= 0)")
        self.k1, self.k2 = -self.beta / self.alpha, (1 - self.beta) / self.alpha
        self.pieces = ((-INF, self.k1, "linear"), (self.k1, self.k2, "convex"),
                       (self.k2, INF, "linear"))
        self.critical_points = (min(max(self.k1 / 2, self.k1), self.k2),)

    def forward(self, x):
        return x * torch.clamp(x * self.alpha + self.beta, 0, 1)

    def f64(self, x):
        gate = torch.clamp((x - self.k1) / (self.k2 - self.k1), 0, 1)
        return torch.where(x > self.k2, x, torch.where(x < self.k1, torch.zeros_like(x), x * gate))

    def df64(self, x):
        mid = (2 * x - self.k1) / (self.k2 - self.k1)
        return torch.where(x > self.k2, torch.ones_like(x),
                           torch.where(x < self.k1, torch.zeros_like(x), mid))

    def piece_df64(self, x, index):
        if index == 0:
            return torch.zeros_like(x)
        if index == 2:
            return torch.ones_like(x)
        return (2 * x - self.k1) / (self.k2 - self.k1)

    def touch64(self, w, index, a, c):
        return (w * (self.k2 - self.k1) + self.k1) / 2

    def derr64(self, x, df):
        return EPS * (2 * x.abs() + abs(self.k1)) / (self.k2 - self.k1)
