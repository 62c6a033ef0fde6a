"""Rigorous step of the normalization family: `normalize`, y = c / sqrt(v) with v = mean(c^2)
+ eps computed by the nodes before (runtime/ops/normalization.py: LayerNorm, RMS norm).

The kernel's IBP and lines rest on that identity (v's range over c's box; McCormick planes of
c r on [l, u] x [rl, ru]; r = v^-1/2 between its tangent and chord over [vl, vu]), and on
float64 evaluation widened by RANGE_EPS (2^-40 relative: far above the float64 rounding of
the formulas) and float32 coefficients whose rounding the lines' 2^-20 margin covers. Here
the identity is only assumed up to a relative `slack` of v: 2^-20 in real mode (the float32
constants of the compiled nodes, eps and older exports' 1/k scale, are rounded: a few float32
ulps), plus gamma32_{D+4} in float32 mode (squares, the D-term mean and + eps of positive
terms in float32: v32 is within that of mean(c32^2) + eps). y's box extremes move by at most
slack |y| for such a v, and v's range is widened by slack before the lines are made. The
float32 quotient itself (sqrt and one division) is allowed 4 float32 ulps of |y|.

Applying the lines: y >= d c + k r + e on the lower side (the upper plane where L < 0), so a
row's r-coefficient per group is kappa = sum_i L_i k_i (computed; its gamma_{D+1} distance
from the exact sum, times max r <= 1.001 / sqrt(eps), is charged), and kappa r is bounded by
r's tangent (kappa >= 0) or chord (kappa < 0) in v. Each coefficient is one rounded product
(charged), the constants dot products rounded down.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.normalization import RANGE_EPS, Normalize
from shardbound.runtime.rigorous.core import (DT, TINY, U32, Step, absdot_upper, down, gamma,
                                              nan_vacuous, product_charge, rigorous_step, up)
from shardbound.runtime.rigorous.relaxation import masked_dot_lower

REAL_SLACK = 2.0 ** -20


@rigorous_step(Normalize)
class NormalizeStep(Step):
    def load(self, op):
        self.D = op.group_size
        self.r_max = 1.001 / math.sqrt(op.eps)

    def slack(self):
        s = REAL_SLACK
        return s + gamma(self.D + 4, U32) if self.float32 else s

    def forward(self, xs):
        return xs[0].to(DT) / torch.sqrt(xs[1].to(DT))

    def f32_delta(self, mags, out):
        lo, hi = out
        return up(torch.maximum(lo.abs(), hi.abs()) * (4 * U32) + 2.0 ** -149)

    def ibp(self, bounds, float32):
        with torch.no_grad():
            bottom, top = self.op._ibp64(*bounds, slack=self.slack())
        widen = up(2 * RANGE_EPS * (bottom.abs() + top.abs()) + TINY)
        lo = self.op._ungrouped(down(bottom - widen), 1)
        hi = self.op._ungrouped(up(top + widen), 1)
        if float32:
            d = self.f32_delta(None, (lo, hi))
            lo, hi = down(lo - d), up(hi + d)
        return nan_vacuous(lo, hi)

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        op = self.op
        with torch.no_grad():
            ln = {k: v.to(DT) for k, v in op._lines(*in_bounds, slack=self.slack()).items()}
        g = op._grouped(L, 2)                                   # (B, S, G, D)
        pos = g.clamp(min=0)
        neg = g - pos
        A_c = op._ungrouped(pos * ln["dL"] + neg * ln["dU"], 2)
        kterms = pos * ln["kL"] + neg * ln["kU"]
        kappa = kterms.sum(-1)                                  # (B, S, G)
        G = kappa.shape[-1]
        k_err = up(up(kterms.abs().sum(-1) * (1.0 + gamma(self.D + 1))) * gamma(self.D + 1))
        kpos = kappa.clamp(min=0)
        kneg = kappa - kpos
        A_v = (kpos * ln["sL"] + kneg * ln["sU"]).reshape(B, S, *self.in_shapes[1])
        charge = up(up(product_charge(A_c, mags[0]) + product_charge(A_v, mags[1]))
                    + absdot_upper(k_err, torch.full((G,), self.r_max, dtype=DT)))
        e = torch.where(g >= 0, ln["eL"], ln["eU"])
        a = torch.where(kappa >= 0, ln["aL"], ln["aU"])
        bias = down(masked_dot_lower(g, e, B, S) + masked_dot_lower(kappa, a, B, S))
        return [(A_c, charge), (A_v, None)], bias
