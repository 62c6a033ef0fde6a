"""The activation family: piecewise-linear activations, bounded through the relaxation
interface (runtime/ops/relaxation.py). Lowered in compiler/lowering/activation.py."""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.base import register_op
from shardbound.runtime.ops.relaxation import ElementwiseRelaxation, Lines


def _unstable(lo, hi):
    return (lo < 0) & (hi > 0)


@register_op
class Relu(ElementwiseRelaxation):
    """CROWN relaxation: upper line through (l, 0) and (u, u); lower slope 1 where u > -l,
    else 0 (exact on stable neurons); alpha-CROWN optimises the lower slope in [0, 1]. Branch
    and bound splits unstable neurons at 0."""

    kind = "relu"
    tp_roles = ("elementwise",)
    has_alpha = True
    splittable = True

    @classmethod
    def summation_note(cls, facts, sums):
        return f"bias A.intercept over {sums(math.prod(facts.shape))}"

    def forward(self, x):
        return torch.clamp(x, min=0)

    def ibp(self, b):
        return torch.clamp(b[0], min=0), torch.clamp(b[1], min=0)

    def relax(self, lo, hi, alpha=None):
        active = lo >= 0
        unstable = _unstable(lo, hi)
        denom = torch.where(unstable, hi - lo, torch.ones_like(hi))
        up_slope = torch.where(unstable, hi / denom, active.to(hi.dtype))
        up_icpt = torch.where(unstable, -lo * hi / denom, torch.zeros_like(hi))
        low_slope = torch.where(unstable, (hi > -lo).to(hi.dtype), active.to(hi.dtype))
        if alpha is not None:           # any slope in [0, 1] is sound
            low_slope = torch.where(unstable, alpha.clamp(0, 1), low_slope)
        return Lines(low_slope, None, up_slope, up_icpt)

    def inexact(self, lo, hi):
        return _unstable(lo, hi)

    def alpha_init(self, in_bounds):
        lo, hi = in_bounds[0]
        return (hi > -lo).to(lo.dtype)

    def branch_slack(self, lo, hi):
        unstable = _unstable(lo, hi)
        denom = torch.where(unstable, hi - lo, torch.ones_like(hi))
        return torch.where(unstable, -lo * hi / denom, torch.zeros_like(hi))
