"""The BLAS properties the ``blocked`` order relies on, checked bitwise on many shapes.

``blocked`` computes each 256-block product as one float32 GEMM called with at least
``MIN_ROWS`` rows and ``MIN_COLS`` columns (zero padded) in one layout, and adds the
blocks along a fixed tree.  That is only deterministic if the GEMM computes every
output element as a function of its two operand rows alone.  Measured on MKL it does;
these tests check it on thousands of random shapes and values, so a BLAS (or torch)
update that breaks it fails here instead of changing bounds silently.  Equality is
``torch.equal`` on the int32 bit patterns, never allclose.
"""
from __future__ import annotations

import random

import pytest
import torch

from shardbound.runtime.numerics import summation as S

from test_summation import data, same, threads, with_threads


def _storage_variant(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in another memory layout: contiguous, a view with a wider row
    stride, or a copy 4 bytes off the allocator's alignment (as fsdp's gathered views)."""
    if how == "wide":
        buf = torch.zeros(t.shape[0], t.shape[1] + 7)
        buf[:, 3:3 + t.shape[1]] = t
        return buf[:, 3:3 + t.shape[1]]
    if how == "offset":
        buf = torch.empty(t.numel() + 1)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out
    return t.clone()


@pytest.mark.parametrize("seed", range(4))
def test_block_product_depends_only_on_its_two_rows(seed):
    """Any subset of rows and columns, in any order, any thread count (1-4) and any
    storage gives each element the bits it has in the full product."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(120):
        K = rng.choice([rng.randint(1, 16), rng.randint(1, 256), 256, 32, 144, 27])
        N = rng.choice([rng.randint(1, 40), rng.randint(1, 700)])
        M = rng.choice([rng.randint(1, 40), rng.randint(1, 1500)])
        x = torch.randn(M, K, generator=g) * torch.exp(2 * torch.randn(M, 1, generator=g))
        if rng.random() < 0.3:
            x = x * (torch.rand(M, K, generator=g) < 0.5)          # ReLU-like zeros
        w = torch.randn(N, K, generator=g)
        ref = with_threads(1, lambda: S.blocked_matmul(x, w))
        for _ in range(3):
            rows = torch.randperm(M, generator=g)[:rng.randint(1, M)]
            cols = torch.randperm(N, generator=g)[:rng.randint(1, N)]
            xs = _storage_variant(x[rows], rng.choice(["contiguous", "wide", "offset"]))
            ws = _storage_variant(w[cols], rng.choice(["contiguous", "wide", "offset"]))
            got = with_threads(rng.randint(1, 4), lambda: S.blocked_matmul(xs, ws))
            assert same(got, ref[rows][:, cols]), (M, K, N, len(rows), len(cols))


@pytest.mark.parametrize("K", [784, 1000, 4096])
def test_every_row_alone_equals_the_batch(K):
    """Many blocks and a tree: 1 row (padded to MIN_ROWS) gives the batch's bits."""
    x, w = data((40, K), K, spread=1.0), data((300, K), K + 1)
    batch = with_threads(2, lambda: S.blocked_matmul(x, w))
    with threads(1):
        for i in range(40):
            assert same(S.blocked_matmul(x[i], w), batch[i])


def test_big_products_do_not_depend_on_threads():
    """Shapes of the CROWN passes (many rows, im2col K), where MKL splits work over
    threads."""
    for M, K, N in [(65536, 32, 144), (4096, 1024, 1024), (20000, 27, 16)]:
        x, w = data((M, K), M + K), data((N, K), N)
        ref = with_threads(1, lambda: S.blocked_matmul(x, w))
        for t in (2, 3):
            assert same(with_threads(t, lambda: S.blocked_matmul(x, w)), ref)
        idx = torch.tensor([0, 5, M // 2, M - 1])
        assert same(S.blocked_matmul(x[idx], w), ref[idx])


def test_padding_is_needed():
    """Why MIN_ROWS / MIN_COLS exist: unpadded MKL calls with few rows or columns take
    other code paths with other sums (a demonstration; skipped if this BLAS has none)."""
    found = False
    for K in (256, 100):
        x, w = data((64, K), 1), data((64, K), 2)
        full = x @ w.T
        few_rows = torch.cat([x[i:i + 2] @ w.T for i in range(0, 64, 2)])
        few_cols = torch.cat([x @ w[j:j + 8].T for j in range(0, 64, 8)], dim=1)
        found |= not same(few_rows, full) or not same(few_cols, full)
    if not found:
        pytest.skip("this BLAS gives the same bits for few rows or columns")
    x, w = data((64, 256), 1), data((64, 256), 2)
    ref = S.blocked_matmul(x, w)
    assert same(torch.cat([S.blocked_matmul(x[i:i + 2], w) for i in range(0, 64, 2)]), ref)
    assert same(torch.cat([S.blocked_matmul(x, w[j:j + 8]) for j in range(0, 64, 8)], 1), ref)


@pytest.mark.parametrize("K", [5, 300, 2000])
def test_dot_last_shapes_equal_matmul_of_the_same_vectors(K):
    """One vector for all rows (bias), one per box (concretisation), one per row."""
    A = data((3, 50, K), K, spread=1.0)
    v, per_box, per_row = data((K,), 1), data((3, 1, K), 2), data((3, 50, K), 3)
    for b in (v, per_box, per_row):
        got = with_threads(2, lambda: S.dot_last(A, b))
        bb = b.expand(A.shape)
        for i, j in [(0, 0), (1, 17), (2, 49)]:
            assert same(got[i, j], S.blocked_matmul(A[i, j][None], bb[i, j][None])[0, 0])
        # row split (fsdp shards the 50 rows) and thread count change nothing
        parts = [S.dot_last(A[:, a:c], b if b.dim() < 3 or b.shape[1] == 1 else b[:, a:c])
                 for a, c in [(0, 1), (1, 20), (20, 50)]]
        assert same(torch.cat(parts, 1), got)
        assert same(with_threads(1, lambda: S.dot_last(A, b)), got)


def test_portable_kernel_keeps_the_guarantees(monkeypatch):
    """Without MKL (or off the CPU) the block products come from the exact-grid kernel:
    the same invariances, within its documented error."""
    from shardbound.runtime.numerics import blocked_gemm
    x, w = data((20, 1300), 31, spread=1.0), data((40, 1300), 32)
    pinned = S.blocked_matmul(x, w)
    monkeypatch.setattr(blocked_gemm, "available", lambda t: False)
    ref = with_threads(1, lambda: S.blocked_matmul(x, w))
    assert same(with_threads(2, lambda: S.blocked_matmul(x, w)), ref)
    assert same(torch.cat([S.blocked_matmul(x[i:i + 1], w) for i in range(20)]), ref)
    rg = S.shard_k_ranges(1300, 3)
    subs = [S.shard_subtotals(x[:, a:b].contiguous(), w[:, a:b].contiguous(), a, b, 1300)
            for a, b in rg]
    assert same(S.combine_subtotals(subs, rg, 1300), ref)
    assert same(S.dot_last(x, w[3]), ref[:, 3])
    scale = x.double().abs() @ w.double().abs().T
    assert bool(((ref.double() - pinned.double()).abs() <= 1e-5 * scale).all())


def test_gradients_through_thread_tiles_and_compact_results():
    """alpha-CROWN differentiates through the ordered products: the worker threads that
    compute tiles must not trip autograd, and gradients keep the thread-invariant bits.
    Results own exactly their bytes (the memory ledger counts storage)."""
    from shardbound.runtime.numerics import contract
    x, w = data((300, 600), 41), data((200, 600), 42)

    def grad(t):
        with threads(t):
            xr = x.clone().requires_grad_(True)
            contract.matmul(xr, w, "blocked").sum().backward()
            return xr.grad

    assert same(grad(2), grad(1))
    small = S.blocked_matmul(x[:3], w)
    assert small.untyped_storage().nbytes() == 3 * 200 * 4
    assert S.dot_last(x[:3], w[0]).untyped_storage().nbytes() == 3 * 4


def test_few_column_products_keep_the_bits_of_the_padded_form():
    """Bias and box terms (N <= MIN_ROWS columns, many rows) run as the transposed GEMM
    with all blocks in one batched call: each element keeps the bits of the untransposed
    single-row product, for K with and without a partial last block, and any threads."""
    g = torch.Generator().manual_seed(11)
    for M, K, N in [(40, 300, 1), (700, 4096, 3), (33, 256, 8), (100, 1000, 2)]:
        x, w = data((M, K), M + K) * (torch.rand(M, K, generator=g) < 0.5), data((N, K), N)
        got = with_threads(3, lambda: S.blocked_matmul(x, w))
        for i in (0, M // 2, M - 1):
            assert same(got[i], S.blocked_matmul(x[i], w))       # 1 row: the padded form


@pytest.mark.parametrize("K", [200, 256, 700, 4096])
def test_dot_over_a_vectors_support_equals_the_dense_dot(K):
    """`support_dot`: a vector zero off its support (a ReLU's intercepts) dotted from the
    rows' entries there alone has the dense blocked dot's bits (the FMA chains skip zeros)."""
    from shardbound.runtime.numerics import support_dot

    if not support_dot.works():
        pytest.skip("no pinned BLAS here")
    if not support_dot.supported(K):    # the callers take the dense rows there
        pytest.skip(f"this machine's chain model leaves K={K}'s last block unmeasured")
    g = torch.Generator().manual_seed(K)
    for M, density in [(5, 0.3), (300, 0.05), (64, 1.0)]:
        a = data((M, K), M * K, spread=3.0) * (torch.rand(M, K, generator=g) < 0.6)
        support = (torch.rand(K, generator=g) < density).nonzero()[:, 0]
        v = torch.zeros(K)
        v[support] = torch.randn(len(support), generator=g)
        got = with_threads(2, lambda: support_dot.dot(a[:, support].contiguous(),
                                                     v[support], support, K))
        assert same(got, S.dot_last(a, v))


@pytest.mark.parametrize("seed", range(2))
def test_a_vector_per_row_equals_each_rows_own_product(seed):
    """`blocked_gemm.row_pairs` (dot_last with a vector per row: batched block diagonals)
    gives every row the bits of the blocked product of its two vectors, for any number of
    rows (padding to MIN_COLS), blocks, thread count and batch shape."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(12):
        K = rng.choice([1, 31, 256, 257, 700, 1300])
        G = rng.choice([1, 7, 32, 33, 300, 1100])
        a = torch.randn(G, K, generator=g) * torch.exp(2 * torch.randn(G, 1, generator=g))
        b = torch.randn(G, K, generator=g)
        got = with_threads(rng.randint(1, 4), lambda: S.dot_last(a.view(1, G, K), b))
        rows = sorted(rng.sample(range(G), min(G, 5)))
        for r in rows:
            assert same(got[0, r], S.blocked_matmul(a[r][None], b[r][None])[0, 0]), (G, K, r)
        assert same(got[0], with_threads(1, lambda: S.dot_last(a, b)))


def test_pool_threads_keep_one_mkl_thread_after_torch_parallel_work():
    """The tiles' threads run MKL on one thread even after torch work that starts OpenMP
    in them (a multi-block bias dot's batched GEMMs and tree adds): torch resets a
    thread's MKL count the first time it asks for it, which changed a T = 4 product's
    rows before `_worker_init` asked first."""
    x, w = data((32, 3000), 1), data((32, 3000), 2)
    ref = with_threads(1, lambda: S.blocked_matmul(x, w))
    rows, v = data((20000, 3000), 3), data((3000,), 4)
    with threads(4):
        S.dot_last(rows, v)                     # batched GEMMs in every pool thread
        assert same(S.blocked_matmul(x, w), ref)


@pytest.mark.parametrize("K", [10, 256, 784])
def test_few_rows_against_one_vector_equal_each_rows_product(K):
    """dot_last's short path for fewer than MIN_COLS rows and one vector (a bound's spec
    rows against a bias or a box centre) gives each row its own product's bits."""
    A, v = data((1, 9, K), K, spread=1.0), data((K,), 5)
    for b in (v, v.view(1, 1, K)):
        got = with_threads(2, lambda: S.dot_last(A, b))
        for i in range(9):
            assert same(got[0, i], S.blocked_matmul(A[0, i][None], v[None])[0, 0])
