"""Reductions of Partial tensors in tp mode: how a zone's hidden channels are split over the
ranks, and how a contraction over that split dimension is finished across ranks.

A tp zone splits C hidden channels (neurons of an MLP layer, channels of a conv) over P ranks.
Every contraction over the hidden dimension -- the row layer's forward product, the column
layer's backward product, the bias terms of zone nodes in the CROWN backward pass -- is then a
sum of per-rank partials that has to be finished across ranks. How, depends on the summation
order (a registry, `REDUCTIONS`):

- `blocked`: the channel split sits on 256-block boundaries (`summation.shard_k_ranges` over
  the channels), so for a contraction over C*X elements (X = spatial size or kernel size per
  channel) every rank's range [c0*X, c1*X) is block aligned. Each rank reduces its blocks into
  the subtree totals of the fixed pair tree, the totals are all-gathered and every rank finishes
  the same tree (`combine_subtotals`): the bits are those of the single-process kernel, for
  every P. Ranks beyond the number of blocks own no channels and send nothing but still join.
- `fast`: an even split; partials are all-gathered and added in rank order (run-to-run equal,
  not across P).

`exact` is not offered in tp mode (the compiler refuses it): its K-split needs exponent
all-reduces per contraction, not built yet.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.numerics.shapes import broadcast_shape
from shardbound.runtime.numerics.summation import (BLOCK, combine_subtotals, shard_k_ranges,
                                          shard_subtotals, subtree_totals, tree_nodes)


GATHER_WHOLE_ELEMENTS = 1 << 16


class Reduction:
    """One zone's split on one rank: `ranges` (per-rank channel [start, stop)), this rank's
    (c0, c1), and the reductions of partials over that split."""

    name = "?"

    def __init__(self, channels: int, comm, ledger, order: str):
        self.channels, self.comm, self.ledger, self.order = int(channels), comm, ledger, order
        self.ranges = self.channel_ranges(self.channels, comm.world)
        self.c0, self.c1 = self.ranges[comm.rank]

    @staticmethod
    def channel_ranges(channels: int, P: int) -> list[tuple[int, int]]:
        raise NotImplementedError

    @property
    def local(self) -> int:
        return self.c1 - self.c0

    def matmul(self, x, w_t, X: int = 1) -> torch.Tensor:
        """Full `x @ w_t.T` from this rank's slices: x (..., local*X), w_t (N, local*X).
        Differentiable w.r.t. x (alpha-CROWN): the gradient of a sum over ranks w.r.t. this
        rank's summand is a local product."""
        if x.requires_grad:
            return _ReducedMatmul.apply(x, w_t, self, X)
        return self.reduce_matmul(x, w_t, X)

    def dot(self, a, b, X: int = 1) -> torch.Tensor:
        """Full `sum(a * b, -1)` from this rank's slices (b broadcast against a)."""
        if a.requires_grad or b.requires_grad:
            return _ReducedDot.apply(a, b, self, X)
        return self.reduce_dot(a, b, X)

    def column_matmul(self, x, w) -> torch.Tensor:
        """This rank's slice `x @ w.T` of a column layer: x replicated (..., K), w this rank's
        weight rows (local, K). Differentiable w.r.t. x (attacks): every rank's slice depends
        on all of x, so the gradient is the reduced sum over ranks of g @ w, which `blocked`
        adds in single mode's tree (the same bits as single mode's gradient)."""
        if x.requires_grad:
            return _ColumnMatmul.apply(x, w, self)
        return contract.matmul(x, w, self.order)

    def sum_partials(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks of equally shaped partials, added in rank order."""
        def finish(every):
            total = every[0, 0]
            for r in range(1, every.shape[0]):
                total = total + every[r, 0]
            return total

        return self._gathered(t.unsqueeze(0), finish)

    def reduce_matmul(self, x, w_t, X: int = 1) -> torch.Tensor:
        raise NotImplementedError

    def reduce_dot(self, a, b, X: int = 1) -> torch.Tensor:
        raise NotImplementedError

    def _gathered(self, buf: torch.Tensor, finish) -> torch.Tensor:
        """Reduce buf (count, *shape) -- count partials per rank -- elementwise across ranks:
        finish(every (P, count, n)) -> (n,). An output of more than GATHER_WHOLE_ELEMENTS is
        cut into P column chunks, gathered one at a time, so the receive buffer is ~1/P of
        what one all-gather would need (P times the output); the send and receive buffers are
        on the ledger ("collective")."""
        P, count, shape = self.comm.world, buf.shape[0], buf.shape[1:]
        M = math.prod(shape)
        flat = buf.reshape(count, M)
        # Small outputs go in one all-gather: chunking only pays for large ones (latency).
        step = M if M <= GATHER_WHOLE_ELEMENTS else max(1, -(-M // P))
        out = torch.empty(M, dtype=buf.dtype, device=buf.device)
        nbytes = (count * M + P * count * step) * buf.element_size()
        self.ledger.add("collective", nbytes)
        try:
            for m0 in range(0, M, step):
                part = flat[:, m0:m0 + step].contiguous()
                every = self.comm.all_gather_flat(part.reshape(-1)).reshape(P, count, -1)
                out[m0:m0 + part.shape[1]] = finish(every)
        finally:
            self.ledger.add("collective", -nbytes)
        return out.reshape(shape)


class BlockedReduction(Reduction):
    name = "blocked"

    def __init__(self, channels: int, comm, ledger, order: str):
        super().__init__(channels, comm, ledger, order)
        # A zone of fewer than two 256-blocks sits on one rank: that rank's subtotal is the
        # whole tree, i.e. the single-process kernel's result, computed in one call and sent
        # in one broadcast (per-block subtotals cost 1.7x the bound time in branch and bound).
        owners = [r for r, (c0, c1) in enumerate(self.ranges) if c1 > c0]
        self.sole_owner = owners[0] if len(owners) == 1 else None

    @staticmethod
    def channel_ranges(channels, P):
        return shard_k_ranges(channels, P)

    def _from_sole_owner(self, compute, shape, like) -> torch.Tensor:
        if self.comm.rank == self.sole_owner:
            out = compute().contiguous()
        else:
            out = torch.empty(shape, dtype=like.dtype, device=like.device)
        if self.comm.world > 1:
            nbytes = out.numel() * out.element_size()
            self.ledger.add("collective", nbytes)
            try:
                self.comm.broadcast_(out, self.sole_owner)
            finally:
                self.ledger.add("collective", -nbytes)
        return out

    def _k_ranges(self, X):
        return [(a * X, b * X) for a, b in self.ranges], self.channels * X

    def reduce_matmul(self, x, w_t, X=1):
        if self.sole_owner is not None:
            return self._from_sole_owner(lambda: contract.matmul(x, w_t, self.order),
                                         (*x.shape[:-1], w_t.shape[0]), x)
        ranges, K = self._k_ranges(X)
        k0, k1 = ranges[self.comm.rank]
        shape = (*x.shape[:-1], w_t.shape[0])
        mine = (shard_subtotals(x.contiguous(), w_t.contiguous(), k0, k1, K)
                if k1 > k0 and x.numel() else [])
        return self._combine(mine, shape, ranges, K, x)

    def reduce_dot(self, a, b, X=1):
        if self.sole_owner is not None:
            shape = broadcast_shape(a.shape, b.shape)[:-1]
            return self._from_sole_owner(lambda: contract.dot_last(a, b, self.order), shape, a)
        ranges, K = self._k_ranges(X)
        k0, k1 = ranges[self.comm.rank]
        shape = broadcast_shape(a.shape, b.shape)[:-1]
        mine = []
        if k1 > k0 and a.numel():
            nb = -(-(k1 - k0) // BLOCK)

            def blocks_of(t):
                pad = nb * BLOCK - t.shape[-1]
                t = torch.nn.functional.pad(t, (0, pad)) if pad else t
                return t.reshape(*t.shape[:-1], nb, BLOCK)

            ap, bp = blocks_of(a), blocks_of(b)
            # One block per row of the padded view: each value depends only on the block's
            # two vectors, bitwise what the whole-K dot_last computes for that block.
            if b.dim() == 1:    # one vector (a bias) for every row: one GEMM per block
                parts = [contract.matmul(ap[..., j, :], bp[j:j + 1], "blocked")[..., 0]
                         for j in range(nb)]
            else:
                parts = list(contract.dot_last(ap, bp, "blocked").unbind(-1))
            mine = subtree_totals(parts, k0, k1, K)
        return self._combine(mine, shape, ranges, K, a)

    def _combine(self, mine, shape, ranges, K, like):
        counts = [len(tree_nodes(k0, k1, K)) for k0, k1 in ranges]
        buf = torch.zeros((max(counts), *shape), dtype=like.dtype, device=like.device)
        for i, t in enumerate(mine):
            buf[i] = t

        def finish(every):
            subtotals = [list(every[r, :counts[r]].unbind(0)) for r in range(len(ranges))]
            return combine_subtotals(subtotals, ranges, K)

        return self._gathered(buf, finish)


class FastReduction(Reduction):
    name = "fast"

    @staticmethod
    def channel_ranges(channels, P):
        size = -(-channels // P)
        return [(min(r * size, channels), min((r + 1) * size, channels)) for r in range(P)]

    def reduce_matmul(self, x, w_t, X=1):
        part = torch.matmul(x, w_t.t()) if x.shape[-1] else torch.zeros(
            (*x.shape[:-1], w_t.shape[0]), dtype=x.dtype, device=x.device)
        return self._sum(part)

    def reduce_dot(self, a, b, X=1):
        return self._sum((a * b).sum(-1))

    def _sum(self, part):
        return self.sum_partials(part)


class _ReducedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_t, red, X):
        ctx.save_for_backward(w_t)
        ctx.order = red.order
        return red.reduce_matmul(x.detach(), w_t, X)

    @staticmethod
    def backward(ctx, grad):
        (w_t,) = ctx.saved_tensors
        if w_t.shape[1] == 0:           # no channels on this rank
            return grad.new_zeros((*grad.shape[:-1], 0)), None, None, None
        return (contract.matmul(grad.contiguous(), w_t.t().contiguous(), ctx.order),
                None, None, None)


class _ColumnMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, red):
        ctx.save_for_backward(w)
        ctx.red = red
        return contract.matmul(x.detach(), w, red.order)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return ctx.red.reduce_matmul(grad.contiguous(), w.t().contiguous()), None, None


class _ReducedDot(torch.autograd.Function):
    """The gradient of a sum over ranks w.r.t. this rank's slices of a and b is local; b
    needs one when it is an intercept that depends on alpha (see contract._OrderedDot)."""

    @staticmethod
    def forward(ctx, a, b, red, X):
        ctx.save_for_backward(b, a if ctx.needs_input_grad[1] else None)
        ctx.a_shape, ctx.b_shape = a.shape, b.shape
        return red.reduce_dot(a.detach(), b.detach(), X)

    @staticmethod
    def backward(ctx, grad):
        b, a = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = (grad.unsqueeze(-1) * b).expand(ctx.a_shape)
        if ctx.needs_input_grad[1]:
            gb = (grad.unsqueeze(-1) * a).sum_to_size(ctx.b_shape)
        return ga, gb, None, None


class _LocalOfReplicated(torch.autograd.Function):
    """y = fn(A): this rank's slice computed from a replicated A. Every rank's slice depends
    on A, so the gradient w.r.t. A is the sum over ranks of each rank's part: recomputed
    locally, then reduced (Megatron's conjugate of the reduction above)."""

    @staticmethod
    def forward(ctx, A, fn, red):
        ctx.save_for_backward(A)
        ctx.fn, ctx.red = fn, red
        with torch.no_grad():
            return fn(A)

    @staticmethod
    def backward(ctx, grad):
        (A,) = ctx.saved_tensors
        with torch.enable_grad():
            A_ = A.detach().requires_grad_(True)
            out = ctx.fn(A_)
            part = None
            if out.requires_grad:       # a rank without channels has a constant part
                # The vector-Jacobian product as the gradient of <out, grad>: autograd hands
                # `out` exactly `grad` (1 * grad), so the bits are those of grad_outputs=grad,
                # whose shape check imports sympy on first use (~0.5 s in every rank).
                (part,) = torch.autograd.grad((out * grad).sum(), A_, allow_unused=True)
        if part is None:
            part = torch.zeros_like(A)
        return ctx.red.sum_partials(part.contiguous()), None, None


def local_of_replicated(red, A: torch.Tensor, fn):
    """fn(A) for a replicated A, differentiable across ranks (see _LocalOfReplicated)."""
    if A.requires_grad:
        return _LocalOfReplicated.apply(A, fn, red)
    return fn(A)


REDUCTIONS = {cls.name: cls for cls in (BlockedReduction, FastReduction)}


def channel_ranges(order: str, channels: int, P: int) -> list[tuple[int, int]]:
    """The per-rank channel split of a zone (what `inspect --nproc P` shows)."""
    return REDUCTIONS[order].channel_ranges(channels, P)


def spatial(shape) -> int:
    """Elements per channel of a per-sample shape (1 for a vector)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1
