"""Constant computation: what the frontend folds and what it refuses.

A node whose inputs are all constants is evaluated at compile time with onnx.reference
(compiler/frontend.py `_fold`), whatever it is: Shape, Size, ConstantOfShape, Range, the
comparisons and logic ops, Where, Cast, ArgMax, ReduceMax, OneHot, arithmetic. Two kinds of
nodes need more:
- ops whose output is a constant although an input is computed: the shape of a computed
  tensor is known (Shape, with start / end, in compiler/lowering/layout.py; Size here);
- ops that are discrete or dynamic in their inputs (comparisons, logic, ArgMax, OneHot,
  rounding, NonZero): applied to the network input they are piecewise constant, with no linear
  bound, so they are folded or refused with a message that says so (`register_constant_only`;
  Where with a computed condition and Gather with computed indices are refused by their
  handlers for the same reason).
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
    ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
     "ArgMax", "ArgMin", "OneHot", "NonZero", "Floor", "Ceil", "Round", "IsNaN", "IsInf",
     "BitShift"],
    "applied to the network input, these are discrete (piecewise-constant) functions with no "
    "linear bound; shardbound evaluates them only on constants (folded at compile time)")
register_constant_only(
    ["ConstantOfShape", "Range", "EyeLike", "RandomNormal", "RandomUniform",
     "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"],
    "applied to the network input (as a shape or a count, or randomly), these have no linear "
    "bound; shardbound evaluates them only on constants (folded at compile time)")
