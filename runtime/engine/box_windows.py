"""`blocked` box terms of rows in patches form from their windows, in the dense rows' bits.

The box terms of a row a over the input, a.center and |a|.radius, are `blocked` dots over
the whole node (C*H*W), which the rows in patches form used to make as dense rows first
(zeros, the windows written in, a crop copy, |rows|, then one product with 8 vector rows
padded): 17% of the bench ResNet's `blocked` CROWN, for windows that cover a third of the
input. The block GEMMs are FMA chains (`numerics/support_dot.py`: a chain model probed per
machine) and a zero term leaves a chain as it is, so each chain equals the chain over the
row's entries in its k range that are not zero -- those inside the row's window. When a
chain is whole grid rows of one channel (its length a multiple of W, a plane a multiple of
it), the window's entries in a chain are `r` grid rows of `pw` entries in k order, so a
row laid out as (C, H, pw) -- its window's columns over every grid row, zeros off its
window's rows -- is every chain's entries in order, each chain `r * pw` long. The vector
entries they meet are the center's (radius') at those columns, the same for every row whose
window starts at the same column: rows go by that column, one batched chain GEMM per group
and side (`support_dot.chain_sums`, the blocks' chains added and the pair tree as the dense
product does). Entries of a window outside the grid (a conv step leaves them, `dirty`)
meet vector zeros, so finite rows are needed (checked) and they change nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardbound.runtime.numerics import support_dot
from shardbound.runtime.numerics.blocktree import BLOCK


def window_box_terms(A, lower, upper):
    """(A.center, |A|.radius), each (1, S), of rows in patches form `A` (one box) in the
    bits of the `blocked` dots over their dense rows; None where this does not apply (the
    caller takes the dense rows): no pinned chain model, chains that are not whole grid
    rows of one channel, chains longer than one FMA chain, rows that are not finite."""
    if not support_dot.works(A.device):
        return None
    B, S, C, ph, pw = A.values.shape
    H, W = A.node_shape[1:]
    K = C * H * W
    chain = BLOCK // support_dot.per_block()        # entries of a full block's chain
    if B != 1 or lower.shape[0] != 1 or K % BLOCK or chain % W or (H * W) % chain \
            or not support_dot.supported(K) or A.values.dtype != torch.float32:
        return None
    r = chain // W                                  # grid rows per chain
    Kp = r * pw
    if Kp > support_dot.ONE_CHAIN_MAX or S == 0 or \
            not math.isfinite(float(A.values.sum())):   # inf * 0 is nan densely
        return None
    L = C * H // r
    oy, ox = A.origin[:, 0], A.origin[:, 1]
    top, bottom = max(0, -int(oy.min())), max(0, int(oy.max()) + ph - H)
    left, right = max(0, -int(ox.min())), max(0, int(ox.max()) + pw - W)
    center = F.pad(((upper + lower) / 2).reshape(C, H, W), (left, right))
    radius = F.pad(((upper - lower) / 2).reshape(C, H, W), (left, right))
    # rows by window column (stable), each group laid out on its own (a cache-sized
    # buffer): (m, C, H, pw), each row's window columns over the grid rows (zeros off its
    # window's rows), then by chain (L, m, Kp)
    order = torch.argsort(ox, stable=True)
    x0s, counts = torch.unique_consecutive(ox[order], return_counts=True)
    if S < support_dot.MIN_COLS * len(x0s):    # groups padded to the pinned shape: dense
        return None
    values = A.values[0]
    terms = values.new_empty((2, S))
    a = 0
    for x0, m in zip(x0s.tolist(), counts.tolist()):
        rows = order[a:a + m]
        grid = values.new_zeros((m, C, top + H + bottom, pw))
        grid.unfold(2, ph, 1)[torch.arange(m), :, oy[rows] + top] = \
            values.index_select(0, rows).transpose(-1, -2)
        lay = grid[:, :, top:top + H].reshape(m, L, Kp).transpose(0, 1).contiguous()
        cols = slice(x0 + left, x0 + left + pw)
        for side, (vec_src, x) in enumerate(((center, lay), (radius, lay.abs()))):
            vec = values.new_zeros((L, support_dot.MIN_ROWS, Kp))
            vec[:, 0] = vec_src[:, :, cols].reshape(L, Kp)
            terms[side, a:a + m] = support_dot.chain_sums(
                lambda i, j, x=x: x[:, i:j].contiguous(), vec, m)
        a += m
    out = torch.empty_like(terms)
    out[:, order] = terms
    return out[0:1], out[1:2]
