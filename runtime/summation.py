"""Deterministic contraction kernels: ``x @ w_t.T`` and ``sum(a * b, -1)``.

Why this exists: measured on our CPUs (MKL, 2 threads), plain float32 *and*
float64 GEMMs change bits with the thread count (e.g. 5 or 7 rows, K=256), with
the number of rows in the call (1 row takes a GEMV path), with transposed-view
operands, and with K split across ranks; ``torch.sum`` of long vectors changes
with threads too.  Bound propagation must give bitwise identical bounds for any
thread count and any world size P, so we offer three summation orders:

``fast``
    plain ``torch.matmul`` / ``(a*b).sum(-1)``.  Only run-to-run equality.
``blocked`` (default)
    K is cut into fixed blocks of ``BLOCK = 256``.  Each block product is computed
    *exactly* in float64 and rounded once to float32, and the per-block results
    are added along a fixed adjacent-pair binary tree.  Why exact: "float64 then
    round" is not enough, because the float64 GEMM itself is order dependent and
    a result near a float32 rounding boundary flips.  So each operand row is
    first rounded, per 256-block, to a 22-bit grid anchored at the block's max
    exponent (``|q| <= 2**22``); 256 such products sum below ``2**52``, so *every*
    summation order inside the GEMM yields the same exact float64.  The per-block
    value is therefore a pure function of the data (independent of threads, BLAS,
    row batching, layout, device), and the fixed tree makes the total depend only
    on the block structure, which ``shard_k_ranges`` respects for any P.
    Accuracy: each operand element moves by at most ``2**-22`` times its
    (row, block) max -- about one float32 rounding for the largest elements --
    so per block ``|err| <= 2**-22 (max|x_b| sum|w_b| + max|w_b| sum|x_b|)``, then
    one float32 rounding per block and a tree of depth ceil(log2 nb).  Typical
    relative error vs float64 ~1e-7; worse for heavy-tailed rows, where tiny
    elements next to a huge one lose bits (use ``exact`` if that matters).
    Cost: float64 GEMMs (alone ~1.7-2.2x float32 here) -- the price of the
    guarantee; measured 2-3.6x of ``fast`` with a ``PreparedWeight``.
``exact``
    correctly rounded float32 of the exact dot product (see ``ozaki.py``);
    K-sharded use: ``exact_exponents`` -> all-reduce MAX -> ``exact_partials`` ->
    all-reduce SUM (any order is exact) -> ``exact_finalize``.

Distributed K-split (blocked): the tree over ``nb = ceil(K/256)`` leaves equals
``node(lo, hi) = node(lo, lo+h) + node(lo+h, hi)`` with ``h`` = half if the size is
a power of two, else the largest power of two below it.  Any contiguous block
range is a union of such nodes; a rank reduces its blocks into those node totals
and ``combine_subtotals`` finishes the same tree, reproducing the single-process
bits exactly.  ``shard_k_ranges`` hands each rank exactly one node by default:

    ranges = shard_k_ranges(K, P)                     # same on every rank
    k0, k1 = ranges[rank]
    mine = shard_subtotals(x[..., k0:k1], w_t[:, k0:k1], k0, k1, K)   # list
    y = combine_subtotals(all_gather(mine), ranges, K)  # == blocked_matmul(x, w_t)

(with one node per rank, ``mine == [tree_reduce(block_partials(x_s, w_s))]``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .ozaki import (_exp, _pow2, _rows, exact_dot_last, exact_exponents,
                    exact_finalize, exact_matmul, exact_partials, round_sum_f32,
                    slice_width)

__all__ = [
    "BLOCK", "ORDERS", "matmul", "dot_last", "fast_matmul", "blocked_matmul",
    "block_partials", "tree_reduce", "shard_k_ranges", "tree_nodes",
    "subtree_totals", "shard_subtotals", "combine_subtotals", "PreparedWeight",
    "prepare_weight", "exact_matmul", "exact_exponents", "exact_partials",
    "exact_finalize", "exact_dot_last", "round_sum_f32", "slice_width",
]

BLOCK = 256
ORDERS = ("fast", "blocked", "exact")
_BLOCK_BITS = (53 - 8) // 2   # 22: 256 * (2**22)**2 = 2**52 -> exact block GEMM


# --------------------------------------------------------------------------- blocks
def _num_blocks(K: int) -> int:
    return -(-int(K) // BLOCK)


def _truncate_blocks(t2: torch.Tensor, name: str = "operand",
                     out: torch.Tensor | None = None, width: int = BLOCK) -> torch.Tensor:
    """(R, K) float32 -> (R, nb, BLOCK) float64 on a 22-bit grid per (row, block).

    Rounds each value to the nearest multiple of ``2**(e-22)`` where
    ``|row block| < 2**e`` (ties to even), so ``|q| <= 2**22`` grid units.  The
    zero padding of the short last block contributes exact zeros.  Uses Rump's
    extraction ``(v + c) - c`` with ``c = 1.5 * 2**(e - 22 + 52)``, whose float64 ulp
    is the grid: rounding happens in the add, the subtraction is exact.  One buffer,
    in place (fresh large allocations cost page faults).
    """
    R, K = t2.shape
    nb = -(-K // width)
    if out is None:
        out = torch.empty((R, nb, width), dtype=torch.float64, device=t2.device)
    flat = out.view(R, nb * width)
    flat[:, :K].copy_(t2)
    flat[:, K:].zero_()
    # max |v| per block without an abs() temporary; amax/amin propagate nan
    amax = torch.maximum(out.amax(-1), out.amin(-1).neg_()) if K else out.sum(-1)
    if not bool(torch.isfinite(amax).all()):   # cheaper than a full isfinite pass
        raise ValueError(f"{name} contains inf or nan; the 'blocked' order requires finite inputs")
    c = _pow2(_exp(amax) + (52 - _BLOCK_BITS)).mul_(1.5).unsqueeze(-1)   # ulp(c) = grid
    return out.add_(c).sub_(c)


class PreparedWeight:
    """A weight ``w_t`` (N, K) with cached per-order data.

    Why: for few rows the conversion of ``w_t`` costs far more than the GEMM;
    weights are constant during bound propagation, so callers prepare them once.
    Caches (lazily): the 22-bit float64 blocks (blocked) and a float64 copy plus
    row norms (exact) -- each about 2x the float32 weight's memory.  Bits are the
    same with or without it.  Never invalidated: do not modify ``w_t`` in place.
    """

    def __init__(self, w_t: torch.Tensor):
        if w_t.dim() != 2 or w_t.dtype != torch.float32:
            raise ValueError(f"w_t must be a float32 (N, K) tensor, got {w_t.dtype} {tuple(w_t.shape)}")
        self.w_t = w_t
        self._blocks = None
        self.exact_cache: dict = {}     # float64 copy + row norms for exact_matmul

    @property
    def shape(self):
        return self.w_t.shape

    def blocks(self) -> torch.Tensor:
        if self._blocks is None:
            self._blocks = _truncate_blocks(self.w_t, "w_t")
        return self._blocks


def prepare_weight(w_t: torch.Tensor) -> PreparedWeight:
    """Wrap ``w_t`` so repeated blocked products reuse its float64 blocks."""
    return w_t if isinstance(w_t, PreparedWeight) else PreparedWeight(w_t)


def _operands(x: torch.Tensor, w_t):
    pw = prepare_weight(w_t)
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.shape[-1] != pw.shape[1]:
        raise ValueError(f"contracted dims differ: x {tuple(x.shape)}, w_t {tuple(pw.shape)}")
    return _rows(x), pw


# --------------------------------------------------------------------------- tree
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


# --------------------------------------------------------------------------- blocked
def _block_products(x2, pw, b0, b1):
    """Leaf function: block i -> RN32(exact block product), (M, N) float32.

    x is truncated one block at a time into a reused buffer (cache resident, no
    page faults); the float64 GEMM output buffer is reused as well.
    """
    wb = pw.blocks()
    M, K = x2.shape
    small = x2.numel() <= (1 << 18)    # small x: truncate all blocks in one go
    xall = _truncate_blocks(x2, "x") if small else None
    xbuf = None if small else torch.empty((M, 1, BLOCK), dtype=torch.float64, device=x2.device)
    obuf = torch.empty((M, wb.shape[0]), dtype=torch.float64, device=x2.device)
    pool: list[torch.Tensor] = []      # float32 leaf buffers handed back by the tree

    def leaf(i):
        k0 = (i - b0) * BLOCK
        if small:
            xb = xall[:, i - b0]
        else:
            xb = _truncate_blocks(x2[:, k0:k0 + BLOCK], "x", out=xbuf).view(M, BLOCK)
        dst = pool.pop() if pool else torch.empty(obuf.shape, dtype=torch.float32,
                                                  device=obuf.device)
        return dst.copy_(torch.mm(xb, wb[:, i - b0].T, out=obuf))   # RN to float32
    leaf.release = pool.append
    return leaf


def block_partials(x: torch.Tensor, w_t, k_start: int = 0, k_stop: int | None = None):
    """Per-block float32 products ``[x_b @ w_b.T for b in blocks of [k_start, k_stop)]``.

    Works on full-K operands (with a range) or on a rank's K-shard (default range).
    Each entry is the exactly computed block product rounded once, so it is
    identical however and wherever it is computed.  ``tree_reduce`` of the list
    for the full range equals ``blocked_matmul``.
    """
    K = x.shape[-1]
    k_stop = K if k_stop is None else k_stop
    b0, b1 = _block_range(k_start, k_stop, K)
    if b1 == b0:
        return []
    x2, pw = _operands(x[..., k_start:k_stop], _sub_weight(w_t, k_start, k_stop, K))
    leaf = _block_products(x2, pw, b0, b1)
    shape = (*x.shape[:-1], pw.shape[0])
    return [leaf(i).reshape(shape) for i in range(b0, b1)]


def _sub_weight(w_t, k_start, k_stop, K):
    if k_start == 0 and k_stop == K:
        return w_t
    if not isinstance(w_t, PreparedWeight):
        return w_t[:, k_start:k_stop]
    sub = PreparedWeight(w_t.w_t[:, k_start:k_stop])
    if w_t._blocks is not None:       # blocks are per-block: a shard's are a slice
        sub._blocks = w_t._blocks[:, k_start // BLOCK:_num_blocks(k_stop)]
    return sub


def blocked_matmul(x: torch.Tensor, w_t) -> torch.Tensor:
    """Deterministic ``x @ w_t.T`` (order 'blocked'); ``w_t`` may be a PreparedWeight."""
    x2, pw = _operands(x, w_t)
    K, N = pw.shape[1], pw.shape[0]
    shape = (*x.shape[:-1], N)
    nb = _num_blocks(K)
    if nb == 0 or x2.shape[0] == 0 or N == 0:
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    leaf = _block_products(x2, pw, 0, nb)
    out = _eval(0, nb, lambda lo, hi: leaf(lo) if hi - lo == 1 else None, leaf.release)
    return out.add_(0.0).reshape(shape)


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


def shard_subtotals(x_shard: torch.Tensor, w_shard, k_start: int, k_stop: int,
                    K: int) -> list[torch.Tensor]:
    """What rank r sends: subtree totals of its K-shard ``x[..., k_start:k_stop]``."""
    return subtree_totals(block_partials(x_shard, w_shard), k_start, k_stop, K)


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


# --------------------------------------------------------------------------- dispatch
def fast_matmul(x: torch.Tensor, w_t) -> torch.Tensor:
    """Plain ``torch.matmul``: fastest, bits depend on threads/BLAS/shape."""
    w = w_t.w_t if isinstance(w_t, PreparedWeight) else w_t
    return torch.matmul(x, w.T)


def matmul(x: torch.Tensor, w_t, order: str = "blocked") -> torch.Tensor:
    """``x (..., K) @ w_t (N, K).T -> (..., N)`` float32 with the given summation order."""
    if order == "fast":
        return fast_matmul(x, w_t)
    if order == "blocked":
        return blocked_matmul(x, w_t)
    if order == "exact":
        if isinstance(w_t, PreparedWeight):
            return exact_matmul(x, w_t.w_t, w_cache=w_t.exact_cache)
        return exact_matmul(x, w_t)
    raise ValueError(f"unknown summation order {order!r}; expected one of {ORDERS}")


def dot_last(a: torch.Tensor, b: torch.Tensor, order: str = "blocked") -> torch.Tensor:
    """``sum(a * b, -1)`` (broadcasting) with the given summation order.

    ``blocked`` gives bitwise the same value as ``blocked_matmul`` of the same
    vectors (same per-block exact products, same tree); ``exact`` the correctly
    rounded value.  Used for bias / concretisation terms, where ``torch.sum`` of a
    long vector changes bits with the thread count.
    """
    if order == "fast":
        return (a * b).sum(-1)
    if order == "exact":
        return exact_dot_last(a, b)
    if order != "blocked":
        raise ValueError(f"unknown summation order {order!r}; expected one of {ORDERS}")
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"dot_last needs float32 operands, got {a.dtype}, {b.dtype}")
    a, b = torch.broadcast_tensors(a, b)
    shape, K = a.shape[:-1], a.shape[-1]
    if K == 0:
        return torch.zeros(shape, dtype=torch.float32, device=a.device)
    a2, b2 = _rows(a), _rows(b)
    R, nb = a2.shape[0], _num_blocks(K)
    width = min(K, BLOCK)                              # no padding when K < BLOCK
    sums = torch.empty((R, nb), dtype=torch.float32, device=a.device)
    step = min(R, max(1, (1 << 19) // (nb * width)))   # cache-sized row chunks
    abuf = torch.empty((step, nb, width), dtype=torch.float64, device=a.device)
    bbuf = torch.empty_like(abuf)                      # reused: no page faults
    for i in range(0, R, step):
        n = min(step, R - i)
        ab = _truncate_blocks(a2[i:i + n], "a", out=abuf[:n], width=width)
        bb = _truncate_blocks(b2[i:i + n], "b", out=bbuf[:n], width=width)
        # exact products on the grid; any summation order is exact; rounded once
        sums[i:i + n] = ab.mul_(bb).sum(-1)
    return tree_reduce(list(sums.unbind(-1))).reshape(shape)
