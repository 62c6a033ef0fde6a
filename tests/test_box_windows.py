"""`blocked` box terms of rows in patches form from their windows (runtime/engine/box_windows.py)
have bitwise the bits of the dense rows' box terms: windows past every edge of the grid,
entries left outside it by a conv step (`dirty`), zeros inside, one and several channels,
and the chain models this machine's BLAS follows; and rows that are not finite or windows
whose rows do not share columns often enough go to the dense rows (None)."""

from __future__ import annotations

import pytest
import torch

from shardbound.runtime.engine.box_terms import box_terms
from shardbound.runtime.engine.box_windows import window_box_terms
from shardbound.runtime.numerics import support_dot
from shardbound.runtime.ops.patches import Patches


def _rows(g, S, node_shape, window, stride, offset):
    """Rows whose windows sit on a strided grid of corners (as a conv pass leaves them),
    entries nonzero outside the grid and about a third zero inside."""
    C = node_shape[0]
    per_axis = 16
    q = torch.arange(per_axis)
    yy, xx = torch.meshgrid(q, q, indexing="ij")
    corners = torch.stack([yy.reshape(-1), xx.reshape(-1)], 1) * stride + offset
    origin = corners.repeat(S // len(corners) + 1, 1)[:S]
    values = torch.randn(1, S, C, *window, generator=g) * \
        torch.exp(torch.randn(1, S, 1, 1, 1, generator=g))
    values[values.abs() < 0.4] = 0
    return Patches(values, origin, node_shape, dirty=True)


def _box(g, node_shape):
    lower = torch.randn(1, *node_shape, generator=g)
    return lower, lower + torch.rand(1, *node_shape, generator=g)


@pytest.mark.parametrize("node_shape, window, stride, offset", [
    ((3, 32, 32), (19, 19), 2, -9),     # the bench ResNet's input rows: past every edge
    ((3, 32, 32), (11, 11), 2, -5),
    ((1, 16, 16), (5, 5), 1, -2),       # one channel, stride-1 corners
    ((2, 16, 16), (16, 3), 1, -1),      # window rows as tall as the grid, narrow columns
])
def test_window_box_terms_have_the_dense_rows_bits(node_shape, window, stride, offset):
    if not support_dot.works():
        pytest.skip("no pinned BLAS here")
    g = torch.Generator().manual_seed(sum(node_shape) + window[0])
    A = _rows(g, 600, node_shape, window, stride, offset)
    lower, upper = _box(g, node_shape)
    got = window_box_terms(A, lower, upper)
    assert got is not None
    want = box_terms(A.masked().to_dense(), lower, upper, "blocked")    # the dense rows
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_window_box_terms_decline_what_they_cannot_match():
    if not support_dot.works():
        pytest.skip("no pinned BLAS here")
    g = torch.Generator().manual_seed(3)
    A = _rows(g, 300, (3, 32, 32), (7, 7), 2, -3)
    lower, upper = _box(g, (3, 32, 32))
    A.values[0, 5, 0, 0, 0] = float("inf")          # inf * 0 is nan in the dense rows
    assert window_box_terms(A, lower, upper) is None
    few = _rows(g, 40, (3, 32, 32), (7, 7), 2, -3)  # 40 rows over 16 window columns
    assert window_box_terms(few, lower, upper) is None
    odd = _rows(g, 600, (3, 30, 30), (7, 7), 2, -3)  # a chain is not whole grid rows
    assert window_box_terms(odd, *_box(g, (3, 30, 30))) is None
