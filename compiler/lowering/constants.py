"""Constant computation: what the frontend folds and what it refuses.

A node whose inputs are all constants is evaluated at compile time with onnx.reference
(compiler/frontend.py `_fold`), whatever it is: Shape, Size, ConstantOfShape, Range, the
comparisons and logic ops, Where, Cast, ArgMax, ReduceMax, OneHot, arithmetic. Two kinds of
nodes need more:
- ops whose output is a constant although an input is computed: the shape of a computed
  tensor is known (Shape, with start / end, in compiler/lowering/layout.py; Size here);
- ops that are dynamic or bit-level in their inputs (NonZero, IsNaN, IsInf, BitShift, the
  shape sources and random ops): applied to the network input they are folded or refused
  with a message that says so (`register_constant_only`; Gather with computed indices is
  refused by its handler). The piecewise-constant ones (comparisons, logic, ArgMax / ArgMin,
  OneHot, rounding, casts to integers, Where with a computed condition) are bounded by the
  discrete family (compiler/lowering/discrete.py).
"""

from __future__ import annotations

import math

import numpy as np

from shardbound.compiler.lowering import register, register_constant_only


@register("Size", since=1, constant_output=True)
def lower_size(ctx, node):
    """The element count of a computed tensor (batch 1), an int64 scalar."""
    x = ctx.computed(node.inputs[0])
    ctx.set_const(node.outputs[0], np.asarray(math.prod(x.full_shape), dtype=np.int64))


register_constant_only(
    ["NonZero"],
    "applied to the network input, its output shape depends on the input values (a dynamic "
    "shape); shardbound evaluates it only on constants (folded at compile time)")
register_constant_only(
    ["IsNaN", "IsInf", "BitShift"],
    "applied to the network input, these test or shift the bits of values shardbound carries "
    "as float32 bounds (IsNaN / IsInf of a network value, integer bit shifts); shardbound "
    "evaluates them only on constants (folded at compile time)")
register_constant_only(
    ["ConstantOfShape", "Range", "EyeLike", "RandomNormal", "RandomUniform",
     "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"],
    "applied to the network input (as a shape or a count, or randomly), these have no linear "
    "bound; shardbound evaluates them only on constants (folded at compile time)")
