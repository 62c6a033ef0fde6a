"""The reduction family (runtime/ops/reduction.py, compiler/lowering/reduction.py):
ReduceSum and ReduceMean over any axes (the batch axis among them), keepdims both ways, axes
as an attribute or an input (noop_with_empty_axes), under every summation order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import OpCase, generate
from test_movement import ints, twice


def _reduce(op, axes, keepdims=1, noop=None, as_input=False):
    def apply(b, x, full, opset):
        attrs = {"keepdims": keepdims}
        if noop is not None:
            attrs["noop_with_empty_axes"] = noop
        if as_input:
            inputs = [x] if axes is None else [x, b.const(ints(*axes))]
            return b.op(op, inputs, **attrs)
        if axes is not None:
            attrs["axes"] = list(axes)
        return b.op(op, [x], **attrs)
    return apply


def _case(name, op, apply, opsets, shape=(2, 3, 4), **kw):
    return OpCase(name, op, lambda rng, o: twice(rng, o, shape, lambda b, x, f: apply(b, x, f, o)),
                  opsets=opsets, **kw)


CASES = [
    _case("reduce_sum_attr", "ReduceSum", _reduce("ReduceSum", [2, -1]), (11,)),
    _case("reduce_sum_no_keepdims", "ReduceSum", _reduce("ReduceSum", [1], keepdims=0), (11,)),
    _case("reduce_sum_all", "ReduceSum", _reduce("ReduceSum", None, keepdims=0), (11,)),
    _case("reduce_sum_input", "ReduceSum", _reduce("ReduceSum", [0, 3], keepdims=0,
                                                   as_input=True), (13,)),
    _case("reduce_sum_noop", "ReduceSum", _reduce("ReduceSum", None, noop=1, as_input=True), (13,)),
    _case("reduce_sum_batch_axis", "ReduceSum", _reduce("ReduceSum", [0], keepdims=0), (11,)),
    _case("reduce_mean_attr", "ReduceMean", _reduce("ReduceMean", [1, 3]), (11, 13)),
    _case("reduce_mean_input", "ReduceMean", _reduce("ReduceMean", [-2], keepdims=0,
                                                     as_input=True), (18,)),
    _case("reduce_mean_all_input", "ReduceMean", _reduce("ReduceMean", None, as_input=True),
          (18,)),
]

generate(CASES, globals())


@pytest.mark.parametrize("order", ["fast", "blocked", "exact"])
def test_reduce_sum_kernel_is_its_transpose_and_row_independent(order):
    """forward = torch sum; backward_linear is the transpose (<A, R x> = <R^T A, x>); the
    backward bits do not depend on which rows of A are propagated together."""
    from shardbound.runtime.ops.reduction import ReduceSum

    op = ReduceSum("r", ["x"], [(3, 300, 2)], axes=(1,), mean=True, order=order)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 300, 2, generator=g)
    assert torch.allclose(op.forward(x), x.mean(dim=2, keepdim=True), atol=1e-6)
    A = torch.randn(2, 5, *op.shape, generator=g)
    (A_in,), bias = op.backward_linear(A)
    lhs = (A.double() * op.forward(x).double().unsqueeze(1)).sum((2, 3, 4))
    rhs = (A_in.double() * x.double().unsqueeze(1)).sum((2, 3, 4))
    assert bias is None and torch.allclose(lhs, rhs, atol=1e-5)
    y_all = op.forward(x)
    for a, b in ((0, 1), (1, 2)):
        assert torch.equal(op.forward(x[a:b].contiguous()), y_all[a:b])
