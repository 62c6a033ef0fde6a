"""Every contraction a bound kernel performs goes through this module.

Bound propagation spends its time in three kinds of sums: matrix products (forward, IBP and the
CROWN backward pass through linear layers), bias terms (A-matrix times bias vector) and the final
concretisation (A-matrix against the input box). Routing all of them through one place lets the
summation order be chosen per program (`fast`, `blocked`, `exact`) without touching the ops.
The order is always passed explicitly: there is no module-level default to drift between runs.
"""

from __future__ import annotations

import torch

ORDERS = ("fast", "blocked", "exact")


def _fast_matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w_t.t())


def _fast_sum_last(a: torch.Tensor) -> torch.Tensor:
    return a.sum(dim=-1)


def _summation_module():
    """The deterministic kernels, imported lazily (they are only needed for their orders)."""
    from shardbound.runtime import summation

    return summation


def matmul(x: torch.Tensor, w_t: torch.Tensor, order: str) -> torch.Tensor:
    """`x @ w_t.T` with x (..., K) and w_t (N, K), summed over K in the given order."""
    if order == "fast":
        return _fast_matmul(x, w_t)
    if order in ORDERS:
        return _summation_module().matmul(x.contiguous(), w_t.contiguous(), order)
    raise ValueError(f"unknown summation order {order!r}; choose one of {', '.join(ORDERS)}")


def sum_last(a: torch.Tensor, order: str) -> torch.Tensor:
    """Sum over the last dimension in the given order."""
    if order == "fast":
        return _fast_sum_last(a)
    if order in ORDERS:
        ones = torch.ones(a.shape[-1], dtype=a.dtype, device=a.device)
        return _summation_module().dot_last(a.contiguous(), ones.expand_as(a).contiguous(), order)
    raise ValueError(f"unknown summation order {order!r}; choose one of {', '.join(ORDERS)}")


def dot_last(a: torch.Tensor, b: torch.Tensor, order: str) -> torch.Tensor:
    """Sum over the last dimension of `a * b` (b broadcast to a) in the given order."""
    b = b.expand_as(a)
    if order == "fast":
        return (a * b).sum(dim=-1)
    if order in ORDERS:
        return _summation_module().dot_last(a.contiguous(), b.contiguous(), order)
    raise ValueError(f"unknown summation order {order!r}; choose one of {', '.join(ORDERS)}")
