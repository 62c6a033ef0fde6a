"""Products with an fsdp weight matrix that is never gathered whole.

The fsdp gather/free schedule keeps one whole gathered parameter per node, and for a wide MLP
that one matrix (64 MiB for 4096x4096) is the part of the per-rank peak that does not fall
with P. Here a linear layer's products stream the weight in blocks (`ShardedParam.gather_block`)
and write each block's slice of the output:

- forward and IBP, y = x @ W.T: blocks of output rows of W, giving y[..., n0:n1];
- the CROWN backward pass, A_in = A @ W: blocks of columns of W, giving A_in[..., k0:k1].

Every block contracts over the whole of its dimension, so each output element is summed
exactly as in single mode; with the `blocked` and `exact` orders an element's bits do not
depend on which other rows or columns share its GEMM, so streaming changes no bit. (`fast`
BLAS gives no such promise, so fsdp with `fast` keeps whole gathers.)

alpha-CROWN differentiates through A @ W. Saving the gathered blocks for the gradient would
rebuild the whole matrix in memory, so `_StreamedBackward` saves nothing and gathers again in
its backward pass (rows of W this time), as FSDP re-gathers before a backward pass. Every
rank runs the same autograd graph, so the collectives line up.
"""

from __future__ import annotations

import torch

from shardbound.runtime.numerics import contract


def _a_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def forward_products(param, xs: list[torch.Tensor], absolute: list[bool], order: str
                     ) -> list[torch.Tensor]:
    """[x @ W.T (or x @ |W|.T)] for each x, gathering each row block of W once."""
    N = param.shape[0]
    outs = [torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device) for x in xs]
    for r0, r1 in param.row_chunks():
        w = param.gather_block(r0, r1, 0, param.shape[1])
        w_abs = w.abs() if any(absolute) else None
        for x, out, use_abs in zip(xs, outs, absolute):
            out[..., r0:r1] = contract.matmul(x, w_abs if use_abs else w, order)
        param.release_block(w)
    return outs


def _backward_products(param, As: list[torch.Tensor], order: str) -> list[torch.Tensor]:
    """[A (..., N) @ W (N, K)] for each A, gathering each column block of W once."""
    N, K = param.shape
    outs = [torch.empty((*A.shape[:-1], K), dtype=A.dtype, device=A.device) for A in As]
    # The outputs are live together with the A's and the block: the ledger sees them now (the
    # engine sets the exact A-matrix total after the step).
    param.ledger.add("a_matrix", sum(_a_bytes(out) for out in outs))
    for c0, c1 in param.column_chunks():
        w_t = param.gather_block(0, N, c0, c1).t().contiguous()
        for A, out in zip(As, outs):
            out[..., c0:c1] = contract.matmul(A, w_t, order)
        param.release_block(w_t)
    return outs


def _gradient_product(param, grad: torch.Tensor, order: str) -> torch.Tensor:
    """grad (..., K) @ W.T (K, N), one row block of W at a time."""
    (out,) = forward_products(param, [grad.contiguous()], [False], order)
    return out


class _StreamedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, param, order):
        ctx.param, ctx.order = param, order
        return _backward_products(param, [A.contiguous()], order)[0]

    @staticmethod
    def backward(ctx, grad):
        return _gradient_product(ctx.param, grad, ctx.order), None, None


def backward_products(param, As: list[torch.Tensor], order: str) -> list[torch.Tensor]:
    """A @ W for each A of the CROWN backward pass (the lower and upper side share the
    gathered blocks); differentiable w.r.t. A without keeping W."""
    if any(A.requires_grad for A in As):
        return [_StreamedBackward.apply(A, param, order) for A in As]
    return _backward_products(param, [A.contiguous() for A in As], order)
