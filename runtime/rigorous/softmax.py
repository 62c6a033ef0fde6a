"""Rigorous step of the softmax family: `softmax` and `log_softmax` over the last axis.

Every quantity is enclosed in float64 interval arithmetic: differences, sums of positive
terms (gamma_n), products and quotients move one ulp outward after rounding, and the library's
exp, log and log1p are allowed LIB (2^-46, the computed-intercept functions' allowance,
runtime/ops/intercepts.py) relative to their value.

IBP (the engine's formula, exact per output over the box): softmax_i lies in
[1 / (1 + e^{T_i}), 1 / (1 + e^{t_i})] with T_i = LSE_{j != i}(u_j - l_i) and t_i =
LSE_{j != i}(l_j - u_i) (LSE is increasing in each argument, so T_i is enclosed from above
by the LSE of the differences rounded up, t_i from below), log_softmax_i in [-softplus(T_i),
-softplus(t_i)]. No overflow: LSE is computed shifted by its largest argument, and e^{T} = inf
gives the bound 0 (the true one is below e^-709).

CROWN: the engine's planes (runtime/ops/softmax.py, after Wei et al. 2023), built again with
every coefficient enclosed. With D(x) = sum_j chord_j(x_j) >= sum_j e^{x_j} (chord_j: the exact
chord of exp over [l_j, u_j]; only its enclosure is computed), h_i(x) = x_i - log D(x) is convex
and below log_softmax_i, and e^{h_i} is convex and below softmax_i; x_i - LSE(x) is
log_softmax_i itself, concave. For a function with a tangent plane below it (or above) at the
box centre x0, value v and gradient g known only as intervals, the plane a . x + c with a the
midpoint of g's interval and c = v_lo - a . x0 - rad . r (rad: the distance of a from g's
interval, r: the box's half width, both rounded up) is below it at every point of the box in
exact arithmetic (mirrored above). softmax_i's upper plane is 1 - sum_{j != i} (lower line of
j), its coefficients summed in float64 with their gamma error charged over max |x|. Per side
the plane or the IBP constant, whichever is better at x0 (both sound), as the engine chooses;
the engine's sigmoid planes (tighter on narrow boxes) are not rebuilt, so the upper side may
be looser there. Applying the lines: per softmax row the (n, n) slopes contracted with the
row's coefficients (charged gamma_{2n} of the absolute products times max |x|), the constants
a dot product rounded down. float32 mode: the library's float32 softmax is allowed 16 float32
ulps of max |f| plus n ulps for its sum (relaxation.py's allowance).
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.intercepts import EPS as LIB
from shardbound.runtime.ops.softmax import _SoftmaxFamily
from shardbound.runtime.rigorous.core import (DT, TINY, U32, U64, Step, absdot_upper, down,
                                              gamma, nan_vacuous, rigorous_step,
                                              to_float32_outward, up)
from shardbound.runtime.rigorous.relaxation import F32_ULPS, cached, masked_dot_lower


# -- interval arithmetic on float64 tensors -------------------------------------------------------
def _exp_lo(t):
    return down(torch.exp(t) * (1.0 - LIB))


def _exp_hi(t):
    return up(torch.exp(t) * (1.0 + LIB))


def _lib_lo(v):
    """A library value v moved below its true one (infinite v kept)."""
    return torch.where(torch.isfinite(v), down(v - LIB * v.abs()), v)


def _lib_hi(v):
    return torch.where(torch.isfinite(v), up(v + LIB * v.abs()), v)


def _sum_lo(x):
    """Of non-negative terms over the last axis."""
    return down(x.sum(-1) * (1.0 - gamma(x.shape[-1])))


def _sum_hi(x):
    return up(x.sum(-1) * (1.0 + gamma(x.shape[-1])))


def _mul(alo, ahi, blo, bhi):
    """[alo, ahi] * [blo, bhi] (finite ends)."""
    ps = [a * b for a in (alo, ahi) for b in (blo, bhi)]
    lo = torch.stack([down(p) for p in ps]).amin(0)
    hi = torch.stack([up(p) for p in ps]).amax(0)
    return lo, hi


def lse_hi(a):
    """An upper bound of LSE over the last axis of exact values <= a (-inf entries: absent)."""
    m = a.amax(-1, keepdim=True)
    ms = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = _sum_hi(_exp_hi(up(a - ms)))
    out = up(ms.squeeze(-1) + _lib_hi(torch.log(s)))
    return torch.where(torch.isfinite(m.squeeze(-1)), out, m.squeeze(-1))


def lse_lo(a):
    """A lower bound of LSE over the last axis of exact values >= a."""
    m = a.amax(-1, keepdim=True)
    ms = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = _sum_lo(_exp_lo(down(a - ms)))
    out = down(ms.squeeze(-1) + _lib_lo(torch.log(s)))
    return torch.where(torch.isfinite(m.squeeze(-1)), out, m.squeeze(-1))


def softplus_hi(t):
    w = _exp_hi(-t.abs())
    return up(t.clamp(min=0) + _lib_hi(torch.log1p(w)))


def softplus_lo(t):
    w = _exp_lo(-t.abs())
    return down(t.clamp(min=0) + _lib_lo(torch.log1p(w)))


def _others(a):
    """a (..., n, n) with the diagonal (j == i) absent (-inf)."""
    n = a.shape[-1]
    return a.masked_fill(torch.eye(n, dtype=torch.bool), -math.inf)


def softmax_ibp(lo, hi, log: bool):
    """Rigorous bounds of softmax (or log_softmax) over the last axis on the box [lo, hi]."""
    T = lse_hi(_others(up(hi.unsqueeze(-2) - lo.unsqueeze(-1))))    # [i, j] = u_j - l_i
    t = lse_lo(_others(down(lo.unsqueeze(-2) - hi.unsqueeze(-1))))   # [i, j] = l_j - u_i
    if log:
        low, high = down(-softplus_hi(T)), up(-softplus_lo(t))
        low = torch.where(torch.isnan(low), -math.inf, low)
        high = torch.where(torch.isnan(high), 0.0, high).clamp(max=0.0)
    else:
        low = down(1.0 / up(1.0 + _exp_hi(T)))
        high = up(1.0 / down(1.0 + _exp_lo(t)))
        low = torch.where(torch.isnan(low), 0.0, low).clamp(0.0, 1.0)
        high = torch.where(torch.isnan(high), 1.0, high).clamp(0.0, 1.0)
    return low, high


def _better(a, c, a2, c2, x0, higher: bool):
    """Per output the line (a, c) or (a2, c2) with the better value at x0 (a line with a
    non-finite intercept never wins)."""
    xa = x0.unsqueeze(-2)
    v, v2 = (a * xa).sum(-1) + c, (a2 * xa).sum(-1) + c2
    ok2 = torch.isfinite(c2) & torch.isfinite(a2).all(-1)
    use2 = ok2 & (~(torch.isfinite(c) & torch.isfinite(a).all(-1))
                  | ((v2 > v) if higher else (v2 < v)))
    return torch.where(use2.unsqueeze(-1), a2, a), torch.where(use2, c2, c)


def _tangent(v_lo, v_hi, g_lo, g_hi, x0, r, below: bool):
    """The plane a . x + c of a convex (below) or concave (above) function over the box
    x0 -+ r from enclosures of its value (..., n) and gradient (..., n, n) at x0: a the
    gradient interval's midpoint, c moved by a . x0 and by rad . r (rad >= |a - g|)."""
    a = (g_lo + g_hi) / 2
    rad = torch.maximum(up(g_hi - a), up(a - g_lo))
    n = a.shape[-1]
    xa = x0.unsqueeze(-2)
    s, e = (a * xa).sum(-1), (a.abs() * xa.abs()).sum(-1)
    allow = up(gamma(n + 1) * e + n * TINY)
    spread = up((rad * r.unsqueeze(-2)).sum(-1) * (1.0 + gamma(n + 1)))
    if below:
        return a, down(down(v_lo - up(s + allow)) - spread)
    return a, up(up(v_hi - down(s - allow)) + spread)


@rigorous_step(_SoftmaxFamily)
class SoftmaxStep(Step):
    def load(self, op):
        self.log = op.log
        self.n = self.shape[-1]

    def forward(self, xs):
        x = xs[0].to(DT)
        return torch.log_softmax(x, dim=-1) if self.log else torch.softmax(x, dim=-1)

    def f32_delta(self, mags, out):
        lo, hi = out
        m = torch.maximum(lo.abs(), hi.abs())
        return up(m * ((F32_ULPS + self.n) * 2 * U32) + F32_ULPS * 2.0 ** -149)

    def ibp(self, bounds, float32):
        lo, hi = bounds[0]
        low, high = softmax_ibp(lo.to(DT), hi.to(DT), self.log)
        if float32:
            d = self.f32_delta(None, (low, high))
            low, high = down(low - d), up(high + d)
        return nan_vacuous(low, high)

    def lines(self, lo, hi):
        """(aL, cL, aU, cU): aL (B, ..., n, n) with row i the slopes of output i's lower line,
        cL (B, ..., n); sound over [lo, hi] in exact arithmetic (kept for the last bounds:
        every backward pass through the node asks for them)."""
        return cached(self, lo, hi, lambda: self._lines(lo.to(DT), hi.to(DT)))

    def _lines(self, lo, hi):
        low, high = self.ibp([(lo, hi)], False)     # float32's delta is charged apart
        finite = (torch.isfinite(lo) & torch.isfinite(hi)).all(-1, keepdim=True)
        zero = torch.zeros_like(lo)
        l, u = torch.where(finite, lo, zero), torch.where(finite, hi, zero)
        x0 = torch.minimum(torch.maximum((l + u) / 2, l), u)
        r = torch.maximum(up(u - x0), up(x0 - l))
        (aL, cL), upper = self._planes(l, u, x0, r)

        def centre(a, c):
            return (a * x0.unsqueeze(-2)).sum(-1) + c

        def pick(a, c, const, better):
            use = finite & torch.isfinite(c) & torch.isfinite(a).all(-1)
            use = use & better(centre(torch.where(use.unsqueeze(-1), a, 0.0),
                                      torch.where(use, c, 0.0)), const)
            return (torch.where(use.unsqueeze(-1), a, 0.0), torch.where(use, c, const))

        sigmoid = None
        if not self.log and self.n >= 2:
            sigmoid = self._sigmoid_planes(l, u, x0, r)
            aL, cL = _better(aL, cL, *sigmoid[0], x0, higher=True)
        aL, cL = pick(aL, cL, low, lambda v, k: v >= k)
        aU, cU = upper if self.log else self._one_minus_others(aL, cL, l, u)
        if sigmoid is not None:
            aU, cU = _better(aU, cU, *sigmoid[1], x0, higher=False)
        aU, cU = pick(aU, cU, high, lambda v, k: v <= k)
        return aL, cL, aU, cU

    def _sigmoid_planes(self, l, u, x0, r):
        """softmax_i = sigmoid(x_i - m_i), m_i = LSE_{j != i} x_j (the engine's second
        construction, tighter on narrow boxes): m_i <= P_i(x), the tangent above the concave
        log sum_{j != i} chord_j(x_j), and m_i >= Q_i(x), its own tangent below (convex), so
        x_i - P_i <= x_i - m_i <= x_i - Q_i; sigmoid is increasing, so its lower line over
        the range of x_i - P_i on the box (and upper line over that of x_i - Q_i; the
        sigmoid kernel's lines, sound in exact arithmetic over the float32 interval rounded
        outward) composed with the plane bounds softmax_i. The composition's products are
        rounded: u |k a| max |x| moved into the intercept."""
        from shardbound.runtime.ops.smooth import Sigmoid

        n = self.n
        eye = torch.eye(n, dtype=torch.bool)
        lj, uj, xj = (t.unsqueeze(-2).expand(*t.shape[:-1], n, n) for t in (l, u, x0))
        c = uj.masked_fill(eye, -math.inf).amax(-1, keepdim=True)        # max_{j != i} u_j
        el_lo, el_hi = _exp_lo(down(lj - c)), _exp_hi(up(lj - c))
        w_lo, w_hi = down(uj - lj).clamp(min=0), up(uj - lj)
        one = torch.ones_like(lj)
        phi_lo = torch.where(w_lo > 0, down(_lib_lo(torch.expm1(w_lo)) / torch.where(
            w_lo > 0, w_lo, one)), one)
        phi_hi = torch.where(w_hi > 0, up(_lib_hi(torch.expm1(w_hi)) / torch.where(
            w_hi > 0, w_hi, one)), one)
        s_lo = down(el_lo * phi_lo).masked_fill(eye, 0.0)
        s_hi = up(el_hi * phi_hi).masked_fill(eye, 0.0)
        d_lo, d_hi = down(xj - lj).clamp(min=0), up(xj - lj)
        D_lo = _sum_lo(down(el_lo + down(s_lo * d_lo)).masked_fill(eye, 0.0)).unsqueeze(-1)
        D_hi = _sum_hi(up(el_hi + up(s_hi * d_hi)).masked_fill(eye, 0.0)).unsqueeze(-1)
        cs = c.squeeze(-1)
        P_lo = down(cs + _lib_lo(torch.log(D_lo.squeeze(-1))))              # log D at x0
        P_hi = up(cs + _lib_hi(torch.log(D_hi.squeeze(-1))))
        aP, cP = _tangent(P_lo, P_hi, down(s_lo / D_hi), up(s_hi / D_lo), x0, r, below=False)
        xo = xj.masked_fill(eye, -math.inf)
        m_lo, m_hi = lse_lo(xo), lse_hi(xo)                                 # m_i(x0)
        q_lo = _exp_lo(down(xo - m_hi.unsqueeze(-1))).masked_fill(eye, 0.0)
        q_hi = _exp_hi(up(xo - m_lo.unsqueeze(-1))).masked_fill(eye, 0.0)
        aQ, cQ = _tangent(m_lo, m_hi, q_lo, q_hi, x0, r, below=True)
        unit = eye.to(DT)
        sig = Sigmoid("sigma", ["t"], [tuple(l.shape[1:])])
        M = torch.maximum(l.abs(), u.abs()).unsqueeze(-2)
        out = []
        for a, cc, lower in ((unit - aP, -cP, True), (unit - aQ, -cQ, False)):
            # a's diagonal is 1 - 0 (a tangent's midpoint of [0, 0]): exact; range on the box
            xa = x0.unsqueeze(-2)
            mid, e = (a * xa).sum(-1) + cc, (a.abs() * xa.abs()).sum(-1) + cc.abs()
            spread = up((a.abs() * r.unsqueeze(-2)).sum(-1) * (1.0 + gamma(n + 1)))
            allow = up(gamma(n + 2) * e + n * TINY)
            t_lo, t_hi = to_float32_outward(down(mid - allow - spread), up(mid + allow + spread))
            ok = torch.isfinite(t_lo) & torch.isfinite(t_hi)
            with torch.no_grad():
                ln = sig.relax(torch.where(ok, t_lo, 0.0), torch.where(ok, t_hi, 0.0))
            k, b = ((ln.lower_slope, ln.lower_icpt) if lower
                    else (ln.upper_slope, ln.upper_icpt))
            k, b = k.to(DT), b.to(DT)
            ak = k.unsqueeze(-1) * a
            move = up(up((ak.abs() * M).sum(-1) * (1.0 + gamma(n + 1))) * (1.01 * U64))
            if lower:
                ck = down(down(down(k * cc) + b) - move)
            else:
                ck = up(up(up(k * cc) + b) + move)
            bad = ~ok
            out.append((ak, torch.where(bad, torch.full_like(ck, math.nan), ck)))
        return out

    def _planes(self, l, u, x0, r):
        """The lower plane of every output (softmax: a tangent of e^{h_i}; log_softmax: of
        h_i) and, for log_softmax, the upper plane (the tangent of x_i - LSE(x)), each as
        (slopes (..., n, n), intercepts (..., n)); non-finite where an enclosure overflowed."""
        n = self.n
        eye = torch.eye(n, dtype=DT)
        c = u.amax(-1, keepdim=True)                       # the shift: D_c = D e^{-c}
        el_lo, el_hi = _exp_lo(down(l - c)), _exp_hi(up(l - c))
        w_lo, w_hi = down(u - l).clamp(min=0), up(u - l)
        one = torch.ones_like(l)
        phi_lo = torch.where(w_lo > 0, down(_lib_lo(torch.expm1(w_lo)) / torch.where(
            w_lo > 0, w_lo, one)), one)                    # expm1(w) / w, increasing
        phi_hi = torch.where(w_hi > 0, up(_lib_hi(torch.expm1(w_hi)) / torch.where(
            w_hi > 0, w_hi, one)), one)
        s_lo, s_hi = down(el_lo * phi_lo), up(el_hi * phi_hi)       # the chords' slopes
        d_lo, d_hi = down(x0 - l).clamp(min=0), up(x0 - l)
        D_lo = _sum_lo(down(el_lo + down(s_lo * d_lo))).unsqueeze(-1)
        D_hi = _sum_hi(up(el_hi + up(s_hi * d_hi))).unsqueeze(-1)
        h_lo = down(down(x0 - c) - _lib_hi(torch.log(D_hi)))      # h_i(x0)
        h_hi = up(up(x0 - c) - _lib_lo(torch.log(D_lo)))
        q_lo, q_hi = down(s_lo / D_hi), up(s_hi / D_lo)            # grad of log D_c
        g_lo = down(eye - q_hi.unsqueeze(-2))                      # grad h_i, [i, k]
        g_hi = up(eye - q_lo.unsqueeze(-2))
        if self.log:
            lower = _tangent(h_lo, h_hi, g_lo, g_hi, x0, r, below=True)
            p_lo, p_hi = softmax_ibp(x0, x0, log=False)            # softmax(x0)
            f_lo = down(x0 - lse_hi(x0).unsqueeze(-1))
            f_hi = up(x0 - lse_lo(x0).unsqueeze(-1))
            upper = _tangent(f_lo, f_hi, down(eye - p_hi.unsqueeze(-2)),
                             up(eye - p_lo.unsqueeze(-2)), x0, r, below=False)
            return lower, upper
        v_lo, v_hi = _exp_lo(h_lo), _exp_hi(h_hi)                  # e^{h_i(x0)}
        G_lo, G_hi = _mul(v_lo.unsqueeze(-1), v_hi.unsqueeze(-1), g_lo, g_hi)
        return _tangent(v_lo, v_hi, G_lo, G_hi, x0, r, below=True), None

    def _one_minus_others(self, aL, cL, l, u):
        """softmax_i = 1 - sum_{j != i} softmax_j <= 1 - sum_{j != i} (lower line of j): the
        slopes as summed in float64, their distance from the exact sums (gamma_{n+1} of the
        column's absolute sum) times max |x| added to the intercept."""
        n = self.n
        off = ~torch.eye(n, dtype=torch.bool)
        aU = -(aL.sum(-2, keepdim=True) - aL)
        err = up(aL.abs().sum(-2) * (1.0 + gamma(n + 1)) * gamma(n + 2))         # (..., n)
        m = torch.maximum(l.abs(), u.abs())
        slack = up((err * m).sum(-1, keepdim=True) * (1.0 + gamma(n + 1)))
        others = cL.unsqueeze(-2).masked_fill(~off, 0.0)            # [i, j] = cL_j, j != i
        s = down(others.sum(-1) - up(others.abs().sum(-1) * gamma(n + 1)))
        return aU, up(up(1.0 - s) + slack)

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        lo, hi = in_bounds[0]
        aL, cL, aU, cU = self.lines(lo, hi)
        pos = L.clamp(min=0)
        neg = L - pos
        R = math.prod(self.shape[:-1])
        n = self.n
        both = torch.cat([pos, neg], -1).reshape(B, S, R, 2 * n)
        slopes = torch.cat([aL, aU], -2).reshape(B, 1, R, 2 * n, n)      # [(i | n + i), k]
        A_in = torch.einsum("bsrj,brjk->bsrk", both, slopes[:, 0]).reshape(B, S, *self.shape)
        wm = up((slopes.abs() @ mags[0].reshape(B, 1, R, n, 1)).squeeze(-1)
                * (1.0 + gamma(n + 1)))                                    # (B, 1, R, 2n)
        charge = up(absdot_upper(both.reshape(B, S, -1), wm.reshape(B, 1, -1))
                    * gamma(2 * n + 1))
        icpt = torch.cat([cL, cU], -1).reshape(B, 1, R * 2 * n)
        bias = masked_dot_lower(both.reshape(B, S, -1), icpt, B, S)
        return [(A_in, charge)], bias
