"""Rigorous steps of the linear family: `linear` (Gemm / MatMul), y = x W^T + b."""

from __future__ import annotations

from shardbound.runtime.ops.linear import Linear
from shardbound.runtime.rigorous.core import WeightedStep, rigorous_step


@rigorous_step(Linear)
class LinearStep(WeightedStep):
    def matmul(self, x, w):
        return x @ w.T

    def adjoint(self, L, w):
        return L @ w

    def bias_full(self):
        return self.b

    def fan_in(self):
        return self.w.shape[1]

    def fan_out(self):
        return self.w.shape[0]
