"""Branch-free elementwise selection: `torch.where` for data-dependent masks.

Why: torch's CPU `where` and `masked_fill` pick each element with a branch, so a mask that
follows the data (the sign of an A-matrix, which line of a relaxation a row uses, whether a
rounding went up) mispredicts about half the time: measured on this machine, 0.55-0.7 ms for
131,072 elements of a random mask against 0.1-0.16 ms for a mask that is all one value, and
0.05 ms for a multiplication. `blend` picks the bits through integer views instead
(b ^ ((a ^ b) & m), m all ones where the mask holds), which has no branch: 0.12 ms for the same
elements. The result is bitwise `torch.where(mask, a, b)`: every bit is taken from a or b.
Not differentiable (callers pass detached values or write their own gradient)."""

from __future__ import annotations

import torch

from shardbound.runtime.numerics.shapes import broadcast_shape

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16, torch.int64: torch.int64, torch.int32: torch.int32}


def mask_bits(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The integer mask `blend` takes for values of `dtype`: all ones where `mask` holds, 0
    elsewhere (make it once when several selections share a mask)."""
    return mask.to(_BITS[dtype]).neg_()


def blend(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
          bits: torch.Tensor | None = None) -> torch.Tensor:
    """torch.where(mask, a, b), bit for bit, without a branch per element; a and b of one
    dtype, broadcasting against each other and the mask. `bits`: `mask_bits(mask, dtype)`,
    when already made."""
    if a.dtype != b.dtype or a.dtype not in _BITS:
        return torch.where(mask, a, b)
    kind = _BITS[a.dtype]
    m = mask_bits(mask, a.dtype) if bits is None else bits
    ai = a.contiguous().view(kind)
    bi = b.contiguous().view(kind)
    d = torch.bitwise_xor(ai, bi)
    d = d.bitwise_and_(m) if tuple(d.shape) == tuple(broadcast_shape(d.shape, m.shape)) \
        else torch.bitwise_and(d, m)
    return d.bitwise_xor_(bi).view(a.dtype)
