"""An open ReLU branch-and-bound tree, kept when `relu_split` stops so that a later call
continues it instead of starting again.

`verify` first runs branch and bound on the root prior as it is, then refines the prior
(runtime/engine/split_refine.py) and goes on: the tree of the first try is continued under
the refined bounds. Sound: every refined bound holds on the whole box, hence on every
domain, so each open domain's carried bounds are intersected with it (a tighter prior can
only raise a bound; lower > upper shows a domain empty, which the next round counts as
proved); the proved share stays proved (its leaves' proofs did not use the refinement), and
the kept alphas and betas are only where the optimiser starts (any start is sound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class BabState:
    """The open domains (aligned rows) and the counters of a stopped `relu_split`."""
    stack: torch.Tensor             # (N, sign-split neurons) int8 assumptions
    depth: torch.Tensor             # (N,) float64: a leaf weighs 2^-depth of the tree
    key: torch.Tensor               # (N,) float64: the parent's margin, most violated first
    warm: torch.Tensor              # (N, width): the parents' alphas and betas, flattened
    has: torch.Tensor               # (N,) bool: which domains have them
    bounds: torch.Tensor | None     # (N, 2, local neurons): carried intermediate bounds
    cuts: torch.Tensor | None       # interval assumptions (--soundness real/float32), or None
    store: WarmAlphas               # holds the layout of `warm`
    bounded: int                    # domains bounded so far
    verified: float                 # proved share of the tree
    unresolved: int                 # open leaves with nothing left to split, set aside
    rounds: int                     # rounds so far (the attacks' seeds)
    plb: torch.Tensor               # (N, S): the parents' bounds per spec row
    rbounds: torch.Tensor | None = None   # (N, 2, neurons) float64: carried rigorous bounds


def tightened(bounds: torch.Tensor | None, prior: torch.Tensor, n: int) -> torch.Tensor:
    """The n domains' carried bounds (n, 2, neurons) intersected with `prior` (1, 2,
    neurons), bounds that hold on the whole box; the prior itself where none are carried."""
    if bounds is None:
        return prior.expand(n, -1, -1).clone()
    return torch.stack([torch.maximum(bounds[:, 0], prior[:, 0]),
                        torch.minimum(bounds[:, 1], prior[:, 1])], dim=1)


class WarmAlphas:
    """Optimised alphas kept per open domain (flattened, on the CPU), so that children start
    beta-CROWN from their parent's slopes. Capped at `cap_bytes` in all: past that, warm
    starts stop for the rest of the run (children start from CROWN's slopes, as the root)."""

    def __init__(self, cap_bytes: int):
        self.cap = cap_bytes
        self.layout = None          # [(op name, shape after the batch dimension)]
        self.on = True

    def flatten(self, alphas: dict, b: int) -> torch.Tensor:
        if self.layout is None:
            self.layout = [(k, tuple(v.shape[1:])) for k, v in alphas.items()]
        return torch.cat([alphas[k].reshape(b, -1).cpu() for k, _ in self.layout], dim=1)

    def unflatten(self, flat: torch.Tensor, device) -> dict:
        out, at = {}, 0
        for k, shape in self.layout:
            size = math.prod(shape)
            out[k] = flat[:, at:at + size].reshape(len(flat), *shape).to(device)
            at += size
        return out

    def width(self) -> int:
        return sum(math.prod(shape) for _, shape in self.layout) if self.layout else 0

    def fits(self, rows: int) -> bool:
        self.on = self.on and rows * self.width() * 4 <= self.cap
        return self.on


class Rows:
    """A per-domain tensor of branch and bound's stack that grows at its end in amortised
    O(rows appended) (capacity doubling) and is taken from its end: the stack's float64
    rigorous bounds (--soundness real/float32, 8 KiB a domain on mnistfc) were copied whole
    by every round's torch.cat, 19% of a long proof's time. `t`: the live rows (a view,
    swapped in place)."""

    def __init__(self, t: torch.Tensor):
        self.buf, self.n = t, len(t)

    @property
    def t(self) -> torch.Tensor:
        return self.buf[:self.n]

    def take(self, k: int) -> torch.Tensor:
        """The last k rows (a copy), removed."""
        out = self.buf[self.n - k:self.n].clone()
        self.n -= k
        return out

    def extend(self, *parts: torch.Tensor) -> None:
        total = self.n + sum(len(x) for x in parts)
        if total > len(self.buf):
            grown = torch.empty((max(total, 2 * len(self.buf)), *self.buf.shape[1:]),
                                dtype=self.buf.dtype)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        for x in parts:
            self.buf[self.n:self.n + len(x)] = x
            self.n += len(x)

