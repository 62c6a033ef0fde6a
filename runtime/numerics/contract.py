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

Non-finite operands (infinite bounds: an op whose input box leaves its domain, log near 0;
NaN from arithmetic on them): the deterministic kernels take finite operands only, so
`blocked` and `exact` sum the finite products in their order and count the infinite ones
apart, exactly, with 0 * inf = 0, and NaN where +inf meets -inf or an operand is NaN (the
engine turns NaN bounds into vacuous ones). `fast` keeps IEEE arithmetic (0 * inf is NaN).

The order is always passed explicitly: there is no module-level default to drift between runs.
Gradients (alpha-CROWN optimises through these sums) use the same order for the backward
products, so optimised slopes are as reproducible as the bounds.
"""

from __future__ import annotations

import math

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
        ctx.save_for_backward(w_t)
        ctx.order = order
        return _ordered_matmul(x, w_t, order)

    @staticmethod
    def backward(ctx, grad):
        (w_t,) = ctx.saved_tensors
        return _ordered_matmul(grad, w_t.t(), ctx.order), None, None


class _OrderedDot(torch.autograd.Function):
    """sum(a * b, -1) in a fixed order. Either side may need a gradient: a (A-matrices) in
    alpha-CROWN, b too when it is a relaxation's intercept that depends on alpha (smooth
    ops). A broadcast b's gradient is summed over the broadcast dims by torch; the engine's
    intercepts that need gradients carry every row, so nothing is summed across rows."""

    @staticmethod
    def forward(ctx, a, b, order):
        ctx.save_for_backward(b, a if ctx.needs_input_grad[1] else None)
        ctx.a_shape, ctx.b_shape = a.shape, b.shape
        return _ordered_dot(a, b, order)

    @staticmethod
    def backward(ctx, grad):
        b, a = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = (grad.unsqueeze(-1) * b).expand(ctx.a_shape)
        if ctx.needs_input_grad[1]:
            gb = (grad.unsqueeze(-1) * a).sum_to_size(ctx.b_shape)
        return ga, gb, None


def matmul(x: torch.Tensor, w_t: torch.Tensor, order: str) -> torch.Tensor:
    """`x @ w_t.T` with x (..., K) and w_t (N, K), summed over K in the given order."""
    if order == "fast":
        return torch.matmul(x, w_t.t())
    _check(order)
    if x.numel() == 0:      # a rank that owns no rows of this pass
        return torch.zeros((*x.shape[:-1], w_t.shape[0]), dtype=x.dtype, device=x.device)
    if x.requires_grad:
        return _OrderedMatmul.apply(x, w_t, order)
    return _ordered_matmul(x, w_t, order)


def dot_last(a: torch.Tensor, b: torch.Tensor, order: str) -> torch.Tensor:
    """Sum over the last dimension of `a * b` (b broadcast against a) in the given order."""
    if order == "fast":
        return (a * b).sum(dim=-1)
    _check(order)
    if a.numel() == 0 or b.numel() == 0:
        return (a * b).sum(dim=-1)          # empty: nothing to order
    if a.requires_grad or b.requires_grad:
        return _OrderedDot.apply(a, b, order)
    return _ordered_dot(a, b, order)


def sum_last(a: torch.Tensor, order: str) -> torch.Tensor:
    """Sum over the last dimension in the given order."""
    if order == "fast":
        return a.sum(dim=-1)
    return dot_last(a, torch.ones(a.shape[-1], dtype=a.dtype, device=a.device), order)


# -- non-finite operands under the deterministic orders -------------------------------------------
def _finite(*ts) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _ordered_matmul(x, w_t, order):
    try:
        return _kernels().matmul(x.contiguous(), w_t.contiguous(), order)
    except ValueError:
        if _finite(x, w_t):
            raise
    return _nonfinite(x, w_t, lambda a, b: _kernels().matmul(a.contiguous(), b.contiguous(), order),
                      lambda a, b: torch.matmul(a, b.t()))


def _ordered_dot(a, b, order):
    try:
        return _kernels().dot_last(a.contiguous(), b.contiguous(), order)
    except ValueError:
        if _finite(a, b):
            raise
    return _nonfinite(a, b, lambda u, v: _kernels().dot_last(u.contiguous(), v.contiguous(), order),
                      lambda u, v: (u * v).sum(-1))


def _nonfinite(a, b, ordered, count):
    """`ordered(a, b)` (a matmul or a dot) with non-finite operands: the finite products in
    the order, plus the infinite terms counted by `count` on 0 / 1 indicators (exact integer
    sums, so in any order): +inf / -inf where only one sign occurs, NaN where both do or an
    operand is NaN; 0 * inf = 0."""
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    out = ordered(torch.where(torch.isfinite(a), a, zero), torch.where(torch.isfinite(b), b, zero))

    def ind(mask):
        return mask.to(a.dtype)

    a_pinf, a_ninf, b_pinf, b_ninf = a == math.inf, a == -math.inf, b == math.inf, b == -math.inf
    a_pos, a_neg, b_pos, b_neg = a > 0, a < 0, b > 0, b < 0
    up = (count(ind(a_pinf), ind(b_pos)) + count(ind(a_ninf), ind(b_neg))
          + count(ind(a_pos), ind(b_pinf)) + count(ind(a_neg), ind(b_ninf)))
    down = (count(ind(a_pinf), ind(b_neg)) + count(ind(a_ninf), ind(b_pos))
            + count(ind(a_pos), ind(b_ninf)) + count(ind(a_neg), ind(b_pinf)))
    nan = count(ind(torch.isnan(a)), torch.ones_like(ind(b_pos))) + count(
        torch.ones_like(ind(a_pos)), ind(torch.isnan(b)))
    out = torch.where(up > 0, math.inf, out)
    out = torch.where(down > 0, -math.inf, out)
    return torch.where((nan > 0) | ((up > 0) & (down > 0)), math.nan, out)
