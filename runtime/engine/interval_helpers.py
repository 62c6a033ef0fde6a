"""Small interval and row helpers of the bound engine (runtime/engine/network.py): NaN made
vacuous, the intersection of two sound bounds, C y over an interval, rows of one box
broadcast over B, and the storage bytes behind the ledger's `bounds` figure. Kept apart so
network.py holds only the passes."""

from __future__ import annotations

import math

import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops import Bounds
from shardbound.runtime.ops.patches import Patches


def vacuous_nan(b: Bounds) -> Bounds:
    """NaN -> the vacuous bound. Interval arithmetic on infinite bounds (an op whose input
    leaves its domain: log near 0, a reciprocal across 0) makes NaN (inf - inf, 0 * inf)
    where nothing is known; -inf / +inf says so soundly. Identity on finite bounds."""
    lo, hi = b
    return torch.where(torch.isnan(lo), -math.inf, lo), torch.where(torch.isnan(hi), math.inf, hi)


class StorageBytes:
    """Bytes of the distinct storages added so far (the ledger's `bounds`, counted as bounds
    are made instead of recounting every node's at each step)."""

    def __init__(self):
        self.seen: set = set()
        self.total = 0

    def add(self, tensors) -> int:
        for t in tensors:
            if t is None:
                continue
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in self.seen:
                self.seen.add(key)
                self.total += key[1]
        return self.total


def expand_rows(A, B: int):
    """Rows made for one box, broadcast (as a view) over the B boxes."""
    if isinstance(A, Patches):
        return A.with_values(A.values.expand(B, *A.values.shape[1:]))
    return A.expand(B, *A.shape[1:])


def intersect(a: Bounds, b: Bounds) -> Bounds:
    """Both are sound, so their intersection is: the tighter side of each."""
    return torch.maximum(a[0], b[0]), torch.minimum(a[1], b[1])


def interval_matvec(C, lo, hi, order) -> Bounds:
    """Bounds of C y for y in [lo, hi] (interval arithmetic, per box)."""
    center, radius = ((hi + lo) / 2).unsqueeze(1), ((hi - lo) / 2).unsqueeze(1)
    mid = contract.dot_last(C, center, order)
    spread = contract.dot_last(C.abs(), radius, order)
    return mid - spread, mid + spread


