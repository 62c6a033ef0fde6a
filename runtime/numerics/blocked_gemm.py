"""Block products of the ``blocked`` order on CPUs with MKL: float32 GEMMs whose bits are pinned.

What is relied on (measured on these machines, MKL 2024.2 with ``MKL_CBWR=AUTO,STRICT``;
checked on thousands of random shapes by ``tests/test_blocked_kernel.py``): a
*single-threaded* MKL SGEMM with at least 4 rows and 24 columns computes every output
element ``c_ij`` as a fixed function of row ``x_i``, row ``w_j`` and K alone -- a
sequential FMA chain over k for K <= 192, two 128-long chains added for K = 256 --
whatever the number of rows and columns in the call, the positions of row i and column j
in it, the leading dimensions and the 4-byte alignment.  What breaks it, so is avoided:

- fewer than 4 rows (GEMV and small-M kernels) or fewer than 24 columns: other code
  paths, other sums.  Every call here gets >= ``MIN_ROWS`` rows and >= ``MIN_COLS``
  columns (zero padded).
- MKL's own threading: with 3 or 4 threads MKL splits small products differently (it
  changed 1/3 of random small shapes; 1 vs 2 threads happened to agree).  So MKL runs
  single-threaded here (``mkl_set_num_threads_local(1)``, per calling thread) and the
  parallelism is ours: the rows (or, for few rows, the columns) are cut into one tile
  per ``torch.get_num_threads()`` thread, each computed by one thread.  Because an
  element depends only on its two rows, the cut points change nothing.
- a transposed operand: ``x`` is always row-major contiguous, ``w_t`` row-major and
  passed transposed (one layout).

Where the MKL entry points are not found (another BLAS) or the tensors are not on the
CPU, ``available`` is False and the caller uses the portable kernel (``blocked_grid``).
"""
from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .blocktree import BLOCK, _eval, _num_blocks

MIN_ROWS = 8    # MKL adds in other orders below 4 rows (measured); 8 leaves a margin
MIN_COLS = 32   # ... and below 24 columns; 32 is also a whole number of vectors
_PAR_MIN_WORK = 1 << 21   # multiply-adds below which one thread beats handing out tiles
_ROW_CHUNK = 256          # rows per pass over the blocks when K has several blocks


def _entry_points():
    """(MKL_Set_Num_Threads_Local, omp_set_num_threads) from torch's own libraries."""
    if not torch.backends.mkl.is_available():
        return None, None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        mkl_local = lib.MKL_Set_Num_Threads_Local     # C, by value (the lowercase is Fortran)
    except (OSError, AttributeError):
        return None, None
    mkl_local.argtypes, mkl_local.restype = [ctypes.c_int], ctypes.c_int
    omp = getattr(lib, "omp_set_num_threads", None)
    if omp is not None:
        omp.argtypes, omp.restype = [ctypes.c_int], None
    return mkl_local, omp


_MKL_LOCAL, _OMP_SET = _entry_points()


def available(t: torch.Tensor) -> bool:
    """Whether this kernel's bits are pinned for ``t``'s device on this build."""
    return _MKL_LOCAL is not None and t.is_cpu


def _worker_init():
    # torch sets a thread's MKL and OpenMP thread counts to its intra-op count the first
    # time that thread asks for them (ATen's lazy_init_num_threads: a parallel_for, such as
    # a large add or a bmm, or get_num_threads), overwriting what is set here; then MKL ran
    # the thread's later GEMMs on T threads, in other orders (measured: rows of a T = 3
    # blocked product changed after a multi-block bias dot had run in the pool). So that
    # first time happens here, before the settings.
    torch.get_num_threads()
    _MKL_LOCAL(1)               # thread-local: the main thread's MKL keeps its setting
    if _OMP_SET is not None:
        _OMP_SET(1)             # per-thread ICV: no nested OpenMP teams in the tree adds


_pool: ThreadPoolExecutor | None = None
_pool_key: tuple[int, int] | None = None
_pool_lock = threading.Lock()


def _get_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads, kept while the thread count stays; a new one after
    fork (the old threads are gone)."""
    global _pool, _pool_key
    with _pool_lock:
        key = (os.getpid(), workers)
        if _pool_key != key:
            if _pool is not None and _pool_key[0] == os.getpid():
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="shardbound-gemm",
                                       initializer=_worker_init)
            _pool_key = key
        return _pool


def pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` (R, K) contiguous with at least ``n`` rows (zero rows appended)."""
    if t.shape[0] >= n:
        return t.contiguous()
    out = torch.zeros((n, t.shape[1]), dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out


def _tiles(M: int, N: int, K: int, T: int) -> list[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) per thread: rows cut evenly, or columns when rows are few."""
    if T <= 1 or M * N * K < _PAR_MIN_WORK:
        return [(0, M, 0, N)]
    if M >= T * MIN_ROWS:
        return [(M * i // T, M * (i + 1) // T, 0, N) for i in range(T)]
    n = min(T, N // MIN_COLS)
    if n >= 2:
        return [(0, M, N * i // n, N * (i + 1) // n) for i in range(n)]
    return [(0, M, 0, N)]


def _tile(x2, wp, N, out, r0, r1, c0, c1) -> None:
    """out[r0:r1, c0:c1] = fixed tree over K-blocks of single-block GEMMs, zeros as
    +0.0.

    With several blocks the rows go ``_ROW_CHUNK`` at a time (never fewer than
    MIN_ROWS), so a chunk's block partials and tree sums stay in cache and the
    scratch buffers are small and reused; the leftmost block of a chunk is written
    straight into the output, where the tree accumulates.  Rows are independent,
    so the chunking does not change any bit.
    """
    m, n = r1 - r0, c1 - c0
    xp = pad_rows(x2[r0:r1], MIN_ROWS)
    wt = wp[c0:c1] if n >= MIN_COLS else wp[:MIN_COLS]    # n < MIN_COLS: c0 == 0, zero rows
    K, rows = xp.shape[1], xp.shape[0]
    nb = _num_blocks(K)
    target = out[r0:r1, c0:c1]
    fits = wt.shape[0] == n and rows == m and target.is_contiguous()
    step = rows if nb == 1 else _ROW_CHUNK
    scratch: dict[int, list[torch.Tensor]] = {}
    a = 0
    while a < rows:
        b = rows if rows - (a + step) < MIN_ROWS else a + step
        xs = xp[a:b]
        tgt = target[a:b] if fits else None

        def leaf(lo, hi):
            if hi - lo != 1:
                return None
            k0, k1 = lo * BLOCK, min(lo * BLOCK + BLOCK, K)
            free = scratch.get(b - a)
            dst = tgt if (lo == 0 and tgt is not None) else (free.pop() if free else torch.empty(
                (b - a, wt.shape[0]), dtype=torch.float32, device=xp.device))
            return torch.mm(xs[:, k0:k1], wt[:, k0:k1].T, out=dst)

        res = _eval(0, nb, leaf, lambda t: scratch.setdefault(t.shape[0], []).append(t))
        res.add_(0.0)                                   # -0.0 -> +0.0
        if res is not tgt:
            e = min(b, m)
            target[a:e].copy_(res[:e - a, :n])
        a = b


def tree_product(x2: torch.Tensor, wp: torch.Tensor, N: int) -> torch.Tensor:
    """(M, N) float32: the fixed pair tree over the 256-blocks of K of the block GEMMs
    ``x2_b @ wp_b.T`` with zeros as +0.0.  ``x2`` (M, K) contiguous; ``wp``
    (>= max(N, MIN_COLS), K) contiguous, zero rows past N (for N <= MIN_ROWS and
    M >= MIN_COLS, MIN_ROWS rows are enough: `vector_rows`).  Bits depend only on the
    operand rows, not on the thread count, M, N or the tiles.  (Non-finite operands give
    non-finite rows as they are: summation.py's callers never asked which.)"""
    M, K = x2.shape
    x2, wp = x2.detach(), wp.detach()   # worker threads run with grad mode on; out= needs off
    T = torch.get_num_threads()
    if N <= MIN_ROWS and M >= MIN_COLS:
        return _few_columns(x2, wp[:MIN_ROWS], N, T)
    tiles = _tiles(M, N, K, T) if T > 1 else [(0, M, 0, N)]
    if len(tiles) == 1 and K <= BLOCK:      # one GEMM: the common small case, less overhead
        xp = x2 if M >= MIN_ROWS else pad_rows(x2, MIN_ROWS)
        prev = _MKL_LOCAL(1)
        try:
            y = torch.mm(xp, wp.T)
        finally:
            _MKL_LOCAL(prev)
        if y.shape[0] != M or y.shape[1] != N:
            y = y[:M, :N].clone()           # compact storage: the memory ledger counts it
        return y.add_(0.0)
    if len(tiles) == 1 and M <= _ROW_CHUNK and max(M, MIN_ROWS) * max(N, MIN_COLS) * _num_blocks(
            K) <= _STACK_MAX:
        return _stacked_blocks(x2, wp, N)
    out = torch.empty((M, N), dtype=torch.float32, device=x2.device)
    _run_tiles(_tile, (x2, wp, N, out), tiles, T)
    return out


_STACK_MAX = 1 << 19      # elements of stacked block products `_stacked_blocks` may make (above
                          # it, measured, `_tile`'s per-block GEMMs are as fast or faster)


def _stacked_blocks(x2: torch.Tensor, wp: torch.Tensor, N: int) -> torch.Tensor:
    """``tree_product`` on one thread for a few rows (<= _ROW_CHUNK) and several K-blocks:
    the full blocks' GEMMs as one batched call on strided views, the last partial block as
    one GEMM, the pair tree level by level (`_tree_levels`, `blocktree._eval`'s pairs).

    Why: `_tile` makes a GEMM call, a buffer and a Python tree step per block, which for
    the spec rows of a bound (9 rows against a vector or a layer) cost ~10x the
    arithmetic. Same operands per block GEMM (>= MIN_ROWS rows of x, >= MIN_COLS rows of
    wp, row-major, wp passed transposed), so the same bits."""
    M, K = x2.shape
    xp = x2 if M >= MIN_ROWS else pad_rows(x2, MIN_ROWS)
    wt = wp[:max(N, MIN_COLS)]
    m, w = xp.shape[0], wt.shape[0]
    nb, full = _num_blocks(K), K // BLOCK
    parts = torch.empty((nb, m, w), dtype=torch.float32, device=x2.device)
    k1 = full * BLOCK
    prev = _MKL_LOCAL(1)
    try:
        if full:
            torch.bmm(xp[:, :k1].view(m, full, BLOCK).transpose(0, 1),
                      wt[:, :k1].view(w, full, BLOCK).permute(1, 2, 0), out=parts[:full])
        if full < nb:
            torch.mm(xp[:, k1:], wt[:, k1:].T, out=parts[full])
    finally:
        _MKL_LOCAL(prev)
    y = _tree_levels(parts)
    if m != M or w != N:
        y = y[:M, :N].clone()               # compact storage: the memory ledger counts it
    return y.add_(0.0)                      # -0.0 -> +0.0


def _run_tiles(tile_fn, args, tiles, T) -> None:
    """tile_fn(*args, *tile) for every tile: the first in this thread (MKL on one thread),
    the others on the pool (sized by T, so every caller reuses it)."""
    futures = []
    if len(tiles) > 1:
        pool = _get_pool(T - 1)
        futures = [pool.submit(tile_fn, *args, *t) for t in tiles[1:]]
    prev = _MKL_LOCAL(1)
    try:
        tile_fn(*args, *tiles[0])
    finally:
        _MKL_LOCAL(prev)
    for f in futures:
        f.result()


# ----------------------------------------------------------------------------- row pairs
def row_pairs(a2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """(G,) float32: element g is ``tree_product(a2[g:g+1], b2[g:g+1], 1)``, the blocked
    dot of row g of ``a2`` with row g of ``b2`` (both (G, K) contiguous): a dot per row
    with its own vector (full alpha-CROWN's intercept terms, one line per row and neuron).

    Why not one GEMM per MIN_COLS rows (their block diagonal): a call each, ~20-40 us of
    overhead for a few us of arithmetic (3.2 ms for 512 rows of 256; here 0.5 ms). The
    block diagonals are one batched GEMM per chunk instead: for every 256-block of K, the
    (MIN_COLS, BLOCK) rows of a group against the same group's rows of b, the pinned
    single-threaded shape (>= MIN_ROWS rows, >= MIN_COLS columns), then the pair tree over
    the blocks' diagonals. Same bits as the per-group GEMMs (each element one block's FMA
    chain over its two rows); ``tests/test_blocked_kernel.py`` checks it on random shapes
    and thread counts."""
    G, K = a2.shape
    n = MIN_COLS
    if G <= n:      # one group: its product's diagonal, through the general kernel
        return tree_product(a2, pad_rows(b2, n), G).diagonal().clone()
    Gp = -(-G // n) * n
    if Gp != G:
        a2, b2 = pad_rows(a2, Gp), pad_rows(b2, Gp)
    out = torch.empty(Gp, dtype=torch.float32, device=a2.device)
    T = torch.get_num_threads()
    per_chunk = max(n, _SWAP_CHUNK // (_num_blocks(K) * n) // n * n)   # rows per pass
    tiles = [(0, Gp)]
    if T > 1 and Gp * n * K >= _PAR_MIN_WORK and Gp >= T * n:
        tiles = [(Gp // n * i // T * n, Gp // n * (i + 1) // T * n) for i in range(T)]
    _run_tiles(_row_pairs_tile, (a2.detach(), b2.detach(), out, per_chunk), tiles, T)
    return out[:G]


def _row_pairs_tile(a2, b2, out, per_chunk, r0, r1) -> None:
    """out[r0:r1] of ``row_pairs`` (r0, r1 multiples of MIN_COLS), ``per_chunk`` rows at a
    time so the stacked block GEMMs stay ~_SWAP_CHUNK elements. One batched GEMM per
    256-block, on strided views of the rows (no copies)."""
    K, n = a2.shape[1], MIN_COLS
    nb = _num_blocks(K)
    for a in range(r0, r1, per_chunk):
        b = min(r1, a + per_chunk)
        c = (b - a) // n
        xs, ws = a2[a:b].view(c, n, K), b2[a:b].view(c, n, K)
        parts = torch.empty((nb, c, n, n), dtype=torch.float32, device=a2.device)
        for j in range(nb):
            k0, k1 = j * BLOCK, min(K, j * BLOCK + BLOCK)
            torch.bmm(xs[:, :, k0:k1], ws[:, :, k0:k1].transpose(1, 2), out=parts[j])
        res = _tree_levels(parts.diagonal(dim1=2, dim2=3))      # (c, n)
        out[a:b] = res.reshape(-1).add_(0.0)                    # -0.0 -> +0.0


# ----------------------------------------------------------------------------- few columns
_SWAP_CHUNK = 1 << 20     # elements of block partials (blocks x 8 x rows) made at a time


def vector_rows(vectors: torch.Tensor) -> torch.Tensor:
    """``vectors`` (n <= MIN_ROWS, K) as the (MIN_ROWS, K) operand `tree_product` reads for
    few columns (zero rows past n): the rows of the (MIN_COLS, K) padded copy it would
    read, without the other 24."""
    out = torch.zeros((MIN_ROWS, vectors.shape[1]), dtype=vectors.dtype, device=vectors.device)
    out[:vectors.shape[0]] = vectors
    return out


def _few_columns(x2: torch.Tensor, w8: torch.Tensor, N: int, T: int) -> torch.Tensor:
    """``tree_product`` for N <= MIN_ROWS columns (the bias and box terms: one vector, or a
    few, against many rows), computed as the transposed product ``w8 @ x2.T``: the
    vectors are the MIN_ROWS rows and x2's rows the (>= MIN_COLS) columns, so the GEMMs
    make 8 instead of 32 products per element of x2 (no padding columns). Same bits:
    each element is still one block's FMA chain over its two operand rows (products
    commute exactly), which ``tests/test_blocked_kernel.py`` checks against the
    untransposed form on random shapes. All full 256-blocks of a row chunk go through
    one batched GEMM (one call, not one per block) and the pair tree is added level by
    level over the stacked partials (the same adjacent pairs as ``blocktree._eval``)."""
    M, K = x2.shape
    tiles = [(0, M)]
    if T > 1 and M * N * K >= _PAR_MIN_WORK and M >= T * MIN_COLS:
        tiles = [(M * i // T, M * (i + 1) // T) for i in range(T)]
    if len(tiles) == 1 and K <= BLOCK and M <= _SWAP_CHUNK // MIN_ROWS:
        # one block, one chunk: `_few_columns_tile`'s one GEMM without its bookkeeping
        # (the small MLPs' bias and box terms: ~10 us a call, about the GEMM's own time)
        prev = _MKL_LOCAL(1)
        try:
            y = torch.mm(w8, x2.T)
        finally:
            _MKL_LOCAL(prev)
        return y[:N].T.contiguous().add_(0.0)
    out = torch.empty((M, N), dtype=torch.float32, device=x2.device)
    _run_tiles(_few_columns_tile, (x2, w8, N, out), tiles, T)
    return out


def _few_columns_tile(x2, w8, N, out, r0, r1) -> None:
    """out[r0:r1] of ``_few_columns`` in row chunks (>= MIN_COLS rows each, so every GEMM
    keeps its pinned shape)."""
    K = x2.shape[1]
    nb, full = _num_blocks(K), K // BLOCK
    step = max(MIN_COLS, _SWAP_CHUNK // (nb * MIN_ROWS))
    a = r0
    while a < r1:
        b = r1 if r1 - (a + step) < MIN_COLS else a + step
        xs = x2[a:b]
        m = b - a
        parts = torch.empty((nb, MIN_ROWS, m), dtype=torch.float32, device=x2.device)
        if full:
            k1 = full * BLOCK
            torch.bmm(w8[:, :k1].view(MIN_ROWS, full, BLOCK).transpose(0, 1),
                      xs[:, :k1].view(m, full, BLOCK).permute(1, 2, 0), out=parts[:full])
        if full < nb:
            torch.mm(w8[:, full * BLOCK:], xs[:, full * BLOCK:].T, out=parts[full])
        res = _tree_levels(parts)[:N]
        res.add_(0.0)                                   # -0.0 -> +0.0
        out[a:b] = res.T
        a = b


def _tree_levels(parts: torch.Tensor) -> torch.Tensor:
    """The fixed pair tree over dim 0, level by level: (p0+p1), (p2+p3), ..., an odd last
    one passed up (``blocktree.tree_reduce``'s order, one add per level)."""
    while parts.shape[0] > 1:
        L = parts.shape[0]
        h = L // 2
        s = parts[0:2 * h:2] + parts[1:2 * h:2]
        parts = torch.cat([s, parts[L - 1:]]) if L % 2 else s
    return parts[0]
