"""Rigorous steps of the layout family: `reshape` and `transpose` (exact views), `pad` (an
index map with constants), and the index-map step the movement family shares."""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.layout import Input, Pad, Reshape, Transpose
from shardbound.runtime.rigorous.core import (DT, Step, absdot_upper, dot_lower, gamma,
                                              rigorous_step, up)


@rigorous_step(Input)
class InputStep(Step):
    """The box itself (the engine puts the input bounds here and concretises over them)."""

    box = "view"

    def forward(self, xs):
        return xs[0]


@rigorous_step(Reshape, Transpose)
class ViewStep(Step):
    """The kernel's own forward and transpose: they only move elements, exactly."""

    box = "view"

    def forward(self, xs):
        return self.op.forward(xs[0])

    def ibp(self, bounds, float32):
        lo, hi = bounds[0]
        return self.op.forward(lo), self.op.forward(hi)

    def back(self, L, in_bounds, mags, alpha=None):
        (L_in,), _ = self.op.backward_linear(L)
        return [(L_in, None)], None


class IndexMapStep(Step):
    """y[i] = x[source[i]] or a constant (runtime/ops/index_map.py). Forward and IBP gather
    (exact); the transpose adds the coefficients of the outputs that read one source, up to
    `depth` of them: gamma_depth |L| is charged when a source has several readers; the
    constants give the bias L . fill as a dot product."""

    def load(self, op):
        self.map = op._map()
        fill = self.fill_of(op)
        if fill is not None:
            fill = torch.where(self.map.sourced, torch.zeros_like(fill), fill)
            if not bool((fill != 0).any()):
                fill = None
        self.fill = fill
        self.box = "view" if len(self.inputs) == 1 and self.map.depth == 1 else None

    def fill_of(self, op):
        """The constants (n_out,) float64, or None."""
        raise NotImplementedError

    def _gather(self, xs, fill):
        B = xs[0].shape[0]
        flat = torch.cat([x.reshape(B, -1) for x in xs], dim=-1)
        value = (torch.zeros(self.map.n_out, dtype=DT) if fill is None else fill).to(flat.dtype)
        return self.map.gather(flat, fill=value).reshape(B, *self.shape)

    def forward(self, xs):
        return self._gather(xs, self.fill)

    def ibp(self, bounds, float32):
        return (self._gather([b[0] for b in bounds], self.fill),
                self._gather([b[1] for b in bounds], self.fill))

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        flat = L.reshape(B, S, self.map.n_out)
        back = self.map.scatter_add(flat)
        sizes = [math.prod(s) for s in self.in_shapes]
        parts = back.split(sizes, dim=-1)
        charges = [None] * len(parts)
        if self.map.depth > 1:
            summed = self.map.scatter_add(flat.abs()).split(sizes, dim=-1)
            charges = [up(absdot_upper(a, m.reshape(m.shape[0], 1, -1)) * gamma(self.map.depth))
                       for a, m in zip(summed, mags)]
        out = [(p.reshape(B, S, *s), c) for p, s, c in zip(parts, self.in_shapes, charges)]
        bias = None if self.fill is None else dot_lower(flat, self.fill)
        return out, bias


@rigorous_step(Pad)
class PadStep(IndexMapStep):
    def fill_of(self, op):
        return self.map.fill.to(DT) if op.has_fill else None
