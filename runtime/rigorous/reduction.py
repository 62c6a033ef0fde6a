"""Rigorous step of the reduction family: `reduce_sum` (ReduceSum, ReduceMean): a sum of
`count` terms (then one division for a mean); the backward step copies the coefficients onto
every summand (divided by count for a mean: one rounded quotient each, charged)."""

from __future__ import annotations

from shardbound.runtime.ops.reduction import ReduceSum
from shardbound.runtime.rigorous.core import LinearMapStep, product_charge, rigorous_step


@rigorous_step(ReduceSum)
class ReduceSumStep(LinearMapStep):
    def load(self, op):
        self.axes, self.mean, self.count = op.axes, op.mean, op.count

    def apply(self, xs, absolute=False):
        y = xs[0].sum(dim=tuple(a + 1 for a in self.axes), keepdim=True)
        return y / self.count if self.mean else y

    def terms(self):
        return self.count + 1

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        L_in = L.expand(B, S, *self.in_shapes[0])
        if not self.mean:
            return [(L_in.contiguous(), None)], None
        L_in = L_in / self.count
        return [(L_in, product_charge(L_in, mags[0]))], None
