"""Data movement as an index map: each output element is one input element, or a constant.

Ops that only move elements (Pad; later Slice, Gather, Concat with constants, Tile,
DepthToSpace) are linear maps whose matrix has at most one 1 per row: output i reads input
`source[i]`, or holds the constant `fill[i]` where `source[i] < 0`. Forward and IBP gather
(bounds move with their elements); the CROWN backward step is the transpose: A is added onto
the sources, and the constants contribute the bias A . fill. Several outputs may read one
source (reflect / edge padding, tiling), so the transpose sums; it sums each source's readers
one at a time in ascending output order (a table `readers[j, s]`: the j-th output reading
source s), never with atomics or a parallel reduction, so its bits do not depend on how many
rows A has, how they are split over ranks, or the thread count.

Build a map from numpy source indices (`IndexMap(source, n_in)`; an op that moves data can
apply itself to `np.arange(n_in)` to get them) or per axis (`IndexMap.from_axes`, for ops that
act on each axis alone: Pad, Slice, Tile). Ops build their maps from their current
`in_shapes` at first use, not in `setup`: tp localises the shapes of zone ops after
construction (`MapCache`).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch


class IndexMap:
    """y[..., i] = x[..., source[i]] where source[i] >= 0, else fill[i] (over the last axis of
    flattened tensors: x (..., n_in), y (..., n_out); `out_shape` is source's shape)."""

    def __init__(self, source, n_in: int, fill=None):
        src = np.asarray(source, dtype=np.int64)
        flat = src.reshape(-1)
        if flat.size and (flat.max(initial=-1) >= n_in):
            raise ValueError(f"index map reads past its input ({flat.max()} >= {n_in})")
        self.out_shape = tuple(src.shape)
        self.n_in, self.n_out = int(n_in), int(flat.size)
        sourced = flat >= 0
        self.complete = bool(sourced.all())
        self.index = torch.from_numpy(np.where(sourced, flat, 0))
        self.sourced = torch.from_numpy(sourced)
        constants = (np.zeros(self.n_out) if fill is None else
                     np.broadcast_to(np.asarray(fill, dtype=np.float64), src.shape).reshape(-1))
        self.fill = torch.from_numpy(np.where(sourced, 0.0, constants).astype(np.float32))
        self.has_fill = bool(np.any(self.fill.numpy() != 0))
        self.readers = torch.from_numpy(_readers(flat, self.n_in, self.n_out))
        self._copy_runs = None                      # scatter_add's injective route, made once

    @classmethod
    def from_axes(cls, in_shape: Sequence[int], axis_sources: Sequence, fill=None) -> "IndexMap":
        """The product of per-axis maps: output (i_0, i_1, ...) reads input (s_0[i_0], s_1[i_1],
        ...), or is a constant when any s_k[i_k] < 0 (e.g. padding on any axis)."""
        in_shape = tuple(int(d) for d in in_shape)
        if len(axis_sources) != len(in_shape):
            raise ValueError(f"{len(axis_sources)} axis maps for a rank-{len(in_shape)} input")
        out_shape = tuple(len(s) for s in axis_sources)
        flat = np.zeros(out_shape, dtype=np.int64)
        valid = np.ones(out_shape, dtype=bool)
        stride = 1
        for axis in reversed(range(len(in_shape))):
            s = np.asarray(axis_sources[axis], dtype=np.int64)
            if s.size and s.max(initial=-1) >= in_shape[axis]:
                raise ValueError(f"axis {axis}: index {s.max()} out of range {in_shape[axis]}")
            view = [1] * len(in_shape)
            view[axis] = len(s)
            flat += (np.maximum(s, 0) * stride).reshape(view)
            valid &= (s >= 0).reshape(view)
            stride *= in_shape[axis]
        return cls(np.where(valid, flat, -1), math.prod(in_shape), fill)

    # -- the map and its transpose ---------------------------------------------------------------
    def gather(self, x: torch.Tensor, fill: torch.Tensor | float | None = None) -> torch.Tensor:
        """x (..., n_in) -> (..., n_out); unsourced outputs take `fill` (default: the map's
        constants)."""
        y = x.index_select(-1, self.index.to(x.device))
        if self.complete:
            return y
        value = self.fill.to(x.device, x.dtype) if fill is None else fill
        return torch.where(self.sourced.to(x.device), y, torch.as_tensor(value, dtype=x.dtype,
                                                                        device=x.device))

    def scatter_add(self, a: torch.Tensor) -> torch.Tensor:
        """The transpose: a (..., n_out) -> (..., n_in), out[s] = sum of a over the outputs that
        read s, added one at a time in ascending output order (fixed, row-independent bits).
        Unsourced outputs are dropped (their part is the bias `a . fill`)."""
        readers = self.readers.to(a.device)
        if readers.shape[0] == 1 and self.n_out > 0:
            # Injective (a Slice, Gather or Pad): each source reads at most one output, so the
            # transpose only copies: out[s] = a[reader of s], +0.0 where none reads (what the
            # zero slot gives). Where the readers are a few runs of consecutive outputs (a
            # slice of channels or rows), those runs are copied as blocks: the input Slice of
            # carvana's UNet spent 12-18% of its CROWN stage in the indexed gather.
            runs = self._runs()
            if runs is not None:
                out = a.new_zeros((*a.shape[:-1], self.n_in))
                for s0, o0, n in runs:
                    out[..., s0:s0 + n] = a[..., o0:o0 + n]
                return out
        padded = torch.cat([a, a.new_zeros((*a.shape[:-1], 1))], dim=-1)   # n_out: a zero slot
        out = padded.index_select(-1, readers[0])
        for j in range(1, readers.shape[0]):
            out = out + padded.index_select(-1, readers[j])
        return out

    def _runs(self, most: int = 16):
        """(source start, output start, length) of the runs in which consecutive sources
        read consecutive outputs (an injective map), or None past `most` runs; made once."""
        if self._copy_runs is None:
            readers = self.readers[0].numpy()
            src = np.nonzero(readers != self.n_out)[0]
            out = readers[src]
            breaks = np.nonzero((np.diff(src) != 1) | (np.diff(out) != 1))[0] + 1
            starts = np.concatenate([[0], breaks]).astype(np.int64)
            ends = np.concatenate([breaks, [len(src)]]).astype(np.int64)
            self._copy_runs = (False if len(src) == 0 or len(starts) > most else
                               [(int(src[a]), int(out[a]), int(b - a))
                                for a, b in zip(starts, ends)])
        return self._copy_runs or None

    @property
    def depth(self) -> int:
        """The most outputs that read one source (1: the map is injective; also 1 when no
        source is read)."""
        return int(self.readers.shape[0])


def _readers(flat: np.ndarray, n_in: int, n_out: int) -> np.ndarray:
    """(depth, n_in): readers[j, s] = the j-th smallest output index reading source s, or n_out
    (a zero slot) when s has fewer than j + 1 readers. At least one row, so that the transpose
    is always computed from its input (autograd then reaches the producers of an empty slice:
    a tp rank without channels joins their collectives too)."""
    outs = np.nonzero(flat >= 0)[0]
    srcs = flat[outs]
    order = np.argsort(srcs, kind="stable")          # by source, then by output index
    srcs, outs = srcs[order], outs[order]
    counts = np.bincount(srcs, minlength=n_in) if srcs.size else np.zeros(n_in, dtype=np.int64)
    depth = max(1, int(counts.max()) if counts.size else 0)
    starts = np.cumsum(counts) - counts
    rank = np.arange(srcs.size) - starts[srcs]
    readers = np.full((depth, n_in), n_out, dtype=np.int64)
    readers[rank, srcs] = outs
    return readers


class MapCache:
    """One IndexMap per key (the op's current shapes), built on first use: tp's zone ops get
    their channel-local shapes after construction, and a map built in `setup` would be stale."""

    def __init__(self, build: Callable[..., IndexMap]):
        self.build = build
        self.key = None
        self.map: IndexMap | None = None

    def get(self, *key) -> IndexMap:
        if self.map is None or key != self.key:
            self.map, self.key = self.build(*key), key
        return self.map
