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

`matmul_xy` (a matrix product of two computed tensors) has no rigorous step yet: refused.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.bilinear import Product
from shardbound.runtime.rigorous.core import (DT, U32, Step, dot_lower, down, nan_vacuous,
                                              product_charge, rigorous_step, up)


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
