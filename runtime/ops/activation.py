"""The activation family: piecewise-linear activations, bounded through the relaxation
interface (runtime/ops/relaxation.py). Lowered in compiler/lowering/activation.py.

- `Relu`.
- `KinkAtZero` ops, f(x) = x for x >= 0 and a x below (any real a, per element): LeakyRelu
  (attribute a), PRelu (a constant slope tensor), Abs (a = -1). Convex when a <= 1, concave
  when a > 1. Optimisable and splittable at 0, like ReLU.
- `Clamp`, f(x) = min(max(x, m), M) with constant per-element m and/or M: Clip (HardTanh,
  Relu6), and Max / Min of a tensor and constants (m alone, M alone). A convex kink at m, a
  concave one at M; optimisable, not splittable (its kinks are not at 0).
- `Sign`: constant lines (a step has no useful slope).

Sound by construction (`PiecewiseLinear`): an op chooses only the *slopes* of its lines; the
intercepts are computed from them as the exact extreme of f(p) - s p over the points where a
piecewise-linear f - s x can reach its extremes on [l, u] (l, u and the kinks inside),
in float64 with an error-free difference, and rounded outward to float32. So every slope,
whatever alpha-CROWN or rounding makes of it, gives a line that holds at every real point of
[l, u] (degenerate, very wide or saturated intervals included); the slope choice only decides
how tight it is. Pieces where f is linear get its own line exactly (intercept error 0).
KinkAtZero ops of one curvature (LeakyRelu, Abs, most PRelus) skip that pass on the side
that is a line through the kink at 0 (its intercept is exactly 0): the side that carries
alpha's (B, S, ...) slopes. bench/activations.py measures the cost against ReLU.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.errors import ShardboundError
from shardbound.runtime.ops.base import register_op
from shardbound.runtime.ops.relaxation import ElementwiseRelaxation, Lines


def _unstable(lo, hi):
    return (lo < 0) & (hi > 0)


def _intercept_note(facts, sums):
    return f"bias A.intercept over {sums(math.prod(facts.shape))}"


@register_op
class Relu(ElementwiseRelaxation):
    """CROWN relaxation: upper line through (l, 0) and (u, u); lower slope 1 where u > -l,
    else 0 (exact on stable neurons); alpha-CROWN optimises the lower slope in [0, 1]. Branch
    and bound splits unstable neurons at 0."""

    kind = "relu"
    tp_roles = ("elementwise",)
    has_alpha = True
    alpha_slope_only = True
    splittable = True
    mip_encoding = "relu"

    @classmethod
    def summation_note(cls, facts, sums):
        return _intercept_note(facts, sums)

    def forward(self, x):
        return torch.clamp(x, min=0)

    def ibp(self, b):
        return torch.clamp(b[0], min=0), torch.clamp(b[1], min=0)

    def relax(self, lo, hi, alpha=None):
        active = lo >= 0
        unstable = _unstable(lo, hi)
        denom = torch.where(unstable, hi - lo, torch.ones_like(hi))
        up_slope = torch.where(unstable, hi / denom, active.to(hi.dtype))
        up_icpt = torch.where(unstable, -lo * hi / denom, torch.zeros_like(hi))
        low_slope = torch.where(unstable, (hi > -lo).to(hi.dtype), active.to(hi.dtype))
        if alpha is not None:           # any slope in [0, 1] is sound
            low_slope = torch.where(unstable, alpha.clamp(0, 1), low_slope)
        return Lines(low_slope, None, up_slope, up_icpt)

    def inexact(self, lo, hi):
        return _unstable(lo, hi)

    def alpha_init(self, in_bounds):
        lo, hi = in_bounds[0]
        return (hi > -lo).to(lo.dtype)

    def branch_slack(self, lo, hi):
        unstable = _unstable(lo, hi)
        denom = torch.where(unstable, hi - lo, torch.ones_like(hi))
        return torch.where(unstable, -lo * hi / denom, torch.zeros_like(hi))


# -- exact intercepts ------------------------------------------------------------------------------
def _two_diff(a: torch.Tensor, b: torch.Tensor):
    """(d, e) with d = fl(a - b) and a - b = d + e exactly (Knuth's TwoSum, float64)."""
    d = a - b
    bv = d - a
    av = d - bv
    return d, (a - av) + (-b - bv)


def _round_out(d: torch.Tensor, e: torch.Tensor, up: bool) -> torch.Tensor:
    """The nearest float32 at or above (up) / at or below d + e, for |e| <= ulp64(d) / 2."""
    r = d.float()
    # r - d is exact, and 0 or at least one ulp64(d) in size: the comparison with e decides.
    gap = r.double() - d
    if up:
        return torch.where(gap < e, torch.nextafter(r, torch.full_like(r, math.inf)), r)
    return torch.where(gap > e, torch.nextafter(r, torch.full_like(r, -math.inf)), r)


def _chord(f_lo, f_hi, lo64, hi64, where) -> torch.Tensor:
    """float32 slope (f(u) - f(l)) / (u - l) where `where`, else 0 (computed in float64)."""
    denom = torch.where(where, hi64 - lo64, torch.ones_like(hi64))
    return torch.where(where, (f_hi - f_lo) / denom, torch.zeros_like(denom)).float()


class PiecewiseLinear(ElementwiseRelaxation):
    """A continuous piecewise-linear f with float32 kinks: subclasses give `value` (f in the
    dtype of its argument, exact in float64 for float32 arguments), `kinks` and `slopes`
    (the float32 slopes of the lower and upper line over [l, u]); IBP and the intercepts are
    derived here (see the module docstring)."""

    tp_roles = ("elementwise",)
    alpha_saved = (4.5, 12.0)       # measured (Clip, PRelu; Abs 6.1): lines of several pieces

    @classmethod
    def summation_note(cls, facts, sums):
        return _intercept_note(facts, sums)

    def value(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kinks(self) -> list:
        """float32 tensors broadcast to the sample shape (or floats): where f bends."""
        raise NotImplementedError

    def slopes(self, lo, hi, alpha):
        """(lower slope, upper slope), float32, broadcast to (B, S or 1, *shape)."""
        raise NotImplementedError

    def forward(self, x):
        return self.value(x)

    def points(self, lo, hi) -> list[torch.Tensor]:
        """The points of [lo, hi] where f - s x has its extremes, for any s: the ends and
        the kinks inside (a kink outside is clamped onto an end)."""
        return [lo, hi] + [torch.clamp(torch.as_tensor(k, dtype=lo.dtype, device=lo.device),
                                       lo, hi) for k in self.kinks()]

    def ibp(self, b):
        lo, hi = b
        values = [self.value(p) for p in self.points(lo, hi)]
        low, high = values[0], values[0]
        for v in values[1:]:
            low, high = torch.minimum(low, v), torch.maximum(high, v)
        return low, high

    def relax(self, lo, hi, alpha=None):
        low, up = self.slopes(lo, hi, alpha)
        return Lines(low, self._intercept(low, lo, hi, upper=False),
                     up, self._intercept(up, lo, hi, upper=True))

    def _intercept(self, slope, lo, hi, upper: bool) -> torch.Tensor:
        """The float32 intercept b making slope x + b an upper (lower) line of f on [lo, hi]:
        max (min) over `points` p of f(p) - slope p, exact, rounded outward. Its gradient
        with respect to the slope is -p at the extreme point (alpha-CROWN)."""
        with torch.no_grad():
            s = slope.detach().double()
            best = at = None
            for p in self.points(lo, hi):
                p64 = p.double()
                d, e = _two_diff(self.value(p64), s * p64)    # s * p is exact in float64
                r = _round_out(d, e, up=upper)
                if best is None:
                    best, at = r, p.expand_as(r)
                else:
                    take = r > best if upper else r < best
                    best, at = torch.where(take, r, best), torch.where(take, p, at)
        if slope.requires_grad:
            return best - (slope - slope.detach()) * at
        return best


# -- f(x) = x (x >= 0), a x (x < 0) --------------------------------------------------------------
class KinkAtZero(PiecewiseLinear):
    """Two linear pieces meeting at 0 with slopes a (x < 0) and 1 (x >= 0), any real a.

    On an unstable neuron (l < 0 < u) one side is the chord through (l, f(l)) and (u, f(u)),
    the other a line s x through the kink with s in [min(a, 1), max(a, 1)]: a lower line when
    f is convex (a <= 1), an upper line when it is concave (a > 1). That slope is alpha's:
    s = a + t (1 - a), t in [0, 1], CROWN's choice t = [u > -l] (the smaller area in both
    cases). A split at 0 leaves f linear on each child."""

    has_alpha = True
    splittable = True

    def negative_slope(self):
        """a: a float or a float32 tensor broadcast to the sample shape."""
        raise NotImplementedError

    def curvature(self) -> str:
        """"convex" (a <= 1 everywhere), "concave" (a > 1 everywhere) or "mixed"."""
        raise NotImplementedError

    def kinks(self):
        return [0.0]

    def _a(self, like):
        return torch.as_tensor(self.negative_slope(), dtype=like.dtype, device=like.device)

    def value(self, x):
        return torch.where(x >= 0, x, x * self._a(x))

    def slopes(self, lo, hi, alpha):
        a = self._a(lo)
        with torch.no_grad():
            unstable = _unstable(lo, hi)
            lo64, hi64 = lo.double(), hi.double()
            chord = _chord(self.value(lo64), self.value(hi64), lo64, hi64, unstable)
            piece = torch.where(lo >= 0, torch.ones_like(lo), a)
        t = (hi > -lo).to(lo.dtype) if alpha is None else alpha.clamp(0, 1)   # grad: alpha
        kink_line = torch.lerp(a.expand_as(piece), torch.ones_like(piece), t)   # exact at t = 0, 1
        side = self.curvature()
        if side != "mixed":             # the chord side stays (B, 1, *shape), without grad
            if not bool(((a <= 1) if side == "convex" else (a > 1)).all()):
                raise ShardboundError(f"node {self.name!r}: its slopes are not all {side} as "
                                      "the program says; recompile the model")
            kink_side = torch.where(unstable, kink_line, piece)
            chord_side = torch.where(unstable, chord, piece)
            return (kink_side, chord_side) if side == "convex" else (chord_side, kink_side)
        convex = a <= 1
        lower = torch.where(unstable, torch.where(convex, kink_line, chord), piece)
        upper = torch.where(unstable, torch.where(convex, chord, kink_line), piece)
        return lower, upper

    def relax(self, lo, hi, alpha=None):
        """Unless the curvature is mixed, the kink-line side (lower when convex) is s x with
        s in [min(a, 1), max(a, 1)] on unstable neurons (lerp rounds monotonically, so it
        stays in) and f's own piece through 0 elsewhere: its intercept is exactly 0, so it
        is None (no bias term, and no exact-intercept pass over alpha's (B, S, ...) slopes);
        the chord side's is computed as usual."""
        side = self.curvature()
        if side == "mixed":
            return super().relax(lo, hi, alpha)
        low, up = self.slopes(lo, hi, alpha)
        if side == "convex":
            return Lines(low, None, up, self._intercept(up, lo, hi, upper=True))
        return Lines(low, self._intercept(low, lo, hi, upper=False), up, None)

    def inexact(self, lo, hi):
        return _unstable(lo, hi) & (self._a(lo) != 1)

    def alpha_init(self, in_bounds):
        lo, hi = in_bounds[0]
        return (hi > -lo).to(lo.dtype)

    def branch_slack(self, lo, hi):
        """|1 - a| (-l u) / (u - l): the chord's gap at the kink, which a split removes."""
        unstable = _unstable(lo, hi)
        denom = torch.where(unstable, hi - lo, torch.ones_like(hi))
        gap = (1 - self._a(lo)).abs() * (-lo * hi / denom)
        return torch.where(unstable, gap, torch.zeros_like(gap))


@register_op
class LeakyRelu(KinkAtZero):
    """LeakyRelu: a = the `alpha` attribute (a float32 value; any sign or size)."""

    kind = "leaky_relu"

    def setup(self, alpha=0.01):
        self.alpha = float(alpha)

    def negative_slope(self):
        return self.alpha

    def curvature(self):
        return "convex" if self.alpha <= 1 else "concave"


@register_op
class PRelu(KinkAtZero):
    """PRelu: a = the constant `slope` tensor, broadcast to the sample shape (per channel:
    a tp zone holds its channels' slice of it)."""

    kind = "prelu"
    param_roles = ("slope",)

    def setup(self, curvature="mixed"):
        """`curvature` (the lowering's, from the slopes): "convex" or "concave" when every
        slope is <= 1 or > 1, which saves the exact-intercept pass on one side (checked
        against the slopes at every use)."""
        if curvature not in ("convex", "concave", "mixed"):
            raise ValueError(f"unknown curvature {curvature!r}")
        self._curvature = curvature

    def negative_slope(self):
        return self.param("slope")

    def curvature(self):
        return self._curvature


@register_op
class Abs(KinkAtZero):
    """|x|: a = -1 (lower line s x with s in [-1, 1] on unstable neurons)."""

    kind = "abs"

    def negative_slope(self):
        return -1.0

    def curvature(self):
        return "convex"

    def value(self, x):
        return x.abs()


# -- f(x) = min(max(x, m), M) -----------------------------------------------------------------
@register_op
class Clamp(PiecewiseLinear):
    """min(max(x, m), M) with constant per-element bounds m <= M (either may be absent:
    unbounded). Clip, HardTanh, Relu6 (m = 0, M = 6), Max(x, c) (m = c alone), Min(x, c)
    (M = c alone).

    The lower line: through the convex kink (m, m) with slope t * (f(u) - m) / (u - m) when
    l < m < u (t in [0, 1]; at t = 1 it passes through (u, f(u)) too), else the chord (f is
    concave or linear there). The upper line: through the concave kink (M, M) with slope
    t' * (M - f(l)) / (M - l) when l < M < u, else the chord. Alpha holds (t, t') for the
    bounds present; CROWN's choice t = [mid > m], t' = [mid < M] with mid = (l + u) / 2,
    the smaller area (ReLU's rule, shifted). Over a wide interval with both kinks inside, both
    lines are supporting lines of the hull, each pivoting on its kink."""

    kind = "clamp"
    param_roles = ("min", "max")
    has_alpha = True

    def _bound(self, role, like):
        b = self.param(role)
        return None if b is None else b.to(like.dtype)

    def value(self, x):
        m, M = self._bound("min", x), self._bound("max", x)
        return torch.clamp(x, min=m, max=M)

    def kinks(self):
        return [b for b in (self.param("min"), self.param("max")) if b is not None]

    def _sides(self) -> list[str]:
        """The bounds present (asked without gathering an fsdp shard)."""
        return [role for role in ("min", "max") if self.params.get(role) is not None]

    def _inside(self, role, lo, hi):
        b = self._bound(role, lo)
        return None if b is None else (lo < b) & (b < hi)

    def slopes(self, lo, hi, alpha):
        sides = self._sides()
        with torch.no_grad():
            lo64, hi64 = lo.double(), hi.double()
            f_lo, f_hi = self.value(lo64), self.value(hi64)
            chord = _chord(f_lo, f_hi, lo64, hi64, hi > lo)
        t = self._default_t(lo, hi) if alpha is None else alpha.clamp(0, 1)   # grad: alpha
        lines = {}
        for i, role in enumerate(sides):
            inside = self._inside(role, lo, hi)
            with torch.no_grad():
                k = self._bound(role, lo64)
                if role == "min":       # pivot (m, m), through (u, f(u)) at t = 1
                    steepest = _chord(k, f_hi, k, hi64, inside)
                else:                   # pivot (M, M), through (l, f(l)) at t = 1
                    steepest = _chord(f_lo, k, lo64, k, inside)
            lines[role] = torch.where(inside, t[:, :, i] * steepest, chord)
        return lines.get("min", chord), lines.get("max", chord)

    def _default_t(self, lo, hi):
        mid = lo / 2 + hi / 2
        ts = [(mid > self._bound("min", lo)) if role == "min" else (mid < self._bound("max", lo))
              for role in self._sides()]
        return torch.stack([t.to(lo.dtype) for t in ts], dim=2)      # (B, 1, sides, *shape)

    def inexact(self, lo, hi):
        out = torch.zeros_like(lo, dtype=torch.bool)
        for role in self._sides():
            out = out | self._inside(role, lo, hi)
        return out

    def alpha_init(self, in_bounds):
        lo, hi = in_bounds[0]
        return self._default_t(lo.unsqueeze(1), hi.unsqueeze(1))[:, 0]   # (B, sides, *shape)

    alpha_per_element = 2           # one per side (alpha_init's `sides`)


# -- sign ---------------------------------------------------------------------------------------
@register_op
class Sign(ElementwiseRelaxation):
    """sign(x) (sign(0) = 0): nondecreasing, so sign(l) <= sign(x) <= sign(u) on [l, u];
    those constants are its lines (exact unless the interval reaches across or onto 0 from
    one side). Its zero gradient blinds attacks; counterexamples are confirmed by a forward
    pass anyway."""

    kind = "sign"
    tp_roles = ("elementwise",)

    @classmethod
    def summation_note(cls, facts, sums):
        return _intercept_note(facts, sums)

    def forward(self, x):
        return torch.sign(x)

    def ibp(self, b):
        return torch.sign(b[0]), torch.sign(b[1])

    def relax(self, lo, hi, alpha=None):
        zero = torch.zeros_like(lo)
        return Lines(zero, torch.sign(lo), zero, torch.sign(hi))

    def inexact(self, lo, hi):
        return torch.sign(lo) != torch.sign(hi)
