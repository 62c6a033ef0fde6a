"""The smooth family: activations that are smooth functions of their input (Sigmoid and Tanh
now; exp, log, gelu and the like belong here too), bounded through the relaxation interface
(runtime/ops/relaxation.py). Lowered in compiler/lowering/smooth.py.

How they are relaxed (`InterceptRelaxation`): a line's slope w may be chosen freely -- by
CROWN's rule, or by alpha-CROWN -- and its intercept is then *computed*: the tightest sound
lower intercept over [l, u] is min over x in [l, u] of g(x) = f(x) - w x, the upper one the
max. So soundness never rests on how a slope was found (a bisection that stopped early, an
optimiser step, a chord slope that lost its digits to cancellation on a narrow interval).
The minimum is found piece by piece, on intervals where f is convex or concave: where the
function to minimise (g, or -g for the maximum) is concave, its minimum is at an endpoint;
where it is convex, at the point where f'(x) = w (closed forms per function) or an endpoint,
and a tangent inequality turns the value at any such candidate into a rigorous bound (a
touching point computed a little off costs a second-order amount, never soundness).

Numerics: everything is computed in float64 from the float32 bounds; slopes are rounded to
float32 first and the intercepts are computed for the float32 slope, less a float64 error
margin, and rounded outward to float32 (down for the lower line, up for the upper), so the
float32 lines are sound in real arithmetic. Only exp, log, tanh, sqrt and the four IEEE
operations are used: measured on this machine, torch's sigmoid (and log1p without
MKL_CBWR) gives other bits for an element at another position of a tensor (vector body vs
scalar tail), which would break tp's bitwise promise; these do not.
Special intervals: lower == upper (slope 0: the point itself), infinite or huge (|x| >
HUGE) bounds (slope 0, the constant bounds [f(l), f(u)]).
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.base import register_op
from shardbound.runtime.ops.relaxation import ElementwiseRelaxation, Lines

F64 = torch.float64
EPS = 2.0 ** -46        # relative float64 error allowed per evaluated term (64 ulps)
TINY = 2.0 ** -126      # absolute slack: the smallest normal float32 (no denormal intercepts)
HUGE = 2.0 ** 32        # beyond this a line buys nothing over the constant bounds
BISECTION_STEPS = 48    # CROWN's tangent points in the mixed case (any result is sound)
# alpha lives in [0, ALPHA_SPAN]^2: the shared optimiser's step (lr 0.25, tuned for ReLU
# slopes in [0, 1]) is then 1/48 of the slope range. Measured (20 steps; sigmoid_mlp,
# tanh_mlp, tp_sigmoid; 36 boxes): total gain of the margins over CROWN 15.4 with span 1,
# 18.6 (4), 19.7 (8), 19.9 (12), 19.8 (16), 18.5 (64): big first steps overshoot an
# optimum that lies near CROWN's slopes.
ALPHA_SPAN = 12.0


def _sig(x):
    """1 / (1 + e^-x) in the dtype of x; saturates to 0 / 1 without inf or NaN."""
    return 1.0 / (1.0 + torch.exp(-x))


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


def _to_slope(w64: torch.Tensor) -> torch.Tensor:
    """float32 slope (differentiable); denormals flushed to 0 (any slope is sound)."""
    w = w64.to(torch.float32)
    return torch.where(w.abs() < TINY, torch.zeros_like(w), w)


class InterceptRelaxation(ElementwiseRelaxation):
    """An elementwise f relaxed by lines with chosen slopes and computed intercepts (see the
    module docstring). A subclass gives f and f' in float64, its convex / concave pieces, the
    points where f' equals a slope on each convex-or-concave piece (`touch64`), CROWN's
    slopes (`default_slopes64`) and the range f takes (`value_range`).

    alpha-CROWN optimises both slopes: alpha (B, S, 2, *shape) in [0, ALPHA_SPAN]^2 maps to
    slopes smin + alpha / ALPHA_SPAN (smax - smin) where [smin, smax] is the range of f' over
    [l, u] (which holds every tangent slope and, by the mean value theorem, every chord
    slope), entry 0 for the lower line and 1 for the upper one. (Parameterising by tangent
    points t in [l, u], slope f'(t), reaches the same slopes; measured, it gained less in 20
    steps at every step scale tried.) The intercepts follow the slopes; their gradient is
    -x* (x* the point where the line touches: the envelope theorem), passed straight through
    the outward rounding."""

    tp_roles = ("elementwise",)
    has_alpha = True
    increasing = True                   # monotone: IBP is [f(l), f(u)]
    # (start, stop, "convex" | "concave") covering the real line, in order
    pieces: tuple[tuple[float, float, str], ...] = ()
    value_range: tuple[float, float] = (-math.inf, math.inf)

    @classmethod
    def summation_note(cls, facts, sums):
        return f"bias A.intercept over {sums(math.prod(facts.shape))}"

    # -- what a function declares (float64 in, float64 out) --------------------------------
    def f64(self, x):
        raise NotImplementedError

    def df64(self, x):
        raise NotImplementedError

    def touch64(self, w, piece: int):
        """A point of piece `piece` where f'(x) = w, or any finite point where there is none
        (it is clamped into the interval and only has to be close for tightness)."""
        raise NotImplementedError

    def default_slopes64(self, lo, hi):
        """CROWN's (lower, upper) slopes for l < u, both finite."""
        raise NotImplementedError

    # -- IBP ----------------------------------------------------------------------------------
    def ibp(self, b):
        if not self.increasing:
            raise NotImplementedError(f"{type(self).__name__}: IBP of a non-monotone function")
        lo, hi = b[0].to(F64), b[1].to(F64)
        flo, fhi = self.f64(lo), self.f64(hi)
        r0, r1 = self.value_range
        lower = round_down(flo - (EPS * flo.abs() + TINY)).clamp(min=r0)
        upper = round_up(fhi + (EPS * fhi.abs() + TINY)).clamp(max=r1)
        return lower.to(b[0].dtype), upper.to(b[1].dtype)

    # -- the lines -------------------------------------------------------------------------
    def relax(self, lo, hi, alpha=None):
        if alpha is not None:
            return self._relax(lo, hi, alpha)
        # CROWN's lines are asked for once per backward pass through this node, with the same
        # bounds: kept for the last bounds seen (held, so their storage cannot be reused;
        # an in-place change bumps _version).
        key = tuple((t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t._version, t.dtype,
                     t.device) for t in (lo, hi))
        cached = getattr(self, "_default_lines", None)
        if cached is None or cached[0] != key:
            cached = self._default_lines = (key, (lo, hi), self._relax(lo, hi, None))
        return cached[2]

    def _relax(self, lo, hi, alpha):
        l64, u64 = lo.to(F64), hi.to(F64)
        finite = (torch.isfinite(l64) & torch.isfinite(u64)
                  & (l64.abs() <= HUGE) & (u64.abs() <= HUGE))
        sloped = finite & (l64 < u64)
        zero = torch.zeros_like(l64)
        # (lower > upper: an empty branch-and-bound domain; any finite lines do)
        L, U = torch.where(finite, l64, zero), torch.where(finite, torch.maximum(u64, l64), zero)
        if alpha is None:
            wl, wu = self.default_slopes64(L, torch.where(sloped, U, L + 1))
        else:
            a = alpha.to(F64)
            wl, wu = self.alpha_slopes64(L, U, a[:, :, 0]), self.alpha_slopes64(L, U, a[:, :, 1])
        wl32 = _to_slope(torch.where(sloped, wl, zero))
        wu32 = _to_slope(torch.where(sloped, wu, zero))
        lines = []
        for side, w32 in ((1.0, wl32), (-1.0, wu32)):
            b64, x_arg = self._intercept64(L, U, w32.detach().to(F64), side)
            # infinite or huge bounds: slope 0, the constant bound f(l) (lower) / f(u) (upper)
            const = self.f64(l64 if side > 0 else u64)
            const = const - side * (EPS * const.abs() + TINY)
            b64 = torch.where(finite, b64, const)
            b32 = round_down(b64) if side > 0 else round_up(b64)
            # a constant line may stop at the function's range (f lies strictly inside it)
            r0, r1 = self.value_range
            flat = b32.clamp(min=r0) if side > 0 else b32.clamp(max=r1)
            b32 = torch.where(w32.detach() == 0, flat, b32)
            if w32.requires_grad:       # d(intercept)/d(slope) = -x*, forward bits unchanged
                x_arg = torch.where(finite, x_arg, zero).to(torch.float32)
                b32 = b32 + (w32 - w32.detach()) * (-x_arg)
            lines.append(b32)
        return Lines(wl32, lines[0], wu32, lines[1])

    def slope_range64(self, lo, hi):
        """[min, max] of f' over [lo, hi]: f' is monotone on each convex or concave piece,
        so its extremes are at the endpoints or at the piece boundaries inside."""
        vals = [self.df64(lo), self.df64(hi)]
        for start, _, _ in self.pieces[1:]:
            vals.append(self.df64(torch.minimum(torch.maximum(lo.new_tensor(start), lo), hi)))
        both = torch.stack(vals)
        return both.min(dim=0).values, both.max(dim=0).values

    def _intercept64(self, lo, hi, w, side: float):
        """side +1: a float64 lower bound on min over [lo, hi] of g = f - w x; side -1: an
        upper bound on its max. Returns (bound, the candidate point where it is attained)."""
        best = best_x = None
        for index, (start, stop, curvature) in enumerate(self.pieces):
            a, c = lo.clamp(min=start), hi.clamp(max=stop)
            inside = a <= c
            a, c = torch.where(inside, a, lo), torch.where(inside, c, lo)
            width = c - a
            # h = side * g is convex here: the tangent at any candidate x bounds h on [a, c]
            # from below; else h is concave and its minimum is at an endpoint.
            h_convex = (curvature == "convex") == (side > 0)
            points = [a, c]
            if h_convex:
                points.append(torch.minimum(torch.maximum(self.touch64(w, index), a), c))
            bound = raw = raw_x = None
            for x in points:
                fx = self.f64(x)
                h = side * (fx - w * x)
                err = EPS * (fx.abs() + (w * x).abs()) + TINY
                if h_convex:
                    dh = side * (self.df64(x) - w)
                    err = err + EPS * (self.df64(x).abs() + w.abs()) * width
                    b = h + torch.minimum(dh * (a - x), dh * (c - x)) - err
                    bound = b if bound is None else torch.maximum(bound, b)
                else:
                    b = h - err
                    bound = b if bound is None else torch.minimum(bound, b)
                if raw is None:
                    raw, raw_x = h, x
                else:
                    raw_x = torch.where(h < raw, x, raw_x)
                    raw = torch.minimum(raw, h)
            bound = torch.where(inside, bound, torch.full_like(bound, math.inf))
            raw = torch.where(inside, raw, torch.full_like(raw, math.inf))
            if best is None:
                best, best_raw, best_x = bound, raw, raw_x
            else:
                best = torch.minimum(best, bound)
                best_x = torch.where(raw < best_raw, raw_x, best_x)
                best_raw = torch.minimum(best_raw, raw)
        return side * best, best_x

    # -- alpha-CROWN -------------------------------------------------------------------------
    def alpha_init(self, in_bounds):
        """CROWN's slopes as points of [0, ALPHA_SPAN]^2 (B, 2, *shape)."""
        lo, hi = in_bounds[0]
        l64, u64 = lo.to(F64), hi.to(F64)
        ok = (torch.isfinite(l64) & torch.isfinite(u64) & (l64.abs() <= HUGE)
              & (u64.abs() <= HUGE) & (l64 < u64))
        zero = torch.zeros_like(l64)
        L, U = torch.where(ok, l64, zero), torch.where(ok, u64, zero + 1)
        out = [self.slope_alpha64(L, U, w).clamp(0, ALPHA_SPAN)
               for w in self.default_slopes64(L, U)]
        return torch.stack(out, dim=1).to(lo.dtype)

    def alpha_slopes64(self, lo, hi, a):
        """The slope of alpha entry a in [0, ALPHA_SPAN]: a point of the range of f' on
        [lo, hi]."""
        smin, smax = self.slope_range64(lo, hi)
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


class SShaped(InterceptRelaxation):
    """f convex on x <= 0 and concave on x >= 0, f' even with its maximum at 0 (sigmoid,
    tanh). CROWN's slopes (Zhang et al. 2018): convex interval (u <= 0): tangent at the
    midpoint below, chord above; concave (l >= 0): the mirror; mixed: the tangent through the
    far endpoint (found by bisection in float64), or the chord where that is itself sound,
    or the tangent at the midpoint where the midpoint lies beyond the far-endpoint tangent
    point (auto_LiRPA makes the same choice; measured on tests/zoo.py's tanh_mlp at box
    radius 0.5, CROWN's margin lower bounds -2.75 / -1.17 / -2.77 -> -2.10 / -0.81 / -2.09)."""

    pieces = ((-math.inf, 0.0, "convex"), (0.0, math.inf, "concave"))
    max_slope = 1.0                     # f'(0)

    def touch_positive64(self, w):
        """x >= 0 with f'(x) = w, for 0 < w <= f'(0) (w is clamped into that range)."""
        raise NotImplementedError

    def touch64(self, w, piece):
        x = self.touch_positive64(w.clamp(1e-300, self.max_slope))
        return -x if piece == 0 else x

    def default_slopes64(self, lo, hi):
        f, df = self.f64, self.df64
        flo, fhi = f(lo), f(hi)
        chord = (fhi - flo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi))
        m = (lo + hi) / 2
        mid = df(m)
        # mixed, upper line: the tangent at d in [0, u] through (l, f(l)); phi(d) rises in d
        def phi(d):
            return f(d) + df(d) * (lo - d) - flo

        def psi(d):      # lower line: the tangent at d in [l, 0] through (u, f(u))
            return f(d) + df(d) * (hi - d) - fhi

        up = _bisect(phi, torch.zeros_like(hi), hi.clamp(min=0))
        down = _bisect(psi, lo.clamp(max=0), torch.zeros_like(lo))
        # ... unless the midpoint lies beyond that tangent point: its tangent is then sound
        # too (phi, psi are monotone) and hugs f over more of the interval
        up, down = torch.maximum(up, m), torch.minimum(down, m)
        mixed_up = torch.where(phi(hi.clamp(min=0)) <= 0, chord, df(up))
        mixed_low = torch.where(psi(lo.clamp(max=0)) >= 0, chord, df(down))
        convex, concave = hi <= 0, lo >= 0
        lower = torch.where(convex, mid, torch.where(concave, chord, mixed_low))
        upper = torch.where(convex, chord, torch.where(concave, mid, mixed_up))
        return lower, upper


def _bisect(fn, a, b):
    """The root of an increasing fn on [a, b] (elementwise, fixed steps; deterministic)."""
    for _ in range(BISECTION_STEPS):
        m = (a + b) / 2
        above = fn(m) > 0
        b, a = torch.where(above, m, b), torch.where(above, a, m)
    return (a + b) / 2


class _SigmoidFn(torch.autograd.Function):
    """1 / (1 + e^-x) with the gradient y (1 - y): torch.sigmoid's bits depend on an element's
    position in the tensor (see the module docstring); exp's do not."""

    @staticmethod
    def forward(ctx, x):
        y = _sig(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y * (1 - y)


@register_op
class Sigmoid(SShaped):
    """sigma(x) = 1 / (1 + e^-x); sigma'(x) = sigma(x) sigma(-x), at most 1/4."""

    kind = "sigmoid"
    max_slope = 0.25
    value_range = (0.0, 1.0)

    def forward(self, x):
        return _SigmoidFn.apply(x)

    def f64(self, x):
        return _sig(x)

    def df64(self, x):
        return _sig(x) * _sig(-x)

    def touch_positive64(self, w):
        # s (1 - s) = w with s = (1 + q) / 2, q = sqrt(1 - 4w): x = logit(s)
        # = log(s / (1 - s)) = 2 log(1 + q) - log(4w), without cancellation for small w
        q = torch.sqrt((1 - 4 * w).clamp(min=0))
        return 2 * torch.log(1 + q) - torch.log(4 * w)


@register_op
class Tanh(SShaped):
    """tanh(x); tanh'(x) = 1 - tanh(x)^2 = 4 sigma(2x) sigma(-2x), at most 1."""

    kind = "tanh"
    max_slope = 1.0
    value_range = (-1.0, 1.0)

    def forward(self, x):
        return torch.tanh(x)

    def f64(self, x):
        return torch.tanh(x)

    def df64(self, x):
        return 4 * _sig(2 * x) * _sig(-2 * x)

    def touch_positive64(self, w):
        # 1 - t^2 = w with t = r = sqrt(1 - w): x = atanh(r) = log(1 + r) - log(w) / 2
        r = torch.sqrt((1 - w).clamp(min=0))
        return torch.log(1 + r) - 0.5 * torch.log(w)
