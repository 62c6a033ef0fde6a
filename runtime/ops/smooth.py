"""The smooth family: S-shaped activations (Sigmoid, Tanh, Erf, Softsign), bounded through
the relaxation interface (runtime/ops/relaxation.py) with chosen slopes and computed
intercepts (`InterceptRelaxation`, runtime/ops/intercepts.py: the machinery every smooth
function shares). Lowered in compiler/lowering/smooth.py.

An S-shaped f is convex on x <= 0 and concave on x >= 0 with f' even and largest at 0; each
kernel gives f, f' and the point x >= 0 where f' equals a slope in closed form. Only exp, log,
tanh, erf, sqrt and the four IEEE operations are used: measured on this machine, torch's
sigmoid (and log1p without MKL_CBWR) gives other bits for an element at another position of a
tensor (vector body vs scalar tail), which would break tp's bitwise promise; these do not.
Special intervals: lower == upper (slope 0: the point itself), infinite or huge (|x| >
HUGE) bounds (slope 0, the constant bounds [f(l), f(u)]).
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.numerics.select import blend, mask_bits
from shardbound.runtime.ops.base import register_op
from shardbound.runtime.ops.intercept_search import SIDES
from shardbound.runtime.ops.intercepts import (ALPHA_SPAN, EPS, F64, HUGE, INF, TINY,  # noqa: F401
                                                InterceptRelaxation, round_down, round_up)

NEWTON_STEPS = 5    # far-endpoint tangents of mixed intervals (4 measured enough, one spare)


def _sig(x):
    """1 / (1 + e^-x) in the dtype of x; saturates to 0 / 1 without inf or NaN. (reciprocal:
    the bits of 1.0 / t, which torch computes as t.reciprocal() * 1.0, one kernel less.)"""
    return torch.reciprocal(1.0 + torch.exp(-x))


def _piece_ends(lo, hi, side):
    """What `SShaped._intercept64` needs of the side alone: P = [a, c], the piece of [lo, hi]
    where f has the line's curvature (x <= 0 for the lower line, x >= 0 for the upper one),
    and the error terms' EPS (max(|a|, |c|) + c - a) and EPS (c - a). Where the interval lies
    wholly on the other side of 0 (P empty), the end of [lo, hi] nearest P instead: there the
    tangent candidate is h at that end, a bound on h(end) only, but h is concave on [lo, hi]
    and its minimum is at an end."""
    lower = side > 0
    a = torch.where(lower, lo, lo.clamp(min=0))
    c = torch.where(lower, hi.clamp(max=0), hi)
    outside = a > c
    a, c = torch.where(outside & ~lower, c, a), torch.where(outside & lower, a, c)
    width = c - a
    per_w = torch.maximum(a.abs(), c.abs()).add_(width).mul_(EPS)
    return a, c, per_w, width.mul_(EPS)


class SShaped(InterceptRelaxation):
    """f convex on x <= 0 and concave on x >= 0, f' even with its maximum at 0 (sigmoid,
    tanh). CROWN's slopes (Zhang et al. 2018): convex interval (u <= 0): tangent at the
    midpoint below, chord above; concave (l >= 0): the mirror; mixed: the tangent through the
    far endpoint (found by Newton's method on the slope, float64), or the chord where that is itself sound,
    or the tangent at the midpoint where the midpoint lies beyond the far-endpoint tangent
    point (auto_LiRPA makes the same choice; measured on tests/zoo.py's tanh_mlp at box
    radius 0.5, CROWN's margin lower bounds -2.75 / -1.17 / -2.77 -> -2.10 / -0.81 / -2.09)."""

    pieces = ((-math.inf, 0.0, "convex"), (0.0, math.inf, "concave"))
    max_slope = 1.0                     # f'(0)
    # autograd's saved A-sized tensors per step (alpha_model.py), measured with the ledger on
    # tests/zoo.py's sigmoid_mlp and tanh_mlp (box radius 0.3) after the one-line-per-element
    # step (selected_lines.py): alpha-CROWN's peak 1.04-1.05x of it under `blocked`, 0.89-0.90x
    # under `fast` (the two-line step's (8.6, 10.6) now over-predicted by 25-29%)
    alpha_saved = (4.2, 6.2)

    def touch_positive64(self, w):
        """x >= 0 with f'(x) = w, for 0 < w <= f'(0) (w is clamped into that range)."""
        raise NotImplementedError

    def touch64(self, w, piece, a=None, c=None):
        # both pieces ask for the same slopes in turn (`_stacked_candidates`, which drops
        # the memo after its loop): computed once
        memo = getattr(self, "_touch_memo", None)
        if memo is not None and memo[0] is w:
            x = memo[1]
        else:
            x = self.touch_positive64(w.clamp(1e-300, self.max_slope))
            self._touch_memo = (w, x)
        return -x if piece == 0 else x

    # -- the intercepts: one touching point per line ------------------------------------------
    def _intercept64(self, lo, hi, w, side):
        """`InterceptRelaxation._intercept64` in closed form for an S-shaped f: a bound on the
        minimum of h = side (f - w x) over [lo, hi] (side +1: the lower line; -1: the upper
        one) from three candidates instead of the generic two pieces' six.

        Why three are enough: h is convex on the piece P where f has the line's curvature
        (x <= 0 for the lower line, x >= 0 for the upper one) and concave on the other one.
        On P the tangent of h at any point t of P bounds h from below (t: where f' = w,
        clamped into P; `touch_positive64`'s closed form, so no search); on the concave rest
        the minimum is at that rest's ends, which are lo or hi or the inflection point 0, and
        0 lies in P whenever the interval crosses it. So min(tangent bound on P, h(lo), h(hi))
        is sound, with error terms at least the generic code's (`err64`, `derr64`, EPS per
        product; some bounded per neuron, below).
        What does not depend on the slope (f at the ends, P) is per neuron, computed once
        for every row of a start node: the per-element work is one touching point and one
        evaluation of f and f' (alpha-CROWN calls this for every row of every start node
        in every iteration; the generic candidates cost ~8x more time and memory).

        Returns (bound, the candidate of least h: the intercept's gradient is -x*); `side` a
        float or a +-1 tensor broadcasting against w, each entry's bits the same either way."""
        side = torch.as_tensor(side, dtype=F64, device=w.device)
        # one side per element (selected_lines.py): what depends on the side alone is made
        # per neuron for both sides, then chosen per element (the same bits)
        per_element = side.numel() > 2 and side.shape == w.shape
        if per_element:
            upper = side < 0
            bits = mask_bits(upper, F64)
            pair = _piece_ends(lo, hi, SIDES.to(w.device).reshape(2, *([1] * lo.dim())))
            a, c, per_w, eps_width = (blend(upper, t[1], t[0], bits) for t in pair)
        else:
            a, c, per_w, eps_width = _piece_ends(lo, hi, side)
        # The error terms, bounded per neuron where the generic code bounds them per element
        # (a few ulps looser, 4 operations on the big tensor fewer): |f(t)| <= 2 max(|f(lo)|,
        # |f(hi)|) (f is monotone; 2 covers the rounding of f64) and |t| <= max(|a|, |c|) (t
        # is clamped into [a, c]); so err64 + EPS |w t| + TINY + (derr64 + EPS |w|) width
        # <= const + |w| per_w + |f'(t)| EPS width. (f'(t) stays per element: on a wide
        # interval it is tiny where max_slope is not.)
        f_hi, f_lo = self.f64(hi), self.f64(lo)
        const = torch.maximum(f_hi.abs(), f_lo.abs()).mul_(2 * EPS).add_(TINY)
        # Per element, in place on a few buffers: a fresh tensor per operation costs more in
        # page faults than its arithmetic (measured: 83 -> 25 ms a call with glibc told to
        # keep freed memory).
        t = self.touch_positive64(w.clamp(1e-300, self.max_slope)).mul_(-side)
        t.clamp_(min=a, max=c)
        ft, dft = self.f_df64(t)
        aw = w.abs()
        err = torch.addcmul(const, aw, per_w)
        wt = torch.abs(dft)
        err.addcmul_(wt, eps_width)
        torch.mul(w, t, out=wt)
        ht = ft.sub_(wt).mul_(side)
        dh = dft.sub_(w).mul_(side)
        tangent = torch.sub(a, t, out=wt).mul_(dh)  # min(dh (a - t), dh (c - t))
        h = torch.sub(c, t).mul_(dh)
        bound = torch.minimum(tangent, h, out=tangent).add_(ht).sub_(err)
        best, best_x = ht, t
        q = dh
        for k, (x, fx) in enumerate(((hi, f_hi), (lo, f_lo))):  # the ends: f per neuron
            if per_element:     # side (f - w x): the bits of side f - w (side x), side +-1
                torch.mul(w, x, out=q)
                torch.sub(fx, q, out=h).mul_(side)
            else:
                sfx, sx = side * fx, side * x
                torch.mul(w, sx, out=q)
                torch.sub(sfx, q, out=h)
            if per_element:     # (a data-dependent mask: branch-free, numerics/select.py)
                best_x = blend(h <= best, x, best_x)
            else:
                torch.where(h <= best, x, best_x, out=best_x)
            if k == 0:
                torch.minimum(best, h, out=best)
            # h - (EPS |f(x)| + TINY + EPS |w x|)
            torch.addcmul(EPS * fx.abs() + TINY, aw, EPS * x.abs(), out=q)
            torch.minimum(bound, h.sub_(q), out=bound)
        bound.nan_to_num_(nan=-INF, posinf=INF, neginf=-INF)
        return bound.mul_(side), best_x

    def _argmin_search(self, lo, hi, w_shape, side):
        """The candidate `_intercept64` returns, as a function of the slope (the generic
        searches' interface, intercept_search.py)."""
        return lambda w: self._intercept64(lo, hi, w, side)[1]

    def f_df64(self, x):
        """(f(x), f'(x)) in float64; a kernel may share work between the two."""
        return self.f64(x), self.df64(x)

    def default_slopes64(self, lo, hi):
        f, df = self.f64, self.df64
        n = lo.numel()
        # The lower line of [l, u] is the upper line of the mirror [-u, -l] (f(-x) = 2 f(0)
        # - f(x), f' even): one search on both halves, stacked. Every evaluation of f (and
        # of f') at once on one stacked tensor: fewer calls, the same bits per element.
        ab = torch.cat([lo.reshape(-1), -hi.reshape(-1), hi.reshape(-1), -lo.reshape(-1)])
        a, b = ab[:2 * n], ab[2 * n:]
        fab = f(ab)
        fa, fb = fab[:2 * n], fab[2 * n:]
        chord = (fb[:n] - fa[:n]) / (b[:n] - a[:n])
        d_mb = df(torch.cat([((lo + hi) / 2).reshape(-1), b]))
        mid, db = d_mb[:n], d_mb[n:]
        m = (a + b) / 2
        slope = self.far_tangent_slope64(a, m, fa, torch.cat([mid, mid]))
        # the chord where it is itself sound: the tangent at u passes above (l, f(l))
        chord_ok = fb + db * (a - b) - fa <= 0
        mixed = torch.where(chord_ok, torch.cat([chord, chord]), slope)
        mixed_up, mixed_low = mixed[:n].view_as(lo), mixed[n:].view_as(lo)
        chord, mid = chord.view_as(lo), mid.view_as(lo)
        convex, concave = hi <= 0, lo >= 0
        lower = torch.where(convex, mid, torch.where(concave, chord, mixed_low))
        upper = torch.where(convex, chord, torch.where(concave, mid, mixed_up))
        return lower, upper

    def far_tangent_slope64(self, a, m, fa, dm):
        """The slope of CROWN's upper line on a mixed [a, b] (a < 0 < b, m its midpoint, fa =
        f(a), dm = f'(m)): the tangent at the point d >= 0 whose tangent passes through
        (a, f(a)), or the tangent at m where m lies beyond d (its tangent is then sound too
        and hugs f over more of the interval).

        Newton's method on the slope: F(y) = (the slope-y tangent at a) - f(a), touching at
        d(y) (closed form), has F'(y) = a - d(y) < 0 and F''(y) = -d'(y) > 0 (f concave on
        x >= 0), so from any start one step lands left of the root and the iterates then rise
        to it monotonically, quadratically near it. A step is y <- (f(d) - f(a)) / (d - a),
        the chord from (a, f(a)) to (d(y), f(d(y))). Started at d = max(m, 0): when m is
        beyond the root, the first chord is already >= f'(m) and the result is f'(m).
        Measured on 4 x 10^5 random intervals per function (sigmoid, tanh, erf, softsign;
        ends of magnitude 1e-9 .. 4e9): after 4 steps the float32 slope is that of the
        converged iteration (60 steps) on every interval (NEWTON_STEPS keeps one spare).
        Any slope is sound (the intercepts are computed for it), so a less converged one
        is only looser."""
        d = m.clamp(min=0)
        for step in range(NEWTON_STEPS):
            y = (self.f64(d) - fa) / (d - a)
            if step + 1 < NEWTON_STEPS:
                d = self.touch_positive64(y.clamp(1e-300, self.max_slope))
        return torch.where(m > 0, torch.minimum(y, dm), y)


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

    def f_df64(self, x):
        # f64 and df64's operations, in place (the same bits; see SShaped._intercept64)
        f = torch.neg(x).exp_().add_(1.0).reciprocal_()
        return f, torch.exp(x).add_(1.0).reciprocal_().mul_(f)

    def touch_positive64(self, w):
        # s (1 - s) = w with s = (1 + q) / 2, q = sqrt(1 - 4w): x = logit(s)
        # = log(s / (1 - s)) = log((1 + q)^2 / (4w)), without cancellation for small w (w
        # >= 1e-300: no overflow); one log, not two (a touching point only has to be close)
        w4 = 4 * w
        q = torch.rsub(w4, 1).clamp_(min=0).sqrt_().add_(1)
        return q.mul_(q).div_(w4).log_()


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

    def f_df64(self, x):
        # f64 and df64's operations, in place (the same bits; see SShaped._intercept64)
        x2 = 2 * x
        d = torch.neg(x2).exp_().add_(1.0).reciprocal_().mul_(4)
        return torch.tanh(x), d.mul_(x2.exp_().add_(1.0).reciprocal_())

    def touch_positive64(self, w):
        # 1 - t^2 = w with t = r = sqrt(1 - w): x = atanh(r) = log((1 + r)^2 / w) / 2
        # (one log, not two: a touching point only has to be close)
        r = torch.rsub(w, 1).clamp_(min=0).sqrt_().add_(1)
        return r.mul_(r).div_(w).log_().mul_(0.5)


@register_op
class Erf(SShaped):
    """erf x; erf'(x) = 2 / sqrt(pi) e^(-x^2), at most 2 / sqrt(pi)."""

    kind = "erf"
    max_slope = 2.0 / math.sqrt(math.pi)
    value_range = (-1.0, 1.0)

    def forward(self, x):
        return torch.erf(x)

    def f64(self, x):
        return torch.erf(x)

    def df64(self, x):
        return self.max_slope * torch.exp(-x * x)

    def touch_positive64(self, w):
        # e^(-x^2) = w / max_slope: x = sqrt(log(max_slope / w))
        return torch.sqrt(torch.log(self.max_slope / w).clamp(min=0))


@register_op
class Softsign(SShaped):
    """x / (1 + |x|); f'(x) = 1 / (1 + |x|)^2, at most 1."""

    kind = "softsign"
    max_slope = 1.0
    value_range = (-1.0, 1.0)

    def forward(self, x):
        return x / (1 + x.abs())

    def f64(self, x):
        return torch.where(torch.isinf(x), torch.sign(x), x / (1 + x.abs()))

    def df64(self, x):
        d = 1 + x.abs()
        return 1.0 / (d * d)

    def touch_positive64(self, w):
        # (1 + x)^2 = 1 / w
        return (1.0 / torch.sqrt(w) - 1).clamp(min=0)
