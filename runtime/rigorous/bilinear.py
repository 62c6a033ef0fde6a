"""Rigorous step of the bilinear family: `product` (x * y elementwise, both computed).

McCormick's planes at the box's corners hold in exact arithmetic for the float64 bounds
themselves: x y - (yc x + xc y - xc yc) = (x - xc)(y - yc), >= 0 at (xl, yl) (a lower plane)
and <= 0 at (xl, yu) (an upper plane) over the box. A positive coefficient takes the lower
plane, a negative one the upper plane (the engine's default shares, alpha = 1; the engine's
optimised shares are not replayed here: any plane is sound, so the certificate is only less
tight where alpha moved them). The coefficients L yc (of x) and L xl (of y) are one rounded
product each (charged u |L_in| . max |input|); the constant -L xl yc is a dot product whose
corner products are rounded in the direction that lowers it. An infinite corner has no plane:
a row with a nonzero coefficient there gets -inf. IBP: the four corner products, each rounded
outward (0 times an infinite bound is 0: the values are finite). float32 mode: one rounding
of the float32 product, u32 |x y| (and an underflow allowance).

`matmul_xy` (Z = X @ Y per group, both computed: attention's Q K^T, softmax(.) V) is the same
relaxation per term x_mk y_kn: the coefficients are contractions A_pos yl^T + A_neg yu^T (of X,
over N: one matrix product of 2N terms) and xl^T A (of Y, over M), charged gamma_n of their
absolute products times max |input| (as a layer's); the constant needs xl yl and xl yu (over K)
enclosed: the computed product -+ gamma_K |xl| |yc|. IBP sums each term's smallest / largest
corner product over K with the gamma allowance.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.bilinear import MatmulXY, Product
from shardbound.runtime.rigorous.core import (DT, TINY, U32, Step, absdot_upper, dot_lower, down,
                                              gamma, nan_vacuous, product_charge, rigorous_step,
                                              up)


def _times(a, b, rnd):
    p = rnd(a * b)
    return torch.where((a == 0) | (b == 0), torch.zeros_like(p), p)


@rigorous_step(Product)
class ProductStep(Step):
    def forward(self, xs):
        return xs[0] * xs[1]

    def ibp(self, bounds, float32):
        (xl, xu), (yl, yu) = bounds
        lo = torch.stack([_times(a, b, down) for a in (xl, xu) for b in (yl, yu)]).amin(0)
        hi = torch.stack([_times(a, b, up) for a in (xl, xu) for b in (yl, yu)]).amax(0)
        if float32:
            d = self.f32_delta(None, (lo, hi))
            lo, hi = down(lo - d), up(hi + d)
        return nan_vacuous(lo, hi)

    def f32_delta(self, mags, out):
        lo, hi = out
        return up(torch.maximum(lo.abs(), hi.abs()) * (1.01 * U32) + 2.0 ** -149)

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        (xl, _), (yl, yu) = in_bounds
        bad = ~(torch.isfinite(xl) & torch.isfinite(yl) & torch.isfinite(yu))
        zero = torch.zeros((), dtype=DT)
        xl, yl, yu = (torch.where(bad, zero, v).unsqueeze(1) for v in (xl, yl, yu))
        pos = L.clamp(min=0)
        neg = L - pos
        L_x = pos * yl + neg * yu                   # one of the two products is 0
        L_y = L * xl
        # -L xl yc, rounded so the sum lowers: L >= 0 needs -(xl yl) from below
        v = torch.where(L >= 0, -up(xl * yl), -down(xl * yu))
        bias = dot_lower(L.reshape(B, S, -1), v.reshape(B, S, -1))
        if bool(bad.any()):
            hit = ((L != 0) & bad.unsqueeze(1)).reshape(B, S, -1).any(-1)
            bias = torch.where(hit, torch.full_like(bias, -math.inf), bias)
        return [(L_x, product_charge(L_x, mags[0])), (L_y, product_charge(L_y, mags[1]))], bias


@rigorous_step(MatmulXY)
class MatmulXYStep(Step):
    """Shapes per box: X (G, M, K), Y (G, K, N), Z (G, M, N)."""

    def forward(self, xs):
        return xs[0] @ xs[1]

    def _sum_k(self, terms, rnd):
        """terms (B, G, M, K, N) summed over K, rounded outward by the gamma allowance."""
        K = terms.shape[-2]
        s, e = terms.sum(-2), terms.abs().sum(-2)
        slack = up(gamma(K + 1) * e + K * TINY)
        return down(s - slack) if rnd is down else up(s + slack)

    def ibp(self, bounds, float32):
        (xl, xu), (yl, yu) = bounds
        xs, ys = (xl.unsqueeze(-1), xu.unsqueeze(-1)), (yl.unsqueeze(-3), yu.unsqueeze(-3))
        lo = torch.stack([_times(a, b, down) for a in xs for b in ys]).amin(0)
        hi = torch.stack([_times(a, b, up) for a in xs for b in ys]).amax(0)
        lo, hi = self._sum_k(lo, down), self._sum_k(hi, up)
        if float32:
            mags = [torch.maximum(a.abs(), b.abs()) for a, b in bounds]
            d = self.f32_delta(mags, (lo, hi))
            lo, hi = down(lo - d), up(hi + d)
        return nan_vacuous(lo, hi)

    def f32_delta(self, mags, out):
        K = self.in_shapes[0][-1]
        s = up((mags[0] @ mags[1]) * (1.0 + gamma(K + 1)))
        return up(s * gamma(K, U32) + K * 2.0 ** -149)

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        (xl, _), (yl, yu) = in_bounds
        bad_x = ~torch.isfinite(xl)
        bad_y = ~(torch.isfinite(yl) & torch.isfinite(yu))
        zero = torch.zeros((), dtype=DT)
        xl = torch.where(bad_x, zero, xl)
        yl, yu = torch.where(bad_y, zero, yl), torch.where(bad_y, zero, yu)
        K, N, M = xl.shape[-1], yl.shape[-1], xl.shape[-2]
        pos = L.clamp(min=0)
        neg = L - pos
        x1, y1 = xl.unsqueeze(1), (yl.unsqueeze(1), yu.unsqueeze(1))
        # of X: [A_pos | A_neg] @ [yl^T ; yu^T], one contraction of 2N terms
        L_x = torch.cat([pos, neg], -1) @ torch.cat([y1[0], y1[1]], -1).transpose(-1, -2)
        mx = mags[0]                                         # (B, 1, G, M, K)
        wl = up((mx @ yl.abs().unsqueeze(1)) * (1.0 + gamma(K + 1)))   # (B, 1, G, M, N)
        wu = up((mx @ yu.abs().unsqueeze(1)) * (1.0 + gamma(K + 1)))
        cx = up(up(absdot_upper(pos.reshape(B, S, -1), wl.reshape(B, 1, -1))
                   + absdot_upper(neg.reshape(B, S, -1), wu.reshape(B, 1, -1)))
                * gamma(2 * N + 1))
        # of Y: xl^T @ A, a contraction over M
        L_y = x1.transpose(-1, -2) @ L
        wy = up((xl.abs().unsqueeze(1) @ mags[1]) * (1.0 + gamma(K + 1)))  # (B, 1, G, M, N)
        cy = up(absdot_upper(L.reshape(B, S, -1), wy.reshape(B, 1, -1)) * gamma(M + 1))
        # the constant -sum A_mn (xl yc)_mn, the corner products enclosed over K
        g = gamma(K + 1)
        P, EP = xl @ yl, xl.abs() @ yl.abs()
        Q, EQ = xl @ yu, xl.abs() @ yu.abs()
        v_pos = -up(P + up(g * EP + K * TINY))
        v_neg = -down(Q - up(g * EQ + K * TINY))
        v = torch.where(L >= 0, v_pos.unsqueeze(1), v_neg.unsqueeze(1))
        bias = dot_lower(L.reshape(B, S, -1), v.reshape(B, S, -1))
        if bool(bad_x.any() or bad_y.any()):
            touched = bad_x.any(-1, keepdim=True) | bad_y.any(-2, keepdim=True)   # (B, G, M, N)
            hit = ((L != 0) & touched.unsqueeze(1)).reshape(B, S, -1).any(-1)
            bias = torch.where(hit, torch.full_like(bias, -math.inf), bias)
        return [(L_x, cx), (L_y, cy)], bias
