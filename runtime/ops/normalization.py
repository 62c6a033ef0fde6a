"""The normalization family: `normalize`, y = x / sqrt(mean(x^2) + eps) over some sample axes
(each group of elements that share the other axes' indices is normalised alone). With its
input centred (x - mean(x), two linear nodes before it) and an affine (gamma, beta) after it,
this is LayerNormalization; alone it is RMS normalisation. compiler/lowering/normalization.py
lowers LayerNormalization (opset 17) and the ReduceMean / Sub / Pow / ReduceMean / Add / Sqrt /
Div pattern of older exports to that composition. Keeping the centring outside the kernel is
what makes the relaxation tight: CROWN bounds the centred value c itself (a linear function of
the network), and the kernel relaxes only c -> c * r(c), r = (mean(c^2) + eps)^(-1/2).

IBP is exact over the box: y_i increases with c_i and, for j != i, decreases with c_j^2 where
c_i > 0 (increases where c_i < 0), so the extremes of y_i put c_i at an end and every other
c_j^2 at its least or greatest value over [l_j, u_j].

CROWN (a linear relaxation in the spirit of Shi et al. 2020 and DeepT's treatment of the
standard deviation, written for this kernel): y_i = c_i * r with
- r in [rl, ru] = [g(vu), g(vl)], g(v) = v^(-1/2), v = mean(c^2) + eps in [vl, vu] (exact
  range over the box);
- McCormick planes of the product c_i * r on [l_i, u_i] x [rl, ru]: y_i >= d c_i + k r + e
  (lower) and y_i <= d' c_i + k' r + e' (upper), the plane whose r-coefficient is the smaller
  end of [l_i, u_i] in magnitude;
- linear bounds of r in c over the box: g is convex and decreasing, so r >= g(v0) + g'(v0)
  (v - v0) with v <= the chord of each c_j^2 (r_low(c)), and r <= the chord of g over [vl, vu]
  with v >= the tangent of each c_j^2 at the middle of its interval (r_up(c)); v0 is v at the
  middle of the box.
In the backward step the r-coefficients of a row are summed over a group first (kappa, one
contraction per group in the program's order), and kappa r is then bounded by r_low or r_up
by kappa's sign: the row's A-matrix over the input is diagonal plus a rank-one term per group.

Numerics: the lines are computed in float64 from the float32 bounds, rounded to float32 and
moved outward by a margin that covers the rounding of every coefficient (2^-20 relative to
the terms of each line) and of rl, ru (2^-40). Group sums in float64 go through a fixed
pairwise tree (`_tree_sum`: elementwise adds, so the bits do not depend on threads or on a
group's position). Infinite input bounds give constant lines from IBP (|y_i| < sqrt(D)
always). eps must be > 0 (the lowering refuses 0): then var + eps > 0 everywhere.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops.base import Op, register_op

F64 = torch.float64
MARGIN = 2.0 ** -20     # outward margin per line, relative to the magnitudes of its terms
RANGE_EPS = 2.0 ** -40  # relative widening of [vl, vu] and [rl, ru] (float64 evaluation)
TINY = 2.0 ** -126


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis, keepdim, by a fixed pairwise tree of elementwise adds (the
    same bits for any thread count and any position of the group)."""
    n = x.shape[-1]
    size = 1 << max(0, (n - 1).bit_length())
    if size != n:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], size - n)], dim=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def _round_down(x64):
    y = x64.to(torch.float32)
    return torch.where(y.to(F64) > x64, torch.nextafter(y, y.new_tensor(-math.inf)), y)


def _round_up(x64):
    y = x64.to(torch.float32)
    return torch.where(y.to(F64) < x64, torch.nextafter(y, y.new_tensor(math.inf)), y)


@register_op
class Normalize(Op):
    """y = x / sqrt(mean(x^2 over `axes`) + eps), the per-sample `axes` normalised together
    (keeping the shape). Relaxed (its lines depend on its input bounds); not splittable;
    replicated in tp (a group spans the channels a zone would split)."""

    kind = "normalize"
    relaxed = True
    backward_memory = "separate"

    def setup(self, axes=(), eps=1e-5):
        self.axes = tuple(sorted(int(a) for a in axes))
        self.eps = float(eps)
        if not self.eps > 0:
            raise ValueError(f"normalize needs eps > 0, got {self.eps}")

    @classmethod
    def summation_note(cls, facts, sums):
        shape = facts.in_shapes[0]
        D = math.prod(shape[a] for a in facts.attrs.get("axes", ()))
        return (f"fwd mean square over {sums(D)} per group; bias A.intercept over "
                f"{sums(math.prod(shape))}; r-coefficients over {sums(D)} per group")

    # -- groups: (lead..., *shape) <-> (lead..., G, D) -------------------------------------------
    def _kept(self):
        return [a for a in range(len(self.in_shapes[0])) if a not in self.axes]

    @property
    def group_size(self) -> int:
        return math.prod(self.in_shapes[0][a] for a in self.axes)

    def _grouped(self, t: torch.Tensor, lead: int) -> torch.Tensor:
        perm = [*range(lead), *(a + lead for a in self._kept()), *(a + lead for a in self.axes)]
        return t.permute(*perm).reshape(*t.shape[:lead], -1, self.group_size)

    def _ungrouped(self, g: torch.Tensor, lead: int) -> torch.Tensor:
        shape = self.in_shapes[0]
        kept, axes = self._kept(), self.axes
        moved = g.reshape(*g.shape[:lead], *(shape[a] for a in kept), *(shape[a] for a in axes))
        order = kept + list(axes)
        inverse = [order.index(a) + lead for a in range(len(shape))]
        return moved.permute(*range(lead), *inverse).contiguous()

    # -- forward and IBP ------------------------------------------------------------------------
    def forward(self, x):
        g = self._grouped(x, 1)
        ms = contract.sum_last(g * g, self.order).unsqueeze(-1) / self.group_size
        return self._ungrouped(g / torch.sqrt(ms + self.eps), 1)

    def _ranges64(self, lo, hi):
        """float64 (l, u, min c^2, max c^2) per element, grouped (B, G, D)."""
        l, u = self._grouped(lo, 1).to(F64), self._grouped(hi, 1).to(F64)
        sq_hi = torch.maximum(l * l, u * u)
        sq_lo = torch.where((l <= 0) & (u >= 0), torch.zeros_like(l), torch.minimum(l * l, u * u))
        return l, u, sq_lo, sq_hi

    def _ibp64(self, l, u, sq_lo, sq_hi):
        """The exact range of every y_i over the box, float64 (B, G, D), before rounding."""
        D = self.group_size
        t_lo, t_hi = _tree_sum(sq_lo), _tree_sum(sq_hi)

        def value(c, others_small):
            others = torch.where(others_small, t_lo - sq_lo, t_hi - sq_hi).clamp(min=0)
            v = self.eps + (c * c + others) / D
            y = c / torch.sqrt(v)
            y = torch.where(torch.isinf(c) & ~torch.isinf(others), torch.sign(c) * math.sqrt(D), y)
            return y

        top = value(u, u >= 0)
        bottom = value(l, l < 0)
        root = math.sqrt(D)
        top = torch.nan_to_num(top, nan=root).clamp(-root, root)
        bottom = torch.nan_to_num(bottom, nan=-root).clamp(-root, root)
        return bottom, top

    def ibp(self, b):
        lo, hi = b
        bottom, top = self._ibp64(*self._ranges64(lo, hi))
        widen = RANGE_EPS * (bottom.abs() + top.abs()) + TINY
        return (self._ungrouped(_round_down(bottom - widen), 1),
                self._ungrouped(_round_up(top + widen), 1))

    def inexact_inputs(self, in_bounds):
        lo, hi = in_bounds[0]
        wide = (self._grouped(lo, 1) < self._grouped(hi, 1)).any(dim=-1, keepdim=True)
        return [self._ungrouped(wide.expand(*wide.shape[:-1], self.group_size), 1)]

    # -- the relaxation ---------------------------------------------------------------------------
    def _lines(self, lo, hi):
        """The float32 lines per box: per element (B, 1, G, D) the lower plane (d, k, e) and
        the upper one, per group (B, 1, G) the r-lines' constants and per element their
        coefficients: r_low(c) = aL + bL . c, r_up(c) = aU + bU . c."""
        D = self.group_size
        eps = self.eps
        l, u, sq_lo, sq_hi = self._ranges64(lo, hi)
        finite = (torch.isfinite(l) & torch.isfinite(u)).all(dim=-1, keepdim=True)
        l = torch.where(finite, l, torch.zeros_like(l))
        u = torch.where(finite, u, torch.zeros_like(u))
        sq_lo = torch.where(finite, sq_lo, torch.zeros_like(sq_lo))
        sq_hi = torch.where(finite, sq_hi, torch.zeros_like(sq_hi))
        vl = (eps + _tree_sum(sq_lo) / D) * (1 - RANGE_EPS)
        vu = (eps + _tree_sum(sq_hi) / D) * (1 + RANGE_EPS)
        rl = (1 / torch.sqrt(vu)) * (1 - RANGE_EPS)
        ru = (1 / torch.sqrt(vl)) * (1 + RANGE_EPS)
        m = (l + u) / 2
        M = torch.maximum(l.abs(), u.abs())

        # r_low: tangent of g at v0, composed with the chords of c_j^2 (v <= v_up(c)).
        v0 = (eps + _tree_sum(m * m) / D).clamp(min=vl, max=vu)
        g0 = 1 / torch.sqrt(v0)
        dg0 = -0.5 * g0 / v0
        sum_lu = _tree_sum(l * u) / D
        bL = dg0 * (l + u) / D
        aL = g0 + dg0 * (eps - sum_lu - v0)
        errL = g0 + dg0.abs() * (_tree_sum((l * u).abs()) / D + v0 + eps) + aL.abs() \
            + _tree_sum(bL.abs() * M)
        # r_up: chord of g over [vl, vu] (slope g'(vu) where the chord loses its digits),
        # composed with the tangents of c_j^2 at m_j (v >= v_low(c)).
        gl, gu = 1 / torch.sqrt(vl), 1 / torch.sqrt(vu)
        spread = vu - vl
        chord = (gu - gl) / torch.where(spread > 0, spread, torch.ones_like(spread))
        slope = torch.where(spread > 1e-6 * vu, chord, -0.5 * gu / vu)
        sum_mm = _tree_sum(m * m) / D
        bU = slope * 2 * m / D
        aU = gl + slope * (eps - sum_mm - vl)
        errU = gl + slope.abs() * (sum_mm + vl + eps) + aU.abs() + _tree_sum(bU.abs() * M)

        # McCormick planes, the one whose r-coefficient is the smaller end in magnitude.
        first = l.abs() <= u.abs()
        k = torch.where(first, l, u)
        dL = torch.where(first, rl, ru)
        eL = -k * dL
        dU = torch.where(first, ru, rl)
        eU = -k * dU
        errP_L = dL * M + k.abs() * ru + eL.abs()
        errP_U = dU * M + k.abs() * ru + eU.abs()

        # Groups with infinite bounds: constant lines from IBP.
        bottom, top = self._ibp64(*self._ranges64(lo, hi))
        zero = torch.zeros_like(l)
        keep = finite.expand_as(l)

        def f32(x):
            return x.to(torch.float32)

        lines = {
            "dL": f32(torch.where(keep, dL, zero)), "kL": f32(torch.where(keep, k, zero)),
            "eL": _round_down(torch.where(keep, eL - MARGIN * errP_L - TINY,
                                          bottom - RANGE_EPS * bottom.abs() - TINY)),
            "dU": f32(torch.where(keep, dU, zero)), "kU": f32(torch.where(keep, k, zero)),
            "eU": _round_up(torch.where(keep, eU + MARGIN * errP_U + TINY,
                                        top + RANGE_EPS * top.abs() + TINY)),
            "bL": f32(torch.where(keep, bL, zero)), "bU": f32(torch.where(keep, bU, zero)),
            "aL": _round_down(torch.where(finite, aL - MARGIN * errL - TINY,
                                          torch.zeros_like(aL))).squeeze(-1),
            "aU": _round_up(torch.where(finite, aU + MARGIN * errU + TINY,
                                        torch.zeros_like(aU))).squeeze(-1),
        }
        return {name: t.unsqueeze(1) for name, t in lines.items()}

    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        lo, hi = in_bounds[0]
        lines = self._lines(lo, hi)
        low = (lines["dL"], lines["kL"], lines["eL"])
        up = (lines["dU"], lines["kU"], lines["eU"])
        r_low, r_up = (lines["aL"], lines["bL"]), (lines["aU"], lines["bU"])
        lA_in, l_bias = self._side(lA, low, up, r_low, r_up)
        if uA is None:
            return [lA_in], [None], l_bias, None
        uA_in, u_bias = self._side(uA, up, low, r_up, r_low)
        return [lA_in], [uA_in], l_bias, u_bias

    def _side(self, A, on_pos, on_neg, r_pos, r_neg):
        """A (B, S, *shape) -> (A over the input, bias (B, S)): positive coefficients take
        the plane `on_pos`, negative ones `on_neg` (the lower plane and the upper one on the
        lower side, the other way round on the upper side); each row's summed r-coefficient
        kappa (per group) takes the r-line `r_pos` where it is positive, `r_neg` where not."""
        B, S = self._rows(A)
        g = self._grouped(A, 2)                                 # (B, S, G, D)
        pos = g.clamp(min=0)
        neg = g - pos
        (dp, kp, ep), (dn, kn, en) = on_pos, on_neg
        kappa = contract.sum_last(pos * kp + neg * kn, self.order)          # (B, S, G)
        kpos = kappa.clamp(min=0)
        kneg = kappa - kpos
        (ap, bp), (an, bn) = r_pos, r_neg
        A_in = pos * dp + neg * dn + kpos.unsqueeze(-1) * bp + kneg.unsqueeze(-1) * bn
        N = g.shape[2] * g.shape[3]
        e_pos = ep.expand(B, 1, *ep.shape[2:]).reshape(B, 1, N)
        e_neg = en.expand(B, 1, *en.shape[2:]).reshape(B, 1, N)
        bias = self._dot(pos.reshape(B, S, N), e_pos) + self._dot(neg.reshape(B, S, N), e_neg)
        bias = bias + self._dot(kpos, ap.expand(B, 1, ap.shape[-1])) \
            + self._dot(kneg, an.expand(B, 1, an.shape[-1]))
        return self._ungrouped(A_in, 2), bias
