"""The reduction family: `reduce_sum`, a sum (or mean) over some sample axes, keeping them as
axes of length 1 (ReduceSum, ReduceMean; compiler/lowering/reduction.py drops them with a
reshape where keepdims is 0).

A sum is a contraction: it goes through numerics/contract.py (`sum_last` over the reduced
elements, moved last), so it follows the program's summation order. IBP is exact (a sum of
lower bounds is the lower bound of the sum); the CROWN step copies A onto every summand (times
1/n for a mean): no contraction, no bias."""

from __future__ import annotations

import math

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops.base import Op, register_op


@register_op
class ReduceSum(Op):
    """y = sum (or mean, with `mean`) of x over `axes` (per-sample axes), keepdims. Acts on
    each channel alone unless it reduces axis 0, so a tp zone can hold a channel slice of it."""

    kind = "reduce_sum"
    tp_roles = ("elementwise",)

    def setup(self, axes=(), mean=False):
        self.axes = tuple(sorted(int(a) for a in axes))
        self.mean = bool(mean)

    @classmethod
    def tp_roles_of(cls, facts):
        if len(facts.in_shapes[0]) < 2 or 0 in facts.attrs.get("axes", ()):
            return ()
        return cls.tp_roles

    @classmethod
    def summation_note(cls, facts, sums):
        n = math.prod(facts.in_shapes[0][a] for a in facts.attrs.get("axes", ()))
        return f"fwd {'mean' if facts.attrs.get('mean') else 'sum'} over {sums(n)}"

    @property
    def count(self) -> int:
        return math.prod(self.in_shapes[0][a] for a in self.axes)

    def infer_shape(self):
        return tuple(1 if a in self.axes else d for a, d in enumerate(self.in_shapes[0]))

    def forward(self, x):
        shape = self.in_shapes[0]
        kept = [a for a in range(len(shape)) if a not in self.axes]
        B = x.shape[0]
        moved = x.permute(0, *(a + 1 for a in kept), *(a + 1 for a in self.axes))
        total = contract.sum_last(moved.reshape(B, *(shape[a] for a in kept), self.count),
                                  self.order)
        if self.mean:
            total = total / self.count
        return total.reshape(B, *self.shape)

    def ibp(self, b):
        return self.forward(b[0]), self.forward(b[1])

    def backward_linear(self, A):
        B, S = self._rows(A)
        A_in = A.expand(B, S, *self.in_shapes[0])
        if self.mean:
            A_in = A_in / self.count
        return [A_in.contiguous()], None
