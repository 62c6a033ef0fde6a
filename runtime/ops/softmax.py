"""The softmax family: `softmax` and `log_softmax` over the last axis of the sample shape (the
lowering moves ONNX's axis there, or coerces to 2-D before opset 13).

IBP is exact per output: softmax_i is increasing in x_i and decreasing in every other x_j, so

    softmax_i in [1 / (1 + sum_{j != i} e^{u_j - l_i}),  1 / (1 + sum_{j != i} e^{l_j - u_i})],

computed in float64 as sigmoid(-logsumexp(...)) (no overflow at any width) and rounded
outward to float32; log_softmax_i = -log(1 + sum ...) likewise.

CROWN uses planes of convex / concave bounds of the whole function (after Wei et al. 2023,
"Convex bounds on the softmax function", the log-sum-exp decomposition), not exp, sum and
reciprocal composed:

- e^{x_j} <= h_j(x_j), its chord over [l_j, u_j], so with D(x) = sum_j h_j(x_j) (affine, > 0)
  softmax_i(x) >= L_i(x) = e^{x_i} / D(x) = exp(x_i - log D(x)), which is convex (x_i minus a
  concave function, under exp): its tangent plane at the box centre is a lower plane.
- sum_i softmax_i = 1, so softmax_i = 1 - sum_{j != i} softmax_j <= 1 - sum_{j != i} l_j(x)
  for any lower lines l_j: the upper plane (concave bound 1 - sum L_j, linearised).
- log_softmax_i = x_i - LSE(x) is concave: its tangent at the centre is an upper plane; and
  log_softmax_i >= x_i - log D(x), whose -log D is convex: its tangent is a lower plane.

Each output then takes, per side, the plane or the constant IBP line, whichever is better on
average over the box (the value at the centre; both are sound). Planes are computed in float64
(exp shifted by the largest upper bound), rounded to float32 slopes with the intercept moved
by what rounding changes over the box plus a relative margin, and rounded outward. Input
bounds that are not finite give the constant IBP lines (vacuous where IBP is). The backward
step contracts each softmax row's (n, n) slopes with the A-matrix through the summation
order, one product per box and row.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops.base import Op, register_op

_MARGIN = 1e-12         # relative float64 evaluation allowance of a plane


def _down(x64: torch.Tensor) -> torch.Tensor:
    """float32 <= x64 (nearest below)."""
    x = x64.float()
    return torch.where(x.double() > x64, torch.nextafter(x, torch.full_like(x, -math.inf)), x)


def _up(x64: torch.Tensor) -> torch.Tensor:
    x = x64.float()
    return torch.where(x.double() < x64, torch.nextafter(x, torch.full_like(x, math.inf)), x)


def _lse_others(a: torch.Tensor) -> torch.Tensor:
    """logsumexp over j != i of a[..., i, j] (float64, -inf when there is no other j)."""
    n = a.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=a.device)
    return torch.logsumexp(a.masked_fill(eye, -math.inf), dim=-1)


class _SoftmaxFamily(Op):
    relaxed = True
    backward_memory = "separate"
    log = False

    @classmethod
    def summation_note(cls, facts, sums):
        n = facts.shape[-1] if facts.shape else 1
        return (f"bwd A.slopes over {sums(2 * n)} per row; "
                f"bias over {sums(2 * math.prod(facts.shape))}")

    def forward(self, x):
        return torch.log_softmax(x, dim=-1) if self.log else torch.softmax(x, dim=-1)

    # -- IBP --------------------------------------------------------------------------------------
    def _ibp64(self, lo, hi):
        l, u = lo.double(), hi.double()
        t_up = _lse_others(l.unsqueeze(-2) - u.unsqueeze(-1))     # [i, j] = l_j - u_i
        t_lo = _lse_others(u.unsqueeze(-2) - l.unsqueeze(-1))     # [i, j] = u_j - l_i
        if self.log:
            zero = torch.zeros_like(t_up)
            low, up = -torch.logaddexp(zero, t_lo), -torch.logaddexp(zero, t_up)
            low = torch.where(torch.isnan(low), -math.inf, low)
            up = torch.where(torch.isnan(up), 0.0, up).clamp(max=0.0)
        else:
            low, up = torch.sigmoid(-t_lo), torch.sigmoid(-t_up)
            low = torch.where(torch.isnan(low), 0.0, low).clamp(0.0, 1.0)
            up = torch.where(torch.isnan(up), 1.0, up).clamp(0.0, 1.0)
        return low, up

    def ibp(self, b):
        low, up = self._ibp64(*b)
        return _down(low), _up(up)

    # -- planes ------------------------------------------------------------------------------
    def _planes64(self, lo, hi):
        """(aL (..., n, n), cL, aU, cU) in float64, sound in exact arithmetic: the output i's
        lines are a[..., i, :] . x + c[..., i]."""
        l, u = lo.double(), hi.double()
        c = u.max(dim=-1, keepdim=True).values
        x0, r = (l + u) / 2, (u - l) / 2
        w = u - l
        e_l, e_u = torch.exp(l - c), torch.exp(u - c)
        small = w <= 1.0            # expm1 keeps the chord slope exact for narrow intervals
        w_small = torch.where(small & (w > 0), w, 1.0)
        s_small = e_l * torch.where(w > 0, torch.expm1(w_small) / w_small, 1.0)
        s = torch.where(small, s_small, (e_u - e_l) / torch.where(small, 1.0, w))
        D = (e_l + s * r).sum(dim=-1, keepdim=True)           # D(x0) >= 1/2
        eye = torch.eye(l.shape[-1], dtype=l.dtype, device=l.device)
        if self.log:
            q = torch.softmax(x0 - c, dim=-1)
            lse0 = torch.logsumexp(x0 - c, dim=-1, keepdim=True)
            aU = eye - q.unsqueeze(-2)
            cU = (x0 - c - lse0) - (aU * x0.unsqueeze(-2)).sum(-1)
            aL = eye - (s / D).unsqueeze(-2)
            cL = (-c - torch.log(D)) + ((s / D) * x0).sum(-1, keepdim=True) \
                + torch.zeros_like(x0)
            return aL, cL, aU, cU
        L = torch.exp(x0 - c) / D                               # L_i(x0)
        aL = L.unsqueeze(-1) * (eye - (s / D).unsqueeze(-2))
        cL = L - (aL * x0.unsqueeze(-2)).sum(-1)
        return aL, cL, None, None

    def _sigmoid_planes64(self, lo, hi):
        """softmax_i = sigmoid(x_i - m_i) with m_i = LSE_{j != i} x_j convex: m_i <= the
        tangent of log(sum_{j != i} chord_j) (concave) and m_i >= its own tangent, so
        x_i - m_i lies between two planes T_L <= x_i - m_i <= T_U; sigmoid is increasing,
        so its lower line over T_L's range and upper line over T_U's give planes of
        softmax_i (the sigmoid kernel's lines: sound over the float32 interval, which is
        rounded outward from float64). Tighter than 1 - sum of the others' lower planes on
        narrow boxes (one relaxation error instead of n - 1). Needs n >= 2."""
        from shardbound.runtime.ops.smooth import Sigmoid

        l, u = lo.double(), hi.double()
        n = l.shape[-1]
        x0, r = (l + u) / 2, (u - l) / 2
        eye = torch.eye(n, dtype=torch.bool, device=l.device)
        lj, uj, xj = l.unsqueeze(-2), u.unsqueeze(-2), x0.unsqueeze(-2)      # [.., i, j]
        c = uj.masked_fill(eye, -math.inf).max(dim=-1, keepdim=True).values  # max_{j != i} u_j
        w = uj - lj
        e_l, e_u = torch.exp(lj - c), torch.exp(uj - c)
        small = w <= 1.0
        w_small = torch.where(small & (w > 0), w, 1.0)
        s_small = e_l * torch.where(w > 0, torch.expm1(w_small) / w_small, 1.0)
        slope = torch.where(small, s_small, (e_u - e_l) / torch.where(small, 1.0, w))
        slope = slope.masked_fill(eye, 0.0)
        D = (e_l + slope * r.unsqueeze(-2)).masked_fill(eye, 0.0).sum(-1, keepdim=True)
        g = slope / D                                       # d log D / d x_j at x0
        m_up0 = c + torch.log(D)                            # the concave bound at x0
        q = torch.softmax((xj - c).masked_fill(eye, -math.inf), dim=-1)     # grad of m_i
        m0 = c + torch.logsumexp((xj - c).masked_fill(eye, -math.inf), dim=-1, keepdim=True)
        unit = eye.to(l.dtype)
        a_lo, a_hi = unit - g, unit - q                     # T_L, T_U slopes
        c_lo = -m_up0.squeeze(-1) + (g * xj).sum(-1)
        c_hi = -m0.squeeze(-1) + (q * xj).sum(-1)
        sig = Sigmoid("sigma", ["t"], [tuple(l.shape[1:])])
        out = []
        for a, cc, lower in ((a_lo, c_lo, True), (a_hi, c_hi, False)):
            mid = (a * xj).sum(-1) + cc
            spread = (a.abs() * r.unsqueeze(-2)).sum(-1)
            margin = _MARGIN * (1 + mid.abs() + spread)
            lines = sig.relax(_down(mid - spread - margin), _up(mid + spread + margin))
            k, b = ((lines.lower_slope, lines.lower_icpt) if lower
                    else (lines.upper_slope, lines.upper_icpt))
            k, b = k.double(), b.double()
            out += [k.unsqueeze(-1) * a, k * cc + b]
        return out

    def lines(self, lo, hi):
        """float32 (aL, cL, aU, cU) per output, each sound over the box (see the docstring)."""
        l, u = lo.double(), hi.double()
        low, up = self._ibp64(lo, hi)
        x0, r = (l + u) / 2, (u - l) / 2
        finite = (torch.isfinite(l) & torch.isfinite(u)).all(dim=-1, keepdim=True)
        safe_l = torch.where(finite, l, 0.0)
        safe_u = torch.where(finite, u, 0.0)
        aL, cL, aU, cU = self._planes64(safe_l, safe_u)
        x0 = torch.where(finite, x0, 0.0)
        r = torch.where(finite, r, 0.0)
        sigmoid = not self.log and l.shape[-1] >= 2
        if sigmoid:
            saL, scL, saU, scU = self._sigmoid_planes64(safe_l, safe_u)

        def centre(a, c):
            return (a * x0.unsqueeze(-2)).sum(-1) + c

        def pick(use, a, c, a2, c2):
            return torch.where(use.unsqueeze(-1), a, a2), torch.where(use, c, c2)

        # lower side: of the planes, the one with the higher centre value; the IBP constant
        # where that is better still
        if sigmoid:
            aL, cL = pick(centre(saL, scL) > centre(aL, cL), saL, scL, aL, cL)
        aL, cL = pick(finite & (centre(aL, cL) >= low), aL, cL, torch.zeros_like(aL), low)
        if not self.log:        # upper planes from the other outputs' lower lines
            aU = aL - aL.sum(dim=-2, keepdim=True)
            cU = 1.0 - (cL.sum(dim=-1, keepdim=True) - cL)
            if sigmoid:
                aU, cU = pick(centre(saU, scU) < centre(aU, cU), saU, scU, aU, cU)
        aU, cU = pick(finite & (centre(aU, cU) <= up), aU, cU, torch.zeros_like(aU), up)
        return (*_rounded(aL, cL, x0, r, lower=True), *_rounded(aU, cU, x0, r, lower=False))

    # -- the CROWN step ------------------------------------------------------------------------
    def inexact_inputs(self, in_bounds):
        b = in_bounds[0]
        return [None if b is None else b[0] < b[1]]

    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        lo, hi = in_bounds[0]
        # Every backward pass through this node in one bound computation meets the same
        # bound tensors: their lines are made once (kept with the tensors they came from).
        aL, cL, aU, cU = self.memo("_lines_memo").get((lo, hi), lambda: self.lines(lo, hi))
        lA_in, l_bias = self._side(lA, aL, cL, aU, cU, -math.inf)
        if uA is None:
            return [lA_in], [None], l_bias, None
        uA_in, u_bias = self._side(uA, aU, cU, aL, cL, math.inf)
        return [lA_in], [uA_in], l_bias, u_bias

    def _side(self, A, pos_a, pos_c, neg_a, neg_c, vacuous):
        """Positive coefficients take the pos lines, negative ones the neg lines; slopes per
        softmax row (n, n) contracted with A's rows there, one product per (box, row)."""
        B, S = self._rows(A)
        n = self.shape[-1]
        R = math.prod(self.shape[:-1])
        pos = A.clamp(min=0).reshape(B, S, R, n)
        neg = A.reshape(B, S, R, n) - pos
        both = torch.cat([pos, neg], dim=-1)                        # (B, S, R, 2n)
        slopes = torch.cat([pos_a.transpose(-1, -2), neg_a.transpose(-1, -2)], dim=-1)
        slopes = slopes.reshape(slopes.shape[0], R, n, 2 * n)       # [j, (i | n + i)]
        if self.order == "fast":
            A_in = torch.matmul(both.transpose(1, 2), slopes.transpose(-1, -2)
                                .expand(B, R, 2 * n, n)).transpose(1, 2)
        else:
            rows = [torch.stack([contract.matmul(both[b, :, r],
                                                 slopes[min(b, slopes.shape[0] - 1), r],
                                                 self.order) for r in range(R)], dim=1)
                    for b in range(B)]
            A_in = torch.stack(rows)
        A_in = A_in.reshape(B, S, *self.shape)
        icpt = torch.cat([pos_c.reshape(-1, R, n), neg_c.reshape(-1, R, n)], dim=-1)
        finite = torch.isfinite(icpt)
        flat = both.reshape(B, S, R * 2 * n)
        bias = self._dot(flat, torch.where(finite, icpt, 0.0).reshape(-1, 1, R * 2 * n))
        if not bool(finite.all()):      # a line that does not exist (log_softmax's -inf)
            hit = (flat != 0) & ~finite.reshape(-1, 1, R * 2 * n)
            bias = torch.where(hit.any(dim=-1), torch.full_like(bias, vacuous), bias)
        return A_in, bias


def _rounded(a64, c64, x0, r, lower: bool):
    """float32 slopes and an intercept that keeps the line on its side over the box
    [x0 - r, x0 + r]: rounding the slopes moves the line by at most |da| . r around x0."""
    a32 = a64.float()
    da = a64 - a32.double()
    shift = (da * x0.unsqueeze(-2)).sum(-1)
    spread = (da.abs() * r.unsqueeze(-2)).sum(-1)
    margin = _MARGIN * (1 + c64.abs() + (a64.abs() * (x0.abs() + r).unsqueeze(-2)).sum(-1))
    finite = torch.isfinite(c64)
    if lower:
        c = torch.where(finite, c64 + shift - spread - margin, c64)
        return a32, _down(c)
    c = torch.where(finite, c64 + shift + spread + margin, c64)
    return a32, _up(c)


@register_op
class Softmax(_SoftmaxFamily):
    kind = "softmax"


@register_op
class LogSoftmax(_SoftmaxFamily):
    kind = "log_softmax"
    log = True
