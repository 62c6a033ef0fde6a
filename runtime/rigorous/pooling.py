"""Rigorous step of the pooling family: `maxpool2d` (average pooling is a depthwise conv2d,
runtime/rigorous/conv.py).

The kernel's window relaxation (runtime/ops/pooling.py `window_lines`) decides, from the
float64 bounds, which windows are exact (y = x_j), which input carries the lower line (y >=
x_j, one-hot, no intercept: exact) and the upper chord's input j and float64 slope s; the
chord's intercept is recomputed here so that s x + t >= max(x_j, m) holds at both ends of
[l_j, u_j] in exact arithmetic (hence on all of it: max(x_j, m) is convex), each product
rounded down and each difference rounded up. alpha (the lower line's window weights) is not
used: the one-hot lower line is sound for any bounds. Exact in float32 (a max)."""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.pooling import MaxPool2d, window_lines
from shardbound.runtime.rigorous.core import (Step, absdot_upper, dot_lower, down, gamma,
                                              rigorous_step, up)
from shardbound.runtime.rigorous.relaxation import cached


@rigorous_step(MaxPool2d)
class MaxPoolStep(Step):
    def load(self, op):
        self.map = op._map()
        self.valid = self.map.sourced.reshape(self.map.out_shape)

    def forward(self, xs):
        return self.op.forward(xs[0])

    def row_elements(self):
        return super().row_elements() + math.prod(self.shape) * self.map.out_shape[-1]

    def ibp(self, bounds, float32):
        lo, hi = bounds[0]
        return self.op.forward(lo), self.op.forward(hi)

    def _lines(self, lo, hi):
        """(lower one-hot (B, C, L, K), upper slopes (B, C, L, K), upper intercept (B, C, L))."""
        return cached(self, lo, hi, lambda: self._compute_lines(lo, hi))

    def _compute_lines(self, lo, hi):
        slo, shi = self.op._slots(lo), self.op._slots(hi)
        w = window_lines(slo, shi, self.valid)
        neg = torch.tensor(-math.inf, dtype=lo.dtype)
        wlo, whi = torch.where(self.valid, slo, neg), torch.where(self.valid, shi, neg)
        j = w.up_slope.ne(0).to(torch.int64).argmax(dim=-1, keepdim=True)
        u_j = torch.gather(whi, -1, j).squeeze(-1)
        l_j = torch.gather(wlo, -1, j).squeeze(-1)
        others = torch.where(torch.arange(wlo.shape[-1]) == j, neg, whi).amax(dim=-1)
        m = torch.maximum(others, l_j)
        s = w.up_slope.sum(dim=-1)                     # one nonzero slot: exact
        t = torch.maximum(up(m - down(s * l_j)), up(u_j - down(s * u_j)))
        t = torch.nan_to_num(t, nan=math.inf)
        t = torch.where(w.exact, torch.zeros_like(t), t)
        return w.low_slope, w.up_slope, t

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        lo, hi = in_bounds[0]
        low, ups, t = self._lines(lo, hi)
        C, n = self.shape[0], self.shape[1] * self.shape[2]
        flat = L.reshape(B, S, C, n)
        pos = flat.clamp(min=0)
        neg = flat - pos
        slots = pos.unsqueeze(-1) * low.unsqueeze(1) + neg.unsqueeze(-1) * ups.unsqueeze(1)
        K = slots.shape[-1]
        A_in = self.map.scatter_add(slots.reshape(B, S, C, n * K))
        summed = self.map.scatter_add(slots.abs().reshape(B, S, C, n * K))
        m = mags[0]
        charge = up(absdot_upper(summed.reshape(B, S, -1), m.reshape(m.shape[0], 1, -1))
                    * gamma(self.map.depth + 1))
        tv = t.reshape(t.shape[0], 1, -1)
        nv = neg.reshape(B, S, -1)
        tv = torch.where(nv == 0, torch.zeros_like(nv), tv.expand_as(nv))
        bias = dot_lower(nv, tv)
        return [(A_in.reshape(B, S, *self.in_shapes[0]), charge)], bias
