"""One line per element: the alpha-CROWN step of a computed-intercept relaxation
(`InterceptRelaxation`, intercepts.py) that makes only the lines the rows use.

Why: on the lower-bound side a row's positive coefficient takes the lower line and a negative
one the upper line (relaxation.py), so of the two lines alpha-CROWN's `relax` makes per (row,
neuron) -- each a slope from alpha, an intercept computed for it, rounded outward -- one is
multiplied by zero. With alphas per row of every start node (full alpha-CROWN) those lines are
most of the step's work: bench/vs_autolirpa.py's sigmoid_mlp spent 56% of a bound in them (its
second start node's 512 rows x 256 neurons, two lines each, every iteration). Here the sign of
the incoming A chooses the line first, and only that slope and intercept are made: half the
per-element work, and the step is A * slope plus one bias dot instead of the split A+ / A-.

Soundness: each element's line is the one the two-line step would have used (the same alpha
entry, the same slope range, the same intercept formula for that side: the same bits for that
line), and a row's coefficient of 0 multiplies whichever line it gets. The step's products
differ in rounding only (A * w instead of A * w_neg + max(A, 0) * (w_pos - w_neg), one bias dot
instead of two), in every mode and order alike, so the bitwise promises across P, threads and
modes hold as before. The gradient reaches the chosen line's alpha only, as before (the other
one was multiplied by zero).
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.numerics.select import blend, mask_bits
from shardbound.runtime.ops.intercept_search import F64
from shardbound.runtime.ops.intercepts import (InterceptRelaxation, alpha_to_slopes_,
                                                slope_gradient)


class _AlphaSlope(torch.autograd.Function):
    """float32 slopes (B, S, *shape) of alpha (B, S, 2, *shape), entry 1 where `upper`, entry
    0 elsewhere: per entry `_AlphaSlopes`' arithmetic (`alpha_to_slopes_`), so each slope
    has the bits the two-line step gives its line; the gradient goes to the chosen entry
    (the other one's is 0)."""

    @staticmethod
    def forward(ctx, alpha, upper, smin, smax, sloped):
        d = smax - smin
        bits32 = mask_bits(upper, torch.float32)
        chosen = blend(upper, alpha[:, :, 1].detach(), alpha[:, :, 0].detach(), bits32)
        w32, flush = alpha_to_slopes_(chosen.to(F64), d, smin, sloped)
        ctx.save_for_backward(d, sloped, flush, bits32)
        return w32

    @staticmethod
    def backward(ctx, grad):
        d, sloped, flush, bits32 = ctx.saved_tensors
        gi = slope_gradient(grad, d, sloped, flush).view(torch.int32)
        # into entry 1 where upper, into entry 0 elsewhere (the other entry gets +0)
        out = torch.stack([torch.bitwise_and(gi, bits32.bitwise_not()),
                           torch.bitwise_and(gi, bits32)], dim=2)
        return out.view(torch.float32), None, None, None, None


def selects_lines(op, alpha, A) -> bool:
    """Whether `op`'s alpha step can make one line per element: a computed-intercept kernel
    with the shared slope map, dense alphas (B, S, 2, *shape) and dense rows of that shape."""
    return (isinstance(op, InterceptRelaxation) and type(alpha) is torch.Tensor
            and isinstance(A, torch.Tensor)
            and type(op).alpha_slopes64 is InterceptRelaxation.alpha_slopes64
            and alpha.dim() == A.dim() + 1 and alpha.shape[2] == 2
            and tuple(alpha[:, :, 0].shape) == tuple(A.shape))


def selected_lines(op: InterceptRelaxation, lo, hi, alpha, upper):
    """(slope, intercept), float32 (B, S, *shape): per element the lower line of alpha entry
    0 where `upper` is False, the upper line of entry 1 where it is True; lo, hi (B, 1,
    *shape). `InterceptRelaxation._relax` for one side per element (its steps, its tail
    `_lines_for_slopes`)."""
    l64 = lo.to(F64)
    u64 = torch.maximum(hi.to(F64), l64)
    sloped = op.sloped64(l64, u64)
    L, U = op._probe(sloped, l64, u64)
    span = op._cached("_slope_ranges", lo, hi, lambda: op.slope_range64(L, U))
    w32 = _AlphaSlope.apply(alpha, upper, span[0], span[1], sloped)
    side = mask_bits(upper, torch.int64).mul_(2).add_(1).to(F64)  # -1 where upper, else +1
    return op._lines_for_slopes(l64, u64, L, U, sloped, w32, side)


def crown_selected(op: InterceptRelaxation, lA, uA, bounds, alpha):
    """The CROWN step with alphas on the lower-bound side, one line per element of lA (the
    upper side keeps CROWN's lines, as `ElementwiseRelaxation.crown_backward` does)."""
    lo, hi = bounds[0].unsqueeze(1), bounds[1].unsqueeze(1)
    slope, icpt = selected_lines(op, lo, hi, alpha, lA.detach() < 0)
    B, S = op._rows(lA)
    lA_in = lA * slope
    bias = op._icpt_dot(lA.reshape(B, S, math.prod(lA.shape[2:])),
                        icpt.reshape(B, S, math.prod(icpt.shape[2:])))
    if uA is None:
        return [lA_in], [None], bias, None
    lines = op.relax(lo, hi, None)
    uA_in, u_bias = op._side(uA, lines.upper_slope, lines.upper_icpt,
                             lines.lower_slope, lines.lower_icpt)
    return [lA_in], [uA_in], bias, u_bias
