"""numerics/select.py: the branch-free pick is torch.where bit for bit (signed zeros, NaN
payloads, infinities, denormals included), for every dtype it handles and with broadcasting."""

from __future__ import annotations

import shardbound  # noqa: F401
import pytest
import torch

from shardbound.runtime.numerics.select import blend, mask_bits


def _values(shape, dtype, g):
    v = torch.randn(shape, generator=g).to(dtype)
    flat = v.view(-1)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40,
                            -1e-45], dtype=torch.float64).to(dtype)
    k = min(special.numel(), flat.numel())
    flat[:k] = special[:k]
    return v


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shapes", [((3, 40, 17), (3, 40, 17), (3, 40, 17)),
                                    ((3, 40, 17), (1, 1, 17), (3, 40, 17)),
                                    ((3, 40, 17), (3, 40, 17), (1, 40, 1)),
                                    ((1, 40, 17), (3, 1, 17), (1, 1, 1))])
def test_blend_is_where_bitwise(dtype, shapes):
    g = torch.Generator().manual_seed(0)
    ms, as_, bs = shapes
    mask = torch.rand(ms, generator=g) < 0.5
    a, b = _values(as_, dtype, g), _values(bs, dtype, g)
    ref = torch.where(mask, a, b)
    bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(dtype, torch.int16)
    for got in (blend(mask, a, b), blend(mask, a, b, mask_bits(mask, dtype))):
        assert got.shape == ref.shape and got.dtype == dtype
        assert torch.equal(got.view(bits), ref.contiguous().view(bits))


def test_blend_falls_back_to_where_for_mixed_dtypes():
    mask = torch.tensor([True, False])
    a, b = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([3.0, 4.0])
    assert torch.equal(blend(mask, a, b), torch.where(mask, a, b))
