"""The rigorous conv adjoint's routes (runtime/rigorous/conv.py, issue 17): conv_transpose2d
and the flipped kernel's correlation compute the same sums as the F.fold adjoint in another
order, so each element must lie within the error account's gamma_{fan_out} |A| |W| of the
fold route's (what core.WeightedStep.back charges for any order), and every route must be
taken where its shapes call for it (the other rigorous tests sample the bounds built on it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# (in_hw, kernel, strides, pads, dilations, groups, C, Cout, route)
CASES = [
    ((9, 11), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, 16, 8, "flip"),       # Cout <= C
    ((9, 11), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, 8, 16, "transpose"),  # Cout > C
    ((7, 7), (3, 3), (2, 2), (1, 0, 1, 1), (1, 1), 1, 4, 4, "transpose"),    # strided
    ((9, 8), (3, 3), (2, 3), (0, 1, 2, 0), (1, 1), 1, 3, 5, "transpose"),
    ((10, 10), (5, 5), (2, 2), (2, 2, 2, 2), (2, 2), 1, 2, 3, "transpose"),  # dilated
    ((8, 9), (3, 3), (1, 1), (3, 0, 1, 4), (2, 1), 1, 6, 2, "flip"),         # pads > taps
    ((6, 7), (3, 2), (1, 1), (0, 2, 1, 0), (1, 1), 2, 4, 2, "flip"),         # grouped
    ((6, 6), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 4, 4, 4, "flip"),         # depthwise
]


@pytest.mark.parametrize("case", CASES, ids=[c[-1] + str(i) for i, c in enumerate(CASES)])
def test_adjoint_routes_are_the_fold_sums_within_the_error_account(case):
    from shardbound.runtime.rigorous.conv import ConvGeometry
    from shardbound.runtime.rigorous.core import gamma

    in_hw, kernel, strides, pads, dilations, G, C, Cout, route = case
    geo = ConvGeometry(in_hw, kernel, strides, pads, dilations, G)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(Cout, C // G, *kernel, dtype=torch.float64, generator=gen)
    # large-magnitude cancellations, so a reordering shows in the last bits
    A = torch.randn(3, Cout, *geo.blocks, dtype=torch.float64, generator=gen) * 1e6
    A[:, :, ::2] += 1e12
    for rows in (A, A[:, :, :-1, :-1]):          # A short of the blocks: zero rows / columns
        assert geo.adjoint_route(rows, w) == route
        full = F.pad(rows, (0, A.shape[3] - rows.shape[3], 0, A.shape[2] - rows.shape[2]))
        got, ref = geo.conv_back(rows, w), geo._back_fold(full, w)
        assert got.shape == ref.shape == (3, C, *in_hw)
        mag = geo._back_fold(full.abs(), w.abs())
        fan_out = (Cout // G) * kernel[0] * kernel[1]
        assert (got - ref).abs().le(2 * gamma(fan_out + 1) * mag).all()
        assert not torch.equal(got, torch.zeros_like(got))
