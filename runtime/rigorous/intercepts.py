"""Rigorous step of the functions with computed intercepts (runtime/ops/intercepts.py: the
smooth, exponential, periodic and gated families: Sigmoid, Tanh, Erf, Softsign, Exp, Log,
Sin, Gelu, ...). Their lines and their IBP are already sound in real arithmetic for float32
bounds (float64 evaluation with an error margin, rounded outward); what is left is the
rounding of applying the lines (relaxation.py's `LinesStep`)."""

from __future__ import annotations

import torch

from shardbound.runtime.ops.intercepts import InterceptRelaxation
from shardbound.runtime.rigorous.core import DT, down, nan_vacuous, rigorous_step, to_float32_outward, up
from shardbound.runtime.rigorous.relaxation import LinesStep


@rigorous_step(InterceptRelaxation)
class InterceptStep(LinesStep):
    def forward(self, xs):
        return self.op.f64(xs[0].to(DT))

    def ibp(self, bounds, float32):
        lo, hi = bounds[0]
        l32, h32 = to_float32_outward(lo, hi)
        with torch.no_grad():
            low, high = self.op.ibp((l32, h32))
        low, high = low.to(DT), high.to(DT)
        if float32:
            d = self.f32_delta(None, (low, high))
            low, high = down(low - d), up(high + d)
        return nan_vacuous(low, high)
