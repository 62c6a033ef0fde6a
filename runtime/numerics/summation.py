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
    K is cut into fixed blocks of ``BLOCK = 256``; each block product is one
    float32 GEMM whose bits are pinned, and the per-block results are added along
    a fixed adjacent-pair binary tree (``blocktree.py``).  Pinned how
    (``blocked_gemm.py``, measured on MKL): a single-threaded MKL SGEMM with at
    least 4 rows and 24 columns computes each element from its two operand rows
    and K alone, whatever the shape, tile position, leading dimension or
    alignment; so every block GEMM gets >= ``MIN_ROWS`` rows and >= ``MIN_COLS``
    columns (zero padded), one layout, MKL single-threaded, and the threads are
    ours (one row or column tile each).  Result: the same bits for any thread
    count, row batching (1 row, fsdp row shards), column split, operand layout,
    run, and -- through the fixed tree -- K-split over ranks.  The kernel
    properties are tested on thousands of random shapes
    (``tests/test_blocked_kernel.py``), so a BLAS update that broke them fails
    the tests instead of changing bounds silently.
    *Not* promised: the same bits on another CPU family, BLAS build or device
    (other kernels chain in other orders); that is ``exact``'s job.  Without
    MKL, or off the CPU, the block products come from ``blocked_grid.py``
    (exact per block on a 22-bit grid, float64 GEMMs: portable, 2-6x slower).
    Accuracy: that of a float32 GEMM with a tree on top,
    ``|err| <= (min(K, 256) + ceil(log2 nb) + 1) * 2**-24 * sum|x||w|`` (plus
    ``K * 2**-150`` for subnormal underflow); typically ~1e-7 relative.
    Cost: ~1.0-1.25x plain SGEMM on large shapes (``bench/summation_kernels.py``),
    1.0-1.4x ``fast`` end to end (``bench/summation.py``); per-call overhead
    (~20-40 us) dominates tiny ones.
``exact``
    correctly rounded float32 of the exact dot product (see ``ozaki.py``);
    K-sharded use: ``exact_exponents`` -> all-reduce MAX -> ``exact_partials`` ->
    all-reduce SUM (any order is exact) -> ``exact_finalize``.

Distributed K-split (blocked), see ``blocktree.py``; ``shard_k_ranges`` hands
each rank exactly one tree node by default:

    ranges = shard_k_ranges(K, P)                     # same on every rank
    k0, k1 = ranges[rank]
    mine = shard_subtotals(x[..., k0:k1], w_t[:, k0:k1], k0, k1, K)   # list
    y = combine_subtotals(all_gather(mine), ranges, K)  # == blocked_matmul(x, w_t)

(with one node per rank, ``mine == [tree_reduce(block_partials(x_s, w_s))]``).
"""
from __future__ import annotations

import torch

from . import blocked_gemm, blocked_grid, nonfinite
from .blocked_gemm import MIN_COLS, MIN_ROWS, pad_rows
from .blocktree import (BLOCK, _block_range, combine_subtotals, shard_k_ranges, subtree_totals,
                        tree_nodes, tree_reduce)
from .shapes import broadcast_shape
from .ozaki import (_rows, exact_dot_last, exact_exponents, exact_finalize,
                    exact_matmul, exact_partials, round_sum_f32, slice_width)

__all__ = [
    "BLOCK", "ORDERS", "MIN_ROWS", "MIN_COLS", "matmul", "dot_last", "fast_matmul",
    "blocked_matmul", "block_partials", "tree_reduce", "shard_k_ranges", "tree_nodes",
    "subtree_totals", "shard_subtotals", "combine_subtotals", "PreparedWeight",
    "prepare_weight", "exact_matmul", "exact_exponents", "exact_partials",
    "exact_finalize", "exact_dot_last", "round_sum_f32", "slice_width",
]

ORDERS = ("fast", "blocked", "exact")


class PreparedWeight:
    """A weight ``w_t`` (N, K) with cached per-order data.

    Why: weights are constant during bound propagation, so per-order conversions
    are done once: the contiguous, zero-padded (to ``MIN_COLS`` rows) copy the
    blocked GEMMs read, and a float64 copy plus row norms for ``exact``.  Bits
    are the same with or without it.  Never invalidated: do not modify ``w_t``
    in place.
    """

    def __init__(self, w_t: torch.Tensor, transposed: torch.Tensor | None = None):
        if w_t.dim() != 2 or w_t.dtype != torch.float32:
            raise ValueError(f"w_t must be a float32 (N, K) tensor, got {w_t.dtype} {tuple(w_t.shape)}")
        self.w_t = w_t
        self._padded = None
        self._transposed = transposed   # w_t.T (K, N) contiguous, for gradients
        self.exact_cache: dict = {}     # float64 copy + row norms for exact_matmul

    @property
    def shape(self):
        return self.w_t.shape

    def transposed(self) -> "PreparedWeight":
        """w_t.T as a prepared operand (a gradient's x @ w_t): made once, then kept."""
        if not isinstance(self._transposed, PreparedWeight):
            t = self._transposed
            self._transposed = PreparedWeight(
                t.contiguous() if t is not None else self.w_t.t().contiguous(), self.w_t)
            self._transposed._transposed = self
        return self._transposed

    def padded(self) -> torch.Tensor:
        """(max(N, MIN_COLS), K) contiguous float32: what the block GEMMs read."""
        if self._padded is None:
            self._padded = pad_rows(self.w_t, MIN_COLS)
        return self._padded


def prepare_weight(w_t: torch.Tensor) -> PreparedWeight:
    """Wrap ``w_t`` so repeated blocked products reuse its padded copy."""
    return w_t if isinstance(w_t, PreparedWeight) else PreparedWeight(w_t)


def _operands(x: torch.Tensor, w_t):
    pw = prepare_weight(w_t)
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.shape[-1] != pw.shape[1]:
        raise ValueError(f"contracted dims differ: x {tuple(x.shape)}, w_t {tuple(pw.shape)}")
    return _rows(x), pw


# --------------------------------------------------------------------------- blocked
def _tree_product(x2: torch.Tensor, pw: PreparedWeight) -> torch.Tensor:
    """(M, N) float32 fixed tree over the 256-block products of x2 (M, K) and pw (N, K),
    zeros as +0.0: pinned float32 MKL GEMMs where available, else the portable
    exact-per-block kernel."""
    x2, N = x2.contiguous(), pw.shape[0]
    if not blocked_gemm.available(x2):
        return nonfinite.matmul(lambda a, w: blocked_grid.tree_product(a, w, N).add_(0.0),
                                x2, pw.w_t[:N].contiguous())
    # An inf or nan operand element makes its whole output row (column) non-finite
    # (inf*0 is nan; an FMA chain or tree never makes a non-finite value finite again),
    # with IEEE's inf/nan, whatever the order: returned as is, like float32 overflow
    # from finite operands (see nonfinite.py).
    return blocked_gemm.tree_product(x2, pw.padded(), N)


def block_partials(x: torch.Tensor, w_t, k_start: int = 0, k_stop: int | None = None):
    """Per-block float32 products ``[x_b @ w_b.T for b in blocks of [k_start, k_stop)]``.

    Works on full-K operands (with a range) or on a rank's K-shard (default range).
    Each entry depends only on the block's operand rows, so it is identical
    however and wherever it is computed.  ``tree_reduce`` of the list for the full
    range equals ``blocked_matmul``.
    """
    K = x.shape[-1]
    k_stop = K if k_stop is None else k_stop
    b0, b1 = _block_range(k_start, k_stop, K)
    if b1 == b0:
        return []
    x2, pw = _operands(x[..., k_start:k_stop], _sub_weight(w_t, k_start, k_stop, K))
    shape = (*x.shape[:-1], pw.shape[0])
    Ks = k_stop - k_start
    return [_tree_product(x2[:, k0:k0 + BLOCK], _sub_weight(pw, k0, min(k0 + BLOCK, Ks), Ks))
            .reshape(shape) for k0 in range(0, Ks, BLOCK)]


def _sub_weight(w_t, k_start, k_stop, K):
    if k_start == 0 and k_stop == K:
        return w_t
    if not isinstance(w_t, PreparedWeight):
        return w_t[:, k_start:k_stop]
    sub = PreparedWeight(w_t.w_t[:, k_start:k_stop])
    if w_t._padded is not None:       # a shard's padded copy is a column slice
        sub._padded = w_t._padded[:, k_start:k_stop]
    return sub


def blocked_matmul(x: torch.Tensor, w_t) -> torch.Tensor:
    """Deterministic ``x @ w_t.T`` (order 'blocked'); ``w_t`` may be a PreparedWeight."""
    x2, pw = _operands(x, w_t)
    K, N, M = pw.shape[1], pw.shape[0], x2.shape[0]
    shape = (*x.shape[:-1], N)
    if K == 0 or M == 0 or N == 0:
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    return _tree_product(x2, pw).reshape(shape)


def shard_subtotals(x_shard: torch.Tensor, w_shard, k_start: int, k_stop: int,
                    K: int) -> list[torch.Tensor]:
    """What rank r sends: subtree totals of its K-shard ``x[..., k_start:k_stop]``."""
    return subtree_totals(block_partials(x_shard, w_shard), k_start, k_stop, K)


def _blocked_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b, -1)`` with broadcasting, as block GEMMs: every value equals
    ``blocked_matmul(a_row[None], b_row[None])`` of its two vectors.

    The rows are grouped by the vector they meet: one vector for all rows (bias
    and box terms: one GEMM), one vector per group along the last batch dim
    (per-box terms), or a vector per row (``blocked_gemm.row_pairs``: batched block
    diagonals).  Groups go ``MIN_COLS`` at a time into one GEMM whose block diagonal
    is the answer; the GEMM is padded to ``MIN_COLS`` columns anyway, so this costs no
    extra flops.
    """
    K = b.shape[-1]
    if (K and a.shape[-1] == K and a.numel() and a.dtype == b.dtype == torch.float32
            and blocked_gemm.available(a)):
        # the two shapes of most calls, without the general path's broadcasting steps
        # (~60 us a call, more than the arithmetic of a bound's spec rows)
        rows = a.numel() // K
        if a.shape == b.shape:                                # a vector per row
            return blocked_gemm.row_pairs(a.reshape(rows, K).contiguous(),
                                          b.reshape(rows, K).contiguous()).reshape(a.shape[:-1])
        if b.numel() == K and rows < MIN_COLS:                # one vector, few rows
            return blocked_gemm.tree_product(a.reshape(rows, K).contiguous(),
                                             pad_rows(b.reshape(1, K), MIN_COLS),
                                             1).reshape(a.shape[:-1])
    if b.numel() == K and a.shape[-1] == K and K:         # one vector for all rows: one GEMM
        rows = a.shape[:-1].numel()
        if rows >= MIN_COLS and a.dtype == torch.float32 and blocked_gemm.available(a):
            x2 = _rows(a).contiguous()      # its 8-row operand, not a 32-row padded copy
            return blocked_gemm.tree_product(x2, blocked_gemm.vector_rows(b.reshape(1, K)),
                                             1).reshape(a.shape[:-1])
        return blocked_matmul(a, b.reshape(1, K))[..., 0]
    shape = broadcast_shape(a.shape, b.shape)
    lead, K = shape[:-1], shape[-1]
    if K == 0 or lead.numel() == 0:
        return torch.zeros(lead, dtype=torch.float32, device=a.device)
    b_lead = (1,) * (len(shape) - b.dim()) + tuple(b.shape[:-1])
    if all(d == 1 for d in b_lead):
        G, R, b2 = 1, lead.numel(), b.reshape(1, K)
    elif b_lead[-1] == 1:
        G, R = lead[:-1].numel(), lead[-1]
        b2 = b.expand(*lead[:-1], 1, K).reshape(G, K)
    else:
        G, R = lead.numel(), 1
        b2 = b.expand(shape).reshape(G, K)
        if a.dtype == torch.float32 and blocked_gemm.available(a):     # a vector per row
            return blocked_gemm.row_pairs(a.expand(shape).reshape(G, K).contiguous(),
                                          b2.contiguous()).reshape(lead)
    a3 = a.expand(shape).reshape(G, R, K)
    out = torch.empty((G, R), dtype=torch.float32, device=a.device)
    for g0 in range(0, G, MIN_COLS):
        n = min(MIN_COLS, G - g0)
        y = blocked_matmul(a3[g0:g0 + n].reshape(n * R, K), b2[g0:g0 + n])   # (n*R, n)
        out[g0:g0 + n] = y.view(n, R, n).diagonal(dim1=0, dim2=2).T
    return out.reshape(lead)


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
            cache = w_t.exact_cache
            return nonfinite.matmul(lambda a, w: exact_matmul(
                a, w, w_cache=cache if w is w_t.w_t else None), x, w_t.w_t)
        return nonfinite.matmul(exact_matmul, x, w_t)
    raise ValueError(f"unknown summation order {order!r}; expected one of {ORDERS}")


def dot_last(a: torch.Tensor, b: torch.Tensor, order: str = "blocked") -> torch.Tensor:
    """``sum(a * b, -1)`` (broadcasting) with the given summation order.

    ``blocked`` gives bitwise the same value as ``blocked_matmul`` of the same
    vectors; ``exact`` the correctly rounded value.  Used for bias /
    concretisation terms, where ``torch.sum`` of a long vector changes bits with
    the thread count.
    """
    if order == "fast":
        return (a * b).sum(-1)
    if order == "exact":
        return nonfinite.dot_last(exact_dot_last, a, b)
    if order != "blocked":
        raise ValueError(f"unknown summation order {order!r}; expected one of {ORDERS}")
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"dot_last needs float32 operands, got {a.dtype}, {b.dtype}")
    return _blocked_dot(a, b)
