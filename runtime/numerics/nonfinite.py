"""Contractions over operands that hold inf or nan, in the orders that slice their operands.

`exact` (Ozaki slices) and the portable `blocked` kernel cut every operand row on a grid
anchored at its largest exponent, which an infinite element does not have; they used to
refuse such operands, so a box of +-1e19 (whose bounds overflow float32 after a layer or
two) or a weight of 3e38 stopped a `blocked` run with a ValueError while `fast` went on.
What is right: the same answer as IEEE arithmetic gives, in every order. A row (or weight
row) holding inf or nan makes every output it meets non-finite (inf * 0 is nan), and which
one -- +inf, -inf or nan -- does not depend on the summation order (nan stays nan; +inf
and -inf together give nan; finite terms cannot cancel an infinity, and float64 sums of
float32 products never overflow). So such rows are contracted plainly in float64 (exact for
this purpose), the others by the order's kernel with the bad rows zeroed, and the results
put together: deterministic, and the same non-finite outputs as `fast`.

Infinite bounds are sound bounds; the runtime turns nan bounds into infinite ones where it
reports them (loader.finite_bounds), so nan is never printed as a bound.
"""
from __future__ import annotations

import torch


def matmul(kernel, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """`kernel(x, w_t)` (x (..., K) @ w_t (N, K).T) for operands that may be non-finite."""
    K, N = x.shape[-1], w_t.shape[0]
    if x.numel() == 0 or w_t.numel() == 0:
        return kernel(x, w_t)
    x2 = x.reshape(-1, K)
    bad_x = ~torch.isfinite(x2).all(dim=-1)
    bad_w = ~torch.isfinite(w_t).all(dim=-1)
    any_x, any_w = bool(bad_x.any()), bool(bad_w.any())
    if not (any_x or any_w):
        return kernel(x, w_t)
    xc = torch.where(bad_x.unsqueeze(-1), torch.zeros((), dtype=x.dtype, device=x.device), x2)
    wc = (torch.where(bad_w.unsqueeze(-1), torch.zeros((), dtype=w_t.dtype, device=w_t.device),
                      w_t) if any_w else w_t)
    out = kernel(xc.reshape(x.shape), wc).reshape(-1, N).clone()
    if any_x:
        out[bad_x] = (x2[bad_x].double() @ w_t.double().T).float()
    if any_w:
        out[:, bad_w] = (x2.double() @ w_t[bad_w].double().T).float()
    return out.reshape(*x.shape[:-1], N)


def dot_last(kernel, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`kernel(a, b)` (sum(a * b, -1), broadcasting) for operands that may be non-finite."""
    if a.numel() == 0 or b.numel() == 0:
        return kernel(a, b)
    fa, fb = torch.isfinite(a).all(dim=-1), torch.isfinite(b).all(dim=-1)
    if bool(fa.all()) and bool(fb.all()):
        return kernel(a, b)
    a, b = torch.broadcast_tensors(a, b)
    bad = ~torch.broadcast_to(fa & fb, a.shape[:-1])
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    out = kernel(torch.where(bad.unsqueeze(-1), zero, a),
                 torch.where(bad.unsqueeze(-1), zero, b)).clone()
    out[bad] = (a[bad].double() * b[bad].double()).sum(dim=-1).float()
    return out
