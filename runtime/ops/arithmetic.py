"""The arithmetic family: `affine` (x * scale + shift with constants broadcast to the sample
shape) and `add` (a weighted sum of computed tensors of one shape). Lowered from Add, Sub,
Mul, Div, Neg and BatchNormalization (compiler/lowering/arithmetic.py)."""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.base import Op, register_op


@register_op
class Affine(Op):
    """y = x * scale + shift, elementwise with constants broadcast to the sample shape (folded
    BatchNorm, input normalisation, Mul/Div/Sub/Neg by constants, average-pool divisors)."""

    kind = "affine"
    param_roles = ("scale", "shift")
    pointwise_affine = True
    tp_roles = ("elementwise",)

    @classmethod
    def summation_note(cls, facts, sums):
        if "shift" not in facts.has_params:
            return None
        return f"bias A.shift over {sums(math.prod(facts.shape))}"

    def forward(self, x):
        s, t = self.param("scale"), self.param("shift")
        y = x * s if s is not None else x
        return y + t if t is not None else y

    def ibp(self, b):
        lo, hi = b
        s = self.param("scale")
        if s is not None:
            a, c = lo * s, hi * s
            lo, hi = torch.minimum(a, c), torch.maximum(a, c)
        t = self.param("shift")
        if t is not None:
            lo, hi = lo + t, hi + t
        return lo, hi

    def backward_linear(self, A):
        B, S = self._rows(A)
        s, t = self.param("scale"), self.param("shift")
        A_in = A * s if s is not None else A
        bias = None
        if t is not None:
            full = t.expand(self.shape).reshape(-1)
            bias = self._dot(A.reshape(B, S, full.numel()), full)
        return [A_in], bias


@register_op
class Add(Op):
    """y = sum_i coeffs[i] * x_i over computed tensors of one shape (residual Add, Sub)."""

    kind = "add"
    accepts_patches = True          # scales its rows: patches stay patches

    def setup(self, coeffs=(1.0, 1.0)):
        self.coeffs = tuple(float(c) for c in coeffs)
        if len(self.coeffs) != len(self.inputs):
            raise TypeError("add needs one coefficient per input")

    def forward(self, *xs):
        y = None
        for c, x in zip(self.coeffs, xs):
            term = x if c == 1.0 else x * c
            y = term if y is None else y + term
        return y

    def ibp(self, *bounds):
        lo = hi = None
        for c, (l, u) in zip(self.coeffs, bounds):
            tl, tu = (l * c, u * c) if c >= 0 else (u * c, l * c)
            lo = tl if lo is None else lo + tl
            hi = tu if hi is None else hi + tu
        return lo, hi

    def backward_linear(self, A):
        return [A if c == 1.0 else A * c for c in self.coeffs], None
