"""Projected-gradient search for counterexamples inside an input box.

For each conjunction of the violation region {C f(x) <= d}, minimise the largest row margin
max_i (C_i f(x) - d_i) over the box with signed-gradient steps from several starting points
(the centre, then seeded random points); a point whose margin is <= 0 is a candidate that the
caller confirms with a plain forward pass. Seeded, so repeated runs find the same point.

Several boxes can be searched in one call (lo, hi of shape (K, n)): every (box, conjunction,
restart) is one row of the same batch, so K boxes cost about what one does on a small network
(a step's time is per call, not per row: branch and bound attacks its most promising domains
this way; one call per domain took 58% of ACAS Xu 1_1/prop_5's input splitting).
"""

from __future__ import annotations

import numpy as np
import torch


def pgd(forward, lo: torch.Tensor, hi: torch.Tensor, C: torch.Tensor, d: np.ndarray,
        owner: np.ndarray, restarts: int = 8, steps: int = 60, seed: int = 0,
        stop=None, forward64=None) -> torch.Tensor | None:
    """A point x in [lo, hi] (flattened) with all rows of some conjunction satisfied, or None.
    lo, hi: one box (any shape of n elements) or K boxes (K, n), searched together (the
    point returned lies in one of them).

    forward: (N, n) -> (N, m) flattened outputs. C (R, m), d (R,), owner (R,) conjunction index.
    stop() (a time budget, the same answer on every rank) is asked before each step: the
    search then ends with None unless the points evaluated so far hold a hit.
    A hit is a margin <= 0 (the region is non-strict) in float32 or, for the same float32
    outputs, in float64 (a threshold that float32 rounds past); with `forward64` (the
    network in float64) the last points are evaluated that way too.
    """
    groups = [np.nonzero(owner == j)[0] for j in range(int(owner.max()) + 1)] if len(owner) else []
    if not groups:
        return None
    gen = torch.Generator().manual_seed(seed)
    n = lo.shape[-1] if lo.dim() == 2 else lo.numel()
    lo, hi = lo.reshape(-1, n), hi.reshape(-1, n)
    per_box = len(groups) * restarts
    d_t = torch.tensor(d, dtype=torch.float32)
    # Every (box, conjunction, restart) is one row of the batch (one box: the same random
    # starts as ever).
    starts = torch.rand(len(lo) * per_box, n, generator=gen)
    starts[::restarts] = 0.5                                  # the centre first
    lo, hi = lo.repeat_interleave(per_box, dim=0), hi.repeat_interleave(per_box, dim=0)
    x = (lo + starts * (hi - lo)).clamp(lo, hi)
    masks = torch.zeros(per_box, C.shape[0], dtype=torch.bool)
    for j, rows in enumerate(groups):
        masks[j * restarts:(j + 1) * restarts, torch.as_tensor(rows)] = True
    masks = masks.repeat(len(x) // per_box, 1)
    momentum = torch.zeros_like(x)
    C64, d64 = C.double(), torch.from_numpy(np.asarray(d, np.float64))

    def worst_of(margins):
        return torch.where(masks, margins, torch.full_like(margins, -torch.inf)).max(dim=1).values

    for it in range(steps + 1):
        x = x.detach().requires_grad_(True)
        y = forward(x)
        margins = y @ C.T - d_t                                 # (N, R)
        worst = worst_of(margins)
        hit = ((worst <= 0) | (worst_of(y.detach().double() @ C64.T - d64) <= 0)).nonzero()
        if len(hit):
            return x[int(hit[0])].detach()
        if it == steps or (stop is not None and stop()):
            if forward64 is not None:
                with torch.no_grad():
                    hit = (worst_of(forward64(x.detach()) @ C64.T - d64) <= 0).nonzero()
                if len(hit):
                    return x[int(hit[0])].detach()
            break
        (grad,) = torch.autograd.grad(worst.sum(), x)
        with torch.no_grad():
            # Momentum on the normalised gradient, and a step that shrinks linearly from a
            # quarter of the box to a hundredth: large moves first, then fine tuning.
            g = grad / grad.abs().sum(dim=1, keepdim=True).clamp(min=1e-30)
            momentum = 0.75 * momentum + g
            step = (hi - lo) * (0.25 * (1 - it / steps) + 0.01)
            x = torch.maximum(torch.minimum(x - step * momentum.sign(), hi), lo)
    return None
