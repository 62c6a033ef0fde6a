"""Determinism tests for runtime.summation (fast / blocked / exact orders).

Every determinism claim is checked bitwise with ``same`` (``torch.equal`` on the
int32 bit patterns: stricter than ``torch.equal`` on floats, which calls
+0 == -0 and NaN != NaN), never with allclose.
"""
from __future__ import annotations

import contextlib
import itertools
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from shardbound.runtime.numerics import blocktree as BT
from shardbound.runtime.numerics import ozaki as oz
from shardbound.runtime.numerics import summation as S

DET_ORDERS = ("blocked", "exact")


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of float32 tensors (shape, dtype and every bit)."""
    return (a.shape == b.shape and a.dtype == b.dtype == torch.float32
            and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)))


def with_threads(n, fn):
    with threads(n):
        return fn()


def data(shape, seed, spread=0.0):
    """Normal data, optionally log-normally scaled (wide dynamic range)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    if spread:
        t = t * torch.exp(torch.randn(shape, generator=g, dtype=torch.float64) * spread)
    return t.float()


# ----------------------------------------------------------------- exact reference
_F32_MAX = float(np.finfo(np.float32).max)
_OVERFLOW = Fraction(2) ** 128 - Fraction(2) ** 103      # RN32 goes to inf from here


def rn32(s: Fraction) -> float:
    """Correctly rounded float32 (ties to even) of an exact rational."""
    if abs(s) >= _OVERFLOW:
        return float("inf") if s > 0 else float("-inf")
    f = np.float32(min(max(float(s), -_F32_MAX), _F32_MAX))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    cands = [c for c in cands if np.isfinite(c)]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - s),
                                     int(np.array(c, dtype=np.float32).view(np.int32)) & 1))
    return float(best) + 0.0


def exact_ref(x, w):
    xs = [[Fraction(v) for v in row] for row in x.double().tolist()]
    ws = [[Fraction(v) for v in row] for row in w.double().tolist()]
    return torch.tensor([[rn32(sum(a * b for a, b in zip(r, c))) for c in ws] for r in xs],
                        dtype=torch.float32)


def ref64(x, w):
    return x.double() @ w.double().T


# ----------------------------------------------------------------- demonstration
def test_plain_matmul_changes_bits_with_threads_but_ours_do_not():
    """Find a shape where plain float32 matmul differs between 1 and 2 threads."""
    found = None
    for m, k, n in [(5, 256, 16), (7, 256, 64), (5, 784, 256), (7, 1000, 16), (3, 4096, 16)]:
        x, w = data((m, k), 1), data((n, k), 2)
        a = with_threads(1, lambda: x @ w.T)
        b = with_threads(2, lambda: x @ w.T)
        if not same(a, b):
            found = (x, w)
            break
    if found is None:
        pytest.skip("no shape found where plain matmul changes bits between 1 and 2 threads")
    x, w = found
    for order in DET_ORDERS:
        assert same(with_threads(1, lambda: S.matmul(x, w, order)),
                           with_threads(2, lambda: S.matmul(x, w, order)))


def test_plain_matmul_changes_bits_with_row_split():
    x, w = data((8, 784), 3), data((64, 784), 4)
    full = x @ w.T
    rows = torch.cat([x[i:i + 1] @ w.T for i in range(8)])
    if same(full, rows):
        pytest.skip("plain matmul happens to be row-split invariant here")
    for order in DET_ORDERS:
        f = S.matmul(x, w, order)
        assert same(f, torch.cat([S.matmul(x[i:i + 1], w, order) for i in range(8)]))


# ----------------------------------------------------------------- invariances
SHAPES = [(m, k, n) for m in (1, 5, 64) for k in (5, 50, 256, 784, 1000, 4096)
          for n in (17,)] + [(7, 1000, 300), (3, 257, 1)]


@pytest.mark.parametrize("order", DET_ORDERS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_thread_invariance(order, m, k, n):
    x, w = data((m, k), m * k + n, spread=1.0), data((n, k), k)
    a = with_threads(1, lambda: S.matmul(x, w, order))
    b = with_threads(2, lambda: S.matmul(x, w, order))
    assert same(a, b)


@pytest.mark.parametrize("order", DET_ORDERS)
def test_row_split_and_batch_dims(order):
    x, w = data((2, 9, 1000), 5, spread=1.0), data((40, 1000), 6)
    full = S.matmul(x, w, order)
    assert full.shape == (2, 9, 40)
    flat = x.reshape(18, 1000)
    assert same(full.reshape(18, 40), S.matmul(flat, w, order))
    for cuts in ([1] * 18, [5, 13], [2, 7, 9]):
        parts = torch.split(flat, cuts)
        got = torch.cat([S.matmul(p, w, order) for p in parts])
        assert same(got, full.reshape(18, 40))


@pytest.mark.parametrize("order", DET_ORDERS)
def test_layout_invariance(order):
    x, w = data((6, 600), 7), data((30, 600), 8)
    w_view = w.T.contiguous().T             # same values, transposed storage
    x_view = x.T.contiguous().T
    ref = S.matmul(x, w, order)
    assert same(S.matmul(x_view, w_view, order), ref)
    assert same(S.matmul(x, S.prepare_weight(w), order), ref)


# ----------------------------------------------------------------- blocked tree + K split
class Sym:
    """Symbolic value: records the addition tree."""

    def __init__(self, v):
        self.v = v

    def __add__(self, o):
        return self if isinstance(o, float) else Sym((self.v, o.v))


def level_by_level(items):
    level = list(items)
    while len(level) > 1:
        nxt = [(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    return level[0]


@pytest.mark.parametrize("n", range(1, 70))
def test_tree_shape(n):
    """The depth-first tree equals the level-by-level adjacent-pair tree."""
    leaves = [Sym(i) for i in range(n)]
    assert S.tree_reduce(leaves).v == level_by_level(range(n))
    assert BT._eval(0, n, lambda lo, hi: leaves[lo] if hi - lo == 1 else None).v == \
        level_by_level(range(n))


@pytest.mark.parametrize("K", [1, 5, 256, 257, 1000, 4096, 4097, 10000])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("balanced", [False, True])
def test_shard_k_ranges(K, P, balanced):
    rg = S.shard_k_ranges(K, P, balanced)
    assert len(rg) == P and rg[0][0] == 0 and rg[-1][1] == K
    for (a0, a1), (b0, b1) in zip(rg, rg[1:]):
        assert a1 == b0
    for k0, k1 in rg:
        assert k0 % S.BLOCK == 0 or k0 == K
        assert k1 % S.BLOCK == 0 or k1 == K
        if k1 > k0 and not balanced:
            assert len(S.tree_nodes(k0, k1, K)) == 1     # one subtotal per rank


@pytest.mark.parametrize("K", [5, 256, 1000, 2560, 4096, 4100])
def test_blocked_k_split_matches_single_process(K):
    x, w = data((5, K), K, spread=1.0), data((33, K), K + 1)
    ref = S.blocked_matmul(x, w)
    assert same(S.tree_reduce(S.block_partials(x, w)), ref)
    for P, balanced in itertools.product(range(1, 5), (False, True)):
        rg = S.shard_k_ranges(K, P, balanced)
        subs = []
        for r, (k0, k1) in enumerate(rg):              # each "rank" owns only its shard
            xs, ws = x[:, k0:k1].contiguous(), w[:, k0:k1].contiguous()
            subs.append(with_threads(1 + r % 2,
                                     lambda: S.shard_subtotals(xs, ws, k0, k1, K)))
            if not balanced and k1 > k0:
                assert len(subs[-1]) == 1
        assert same(S.combine_subtotals(subs, rg, K), ref), (P, balanced)
    # the brief's flow: block_partials on full operands for a rank's range + tree_reduce
    for k0, k1 in S.shard_k_ranges(K, 4):
        if k1 > k0:
            direct = S.tree_reduce(S.block_partials(x, w, k0, k1))
            assert same(direct, S.subtree_totals(
                S.block_partials(x, w, k0, k1), k0, k1, K)[0] + 0.0)


def test_blocked_many_rows_match_few_rows():
    """Many rows (row chunks, thread tiles) give the bits of few rows (one padded GEMM)."""
    x, w = data((80, 4100), 13, 1.0), data((24, 4100), 14)
    big = with_threads(2, lambda: S.blocked_matmul(x, w))
    assert same(big, with_threads(1, lambda: S.blocked_matmul(x, w)))
    assert same(big[:7], S.blocked_matmul(x[:7], w))
    assert same(big[79], S.blocked_matmul(x[79], w))


def test_blocked_prepared_weight_shards():
    K = 1300
    x, w = data((4, K), 11), data((20, K), 12)
    pw = S.prepare_weight(w)
    pw.padded()
    ref = S.blocked_matmul(x, w)
    assert same(S.blocked_matmul(x, pw), ref)
    rg = S.shard_k_ranges(K, 3)
    subs = [S.tree_reduce(S.block_partials(x, pw, k0, k1)) for k0, k1 in rg]
    assert same(S.combine_subtotals([[s] for s in subs], rg, K), ref)


def _blocked_error_bound(x, w):
    """Documented bound: a float32 GEMM per 256-block (FMA chains of at most 256 terms),
    then a float32 tree of depth ceil(log2 nb): (min(K, 256) + depth + 1) * 2**-24 *
    sum|x||w|, plus at most 2**-150 per product lost to subnormal underflow."""
    K = x.shape[1]
    nb = -(-K // S.BLOCK)
    depth = max(nb - 1, 0).bit_length()
    scale = x.double().abs() @ w.double().abs().T
    return 1.01 * (min(K, S.BLOCK) + depth + 1) * 2.0 ** -24 * scale + K * 2.0 ** -150


def test_blocked_accuracy_vs_float64():
    for seed, spread in [(0, 0.0), (1, 0.5), (2, 1.0)]:
        x, w = data((16, 3000), seed, spread), data((50, 3000), seed + 10, spread)
        err = (S.blocked_matmul(x, w).double() - ref64(x, w)).abs()
        scale = x.double().abs() @ w.double().abs().T
        assert bool((err <= 1e-5 * scale).all())
    for seed, spread in [(3, 2.0), (4, 4.0)]:          # heavy tails: the documented bound
        x, w = data((16, 3000), seed, spread), data((50, 3000), seed + 10, spread)
        err = (S.blocked_matmul(x, w).double() - ref64(x, w)).abs()
        assert bool((err <= _blocked_error_bound(x, w)).all())


def test_blocked_extreme_magnitudes():
    K = 600
    for scale_x, scale_w in [(1e-42, 1.0), (1e-20, 1e-20), (1e36, 1.0), (1e37, 1e37)]:
        x = (data((5, K), 81) * scale_x).float()
        w = (data((7, K), 82) * scale_w).float()
        got = with_threads(1, lambda: S.blocked_matmul(x, w))
        assert same(got, with_threads(2, lambda: S.blocked_matmul(x, w)))
        assert same(got[2:3], S.blocked_matmul(x[2:3], w))
        r = ref64(x, w)
        fin = r.abs() < 3e38
        bound = _blocked_error_bound(x, w) + 2.0 ** -149
        assert bool(((got.double() - r).abs()[fin] <= bound[fin]).all())
        assert not bool(torch.isfinite(got[~fin]).any())   # float32 overflow: inf/nan


def test_integer_data_all_orders_agree():
    """Small integers: every product and sum is exact, so all orders must agree."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-50, 50, (9, 3000), generator=g).float()
    w = torch.randint(-50, 50, (11, 3000), generator=g).float()
    want = ref64(x, w).float()
    for order in S.ORDERS:
        assert same(S.matmul(x, w, order), want)


# ----------------------------------------------------------------- exact
@pytest.mark.parametrize("seed,spread,k", [(0, 0.0, 37), (1, 3.0, 37), (2, 6.0, 20), (3, 1.0, 300)])
def test_exact_is_correctly_rounded(seed, spread, k):
    x, w = data((4, k), seed, spread), data((5, k), seed + 100, spread)
    x[0, : k // 2] *= -1
    want = exact_ref(x, w)
    for got in (S.matmul(x, w, "exact"), oz.exact_matmul(x, w, method="slices"),
                S.dot_last(x[:, None, :], w[None, :, :], "exact")):
        assert same(got, want)


def test_exact_hand_made_cases():
    t = lambda *v: torch.tensor([v], dtype=torch.float32)
    ones = lambda k: torch.ones(1, k)
    cases = [
        (t(1.0, 2.0 ** -24), ones(2), 1.0),                                 # tie -> even
        (t(1.0, 2.0 ** -24, 2.0 ** -60), ones(3), 1.0 + 2.0 ** -23),       # just above tie
        (t(1.0 + 2.0 ** -23, 2.0 ** -24), ones(2), 1.0 + 2.0 ** -22),      # tie -> even (up)
        (t(1e30, 1.0, -1e30), ones(3), 1.0),                                # cancellation
        (t(2.0 ** -149), t(0.5), 0.0),                                      # tie to zero
        (t(2.0 ** -149), t(0.75), 2.0 ** -149),                             # subnormal result
        (t(2.0 ** -149, 2.0 ** -149), t(0.5, 0.5), 2.0 ** -149),
        (t(3e38, 3e38), ones(2), float("inf")),                             # overflow
        (t(-3e38, -3e38), ones(2), float("-inf")),
        (t(-0.0, 0.0), t(1.0, -1.0), 0.0),                                  # zero is +0
    ]
    for x, w, want in cases:
        for got in (S.matmul(x, w, "exact")[0, 0], S.dot_last(x[0], w[0], "exact"),
                    oz.exact_matmul(x, w, method="slices")[0, 0]):
            assert got.item() == want and not (want == 0 and torch.signbit(got)), (x, w, got)
        assert float(exact_ref(x, w)[0, 0]) == want


def test_exact_within_half_ulp_of_float64_reference():
    x, w = data((64, 2000), 21, 1.0), data((96, 2000), 22, 1.0)
    got = S.matmul(x, w, "exact").double()
    r = ref64(x, w)
    half_ulp = (torch.nextafter(got.float(), torch.tensor(float("inf"))).double() - got) / 2
    slack = 2000 * 2.0 ** -53 * (x.double().abs() @ w.double().abs().T)   # float64 ref error
    assert bool(((got - r).abs() <= half_ulp + slack).all())


def test_exact_order_independence():
    """Same bits for permuted K, permuted partial sums and permuted slice terms."""
    K = 3000
    x, w = data((6, K), 31, 4.0), data((9, K), 32, 4.0)
    ref = S.matmul(x, w, "exact")
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(0))
    assert same(S.matmul(x[:, perm], w[:, perm], "exact"), ref)
    exps = oz.exact_exponents(x, w)
    parts = oz.exact_partials(x, w, exps, K)
    terms = [parts[s, t] * 2.0 ** (-20 * (s + t)) for s in range(parts.shape[0])
             for t in range(parts.shape[1])]
    base = oz.round_sum_f32(terms)
    rnd = random.Random(0)
    for _ in range(3):
        rnd.shuffle(terms)
        assert same(oz.round_sum_f32(terms), base)
        assert same(oz.round_sum_f32(terms, force_exact=True), base)


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_exact_k_split_with_allreduce(P):
    K = 2500
    x, w = data((5, K), 41, 2.0), data((7, K), 42, 2.0)
    x[1] = 0.0                                        # an all-zero row
    x[2, :1500] = 0.0                                 # zero on some ranks only
    ref = S.matmul(x, w, "exact")
    rnd = random.Random(P)
    cuts = sorted(rnd.sample(range(1, K), P - 1))     # arbitrary, unaligned split
    bounds = list(zip([0] + cuts, cuts + [K]))
    local = [oz.exact_exponents(x[:, a:b], w[:, a:b]) for a, b in bounds]
    exps = (torch.stack([e[0] for e in local]).amax(0),       # all-reduce MAX
            torch.stack([e[1] for e in local]).amax(0))
    parts = [with_threads(1 + r % 2, lambda: oz.exact_partials(x[:, a:b], w[:, a:b], exps, K))
             for r, (a, b) in enumerate(bounds)]
    for order in (list(range(P)), list(reversed(range(P))), rnd.sample(range(P), P)):
        total = parts[order[0]].clone()
        for r in order[1:]:
            total += parts[r]                         # all-reduce SUM, any order
        assert same(oz.exact_finalize(total, exps, K), ref)
    assert same(S.exact_matmul(x, w, exps=oz.exact_exponents(x, w)), ref)


def test_exact_internal_paths_agree():
    for k, spread in [(1, 0.0), (64, 3.0), (65, 0.0), (4096, 1.0)]:
        a, b = data((300, k), k, spread), data((300, k), k + 1)
        auto = oz._dot_rows(a, b)
        assert same(auto, oz._dot_rows(a, b, certify=False))
        assert same(auto, oz.exact_matmul(a, b).diagonal())
    x, w = data((20, 800), 51, 3.0), data((30, 800), 52, 3.0)
    assert same(oz.exact_matmul(x, w), oz.exact_matmul(x, w, method="slices"))
    # massive cancellation: nearly nothing certifies, auto falls back to slicing
    x = data((30, 40), 53)
    x[:, 0], x[:, 1] = 1e30, -1e30
    w = data((20, 40), 54).abs() + 1
    w[:, 1] = w[:, 0]
    want = exact_ref(x, w)
    assert same(oz.exact_matmul(x, w), want)
    assert same(S.dot_last(x[:, None], w[None], "exact"), want)


# ----------------------------------------------------------------- dot_last
def test_plain_sum_changes_bits_with_threads_but_dot_last_does_not():
    a, b = data((1 << 17,), 91), data((1 << 17,), 92)
    f1 = with_threads(1, lambda: S.dot_last(a, b, "fast"))
    f2 = with_threads(2, lambda: S.dot_last(a, b, "fast"))
    if same(f1, f2):
        pytest.skip("plain (a*b).sum() happens to be thread invariant here")
    for order in DET_ORDERS:
        assert same(with_threads(1, lambda: S.dot_last(a, b, order)),
                           with_threads(2, lambda: S.dot_last(a, b, order)))


@pytest.mark.parametrize("order", DET_ORDERS)
def test_dot_last_invariance_and_consistency(order):
    a, b = data((3, 70000), 61), data((3, 70000), 62)
    x = with_threads(1, lambda: S.dot_last(a, b, order))
    assert same(x, with_threads(2, lambda: S.dot_last(a, b, order)))
    for r in range(3):   # same bits as the matmul of the same vectors, and row split
        assert same(S.matmul(a[r:r + 1], b[r:r + 1], order)[0, 0], x[r])
        assert same(S.dot_last(a[r], b[r], order), x[r])
    for k in (1, 100, 256, 300):                                      # short K too
        assert same(S.dot_last(a[:, :k], b[:, :k], order),
                    S.matmul(a[:, :k], b[:, :k], order).diagonal())
    bc = S.dot_last(a[:, None, :1000], b[None, :2, :1000], order)    # broadcasting
    assert bc.shape == (3, 2)
    assert same(bc[2, 1], S.dot_last(a[2, :1000], b[1, :1000], order))


def test_dot_last_blocked_accuracy():
    a, b = data((10, 5000), 63, 1.0), data((10, 5000), 64)
    got = S.dot_last(a, b).double()
    ref = (a.double() * b.double()).sum(-1)
    assert bool(((got - ref).abs() <= 1e-5 * (a.double() * b.double()).abs().sum(-1)).all())


# ----------------------------------------------------------------- fast, errors, edges
def test_fast_is_plain_torch():
    x, w = data((2, 3, 100), 71), data((8, 100), 72)
    assert same(S.matmul(x, w, "fast"), torch.matmul(x, w.T))
    assert same(S.dot_last(x, w[:3], "fast"), (x * w[:3]).sum(-1))


def test_invalid_inputs():
    x, w = data((2, 10), 1), data((3, 10), 2)
    for bad in ("Fast", "tree", ""):
        with pytest.raises(ValueError):
            S.matmul(x, w, bad)
        with pytest.raises(ValueError):
            S.dot_last(x, x, bad)
    with pytest.raises(ValueError):
        S.matmul(x.double(), w, "blocked")
    with pytest.raises(ValueError):
        S.matmul(x, data((3, 11), 3), "blocked")
    with pytest.raises(ValueError):
        S.block_partials(x, w, 3, 10)                 # unaligned range


def _nonfinite_pattern(t):
    return torch.isnan(t), torch.isposinf(t), torch.isneginf(t)


@pytest.mark.parametrize("portable", [False, True])
def test_non_finite_operands_give_ieee_results_in_every_order(portable, monkeypatch):
    """inf/nan operands (a huge box overflowing, a 3e38 weight) give what IEEE float32
    gives -- the same inf/nan outputs as `fast`, the finite ones unchanged -- in every
    order and kernel, instead of a ValueError (runtime/numerics/nonfinite.py)."""
    from shardbound.runtime.numerics import blocked_gemm

    if portable:
        monkeypatch.setattr(blocked_gemm, "available", lambda *a: False)
    x, w = data((6, 600), 1), data((5, 600), 2)
    x[1, 3], x[2, 400], x[3, 7], x[3, 9] = float("inf"), float("nan"), float("inf"), -float("inf")
    w[4, 500] = -float("inf")
    fin_x, fin_w = x.clone(), w.clone()
    fin_x[1:4], fin_w[4] = 0.0, 0.0
    for order in DET_ORDERS:
        for a, b in ((x, w), (w, x)):
            got, ref = S.matmul(a, b, order), torch.matmul(a, b.T)
            for g, r in zip(_nonfinite_pattern(got), _nonfinite_pattern(ref)):
                assert torch.equal(g, r), order
        clean = S.matmul(fin_x, fin_w, order)
        ok = torch.isfinite(torch.matmul(x, w.T))
        assert torch.equal(S.matmul(x, w, order)[ok], clean[ok]), order
        got, ref = S.dot_last(x, x[0], order), (x * x[0]).sum(-1)
        for g, r in zip(_nonfinite_pattern(got), _nonfinite_pattern(ref)):
            assert torch.equal(g, r), order
        assert torch.equal(got[4:], S.dot_last(x[4:], x[0], order)), order


@pytest.mark.parametrize("order", S.ORDERS)
def test_edge_shapes_and_zero_sign(order):
    assert S.matmul(torch.zeros(3, 0), torch.zeros(4, 0), order).shape == (3, 4)
    assert S.matmul(torch.zeros(0, 5), torch.zeros(4, 5), order).shape == (0, 4)
    if order != "fast":
        z = S.matmul(torch.full((2, 300), -0.0), data((3, 300), 1), order)
        assert not bool(torch.signbit(z).any())
        assert not bool(torch.signbit(S.dot_last(torch.full((300,), -0.0),
                                                 torch.ones(300), order)))
