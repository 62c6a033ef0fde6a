"""Every contraction a bound kernel performs goes through this module.

Bound propagation spends its time in three kinds of sums: matrix products (forward, IBP and the
CROWN backward pass through linear layers and im2col convolutions), bias terms (A-matrix times
bias vector) and the final concretisation (A-matrix against the input box). Routing all of them
through one place lets the summation order be chosen per program without touching the ops:

- `fast`: plain BLAS; bits repeat run to run only.
- `blocked`: fixed 256-blocks, one bit-pinned float32 GEMM per block, a fixed pairwise tree
  over blocks (shardbound.runtime.numerics.summation): the same bits for any thread count, row batching
  or rank count on one machine and BLAS.
- `exact`: correctly rounded (Ozaki slices): the same bits on any BLAS or device too.

The order is always passed explicitly: there is no module-level default to drift between runs.
Gradients (alpha-CROWN optimises through these sums) use the same order for the backward
products, so optimised slopes are as reproducible as the bounds.
"""

from __future__ import annotations

import torch

ORDERS = ("fast", "blocked", "exact")


def _kernels():
    """The deterministic kernels, imported lazily (only their orders need them)."""
    from shardbound.runtime.numerics import summation

    return summation


def _check(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"unknown summation order {order!r}; choose one of {', '.join(ORDERS)}")


class _OrderedMatmul(torch.autograd.Function):
    """x @ w_t.T in a fixed order; the gradient w.r.t. x is g @ w_t in the same order (the
    weights never need gradients in bound propagation)."""

    @staticmethod
    def forward(ctx, x, w_t, order):
        if isinstance(w_t, torch.Tensor):
            ctx.save_for_backward(w_t)
            ctx.prepared = None
            w_t = w_t.contiguous()
        else:                           # a prepared operand (see `prepare`): kept by its owner
            ctx.prepared = w_t
        ctx.order = order
        return _kernels().matmul(x.contiguous(), w_t, order)

    @staticmethod
    def backward(ctx, grad):
        if ctx.prepared is not None:
            w = ctx.prepared.transposed()
        else:
            (w_t,) = ctx.saved_tensors
            w = w_t.t().contiguous()
        return _kernels().matmul(grad.contiguous(), w, ctx.order), None, None


class _OrderedDot(torch.autograd.Function):
    """sum(a * b, -1) in a fixed order. Either side may need a gradient: a (A-matrices) in
    alpha-CROWN, b too when it is a relaxation's intercept that depends on alpha (smooth
    ops). A broadcast b's gradient is summed over the broadcast dims by torch; the engine's
    intercepts that need gradients carry every row, so nothing is summed across rows."""

    @staticmethod
    def forward(ctx, a, b, order):
        ctx.save_for_backward(b, a if ctx.needs_input_grad[1] else None)
        ctx.a_shape, ctx.b_shape = a.shape, b.shape
        return _kernels().dot_last(a.contiguous(), b.contiguous(), order)

    @staticmethod
    def backward(ctx, grad):
        b, a = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = (grad.unsqueeze(-1) * b).expand(ctx.a_shape)
        if ctx.needs_input_grad[1]:
            gb = (grad.unsqueeze(-1) * a).sum_to_size(ctx.b_shape)
        return ga, gb, None


def prepare(w_t: torch.Tensor, order: str, w: torch.Tensor | None = None):
    """`w_t` (N, K) as the operand of many products `matmul(x, ., order)`: what each order
    derives from a weight (the ordered kernels' padded copy, `exact`'s float64 slices) is
    then made once, not per call; `w`, when the caller holds w_t's transpose contiguous,
    serves the gradient. Bits are those of passing `w_t` itself. Do not modify w_t after."""
    if order == "fast":
        return w_t
    _check(order)
    return _kernels().PreparedWeight(w_t.contiguous(), transposed=w)


def matmul(x: torch.Tensor, w_t, order: str) -> torch.Tensor:
    """`x @ w_t.T` with x (..., K) and w_t (N, K) (a tensor, or `prepare`'s operand), summed
    over K in the given order."""
    if order == "fast":
        return torch.matmul(x, getattr(w_t, "w_t", w_t).t())
    _check(order)
    if x.numel() == 0:      # a rank that owns no rows of this pass
        return torch.zeros((*x.shape[:-1], w_t.shape[0]), dtype=x.dtype, device=x.device)
    if x.requires_grad:
        return _OrderedMatmul.apply(x, w_t, order)
    if isinstance(w_t, torch.Tensor):
        w_t = w_t.contiguous()
    return _kernels().matmul(x.contiguous(), w_t, order)


def dot_last(a: torch.Tensor, b: torch.Tensor, order: str) -> torch.Tensor:
    """Sum over the last dimension of `a * b` (b broadcast against a) in the given order.
    `fast` contracts with a matrix product (no full-size temporary `a * b`) where b is one
    vector or one vector per leading batch entry: the shapes every bias and box term has."""
    if order == "fast":
        return _fast_dot(a, b)
    _check(order)
    if a.numel() == 0 or b.numel() == 0:
        return (a * b).sum(dim=-1)          # empty: nothing to order
    if a.requires_grad or b.requires_grad:
        return _OrderedDot.apply(a, b, order)
    return _kernels().dot_last(a.contiguous(), b.contiguous(), order)


def sum_last(a: torch.Tensor, order: str) -> torch.Tensor:
    """Sum over the last dimension in the given order."""
    if order == "fast":
        return a.sum(dim=-1)
    return dot_last(a, torch.ones(a.shape[-1], dtype=a.dtype, device=a.device), order)


def _fast_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) as a BLAS product: b (K,) -> a matrix-vector product over all rows; b
    (..., 1, K) against a (..., S, K) with the same leading dims -> a batched one; anything
    else (or an empty operand) elementwise."""
    if a.numel() == 0 or b.numel() == 0 or a.dtype != b.dtype:
        return (a * b).sum(dim=-1)
    if b.dim() == 1 and a.dim() >= 1 and a.shape[-1] == b.shape[0]:
        return torch.matmul(a, b)
    if (a.dim() >= 2 and b.dim() == a.dim() and b.shape[-2] == 1
            and b.shape[:-2] == a.shape[:-2] and b.shape[-1] == a.shape[-1]):
        return torch.matmul(a, b.transpose(-1, -2)).squeeze(-1)
    return (a * b).sum(dim=-1)
