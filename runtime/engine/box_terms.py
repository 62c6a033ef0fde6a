"""The box terms of CROWN's concretisation: for each row a of an A-matrix, a.center and
|a|.radius over the input box, whose difference and sum are the row's minimum and maximum of
a x. One function, kept apart from the engine because every summation order and both A forms
(dense rows, patches) meet here, and their bit promises are decided by which kernel sums."""

from __future__ import annotations

import math

import torch

from shardbound.runtime.engine.box_windows import window_box_terms
from shardbound.runtime.numerics import contract
from shardbound.runtime.ops import Bounds
from shardbound.runtime.ops.patches import Patches

SMALL_BOX_TERMS = 1 << 20       # A-matrix elements up to which both box terms share a call


def box_terms(A, lower, upper, order: str) -> Bounds:
    """(A.center, |A|.radius) per row. Rows in patches form meet the box at their windows
    (`fast`; `blocked` where `box_windows` matches the dense rows' bits) or go dense first
    (the ordered summations sum over the whole input). Under
    the ordered summations a small A takes both terms from one kernel call (each value
    depends on its two vectors alone, so the bits are those of two calls)."""
    if isinstance(A, Patches):
        if order != "fast":
            if order == "blocked" and not A.requires_grad:
                got = window_box_terms(A, lower, upper)     # from the windows, same bits
                if got is not None:
                    return got
            K = math.prod(A.node_shape)
            if A.values.shape[0] == 1 and lower.shape[0] == 1 and \
                    not A.requires_grad and K <= SMALL_BOX_TERMS:
                both = A.dense_map(lambda rows: _small_patch_terms(rows, lower, upper, order),
                                   dense=False)
            else:
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
        rows = flat.new_empty((2 * S, K))       # [A; |A|]: the concatenation, made in place
        rows[:S].copy_(flat[0])
        torch.abs(flat[0], out=rows[S:])
        both = contract.matmul(rows, torch.cat([center[0], radius[0]]), order)
        return both[:S, 0].unsqueeze(0), both[S:, 1].unsqueeze(0)
    return (contract.dot_last(flat, center, order),
            contract.dot_last(flat.abs(), radius, order))


def _small_patch_terms(rows: Patches, lower, upper, order: str) -> torch.Tensor:
    """(1, s, 2): both box terms of a chunk of rows in patches form (one box), by the
    small-A route of `box_terms` -- one product of [rows; |rows|] (2s, K) against
    [center; radius] -- with the dense rows written straight into the top half of that
    operand and their magnitudes into the bottom half (no dense copy, no concatenation:
    the same operands, so the same bits)."""
    s, K = rows.values.shape[1], math.prod(rows.node_shape)
    both = rows.values.new_empty((2 * s, K))
    rows.to_dense(out=both[:s].view(1, s, *rows.node_shape))
    torch.abs(both[:s], out=both[s:])
    center = ((upper + lower) / 2).reshape(1, -1)
    radius = ((upper - lower) / 2).reshape(1, -1)
    y = contract.matmul(both, torch.cat([center, radius]), order)
    return torch.stack([y[:s, 0], y[s:, 1]], dim=-1).unsqueeze(0)
