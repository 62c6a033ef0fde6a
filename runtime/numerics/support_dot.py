"""``blocked`` dot products against a vector that is zero almost everywhere, without the zeros.

A ReLU's upper intercept is zero on every stable neuron (most of them), and under ``blocked``
its bias term ``sum_k a_k v_k`` must have the bits of the block GEMMs over the dense rows
(``blocked_gemm``). Those GEMMs are FMA chains (measured on MKL, single-threaded, >= 4 rows
and >= 24 columns), split by a chain model that depends on the CPU MKL dispatches for
(`CHAIN_MODELS`): on one machine one chain over k for a block of K <= 192, and for a full
block of 256 two chains, over k in [0, 128) and [128, 256), added; on an AVX-512 one (session
8's) one chain over every block of up to 256. `works()` probes which model this BLAS
follows (none: the callers take the dense rows). An FMA with a zero factor leaves the
chain as it is (``fma(a, 0, c) == c`` for finite a, up to the sign of a zero, which the
final ``+ 0.0`` makes +0), so each chain equals the chain over the vector's nonzeros alone,
in the same order, and appending zeros to a chain changes nothing. Here every chain is
computed from the nonzeros of its k range only (one batched GEMM over all chains, each
padded with zeros to the longest), the two chains of a block added, and the blocks summed
along the same pair tree: the bits of the dense product, from the rows' entries at the
vector's support alone (no dense rows). Under the two-chain model a block of 192 < K < 256 (the last one) has a
chain split not measured: `supported` says no and the caller takes the dense rows.
`tests/test_blocked_kernel.py` checks the equality bitwise on random supports, and
`works()` probes it once per process before any caller relies on it.
"""
from __future__ import annotations

import torch

from . import blocked_gemm
from .blocked_gemm import MIN_COLS, MIN_ROWS, _MKL_LOCAL, _tree_levels
from .blocktree import BLOCK, _num_blocks

# (half, one chain max) per chain model: a full block's chains split at `half` (BLOCK: one
# chain), and blocks (or padded chains) up to `one chain max` long are one chain
CHAIN_MODELS = ((128, 192), (BLOCK, BLOCK))
HALF, ONE_CHAIN_MAX = CHAIN_MODELS[0]      # the model in use (`works()` sets the probed one)
_CHUNK = 1 << 21           # elements of padded chain operands made at a time


def supported(K: int) -> bool:
    """Whether the chain split of every block of a K-long dot is known."""
    last = K - (_num_blocks(K) - 1) * BLOCK
    return K > 0 and (last == BLOCK or last <= ONE_CHAIN_MAX)


def per_block() -> int:
    """Chains per full block under the model in use (2: split at HALF; 1: one chain)."""
    return 1 if HALF >= BLOCK else 2


def num_chains(K: int) -> int:
    """The chains of a K-long dot (per_block() per block; the last block one or more)."""
    return per_block() * _num_blocks(K)


class Plan:
    """What a dot against one sparse vector needs, made once for all row chunks: the
    vector's nonzeros laid out by chain (`grid_chain`: per block, one or the two halves
    of the chain model), each chain padded with zeros to the longest."""

    def __init__(self, vals: torch.Tensor, support: torch.Tensor, K: int):
        self.K, self.n, self.nc = K, len(support), num_chains(K)
        self.chain = grid_chain(support, K)
        counts = torch.bincount(self.chain, minlength=self.nc)
        self.Kp = int(counts.max()) if self.n else 0
        start = torch.cumsum(counts, 0) - counts
        self.pos = torch.arange(self.n, device=support.device) - start[self.chain]
        self.vec = torch.zeros((self.nc, MIN_ROWS, self.Kp), dtype=torch.float32,
                               device=support.device)
        self.vec[self.chain, 0, self.pos] = vals

    def dot(self, cols: torch.Tensor) -> torch.Tensor:
        """(M,) float32: ``blocked`` ``dot_last(a, v)`` of rows a (M, K) with the vector,
        given only ``cols = a[:, support]`` (M, n): bitwise the dense call's (module doc)."""
        M = cols.shape[0]
        if self.n == 0 or M == 0:
            return torch.zeros(M, dtype=torch.float32, device=cols.device)

        def chains(a, b):
            xp = torch.zeros((self.nc, b - a, self.Kp), dtype=torch.float32,
                             device=cols.device)
            xp[self.chain, :, self.pos] = cols[a:b].T
            return xp
        return chain_sums(chains, self.vec, M)


def chain_sums(chains, vec: torch.Tensor, M: int) -> torch.Tensor:
    """(M,) float32: the blocked sums from their chains. ``chains(a, b)`` gives rows a..b's
    entries by chain, (num_chains, b - a, Kp) (`grid_chain`'s: under the two-chain model
    chain 2i and 2i+1 are block i's two halves; zeros where a chain is shorter); `vec`
    (num_chains, MIN_ROWS, Kp) the vector's entries alike in row 0. Each chain is one GEMM
    (<= ONE_CHAIN_MAX long: one FMA chain), all in one batched call per row chunk
    (>= MIN_COLS rows: the pinned shape), a block's two halves added, the blocks along the
    pair tree, then + 0.0."""
    L, _, Kp = vec.shape
    out = torch.empty(M, dtype=torch.float32, device=vec.device)
    step = max(MIN_COLS, _CHUNK // max(1, L * Kp))
    prev = _MKL_LOCAL(1)
    try:
        a = 0
        while a < M:
            b = M if M - (a + step) < MIN_COLS else a + step
            xp = chains(a, b)
            if b - a < MIN_COLS:                 # fewer rows than the pinned shape: zero rows
                xp = torch.cat([xp, xp.new_zeros((L, MIN_COLS - (b - a), Kp))], dim=1)
            parts = torch.bmm(vec, xp.transpose(1, 2))[:, 0]                # (chains, m)
            if per_block() == 2:
                parts = parts[0::2] + parts[1::2]
            out[a:b] = _tree_levels(parts)[:b - a] + 0.0
            a = b
    finally:
        _MKL_LOCAL(prev)
    return out


def grid_chain(p: torch.Tensor, K: int) -> torch.Tensor:
    """The chain of flat positions p of a K-long sum: block * 2 + half (two-chain model), or
    the block (one chain per block)."""
    block, within = p // BLOCK, p % BLOCK
    if per_block() == 1:
        return block
    return block * 2 + (((block + 1) * BLOCK <= K) & (within >= HALF)).long()


def dot(cols: torch.Tensor, vals: torch.Tensor, support: torch.Tensor, K: int) -> torch.Tensor:
    """`Plan(vals, support, K).dot(cols)`: the dense rows' ``blocked`` dot with a vector v
    (K,) that is zero off `support` (sorted flat positions), from ``cols = a[:, support]``
    and ``vals = v[support]``; K must be `supported`."""
    return Plan(vals, support, K).dot(cols)


_works: bool | None = None


def works(device=None) -> bool:
    """Whether this BLAS computes the chains as one of `CHAIN_MODELS` says: probed once per
    process on random rows and supports against the dense blocked product, the first model
    that matches every probe kept (HALF, ONE_CHAIN_MAX); False without MKL or when none
    matches. The model depends on the machine only, so every rank of a job on one kind of
    machine picks the same one (and the dense rows' bits are the same either way)."""
    global _works, HALF, ONE_CHAIN_MAX
    if _works is None:
        probe = torch.zeros(1, device=device)
        _works = False
        if blocked_gemm.available(probe):
            for model in CHAIN_MODELS:
                HALF, ONE_CHAIN_MAX = model
                if _probe():
                    _works = True
                    break
            else:
                HALF, ONE_CHAIN_MAX = CHAIN_MODELS[0]
    return _works


def _probe() -> bool:
    """Every probe dot (partial last blocks of both models' kinds, sparse and dense
    supports: padded chains up to ONE_CHAIN_MAX long) equal to the dense one."""
    from .summation import dot_last

    g = torch.Generator().manual_seed(20261201)
    for K in (200, 256, 700, 1024, 4096):
        for density in (0.1, 1.0):
            a = torch.randn(40, K, generator=g) * torch.exp(2 * torch.randn(40, 1, generator=g))
            support = (torch.rand(K, generator=g) < density).nonzero()[:, 0]
            v = torch.zeros(K)
            v[support] = torch.randn(len(support), generator=g)
            if supported(K) and not torch.equal(dot(a[:, support].contiguous(), v[support],
                                                    support, K), dot_last(a, v, "blocked")):
                return False
    return True
