"""The box terms of CROWN's concretisation: for each row a of an A-matrix, a.center and
|a|.radius over the input box, whose difference and sum are the row's minimum and maximum of
a x. One function, kept apart from the engine because every summation order and both A forms
(dense rows, patches) meet here, and their bit promises are decided by which kernel sums."""

from __future__ import annotations

import math

import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops import Bounds
from shardbound.runtime.ops.patches import Patches

SMALL_BOX_TERMS = 1 << 20       # A-matrix elements up to which both box terms share a call


def box_terms(A, lower, upper, order: str) -> Bounds:
    """(A.center, |A|.radius) per row. Rows in patches form meet the box at their windows
    (`fast`) or go dense first (the ordered summations sum over the whole input). Under
    the ordered summations a small A takes both terms from one kernel call (each value
    depends on its two vectors alone, so the bits are those of two calls)."""
    if isinstance(A, Patches):
        if order != "fast":
            both = A.dense_map(lambda rows: torch.stack(
                box_terms(rows, lower, upper, order), dim=-1))
            return both[..., 0], both[..., 1]
        else:
            B, S = A.shape[:2]
            center, radius = A.gather_many([((upper + lower) / 2).unsqueeze(1),
                                            ((upper - lower) / 2).unsqueeze(1)])
            return (contract.dot_last(A.flat(), center.reshape(B, S, -1), order),
                    contract.dot_last(A.flat().abs(), radius.reshape(B, S, -1), order))
    B, S = A.shape[:2]
    K = math.prod(A.shape[2:])
    flat = A.reshape(B, S, K)
    center = ((upper + lower) / 2).reshape(B, 1, -1)
    radius = ((upper - lower) / 2).reshape(B, 1, -1)
    if order != "fast" and B == 1 and 0 < S * K <= SMALL_BOX_TERMS and \
            not flat.requires_grad:
        both = contract.matmul(torch.cat([flat[0], flat[0].abs()]),
                               torch.cat([center[0], radius[0]]), order)
        return both[:S, 0].unsqueeze(0), both[S:, 1].unsqueeze(0)
    return (contract.dot_last(flat, center, order),
            contract.dot_last(flat.abs(), radius, order))
