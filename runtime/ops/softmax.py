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
(exp shifted by the largest upper bound) in centred form, each as its value v at the box centre
x0 and its slopes a, with the magnitudes of the terms each was computed from (`Plane`): a
float64 result's rounding error scales with those magnitudes, not with the result, which may
cancel (softmax's gradient rows sum to zero; with inputs near 1e6 an upper plane built as 1
minus the others' intercepts lost 800 times its own value, a line below the function). The
intercept is v - a32 . x0 with a32 the float32 slopes, moved outward by |a - a32| . r, by the
error margin `_rel(n) (1 + m_v + |v| + m_a . r + |a32| . |x0|)` (the standard gamma_n bound of
the terms, with 1e-12 relative as its floor: the library's exp / log, the shifts) and rounded
outward to float32. Input
bounds that are not finite give the constant IBP lines (vacuous where IBP is). The backward
step contracts each softmax row's (n, n) slopes with the A-matrix through the summation
order, one product per box and row.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops.base import Op, register_op

_MARGIN = 1e-12         # relative float64 evaluation allowance of a plane's terms (floor)


def _rel(n: int) -> float:
    """The relative allowance of a plane of n inputs: 1e-12, plus gamma of the few n-term
    float64 sums each coefficient passes through (it matters past n ~ 1,000)."""
    return _MARGIN + 8 * n * 2.0 ** -53


class Plane(NamedTuple):
    """One side's planes in centred form, float64: slopes a (..., n, n) (output i's row
    a[..., i, :]), values v (..., n) at the box centre x0, and the magnitudes ma, mv of the
    terms each was computed from (>= |a|, |v|; what their rounding errors scale with): the
    plane of output i is v_i + a_i . (x - x0)."""

    a: torch.Tensor
    v: torch.Tensor
    ma: torch.Tensor
    mv: torch.Tensor

    @staticmethod
    def pick(use, p, q):
        """p where `use` (..., n), q elsewhere."""
        return Plane(*(torch.where(use.unsqueeze(-1) if x.dim() > use.dim() else use, x, y)
                       for x, y in zip(p, q)))

    @staticmethod
    def constant(value):
        """The constant line `value` (IBP's)."""
        z = torch.zeros(*value.shape, value.shape[-1], dtype=value.dtype, device=value.device)
        return Plane(z, value, z, value.abs())


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
        """(lower, upper) `Plane`s in float64, sound in exact arithmetic (upper None for
        softmax: it comes from the other outputs' lower planes, `lines`)."""
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
        g = (s / D).unsqueeze(-2)                               # d log D / d x_j at x0
        t0 = x0 - c                                             # the shifted centre
        if self.log:
            lse0 = torch.logsumexp(t0, dim=-1, keepdim=True)
            q = torch.softmax(t0, dim=-1).unsqueeze(-2)
            logD = torch.log(D)
            upper = Plane(eye - q, t0 - lse0, eye + q, t0.abs() + lse0.abs() + 1.0)
            lower = Plane(eye - g, t0 - logD, eye + g, t0.abs() + logD.abs() + 1.0)
            return lower, upper
        L = torch.exp(t0) / D                                   # L_i(x0)
        return Plane(L.unsqueeze(-1) * (eye - g), L, L.unsqueeze(-1) * (eye + g), L), None

    def _sigmoid_planes64(self, lo, hi):
        """softmax_i = sigmoid(x_i - m_i) with m_i = LSE_{j != i} x_j convex: m_i <= the
        tangent of log(sum_{j != i} chord_j) (concave) and m_i >= its own tangent, so
        x_i - m_i lies between two planes T_L <= x_i - m_i <= T_U; sigmoid is increasing,
        so its lower line over T_L's range and upper line over T_U's give planes of
        softmax_i (the sigmoid kernel's lines: sound over the float32 interval, which is
        rounded outward from float64, widened by what rounding may have moved T). Tighter
        than 1 - sum of the others' lower planes on narrow boxes (one relaxation error
        instead of n - 1). Needs n >= 2. (lower, upper) `Plane`s."""
        from shardbound.runtime.ops.smooth import Sigmoid

        l, u = lo.double(), hi.double()
        n = l.shape[-1]
        rel = _rel(n)
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
        q = torch.softmax((xj - c).masked_fill(eye, -math.inf), dim=-1)     # grad of m_i
        lse0 = torch.logsumexp((xj - c).masked_fill(eye, -math.inf), dim=-1)
        logD = torch.log(D).squeeze(-1)
        t0 = x0 - c.squeeze(-1)                             # x0_i - max_{j != i} u_j
        unit = eye.to(l.dtype)
        sig = Sigmoid("sigma", ["t"], [tuple(l.shape[1:])])
        out = []
        # T_L = x_i - (the concave bound of m_i), T_U = x_i - (m_i's tangent), at x0
        for a, ma, v, mv, lower in ((unit - g, unit + g, t0 - logD, logD.abs(), True),
                                    (unit - q, unit + q, t0 - lse0, lse0.abs(), False)):
            mv = t0.abs() + mv + 1.0
            spread = (a.abs() * r.unsqueeze(-2)).sum(-1)
            margin = rel * (1 + mv + v.abs() + spread + (ma * r.unsqueeze(-2)).sum(-1))
            lines = sig.relax(_down(v - spread - margin), _up(v + spread + margin))
            k, b = ((lines.lower_slope, lines.lower_icpt) if lower
                    else (lines.upper_slope, lines.upper_icpt))
            k, b = k.double(), b.double()
            # k T + b, with what T's rounding may have moved it by (|k| (1 + mv + ma . r))
            out.append(Plane(k.unsqueeze(-1) * a, k * v + b, k.abs().unsqueeze(-1) * ma,
                             k.abs() * (mv + v.abs()) + b.abs()))
        return out

    def lines(self, lo, hi):
        """float32 (aL, cL, aU, cU) per output, each sound over the box (see the docstring)."""
        l, u = lo.double(), hi.double()
        low, up = self._ibp64(lo, hi)
        x0, r = (l + u) / 2, (u - l) / 2
        finite = (torch.isfinite(l) & torch.isfinite(u)).all(dim=-1, keepdim=True)
        safe_l = torch.where(finite, l, 0.0)
        safe_u = torch.where(finite, u, 0.0)
        lower, upper = self._planes64(safe_l, safe_u)
        x0 = torch.where(finite, x0, 0.0)
        r = torch.where(finite, r, 0.0)
        rel = _rel(l.shape[-1])
        sigmoid = not self.log and l.shape[-1] >= 2
        if sigmoid:
            s_lower, s_upper = self._sigmoid_planes64(safe_l, safe_u)

        def worth(p, side):
            """The value at x0 of the float32 line p becomes (side -1: lower, +1: upper):
            its margins and the intercept's float32 rounding taken."""
            a32, c32 = _rounded(p, x0, r, rel, lower=side < 0)
            return (a32.double() * x0.unsqueeze(-2)).sum(-1) + c32.double()

        # lower side: of the planes, the one with the higher centre value; the IBP constant
        # where that is better still
        if sigmoid:
            lower = Plane.pick(worth(s_lower, -1) > worth(lower, -1), s_lower, lower)
        ibp_low, ibp_up = Plane.constant(low), Plane.constant(up)
        lower = Plane.pick(finite & (worth(lower, -1) >= worth(ibp_low, -1)), lower, ibp_low)
        if not self.log:        # upper planes from the other outputs' lower lines
            total = [t.sum(dim=-2, keepdim=True) for t in (lower.a, lower.ma)]
            vsum = lower.v.sum(dim=-1, keepdim=True)
            upper = Plane(lower.a - total[0], 1.0 - (vsum - lower.v), lower.ma + total[1],
                          1.0 + lower.mv.sum(dim=-1, keepdim=True) + torch.zeros_like(lower.v))
            if sigmoid:
                upper = Plane.pick(worth(s_upper, 1) < worth(upper, 1), s_upper, upper)
        upper = Plane.pick(finite & (worth(upper, 1) <= worth(ibp_up, 1)), upper, ibp_up)
        return (*_rounded(lower, x0, r, rel, lower=True),
                *_rounded(upper, x0, r, rel, lower=False))

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


def _margin(p: Plane, x0, r, rel):
    """What float64 rounding may have moved plane p's value at x0 (1 + m_v) and its slopes
    over the box (m_a . r), and what its intercept v - a . x0 loses to rounding (|v| + |a| .
    |x0|): rel times the magnitudes of the terms, not of the results."""
    terms = p.ma * r.unsqueeze(-2) + p.a.abs() * x0.abs().unsqueeze(-2)
    return rel * (1 + p.mv + p.v.abs() + terms.sum(-1))


def _rounded(p: Plane, x0, r, rel, lower: bool):
    """float32 slopes and an intercept that keeps the plane on its side over the box
    [x0 - r, x0 + r]: rounding the slopes moves the line by at most |a - a32| . r around x0,
    float64 rounding by `_margin`."""
    a32 = p.a.float()
    a32_64 = a32.double()
    spread = ((p.a - a32_64).abs() * r.unsqueeze(-2)).sum(-1)
    c64 = p.v - (a32_64 * x0.unsqueeze(-2)).sum(-1)
    move = spread + _margin(p, x0, r, rel)
    finite = torch.isfinite(p.v)
    if lower:
        return a32, _down(torch.where(finite, c64 - move, p.v))
    return a32, _up(torch.where(finite, c64 + move, p.v))


@register_op
class Softmax(_SoftmaxFamily):
    kind = "softmax"


@register_op
class LogSoftmax(_SoftmaxFamily):
    kind = "log_softmax"
    log = True
