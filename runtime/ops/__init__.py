"""Bound kernels, one module per op family; each class declares the traits the rest of the
system reads (runtime/ops/base.py) and, when nonlinear, its relaxation
(runtime/ops/relaxation.py).

Families (each with a lowering module of the same name under compiler/lowering/): linear,
conv, pooling, activation, arithmetic, layout, smooth, exponential, periodic, gated, movement,
reduction, normalization, discrete. Shared machinery: base.py (Op, traits, registry), relaxation.py
(the relaxation interface), intercepts.py (lines with computed intercepts, for the smooth functions),
index_map.py (the index maps of the movement kernels). `OP_TYPES` maps IR op kinds to
classes; the generated program names classes as `ops.<Class>`, which resolves any
registered kernel (the module `__getattr__` below): a new family needs one import line here.

May import: torch, `runtime.numerics`, `runtime.errors`. Nothing above them.
"""

from shardbound.runtime.ops.base import OP_TYPES, Bounds, NodeFacts, Op, register_op
from shardbound.runtime.ops.relaxation import ElementwiseRelaxation, Lines
from shardbound.runtime.ops.layout import Input, Pad, Reshape, Transpose
from shardbound.runtime.ops.linear import Linear
from shardbound.runtime.ops.conv import Conv2d
from shardbound.runtime.ops.arithmetic import Add, Affine
from shardbound.runtime.ops.activation import Relu
from shardbound.runtime.ops.smooth import Erf, Sigmoid, Softsign, Tanh  # noqa: F401
from shardbound.runtime.ops.pooling import MaxPool2d
from shardbound.runtime.ops import bilinear, discrete, exponential, gated, periodic, softmax  # noqa: F401,E501
from shardbound.runtime.ops.movement import Move, Resample
from shardbound.runtime.ops.reduction import ReduceSum
from shardbound.runtime.ops.normalization import Normalize

__all__ = ["OP_TYPES", "Bounds", "NodeFacts", "Op", "register_op", "ElementwiseRelaxation",
           "Lines", "Input", "Pad", "Reshape", "Transpose", "Linear", "Conv2d", "Add", "Affine",
           "Relu", "Sigmoid", "Tanh", "MaxPool2d", "Move", "Resample", "ReduceSum", "Normalize"]


def __getattr__(name: str):
    """`ops.<Class>` for every registered kernel (the generated program's spelling)."""
    for cls in OP_TYPES.values():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
