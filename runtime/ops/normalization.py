"""The normalization family: `normalize`, y = c / sqrt(v) where v = mean(c^2) + eps over some
sample axes (each group of elements that share the other axes' indices is normalised alone).
Its second input v is computed by the nodes before it (pow 2, reduce_sum with mean, affine +
eps) from the same c: by construction v(x) = mean(c(x)^2) + eps for every input x, so the
kernel may use both v's own bounds (CROWN bounds it, which captures how the c_j move together)
and the range of mean(c^2) + eps over c's box. With c = x - mean(x) (linear nodes) and an
affine (gamma, beta) after it this is LayerNormalization; with c = x, RMS normalisation.
compiler/lowering/normalization.py lowers LayerNormalization (opset 17) and the ReduceMean /
Sub / Pow / ReduceMean / Add / Sqrt / Div pattern of older exports to that composition.

IBP is exact over c's box (intersected with c * [vu^-1/2, vl^-1/2]): y_i increases with c_i
and, for j != i, decreases with c_j^2 where c_i > 0 (increases where c_i < 0), so the extremes
of y_i put c_i at an end and every other c_j^2 at its least or greatest value over [l_j, u_j].

CROWN (a linear relaxation in the spirit of Shi et al. 2020's for products and the standard
deviation, written for this kernel): y_i = c_i * r, r = g(v) = v^(-1/2), with
- [vl, vu]: v's bounds intersected with the range of mean(c^2) + eps over the box (>= eps > 0,
  so g is finite), and r in [rl, ru] = [g(vu), g(vl)];
- McCormick planes of the product c_i * r on [l_i, u_i] x [rl, ru]: y_i >= d c_i + k r + e
  (lower) and y_i <= d' c_i + k' r + e' (upper), the plane whose r-coefficient is the smaller
  end of [l_i, u_i] in magnitude;
- lines of the convex, decreasing g over [vl, vu]: r >= the tangent at the middle, r <= the
  chord.
In the backward step the r-coefficients of a row are summed over a group first (kappa, one
contraction per group in the program's order) and kappa r is bounded by g's lower or upper
line by kappa's sign, which sends kappa times its slope to v; A over c is diagonal. The nodes
that compute v then relax c^2 (the pow kernel). Measured against auto_LiRPA 0.7.1 (which
relaxes sqrt, the division and the product one by one) on Linear-LayerNorm-Linear-ReLU-Linear:
mean CROWN width 0.0097 / 0.060 / 0.66 against 0.0098 / 0.065 / 1.11 at box radius 0.01 /
0.05 / 0.2 (bench/normalization.py).

Numerics: the lines are computed in float64 from the float32 bounds, rounded to float32 and
moved outward by a margin that covers the rounding of every coefficient (2^-20 relative to
the terms of each line) and of [vl, vu] and [rl, ru] (2^-40). Group sums in float64 go
through a fixed pairwise tree (`_tree_sum`: elementwise adds, so the bits do not depend on
threads or on a group's position). Infinite bounds of c give constant lines from IBP (|y_i|
< sqrt(D) always). eps must be > 0 (the lowering refuses 0): then v >= eps > 0 everywhere.
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
    """y = c / sqrt(v) with v = mean(c^2 over `axes`) + eps (the second input, of the reduced
    shape with the axes kept as 1), the per-sample `axes` normalised together. Relaxed; not
    splittable; replicated in tp (a group spans the channels a zone would split)."""

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
        return (f"bias A.intercept over {sums(math.prod(shape))}; r-coefficients over "
                f"{sums(D)} per group")

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

    def infer_shape(self):
        shape = self.in_shapes[0]
        reduced = tuple(1 if a in self.axes else d for a, d in enumerate(shape))
        if len(self.in_shapes) != 2 or self.in_shapes[1] != reduced or not self.axes:
            raise ValueError(f"normalize takes c {shape} and its mean square {reduced}, got "
                             f"{list(self.in_shapes)}")
        return shape

    # -- forward and IBP ------------------------------------------------------------------------
    def forward(self, c, v):
        return c / torch.sqrt(v)

    def _ranges64(self, lo, hi):
        """float64 (l, u, min c^2, max c^2) per element, grouped (B, G, D)."""
        l, u = self._grouped(lo, 1).to(F64), self._grouped(hi, 1).to(F64)
        sq_hi = torch.maximum(l * l, u * u)
        sq_lo = torch.where((l <= 0) & (u >= 0), torch.zeros_like(l), torch.minimum(l * l, u * u))
        return l, u, sq_lo, sq_hi

    def _box_ibp64(self, l, u, sq_lo, sq_hi):
        """The exact range of every y_i over the box of c, float64 (B, G, D)."""
        D = self.group_size
        t_lo, t_hi = _tree_sum(sq_lo), _tree_sum(sq_hi)

        def value(c, others_small):
            others = torch.where(others_small, t_lo - sq_lo, t_hi - sq_hi).clamp(min=0)
            y = c / torch.sqrt(self.eps + (c * c + others) / D)
            return torch.where(torch.isinf(c) & ~torch.isinf(others), torch.sign(c) * math.sqrt(D), y)

        root = math.sqrt(D)
        top = torch.nan_to_num(value(u, u >= 0), nan=root).clamp(-root, root)
        bottom = torch.nan_to_num(value(l, l < 0), nan=-root).clamp(-root, root)
        return bottom, top

    def _v_range64(self, sq_lo, sq_hi, v_bounds, slack=0.0):
        """[vl, vu] (B, G, 1) float64: the range of mean(c^2) + eps over the box of c,
        intersected with v's own bounds (CROWN-tight; where they do not meet, rounding made
        them disagree and the box's range alone is kept), widened by RANGE_EPS and `slack`
        (relative: how far v may be from mean(c^2) + eps, --soundness real / float32's
        allowance for the rounded constants and the float32 evaluation of v)."""
        D = self.group_size
        vl = self.eps + _tree_sum(sq_lo) / D
        vu = self.eps + _tree_sum(sq_hi) / D
        if v_bounds is not None:
            B = sq_lo.shape[0]
            gl = v_bounds[0].reshape(B, -1, 1).to(F64)
            gu = v_bounds[1].reshape(B, -1, 1).to(F64)
            nl, nu = torch.maximum(vl, gl), torch.minimum(vu, gu)
            meet = nl <= nu
            vl, vu = torch.where(meet, nl, vl), torch.where(meet, nu, vu)
        return vl * (1 - RANGE_EPS - slack), vu * (1 + RANGE_EPS + slack)

    def _ibp64(self, c_bounds, v_bounds, slack=0.0):
        l, u, sq_lo, sq_hi = self._ranges64(*c_bounds)
        bottom, top = self._box_ibp64(l, u, sq_lo, sq_hi)
        if slack:           # v = (mean(c^2) + eps)(1 + t), |t| <= slack: y moves by |y| slack
            bottom, top = bottom - slack * bottom.abs(), top + slack * top.abs()
        vl, vu = self._v_range64(sq_lo, sq_hi, v_bounds, slack)
        rl, ru = (1 / torch.sqrt(vu)) * (1 - RANGE_EPS), (1 / torch.sqrt(vl)) * (1 + RANGE_EPS)
        ends = torch.nan_to_num(torch.stack([l * rl, l * ru, u * rl, u * ru]), nan=0.0)
        finite = torch.isfinite(l) & torch.isfinite(u)
        bottom = torch.where(finite, torch.maximum(bottom, ends.amin(0)), bottom)
        top = torch.where(finite, torch.minimum(top, ends.amax(0)), top)
        return bottom, top

    def ibp(self, c_bounds, v_bounds):
        bottom, top = self._ibp64(c_bounds, v_bounds)
        widen = RANGE_EPS * (bottom.abs() + top.abs()) + TINY
        return (self._ungrouped(_round_down(bottom - widen), 1),
                self._ungrouped(_round_up(top + widen), 1))

    def inexact_inputs(self, in_bounds):
        """Every element of a group whose box is not a point (each output of a group depends
        on all its inputs); v where the group is inexact."""
        c_bounds, v_bounds = in_bounds
        masks = [None, None]
        if c_bounds is not None:
            lo, hi = c_bounds
            wide = (self._grouped(lo, 1) < self._grouped(hi, 1)).any(dim=-1, keepdim=True)
            masks[0] = self._ungrouped(wide.expand(*wide.shape[:-1], self.group_size), 1)
        if v_bounds is not None:
            masks[1] = v_bounds[0] < v_bounds[1]
        return masks

    # -- the relaxation ---------------------------------------------------------------------------
    def _lines(self, c_bounds, v_bounds, slack=0.0):
        """The float32 lines per box: per element (B, 1, G, D) the lower plane y >= d c +
        k r + e and the upper one, per group (B, 1, G) the r-lines r >= sL v + aL and
        r <= sU v + aU."""
        l, u, sq_lo, sq_hi = self._ranges64(*c_bounds)
        finite = (torch.isfinite(l) & torch.isfinite(u)).all(dim=-1, keepdim=True)
        zero = torch.zeros_like(l)
        l, u = torch.where(finite, l, zero), torch.where(finite, u, zero)
        sq_lo, sq_hi = torch.where(finite, sq_lo, zero), torch.where(finite, sq_hi, zero)
        vl, vu = self._v_range64(sq_lo, sq_hi, v_bounds, slack)
        gl, gu = 1 / torch.sqrt(vl), 1 / torch.sqrt(vu)
        rl, ru = gu * (1 - RANGE_EPS), gl * (1 + RANGE_EPS)
        M = torch.maximum(l.abs(), u.abs())

        # r >= g(v0) + g'(v0) (v - v0) (tangent of the convex g at the middle of [vl, vu]);
        # r <= the chord of g over [vl, vu] (slope g'(vu), never below the chord's, where the
        # chord loses its digits).
        v0 = (vl + vu) / 2
        g0 = 1 / torch.sqrt(v0)
        sL = -0.5 * g0 / v0
        aL = g0 - sL * v0
        errL = 2 * g0 + aL.abs() + sL.abs() * vu
        spread = vu - vl
        chord = (gu - gl) / torch.where(spread > 0, spread, torch.ones_like(spread))
        sU = torch.where(spread > 1e-6 * vu, chord, -0.5 * gu / vu)
        aU = gl - sU * vl
        errU = gl + aU.abs() + sU.abs() * vu

        # McCormick planes of c_i * r, the one whose r-coefficient is the smaller end.
        first = l.abs() <= u.abs()
        k = torch.where(first, l, u)
        dL, dU = torch.where(first, rl, ru), torch.where(first, ru, rl)
        eL, eU = -k * dL, -k * dU
        errP_L = dL * M + k.abs() * ru + eL.abs()
        errP_U = dU * M + k.abs() * ru + eU.abs()

        # Groups with infinite bounds: constant lines from IBP.
        bottom, top = self._ibp64(c_bounds, v_bounds, slack)
        keep = finite.expand_as(l)

        def elem(x):
            return torch.where(keep, x, zero).to(torch.float32)

        def group(x):
            return torch.where(finite, x, torch.zeros_like(x)).to(torch.float32).squeeze(-1)

        lines = {
            "dL": elem(dL), "kL": elem(k), "dU": elem(dU), "kU": elem(k),
            "eL": _round_down(torch.where(keep, eL - MARGIN * errP_L - TINY,
                                          bottom - RANGE_EPS * bottom.abs() - TINY)),
            "eU": _round_up(torch.where(keep, eU + MARGIN * errP_U + TINY,
                                        top + RANGE_EPS * top.abs() + TINY)),
            "sL": group(sL), "sU": group(sU),
            "aL": _round_down(torch.where(finite, aL - MARGIN * errL - TINY,
                                          torch.zeros_like(aL))).squeeze(-1),
            "aU": _round_up(torch.where(finite, aU + MARGIN * errU + TINY,
                                        torch.zeros_like(aU))).squeeze(-1),
        }
        return {name: t.unsqueeze(1) for name, t in lines.items()}

    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        lines = self._lines(*in_bounds)
        low = (lines["dL"], lines["kL"], lines["eL"])
        up = (lines["dU"], lines["kU"], lines["eU"])
        r_low, r_up = (lines["aL"], lines["sL"]), (lines["aU"], lines["sU"])
        lA_c, lA_v, l_bias = self._side(lA, low, up, r_low, r_up)
        if uA is None:
            return [lA_c, lA_v], [None, None], l_bias, None
        uA_c, uA_v, u_bias = self._side(uA, up, low, r_up, r_low)
        return [lA_c, lA_v], [uA_c, uA_v], l_bias, u_bias

    def _side(self, A, on_pos, on_neg, r_pos, r_neg):
        """A (B, S, *shape) -> (A over c, A over v, bias (B, S)): positive coefficients take
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
        (ap, sp), (an, sn) = r_pos, r_neg
        A_c = self._ungrouped(pos * dp + neg * dn, 2)
        A_v = (kpos * sp + kneg * sn).reshape(B, S, *self.in_shapes[1])
        N = g.shape[2] * g.shape[3]
        e_pos = ep.expand(B, 1, *ep.shape[2:]).reshape(B, 1, N)
        e_neg = en.expand(B, 1, *en.shape[2:]).reshape(B, 1, N)
        bias = self._dot(pos.reshape(B, S, N), e_pos) + self._dot(neg.reshape(B, S, N), e_neg)
        bias = bias + self._dot(kpos, ap.expand(B, 1, ap.shape[-1])) \
            + self._dot(kneg, an.expand(B, 1, an.shape[-1]))
        return A_c, A_v, bias
