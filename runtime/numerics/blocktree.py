"""The fixed adjacent-pair tree over 256-blocks, and its K-split across ranks.

Pure bookkeeping (no arithmetic of its own besides ``+``): which partials are added
to which, in which order.  ``summation.py`` supplies the per-block products.

The tree over ``nb = ceil(K/256)`` leaves is ``node(lo, hi) = node(lo, lo+h) +
node(lo+h, hi)`` with ``h`` = half if the size is a power of two, else the largest
power of two below it; evaluated depth-first it equals the level-by-level
adjacent-pair tree ``(p0+p1), (p2+p3), ...``.  Any contiguous block range is a
union of such nodes, so a rank that owns a block-aligned K range can reduce its
blocks into those node totals, and ``combine_subtotals`` finishes the very same
tree from every rank's totals: the bits equal the single-process result.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

BLOCK = 256


def _num_blocks(K: int) -> int:
    return -(-int(K) // BLOCK)


def _split(n: int) -> int:
    """Size of the left child of a tree node with n >= 2 leaves."""
    return n // 2 if n & (n - 1) == 0 else 1 << (n.bit_length() - 1)


def _eval(lo: int, hi: int, get: Callable[[int, int], torch.Tensor | None],
          release: Callable[[torch.Tensor], None] | None = None):
    """Value of tree node [lo, hi): ``get`` may supply it, else recurse to children.

    With ``release`` (only for private, freshly computed leaves) the sum goes
    into the left child's buffer and the right one is handed back for reuse;
    ``a.add_(b)`` has the same bits as ``a + b``.
    """
    v = get(lo, hi)
    if v is not None:
        return v
    if hi - lo == 1:
        raise ValueError(f"missing value for block {lo}")
    mid = lo + _split(hi - lo)
    left, right = _eval(lo, mid, get, release), _eval(mid, hi, get, release)
    if release is None:
        return left + right
    left.add_(right)
    release(right)
    return left


def tree_reduce(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """Fixed adjacent-pair tree, level by level: (p0+p1),(p2+p3),...; odd last passes up.

    This is the reference order; ``_eval`` computes the identical tree depth-first
    (needing only O(log nb) live partials).  Zero results are canonicalised to
    +0.0 (the sign of zero is the only thing the inputs' zero signs can change).
    """
    level = list(partials)
    if not level:
        raise ValueError("tree_reduce needs at least one partial")
    while len(level) > 1:
        nxt = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0] + 0.0


def tree_nodes(k_start: int, k_stop: int, K: int) -> list[tuple[int, int]]:
    """Maximal tree nodes (in K units, in order) that tile ``[k_start, k_stop)``."""
    nb = _num_blocks(K)
    b0, b1 = _block_range(k_start, k_stop, K)
    out: list[tuple[int, int]] = []

    def cover(lo, hi):
        if hi <= b0 or b1 <= lo:
            return
        if b0 <= lo and hi <= b1:
            out.append((lo, hi))
            return
        mid = lo + _split(hi - lo)
        cover(lo, mid)
        cover(mid, hi)

    if nb and b1 > b0:
        cover(0, nb)
    return [(lo * BLOCK, min(hi * BLOCK, K)) for lo, hi in out]


def _block_range(k_start: int, k_stop: int, K: int) -> tuple[int, int]:
    if k_start == k_stop == K:
        return _num_blocks(K), _num_blocks(K)
    if k_start % BLOCK or not (0 <= k_start <= k_stop <= K) or (k_stop % BLOCK and k_stop != K):
        raise ValueError(f"range [{k_start}, {k_stop}) is not aligned to BLOCK={BLOCK} within K={K}")
    return k_start // BLOCK, _num_blocks(k_stop)


def shard_k_ranges(K: int, P: int, balanced: bool = False) -> list[tuple[int, int]]:
    """Per-rank ``[start, stop)`` K ranges, block aligned, contiguous, in rank order.

    Default: every non-empty range is exactly one tree node (split the largest
    node, leftmost first), so each rank sends one subtotal.  ``balanced=True``:
    equal block counts; ranks then send ``len(tree_nodes(...))`` subtotals.
    Ranks beyond the number of blocks get empty ranges ``(K, K)``.
    """
    if P < 1:
        raise ValueError("P must be >= 1")
    nb = _num_blocks(K)
    if balanced:
        cuts = [nb * r // P for r in range(P + 1)]
        return [(min(cuts[r] * BLOCK, K), min(cuts[r + 1] * BLOCK, K)) for r in range(P)]
    nodes = [(0, nb)] if nb else []
    while len(nodes) < P:
        sizes = [hi - lo for lo, hi in nodes]
        if not sizes or max(sizes) < 2:
            break
        i = sizes.index(max(sizes))
        lo, hi = nodes[i]
        mid = lo + _split(hi - lo)
        nodes[i:i + 1] = [(lo, mid), (mid, hi)]
    out = [(lo * BLOCK, min(hi * BLOCK, K)) for lo, hi in nodes]
    return out + [(K, K)] * (P - len(out))


def subtree_totals(partials: Sequence[torch.Tensor], k_start: int, k_stop: int,
                   K: int) -> list[torch.Tensor]:
    """Reduce a rank's block partials (blocks of ``[k_start, k_stop)``) into the
    totals of ``tree_nodes(k_start, k_stop, K)`` -- exactly what the full tree
    computes for those nodes.  One tensor when the range is a single node."""
    b0, _ = _block_range(k_start, k_stop, K)
    res = []
    for lo, hi in tree_nodes(k_start, k_stop, K):
        n0, n1 = lo // BLOCK - b0, _num_blocks(hi) - b0
        res.append(tree_reduce(partials[n0:n1]))
    return res


def combine_subtotals(subtotals: Sequence[Sequence[torch.Tensor]],
                      ranges: Sequence[tuple[int, int]], K: int) -> torch.Tensor:
    """Finish the tree from every rank's subtotals (gathered in rank order).

    ``subtotals[r]`` must be ``shard_subtotals(..., *ranges[r], K)``; the ranges
    must tile ``[0, K)``.  Result is bitwise equal to ``blocked_matmul``.
    """
    nodes = {}
    for (k0, k1), vals in zip(ranges, subtotals):
        spans = tree_nodes(k0, k1, K)
        if len(spans) != len(vals):
            raise ValueError(f"rank range [{k0},{k1}) needs {len(spans)} subtotals, got {len(vals)}")
        for (lo, hi), v in zip(spans, vals):
            nodes[(lo // BLOCK, _num_blocks(hi))] = v
    nb = _num_blocks(K)
    if nb == 0:
        raise ValueError("K == 0: nothing to combine")
    return _eval(0, nb, lambda lo, hi: nodes.get((lo, hi))) + 0.0
