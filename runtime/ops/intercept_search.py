"""The searches behind the computed-intercept lines (runtime/ops/intercepts.py): where a line
of slope w touches f (each piece's candidates, stacked), and CROWN's envelope slopes on an
interval of mixed curvature (bisection on the slope). A mixin of `InterceptRelaxation`, kept
apart because it is the part that costs time, not the part that makes lines sound: a search
only chooses a slope or a candidate point, and the intercepts are computed rigorously for
whatever it returns (intercepts.py), so a search that stops early is looser, never unsound.

Speed without other bits: on the small tensors of a CROWN pass the cost is the number of
torch calls, not their size, so the searches stack work instead of looping over it. Every
piece's touching point comes from one bisection over a piece axis where a class has one
derivative formula (`_touch_stacked`), and what does not depend on the slope (the pieces
within [l, u], which candidates count, the derivative at the pieces' ends) is computed once
per interval (`_Candidates`), not once per step of the envelope search. Each element goes
through the same float64 operations in the same order as in the per-piece loop, and the
functions used are position-independent (intercepts.py), so the results are bitwise the
same (tests/ops/test_intercept_search.py).
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64
INF = math.inf
BISECTION_STEPS = 48    # `bisect`'s default (S-shaped tangents: Newton, smooth.NEWTON_STEPS)
TOUCH_STEPS = 32        # touching points by bisection: off by 2^-32 of the piece, which
                        # loosens a bound by ~ f'' width^2 2^-32 (any result is sound)
ENVELOPE_STEPS = 20     # CROWN's slopes of a mixed-curvature interval: the line's value at
                        # the midpoint is flat near the optimum (any result is sound)
SIDES = torch.tensor([1.0, -1.0], dtype=torch.float64)    # lower line, upper line


def bisect(fn, a, b, steps: int = BISECTION_STEPS):
    """The root of an increasing fn on [a, b] (elementwise, fixed steps; deterministic)."""
    for _ in range(steps):
        m = (a + b) / 2
        above = fn(m) > 0
        b, a = torch.where(above, m, b), torch.where(above, a, m)
    return (a + b) / 2


def broadcast_shape(*shapes) -> tuple[int, ...]:
    """torch.broadcast_shapes for valid shapes, without its Python-side checks (~100 us)."""
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for shape in shapes:
        for i, n in enumerate(shape, rank - len(shape)):
            if n != 1:
                out[i] = n
    return tuple(out)


def no_nan(v: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(torch.isnan(v), torch.full_like(v, fill), v)


def h_convexity(curvature, side):
    """Where h = side (f - w x) is convex on a piece of this curvature: f convex for the
    lower line (side +1), concave for the upper one; a bool tensor curvature (periodic
    functions) is True where f is convex."""
    h_convex = side > 0
    if isinstance(curvature, str):
        return h_convex if curvature == "convex" else ~h_convex
    return torch.where(h_convex, curvature, ~curvature)


class _Candidates:
    """What the stacked candidates of [lo, hi] share whatever the slope: the pieces' ends
    (a, c) and where each piece lies inside the interval and makes h convex, stacked over
    pieces (axis 0) and broadcast to `shape` (the slopes' shape); with `stacked_touch`, also
    f' at the pieces' ends (the bisection's orientation)."""

    def __init__(self, kernel, pieces, side, shape, stacked_touch: bool):
        self.kernel, self.pieces, self.shape = kernel, pieces, shape
        self.a = torch.stack([p[1].expand(shape) for p in pieces])
        self.c = torch.stack([p[2].expand(shape) for p in pieces])
        self.convex = torch.stack([h_convexity(p[4], side).expand(shape) for p in pieces])
        self.inside = torch.stack([p[3].expand(shape) for p in pieces])
        self.rising = None
        if stacked_touch:
            da, dc = kernel.piece_df64(self.a, 0), kernel.piece_df64(self.c, 0)
            self.rising = dc >= da

    def points(self, w):
        """(pieces, 3, *shape): each piece's a, c and touching point of slope w."""
        k, a, c = self.kernel, self.a, self.c
        if self.rising is not None:
            t = k._touch_stacked(w, a, c, self.rising)
        else:
            try:
                t = torch.stack([k.touch64(w, p[0], p[1], p[2]).expand(self.shape)
                                 for p in self.pieces])
            finally:    # touch64 may memoise over the pieces of one call (smooth.py)
                k.__dict__.pop("_touch_memo", None)
        t = torch.minimum(torch.maximum(t, a), c)
        return torch.stack([a, c, t], dim=1)


class SlopeSearch:
    """The candidate and slope searches of `InterceptRelaxation` (see the module docstring)."""

    def _stackable(self, pieces, side) -> bool:
        """Whether every piece's candidates can be evaluated in one stacked call: both lines
        at once (then every non-linear piece has a touching point on one side), several
        pieces, none linear, and one derivative formula for all of them."""
        from shardbound.runtime.ops.intercepts import InterceptRelaxation

        return (isinstance(side, torch.Tensor) and len(pieces) > 1
                and type(self).piece_df64 is InterceptRelaxation.piece_df64
                and not any(isinstance(p[4], str) and p[4] == "linear" for p in pieces))

    def _candidates(self, pieces, side, shape) -> _Candidates:
        from shardbound.runtime.ops.intercepts import InterceptRelaxation

        stacked_touch = type(self).touch64 is InterceptRelaxation.touch64
        return _Candidates(self, pieces, side, shape, stacked_touch)

    def _touch_stacked(self, w, a, c, rising):
        """The default `touch64` (bisection on f' - w over [a, c], TOUCH_STEPS steps) of
        every piece at once, a and c stacked over pieces: the same operations per element
        as piece by piece (f' has one formula on every piece: `_stackable`)."""
        sign = torch.where(rising, 1.0, -1.0).to(F64)
        return bisect(lambda x: sign * (self.piece_df64(x, 0) - w), a, c, TOUCH_STEPS)

    def _stacked_candidates(self, pieces, w, side):
        """(x, h_convex, inside) stacked over pieces (axis 0) and candidates a, c, touching
        point (axis 1): what `_piece_bound` evaluates piece by piece."""
        cand = self._candidates(pieces, side, broadcast_shape(pieces[0][1].shape, w.shape))
        return cand.points(w), cand.convex, cand.inside

    @staticmethod
    def _first_min(h, x, inside, h_convex):
        """The candidate of least h (no touching point where h is concave, nothing outside
        the interval), the first of equals in piece-major order: `_intercept64`'s choice."""
        h = torch.cat([h[:, :2], torch.where(h_convex, h[:, 2], INF).unsqueeze(1)], dim=1)
        h = torch.where(inside.unsqueeze(1), h, INF)
        n = h.shape[0] * h.shape[1]
        _, at = torch.min(h.reshape(n, *h.shape[2:]), dim=0)
        return torch.gather(x.reshape(n, *x.shape[2:]), 0, at.unsqueeze(0)).squeeze(0)

    # -- CROWN's slopes on an interval of mixed curvature --------------------------------------
    def envelope_slopes64(self, lo, hi):
        """The slopes (stacked: lower, upper) of the supporting lines of f's convex (lower)
        / concave (upper) envelope over [lo, hi] at the midpoint: the line touching f where
        the tangent point of the slope-w line crosses the midpoint (it moves right as w grows
        for the lower line, left for the upper one). Bisection on w, both sides at once; each
        step needs only where the line touches (`_argmin64`), not its intercept."""
        m = (lo + hi) / 2
        smin, smax = self.slope_range64(lo, hi)
        a, b = torch.stack([smin, smin]), torch.stack([smax, smax])
        side = SIDES.to(lo.device).reshape(2, *([1] * lo.dim()))
        argmin = self._argmin_search(lo, hi, a.shape, side)
        for _ in range(ENVELOPE_STEPS):
            w = (a + b) / 2
            x = argmin(w)
            grow = torch.where(side > 0, x < m, x > m)
            a, b = torch.where(grow, w, a), torch.where(grow, b, w)
        return (a + b) / 2

    def _argmin64(self, lo, hi, w, side):
        """The candidate point where side (f - w x) is smallest over [lo, hi]: the point
        `_intercept64` returns, found from the candidates' values alone (the same values,
        compared in the same order: the same point)."""
        return self._argmin_search(lo, hi, w.shape, side)(w)

    def _argmin_search(self, lo, hi, w_shape, side):
        """`_argmin64` over [lo, hi] as a function of slopes of shape `w_shape`, with what
        does not depend on the slope computed once (the envelope search asks 20 times)."""
        pieces = list(self._pieces_within(lo, hi))
        if self._stackable(pieces, side):
            cand = self._candidates(pieces, side, broadcast_shape(pieces[0][1].shape, w_shape))

            def stacked(w):
                x = cand.points(w)
                return self._first_min(no_nan(side * (self.f64(x) - w * x), INF), x,
                                       cand.inside, cand.convex)
            return stacked
        return lambda w: self._argmin_pieces(pieces, w, side)

    def _argmin_pieces(self, pieces, w, side):
        """`_argmin64` piece by piece (linear pieces, or a derivative per piece)."""
        best = best_x = None
        for index, a, c, inside, curvature in pieces:
            if isinstance(curvature, str) and curvature == "linear":
                h_convex = False
            else:
                h_convex = h_convexity(curvature, side)
            shape = broadcast_shape(a.shape, w.shape)
            points = [a.expand(shape), c.expand(shape)]
            if h_convex is not False:
                t = torch.minimum(torch.maximum(self.touch64(w, index, a, c), a), c)
                points.append(t.expand(shape))
            x = torch.stack(points)
            h = no_nan(side * (self.f64(x) - w * x), INF)
            if h_convex is not False:
                h = torch.cat([h[:2], torch.where(h_convex, h[2], INF).unsqueeze(0)])
            raw, at = torch.min(h, dim=0)
            raw_x = torch.gather(x, 0, at.unsqueeze(0)).squeeze(0)
            raw = torch.where(inside, raw, torch.full_like(raw, INF))
            if best is None:
                best, best_x = raw, raw_x
            else:
                best_x = torch.where(raw < best, raw_x, best_x)
                best = torch.minimum(best, raw)
        return best_x
