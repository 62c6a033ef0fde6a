"""The layout family (runtime/ops/layout.py, compiler/lowering/layout.py): reshapes by every
exporter's spelling, transposes, pass-through ops and the constant sources."""

from __future__ import annotations

import numpy as np

import zoo
from harness import OpCase, generate


def _net(rng, opset, middle, input_shape=(2, 3, 4), outputs=3):
    """x -> middle(b, x) -> Flatten -> Gemm -> Relu -> Gemm."""
    b = zoo.Builder(rng, input_shape, opset=opset)
    h = middle(b, "x")
    h = b.op("Flatten", [h], axis=1)
    h = b.relu(b.gemm(h, int(np.prod(input_shape)), 8))
    return b.build(b.gemm(h, 8, outputs)), input_shape


def _reshape_const(b, x):
    return b.op("Reshape", [x, b.const(np.array([1, 6, -1], dtype=np.int64))])


def _reshape_via_shape(b, x):
    """Shape -> Gather-free arithmetic on constants -> Reshape: the target is computed from a
    Shape node (constant output) and folded."""
    s = b.op("Shape", [x])
    return b.op("Reshape", [b.relu(x), s])


def _squeeze_unsqueeze(axes_as_input):
    def middle(b, x):
        if axes_as_input:
            h = b.op("Unsqueeze", [x, b.const(np.array([2], dtype=np.int64))])
            return b.op("Squeeze", [b.relu(h), b.const(np.array([2], dtype=np.int64))])
        h = b.op("Unsqueeze", [x], axes=[2])
        return b.op("Squeeze", [b.relu(h)], axes=[2])
    return middle


def _transpose(b, x):
    return b.op("Transpose", [b.relu(x)], perm=[0, 2, 3, 1])


def _relu(b, x):
    return b.relu(x)


def _identity_dropout_cast(b, x):
    h = b.op("Identity", [x])
    h = b.op("Dropout", [b.relu(h)])
    return b.op("Cast", [h], to=1)


def _constant(b, x):
    c = b.op("Constant", [], value=zoo.numpy_helper.from_array(
        np.full((1, 2, 3, 4), 0.25, dtype=np.float32)))
    return b.op("Add", [b.relu(x), c])


def _case(name, op, middle, opsets=(13,)):
    return OpCase(name, op, lambda rng, o: _net(rng, o, middle), opsets=opsets)


CASES = [
    _case("reshape", "Reshape", _reshape_const),
    _case("reshape_shape", "Shape", _reshape_via_shape),
    _case("squeeze_unsqueeze_attr", "Squeeze", _squeeze_unsqueeze(False), opsets=(11,)),
    _case("unsqueeze_attr", "Unsqueeze", _squeeze_unsqueeze(False), opsets=(11,)),
    _case("squeeze_unsqueeze_input", "Squeeze", _squeeze_unsqueeze(True), opsets=(13,)),
    _case("unsqueeze_input", "Unsqueeze", _squeeze_unsqueeze(True), opsets=(13,)),
    _case("transpose", "Transpose", _transpose),
    _case("flatten", "Flatten", _relu, opsets=(9, 13)),
    _case("identity", "Identity", _identity_dropout_cast),
    _case("dropout", "Dropout", _identity_dropout_cast, opsets=(12,)),
    _case("cast", "Cast", _identity_dropout_cast, opsets=(13,)),
    _case("constant", "Constant", _constant),
]

generate(CASES, globals())
