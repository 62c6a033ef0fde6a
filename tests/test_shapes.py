"""runtime/numerics/shapes.py's broadcast_shape follows the broadcasting rules (checked against
numpy's: torch.broadcast_shapes, which the kernels no longer call, imports sympy on its first
call, seconds of this test's time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardbound.runtime.numerics.shapes import broadcast_shape

CASES = [((2, 3), (3,)), ((1,), (4, 1, 5)), ((7, 1, 2), (1, 6, 1)), ((0, 3), (1, 3)),
         ((), (2, 2)), ((5,), ()), (torch.Size([2, 1]), torch.Size([1, 9])), ((3, 1), (3, 1))]


@pytest.mark.parametrize("a,b", CASES)
def test_same_as_numpy(a, b):
    got = broadcast_shape(a, b)
    assert isinstance(got, torch.Size) and tuple(got) == np.broadcast_shapes(tuple(a), tuple(b))


def test_shapes_that_do_not_broadcast_are_refused():
    with pytest.raises(ValueError, match="do not broadcast"):
        broadcast_shape((2, 3), (4, 3))
