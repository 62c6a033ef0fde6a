"""Portable block products of the ``blocked`` order (any BLAS, any device): exact per block.

Used where ``blocked_gemm`` cannot pin its bits (no MKL entry points, or a non-CPU
device).  Each operand row is rounded, per 256-block, to a 22-bit grid anchored at the
block's largest exponent (``|q| <= 2**22``); 256 such products sum below ``2**52``, so
*every* summation order inside a float64 GEMM yields the same exact value, which is
rounded once to float32.  A block partial is therefore a pure function of the data,
on any BLAS or device; the fixed tree (``blocktree``) does the rest.  Why not the
default: float64 GEMMs cost ~2x float32 here, and the conversions more (the whole
``blocked`` order measured 2-6x of ``fast`` with this kernel).
Accuracy: each operand element moves by at most ``2**-22`` times its (row, block) max,
so per block ``|err| <= 2**-22 (max|x_b| sum|w_b| + max|w_b| sum|x_b|)``, then one
float32 rounding per block and the tree.
"""
from __future__ import annotations

import torch

from .blocktree import BLOCK, _eval, _num_blocks
from .ozaki import _exp, _pow2

_BLOCK_BITS = (53 - 8) // 2   # 22: 256 * (2**22)**2 = 2**52 -> exact block GEMM


def _truncate_blocks(t2: torch.Tensor, name: str) -> torch.Tensor:
    """(R, K) float32 -> (R, nb, BLOCK) float64 on a 22-bit grid per (row, block).

    Rounds each value to the nearest multiple of ``2**(e-22)`` where
    ``|row block| < 2**e`` (ties to even) with Rump's extraction ``(v + c) - c``,
    ``c = 1.5 * 2**(e - 22 + 52)``, whose float64 ulp is the grid: rounding happens
    in the add, the subtraction is exact.  Zero padding contributes exact zeros.
    """
    R, K = t2.shape
    nb = _num_blocks(K)
    out = torch.zeros((R, nb * BLOCK), dtype=torch.float64, device=t2.device)
    out[:, :K] = t2
    out = out.view(R, nb, BLOCK)
    amax = torch.maximum(out.amax(-1), out.amin(-1).neg_()) if K else out.sum(-1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{name} contains inf or nan; the 'blocked' order requires finite inputs")
    c = _pow2(_exp(amax) + (52 - _BLOCK_BITS)).mul_(1.5).unsqueeze(-1)   # ulp(c) = grid
    return out.add_(c).sub_(c)


def tree_product(x2: torch.Tensor, w_t: torch.Tensor, N: int) -> torch.Tensor:
    """(M, N) float32: fixed pair tree over the exact, once-rounded block products."""
    xb, wb = _truncate_blocks(x2, "x"), _truncate_blocks(w_t[:N], "w_t")

    def leaf(lo, hi):
        return torch.mm(xb[:, lo], wb[:, lo].T).float() if hi - lo == 1 else None

    return _eval(0, _num_blocks(x2.shape[1]), leaf)
