"""Sound lines for an elementwise function given piece by piece: chosen slopes, computed
intercepts. The machinery the smooth, exponential, periodic and gated families share; their
kernels only declare a function (not a family: no lowering module of this name).

The idea: a line's slope w may be chosen freely -- by CROWN's rule, or by alpha-CROWN -- and
its intercept is then *computed*: the tightest sound lower intercept over [l, u] is min over x
in [l, u] of g(x) = f(x) - w x, the upper one the max. So soundness never rests on how a slope
was found (a bisection that stopped early, an optimiser step, a chord slope that lost its digits
to cancellation on a narrow interval). The minimum is found piece by piece, on intervals where f
is convex, concave or linear: where the function to minimise (g, or -g for the maximum) is
concave, its minimum is at an endpoint; where it is convex, at the point where f'(x) = w (closed
forms per function, or a bisection: f' is monotone on a piece) or an endpoint, and a tangent
inequality turns the value at any such candidate into a rigorous bound (a touching point
computed a little off costs a second-order amount, never soundness). At a piece boundary f may
have a kink: each piece's tangents use that piece's own derivative (`piece_df64`).

Numerics: everything is computed in float64 from the float32 bounds; slopes are rounded to
float32 first and the intercepts are computed for the float32 slope, less a float64 error
margin (`err64`: the evaluation error of f, EPS per term by default; `piece_err`: a bound per
unit of width where piece boundaries are known only to float64 precision, see the gated and
periodic families), and rounded outward to float32 (down for the lower line, up for the upper),
so the float32 lines are sound in real arithmetic. Kernels use only float64 functions whose
bits do not depend on an element's position in a tensor (measured: exp, expm1, log, sqrt, sin,
cos, tanh, erf, erfc, acos and the IEEE operations; not torch's sigmoid, log1p, softplus or pow
with a fractional exponent: vector body vs scalar tail), which tp's bitwise promise needs.

Special intervals get constant lines, [min f, max f] over [l, u] (`range64`): lower == upper
(the point itself), infinite or huge (|x| > `sloped_limit`) bounds, intervals that leave the
function's domain (`domain64`: log on l <= 0, a reciprocal across 0), and lines whose slope or
intercept overflows float32 (exp of large bounds). Those constants are infinite where f is
unbounded on [l, u] or may be NaN there (an input box that reaches log's negative side): an
infinite bound is never wrong; NaN never appears (`infinite_lines`: the CROWN step counts
infinite intercepts apart, relaxation.py).

CROWN's slopes (`default_slopes64`): on an interval where f has one curvature, the tangent at
the midpoint and the chord (Zhang et al. 2018); otherwise the supporting lines of f's convex
(lower) and concave (upper) envelopes over [l, u] at the midpoint, found by bisection on the
slope (the touching point of the line with slope w moves monotonically with w; the searches
are in runtime/ops/intercept_search.py, a mixin of `InterceptRelaxation`). That rule is
the one that minimises the area between the line and f, and gives the classic choices on
intervals of one curvature and for S-shaped functions (the tangent through the far endpoint).

alpha-CROWN optimises both slopes: alpha (B, S, 2, *shape) in [0, ALPHA_SPAN]^2 maps to slopes
smin + alpha / ALPHA_SPAN (smax - smin) where [smin, smax] is the range of f' over [l, u]
(which holds every tangent slope and, by the mean value theorem, every chord slope), entry 0
for the lower line and 1 for the upper one. The intercepts follow the slopes; their gradient is
-x* (x* the point where the line touches: the envelope theorem), passed straight through the
outward rounding.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.intercept_search import (  # noqa: F401  (re-exported)
    BISECTION_STEPS, ENVELOPE_STEPS, F64, INF, SIDES as _SIDES, TOUCH_STEPS, SlopeSearch, bisect,
    h_convexity, no_nan)
from shardbound.runtime.numerics.select import blend
from shardbound.runtime.numerics.shapes import broadcast_shape
from shardbound.runtime.ops.relaxation import ElementwiseRelaxation, Lines
from shardbound.runtime.ops.memo import tensor_key

EPS = 2.0 ** -46        # relative float64 error allowed per evaluated term (64 ulps)
TINY = 2.0 ** -126      # absolute slack: the smallest normal float32 (no denormal intercepts)
HUGE = 2.0 ** 32        # beyond this a line buys nothing over the constant bounds
# alpha lives in [0, ALPHA_SPAN]^2: the shared optimiser's step (lr 0.25, tuned for ReLU
# slopes in [0, 1]) is then 1/48 of the slope range. Measured (20 steps; sigmoid_mlp,
# tanh_mlp, tp_sigmoid; 36 boxes): total gain of the margins over CROWN 15.4 with span 1,
# 18.6 (4), 19.7 (8), 19.9 (12), 19.8 (16), 18.5 (64): big first steps overshoot an
# optimum that lies near CROWN's slopes.
ALPHA_SPAN = 12.0


def round_down(x64: torch.Tensor) -> torch.Tensor:
    """The largest float32 <= x64, one more ulp down."""
    y = x64.to(torch.float32)
    y = torch.where(y.to(F64) > x64, torch.nextafter(y, y.new_tensor(-math.inf)), y)
    return torch.nextafter(y, y.new_tensor(-math.inf))


def round_up(x64: torch.Tensor) -> torch.Tensor:
    """The smallest float32 >= x64, one more ulp up."""
    y = x64.to(torch.float32)
    y = torch.where(y.to(F64) < x64, torch.nextafter(y, y.new_tensor(math.inf)), y)
    return torch.nextafter(y, y.new_tensor(math.inf))


def _round_down_(x64: torch.Tensor) -> torch.Tensor:
    """`round_down` with fewer temporaries (x64 is clobbered): the same bits."""
    y = x64.to(torch.float32)
    minus = y.new_tensor(-math.inf)
    above = torch.gt(y.to(F64, copy=False), x64, out=torch.empty(y.shape, dtype=torch.bool))
    # (where the rounding went up follows the data: a branch-free pick, numerics/select.py)
    y = blend(above, torch.nextafter(y, minus, out=x64.new_empty(0, dtype=y.dtype)), y)
    return torch.nextafter(y, minus, out=y)


class _AlphaSlopes(torch.autograd.Function):
    """float32 slopes (2, B, S, *shape) of alpha (B, S, 2, *shape): `alpha_slopes64` of each
    entry (smin + alpha / ALPHA_SPAN (smax - smin)), 0 where not sloped, `to_slope`'s flush,
    computed in place on one float64 buffer, with the gradient autograd gives that chain (the
    same operations: the same bits); alpha-CROWN asks for it per row of every start node."""

    @staticmethod
    def forward(ctx, alpha, smin, smax, sloped):
        d = smax - smin
        w = torch.empty((2, *alpha[:, :, 0].shape), dtype=F64, device=alpha.device)
        w.copy_(alpha.detach().movedim(2, 0))
        w32, flush = alpha_to_slopes_(w, d, smin, sloped)
        ctx.save_for_backward(d, sloped, flush)
        return w32

    @staticmethod
    def backward(ctx, grad):
        d, sloped, flush = ctx.saved_tensors
        return slope_gradient(grad, d, sloped, flush).movedim(0, 2), None, None, None


def alpha_to_slopes_(w: torch.Tensor, d, smin, sloped):
    """float32 slopes smin + w / ALPHA_SPAN d (w: float64 alpha entries, overwritten), 0 where
    not sloped, denormals flushed; and where they were flushed (for `slope_gradient`)."""
    w.div_(ALPHA_SPAN).mul_(d).add_(smin).masked_fill_(~sloped, 0.0)
    w32 = w.to(torch.float32)
    flush = w32.abs() < TINY
    return w32.masked_fill_(flush, 0.0), flush


def slope_gradient(grad, d, sloped, flush):
    """The gradient `alpha_to_slopes_` passes back to its alpha entries (float32)."""
    g = grad.masked_fill(flush, 0.0).to(F64).masked_fill_(~sloped, 0.0)
    g = g.mul_(d).div_(ALPHA_SPAN).add_(0.0)    # (+ 0: the two slices' gradients summed)
    return g.to(torch.float32)


class _TouchGradient(torch.autograd.Function):
    """b + (w - w.detach()) (-x*): the intercept b (no gradient of its own) with the
    envelope theorem's gradient -x* per slope w, without autograd's three temporaries."""

    @staticmethod
    def forward(ctx, w, b, x):
        ctx.save_for_backward(x)
        return b

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.neg(), None, None


def to_slope(w64: torch.Tensor) -> torch.Tensor:
    """float32 slope (differentiable); denormals flushed to 0 (any slope is sound)."""
    w = w64.to(torch.float32)
    return torch.where(w.abs() < TINY, torch.zeros_like(w), w)


def _margin(v: torch.Tensor) -> torch.Tensor:
    """EPS |v| + TINY for finite v, 0 for infinite v (an infinite bound needs no margin)."""
    return torch.where(torch.isfinite(v), EPS * v.abs() + TINY, torch.zeros_like(v))


def _clip_low(x, bound):
    return x.clamp(min=bound) if not isinstance(bound, torch.Tensor) else torch.maximum(x, bound)


def _clip_high(x, bound):
    return x.clamp(max=bound) if not isinstance(bound, torch.Tensor) else torch.minimum(x, bound)


class Pointwise(torch.autograd.Function):
    """y = kernel.value(x) with dy/dx = kernel.grad(x): for forwards whose autograd graph
    would hold NaN (a torch.where over a branch that overflows) or whose torch op is
    position-dependent; both are computed in float64 and rounded."""

    @staticmethod
    def forward(ctx, x, kernel):
        ctx.save_for_backward(x)
        ctx.kernel = kernel
        return kernel.f64(x.to(F64)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        d = ctx.kernel.df64(x.to(F64)).to(x.dtype)
        return grad * d, None


class InterceptRelaxation(SlopeSearch, ElementwiseRelaxation):
    """An elementwise f relaxed by lines with chosen slopes and computed intercepts (see the
    module docstring). A subclass gives f and f' in float64 (`f64`, `df64`; the limits at
    +-inf, never NaN where f is defined), its pieces, and optionally closed forms for the
    points where f' equals a slope (`touch64`), CROWN's slopes (`default_slopes64`), its
    domain (`domain64`), its range on an interval (`range64`) and its extrema
    (`critical_points`)."""

    tp_roles = ("elementwise",)
    has_alpha = True
    alpha_saved = (10.6, 12.6)      # measured (sigmoid): the slope's range arithmetic
    alpha_per_element = 2           # both lines' slopes are optimised
    interval_splittable = True  # its lines tighten on narrower intervals (GenBaB-style BaB)
    increasing = True           # nondecreasing: IBP is [f(l), f(u)]
    decreasing = False          # nonincreasing: [f(u), f(l)]; neither: `critical_points`
    # (start, stop, "convex" | "concave" | "linear") covering the real line, in order
    pieces: tuple[tuple[float, float, str], ...] = ()
    global_curvature: str | None = None     # "convex" / "concave" on the whole line
    critical_points: tuple[float, ...] = ()     # local extrema of a non-monotone f
    value_range: tuple[float, float] = (-INF, INF)
    sloped_limit = HUGE
    piece_err = 0.0             # tangent error per unit of width (approximate boundaries)
    probe = (0.0, 1.0)          # a harmless interval for elements that get constant lines

    @property
    def infinite_lines(self) -> bool:
        """Lines may have infinite intercepts where f is unbounded (relaxation.py)."""
        return not (math.isfinite(self.value_range[0]) and math.isfinite(self.value_range[1]))

    @classmethod
    def summation_note(cls, facts, sums):
        return f"bias A.intercept over {sums(math.prod(facts.shape))}"

    # -- what a function declares (float64 in, float64 out) --------------------------------
    def f64(self, x):
        raise NotImplementedError

    def df64(self, x):
        raise NotImplementedError

    def piece_df64(self, x, index: int):
        """The derivative of piece `index`'s own formula (one-sided at a kink)."""
        return self.df64(x)

    def err64(self, x, fx):
        """A bound on |f64(x) - f(x)| (default: EPS relative)."""
        return EPS * fx.abs()

    def derr64(self, x, df):
        """A bound on the error of piece_df64 at x (default: EPS relative; a derivative that
        is a sum of terms of both signs, like gelu's, bounds it by the terms)."""
        return EPS * df.abs()

    def pieces64(self, lo, hi):
        """The pieces over [lo, hi]: (start, stop, curvature), floats or tensors; a
        curvature tensor is True where convex (periodic functions)."""
        return self.pieces

    def touch64(self, w, index: int, a, c):
        """A point of piece `index` within [a, c] where f'(x) = w, or any point of it where
        there is none (it is clamped into the interval and only has to be close for
        tightness). Default: bisection (f' is monotone on a piece)."""
        da, dc = self.piece_df64(a, index), self.piece_df64(c, index)
        sign = torch.where(dc >= da, torch.ones_like(w), -torch.ones_like(w))
        return bisect(lambda x: sign * (self.piece_df64(x, index) - w), a, c, TOUCH_STEPS)

    def domain64(self, lo, hi):
        """Bool: where f is finite and continuous on [lo, hi] (lines may slope there)."""
        return torch.ones_like(lo, dtype=torch.bool)

    def range64(self, lo, hi):
        """(min, max) of f over [lo, hi] in float64 (infinite where unbounded or where f may
        be NaN: never NaN itself)."""
        f = self.f64
        if self.increasing:
            return f(lo), f(hi)
        if self.decreasing:
            return f(hi), f(lo)
        points = [lo, hi] + [torch.minimum(torch.maximum(lo.new_tensor(p), lo), hi)
                             for p in self.critical_points + self._boundaries()]
        values = torch.stack([f(p) for p in points])
        bad = torch.isnan(values).any(dim=0)
        low, high = torch.amin(values, dim=0), torch.amax(values, dim=0)
        return torch.where(bad, -INF, low), torch.where(bad, INF, high)

    def _boundaries(self) -> tuple[float, ...]:
        return tuple(float(s) for s, _, _ in self.pieces[1:])

    # -- IBP ----------------------------------------------------------------------------------
    def ibp(self, b):
        lo, hi = b[0].to(F64), b[1].to(F64)
        rmin, rmax = self.range64(lo, hi)
        r0, r1 = self.value_range
        lower = round_down(rmin - _margin(rmin)).clamp(min=r0)
        upper = round_up(rmax + _margin(rmax)).clamp(max=r1)
        return lower.to(b[0].dtype), upper.to(b[1].dtype)

    # -- the lines -------------------------------------------------------------------------
    def relax(self, lo, hi, alpha=None):
        if alpha is not None:
            return self._relax(lo, hi, alpha)
        return self._cached("_default_lines", lo, hi, lambda: self._relax(lo, hi, None))

    def _cached(self, slot: str, lo, hi, compute):
        """compute() for the last bounds seen in `slot`: CROWN's lines and alpha's slope
        ranges are asked for once per backward pass through this node, with the same bounds
        (held, so their storage cannot be reused; an in-place change bumps _version)."""
        key = tensor_key(lo, hi)
        cached = getattr(self, slot, None)
        if cached is None or cached[0] != key:
            cached = (key, (lo, hi), compute())
            setattr(self, slot, cached)
        return cached[2]

    def sloped64(self, l64, u64):
        """Where lines may have a slope: finite, not huge, not a point, inside the domain."""
        finite = (torch.isfinite(l64) & torch.isfinite(u64) & (l64.abs() <= self.sloped_limit)
                  & (u64.abs() <= self.sloped_limit))
        return finite & (l64 < u64) & self.domain64(l64, u64)

    def _probe(self, sloped, l64, u64):
        p0, p1 = self.probe
        return (torch.where(sloped, l64, torch.full_like(l64, p0)),
                torch.where(sloped, u64, torch.full_like(u64, p1)))

    def _relax(self, lo, hi, alpha):
        l64 = lo.to(F64)
        # (lower > upper: an empty branch-and-bound domain; the point l: any finite lines do)
        u64 = torch.maximum(hi.to(F64), l64)
        sloped = self.sloped64(l64, u64)
        L, U = self._probe(sloped, l64, u64)
        zero = torch.zeros_like(l64)
        w32 = None
        if alpha is None:
            wl, wu = self.default_slopes64(L, U)
        else:
            span = self._cached("_slope_ranges", lo, hi, lambda: self.slope_range64(L, U))
            if (type(self).alpha_slopes64 is InterceptRelaxation.alpha_slopes64
                    and broadcast_shape(alpha[:, :, 0].shape, span[0].shape)
                    == alpha[:, :, 0].shape):
                w32 = _AlphaSlopes.apply(alpha, span[0], span[1], sloped)
            else:
                a = alpha.to(F64)
                wl = self.alpha_slopes64(L, U, a[:, :, 0], span)
                wu = self.alpha_slopes64(L, U, a[:, :, 1], span)
        # both lines at once, stacked on a leading axis: entry 0 the lower line, 1 the upper
        if w32 is None:
            w32 = to_slope(torch.where(sloped, torch.stack(torch.broadcast_tensors(wl, wu)),
                                       zero))
        side = _SIDES.to(w32.device).reshape(2, *([1] * (w32.dim() - 1)))
        w32, b32 = self._lines_for_slopes(l64, u64, L, U, sloped, w32, side)
        return Lines(w32[0], b32[0], w32[1], b32[1])

    def _lines_for_slopes(self, l64, u64, L, U, sloped, w32, side):
        """(slopes, intercepts) float32 of the lines with slopes w32: side +1 entries are
        lower lines, -1 upper ones (`side` per line, stacked, or per element:
        selected_lines.py; each entry's bits the same either way). Intercepts computed for
        the slopes, rounded outward; constant lines where a line may not slope."""
        lower = side > 0
        side32 = side.to(torch.float32)
        rmin, rmax = self.range64(l64, u64)
        r0, r1 = self.value_range
        b64, x_arg = self._intercept64(L, U, w32.detach().to(F64), side)
        const = blend(lower, rmin - _margin(rmin), rmax + _margin(rmax))
        b64 = torch.where(sloped, b64, const, out=b64)
        # down for the lower line, up for the upper one (round_up(x) = -round_down(-x))
        b32 = _round_down_(b64.mul_(side)).mul_(side32)
        # a slope or an intercept beyond float32: the constant line instead. (First one sum
        # each: finite sums mean every entry is finite, nothing is bad; an infinite sum of
        # finite entries only takes the exact test. Four passes over the lines fewer.)
        bad = None
        if not bool(torch.isfinite(b32.sum() + w32.detach().sum())):
            bad = sloped & ~(torch.isfinite(b32) & torch.isfinite(w32.detach()))
        if bad is not None and bool(bad.any()):
            w32 = torch.where(bad, torch.zeros_like(w32), w32)
            b32 = torch.where(bad, side32 * round_down(side * const), b32)
        # a constant line may stop at the function's range (f lies inside it)
        flat = w32.detach() == 0
        if bool(flat.any()):
            b32 = torch.where(flat, blend(lower, b32.clamp(min=r0), b32.clamp(max=r1)), b32)
        if w32.requires_grad:       # d(intercept)/d(slope) = -x*, forward bits unchanged
            ok = sloped if bad is None else sloped & ~bad
            x_arg = x_arg.masked_fill(~ok, 0.0).to(torch.float32)
            b32 = _TouchGradient.apply(w32, b32, x_arg)
        return w32, b32

    def _alpha_step(self, lA, uA, bounds, alpha):
        from shardbound.runtime.ops import selected_lines

        if not selected_lines.selects_lines(self, alpha, lA):
            return None
        return selected_lines.crown_selected(self, lA, uA, bounds, alpha)

    def _pieces_within(self, lo, hi):
        """(index, a, c, inside, curvature) per piece: [a, c] = the piece within [lo, hi]."""
        for index, (start, stop, curvature) in enumerate(self.pieces64(lo, hi)):
            a, c = _clip_low(lo, start), _clip_high(hi, stop)
            inside = a <= c
            yield index, torch.where(inside, a, lo), torch.where(inside, c, lo), inside, curvature

    def slope_range64(self, lo, hi):
        """[min, max] of f' over [lo, hi]: f' is monotone on each piece, so its extremes are
        at the ends of the pieces within the interval (each piece's own derivative at a
        kink). An infinite end (sqrt at 0) is replaced by f' a little inside."""
        lows, highs = [], []
        for index, a, c, inside, _ in self._pieces_within(lo, hi):
            ends = []
            for x, toward in ((a, c), (c, a)):
                d = self.piece_df64(x, index)
                bad = ~torch.isfinite(d)
                if bool(bad.any()):
                    d = torch.where(bad, self.piece_df64(x + (toward - x) * 2.0 ** -20, index), d)
                ends.append(d)
            lo_d, hi_d = torch.minimum(*ends), torch.maximum(*ends)
            lows.append(torch.where(inside, lo_d, torch.full_like(lo_d, INF)))
            highs.append(torch.where(inside, hi_d, torch.full_like(hi_d, -INF)))
        smin, smax = torch.amin(torch.stack(lows), dim=0), torch.amax(torch.stack(highs), dim=0)
        # f' still infinite or NaN (a point where f is not differentiable): any finite range
        ok = torch.isfinite(smin) & torch.isfinite(smax)
        return torch.where(ok, smin, torch.zeros_like(smin)), torch.where(ok, smax, torch.zeros_like(smax))

    def _intercept64(self, lo, hi, w, side):
        """side +1: a float64 lower bound on min over [lo, hi] of g = f - w x; side -1: an
        upper bound on its max. Returns (bound, the candidate point where it is attained).
        `side` may also be a tensor of +-1 broadcasting against w (both lines at once,
        stacked on a leading axis: `_relax`); each entry gets the bits it gets alone."""
        pieces = list(self._pieces_within(lo, hi))
        if self._stackable(pieces, side):
            return self._intercept64_stacked(pieces, w, side)
        best = best_x = best_raw = None
        for index, a, c, inside, curvature in pieces:
            width = c - a
            # h = side * g is convex where f is convex (lower line) or concave (upper line):
            # the tangent at any candidate x bounds h on [a, c] from below; else h is concave
            # (or linear) and its minimum is at an endpoint. Per side, and per element where
            # the curvature is (periodic functions).
            if isinstance(curvature, str) and curvature == "linear":
                h_convex = False
            elif isinstance(side, torch.Tensor):
                h_convex = h_convexity(curvature, side)
            elif isinstance(curvature, str):
                h_convex = (curvature == "convex") == (side > 0)
            else:
                h_convex = curvature if side > 0 else ~curvature
            bound, raw, raw_x = self._piece_bound(index, a, c, width, w, side, h_convex)
            bound = torch.where(inside, bound, torch.full_like(bound, INF))
            raw = torch.where(inside, raw, torch.full_like(raw, INF))
            if best is None:
                best, best_raw, best_x = bound, raw, raw_x
            else:
                best = torch.minimum(best, bound)
                best_x = torch.where(raw < best_raw, raw_x, best_x)
                best_raw = torch.minimum(best_raw, raw)
        return side * best, best_x

    def _intercept64_stacked(self, pieces, w, side):
        """`_intercept64` with every piece in one evaluation (the same formulas per entry:
        the same bits)."""
        x, h_convex, inside = self._stacked_candidates(pieces, w, side)
        a, c = x[:, 0:1], x[:, 1:2]
        width = c - a
        fx = self.f64(x)
        h = side * (fx - w * x)
        err = self.err64(x, fx) + EPS * (w * x).abs() + TINY
        if self.piece_err:
            err = err + self.piece_err * width
        ends = torch.amin(no_nan(h[:, :2] - err[:, :2], -INF), dim=1)
        df = self.df64(x)
        dh = side * (df - w)
        err = err + (self.derr64(x, df) + EPS * w.abs()) * width
        tangent = torch.amax(no_nan(h + torch.minimum(dh * (a - x), dh * (c - x)) - err, -INF),
                             dim=1)
        bound = torch.where(inside, torch.where(h_convex, tangent, ends), INF)
        best_x = self._first_min(no_nan(h, INF), x, inside, h_convex)
        return side * torch.amin(bound, dim=0), best_x

    def _piece_bound(self, index, a, c, width, w, side, h_convex):
        """(a lower bound on min of h = side (f - w x) over [a, c], the smallest candidate
        value of h and its point) where h is convex (tangents at a, c and the touching point)
        or concave (the endpoints); h_convex is a bool, or a bool tensor choosing per entry.
        A candidate whose bound is NaN (f' infinite there) is dropped; an h that is NaN
        (outside f's domain) gives -inf. The candidates are stacked on a new leading axis
        (one evaluation of f for all of them)."""
        tangents = h_convex is not False
        shape = broadcast_shape(a.shape, w.shape)
        points = [a.expand(shape), c.expand(shape)]
        if tangents:
            t = torch.minimum(torch.maximum(self.touch64(w, index, a, c), a), c)
            points.append(t.expand(shape))
        x = torch.stack(points)
        fx = self.f64(x)
        h = side * (fx - w * x)
        err = self.err64(x, fx) + EPS * (w * x).abs() + TINY
        if self.piece_err:
            err = err + self.piece_err * width
        if h_convex is not True:                # the endpoints' minimum
            ends = torch.amin(no_nan(h[:2] - err[:2], -INF), dim=0)
        if tangents:                            # the tangents' maximum
            df = self.piece_df64(x, index)
            dh = side * (df - w)
            err = err + (self.derr64(x, df) + EPS * w.abs()) * width
            tangent = torch.amax(no_nan(h + torch.minimum(dh * (a - x), dh * (c - x)) - err,
                                         -INF), dim=0)
        h = no_nan(h, INF)
        if h_convex is True:
            bound = tangent
        elif h_convex is False:
            bound = ends
        else:                                   # per entry; no touching point where concave
            bound = torch.where(h_convex, tangent, ends)
            h = torch.cat([h[:2], torch.where(h_convex, h[2], INF).unsqueeze(0)])
        raw, at = torch.min(h, dim=0)           # the first of equal candidates
        return bound, raw, torch.gather(x, 0, at.unsqueeze(0)).squeeze(0)

    # -- CROWN's slopes ------------------------------------------------------------------------
    def curvature64(self, lo, hi):
        """+1 where f is convex on [lo, hi], -1 where concave, 0 where neither (for lo < hi)."""
        kind = {"convex": 1, "linear": 1, "concave": -1}
        if self.global_curvature is not None:
            return torch.full_like(lo, kind[self.global_curvature])
        out = torch.zeros_like(lo)
        for start, stop, curvature in self.pieces64(lo, hi):
            within = (lo >= start) & (hi <= stop)
            if isinstance(curvature, str):
                value = torch.full_like(lo, kind[curvature])
            else:
                value = torch.where(curvature, 1.0, -1.0).to(lo.dtype)
            out = torch.where(within, value, out)
        return out

    def default_slopes64(self, lo, hi):
        """CROWN's (lower, upper) slopes for l < u, both finite (see the module docstring)."""
        f = self.f64
        chord = (f(hi) - f(lo)) / (hi - lo)
        m = (lo + hi) / 2
        mid = self.df64(m)
        kind = self.curvature64(lo, hi)
        convex, concave = kind > 0, kind < 0
        lower = torch.where(convex, mid, chord)
        upper = torch.where(concave, mid, chord)
        mixed = ~(convex | concave)
        if bool(mixed.any()):
            lo_m, hi_m = lo[mixed], hi[mixed]
            envelope = self.envelope_slopes64(lo_m, hi_m)
            lower = lower.masked_scatter(mixed, envelope[0])
            upper = upper.masked_scatter(mixed, envelope[1])
        return lower, upper

    # -- alpha-CROWN -------------------------------------------------------------------------
    def alpha_init(self, in_bounds):
        """CROWN's slopes as points of [0, ALPHA_SPAN]^2 (B, 2, *shape)."""
        lo, hi = in_bounds[0]
        l64, u64 = lo.to(F64), hi.to(F64)
        L, U = self._probe(self.sloped64(l64, u64), l64, u64)
        out = [self.slope_alpha64(L, U, w).clamp(0, ALPHA_SPAN)
               for w in self.default_slopes64(L, U)]
        return torch.stack(out, dim=1).to(lo.dtype)

    def alpha_slopes64(self, lo, hi, a, span=None):
        """The slope of alpha entry a in [0, ALPHA_SPAN]: a point of the range of f' on
        [lo, hi] (`span`, when known)."""
        smin, smax = self.slope_range64(lo, hi) if span is None else span
        return smin + (a / ALPHA_SPAN) * (smax - smin)

    def slope_alpha64(self, lo, hi, w):
        """The alpha entry of slope w (the inverse of alpha_slopes64; mid-range when f' is
        constant on [lo, hi])."""
        smin, smax = self.slope_range64(lo, hi)
        span = smax - smin
        spread = span > 0
        t = (w - smin) / torch.where(spread, span, torch.ones_like(span))
        return ALPHA_SPAN * torch.where(spread, t, torch.full_like(t, 0.5))

    def alpha_project_(self, alpha):
        alpha.clamp_(0, ALPHA_SPAN)
