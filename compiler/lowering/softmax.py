"""The softmax family: Softmax and LogSoftmax (runtime/ops/softmax.py), whose kernels act on
the last axis of the sample shape.

The axis semantics changed in opset 13: before, the input is coerced to 2-D at `axis`
(default 1) and the function runs over the flattened trailing dims (a reshape to (N, D) and
back: views); from 13 on it runs over the one axis `axis` (default -1), moved last by a
transpose and back when it is not last already.
"""

from __future__ import annotations

import math

from shardbound.compiler.lowering import register
from shardbound.compiler.lowering.layout import permute


def _axis(ctx, node, rank, default):
    axis = int(node.attrs.get("axis", default))
    if not -rank <= axis < max(rank, 1):
        raise ctx.error(f"axis {axis} is out of range for an input of rank {rank}")
    return axis % rank if rank else 0


def _coerced(ctx, node, kind):
    """Before opset 13: over the trailing dims from `axis` on, flattened."""
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    axis = _axis(ctx, node, len(full), 1)
    two = (math.prod(full[:axis]), math.prod(full[axis:]))
    y = ctx.emit(kind, [ctx.reshaped(x, two, None, node.op)])
    ctx.reshaped(y, full, node.outputs[0], node.op)


def _one_axis(ctx, node, kind):
    """From opset 13: over one axis, moved last and back."""
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    rank = len(full)
    axis = _axis(ctx, node, rank, -1)
    if axis == rank - 1 and x.shape and len(x.shape) >= 1:
        ctx.emit(kind, [x], node.outputs[0])
        return
    perm = [d for d in range(rank) if d != axis] + [axis]
    back = [perm.index(d) for d in range(rank)]
    y = ctx.emit(kind, [ctx.canonical(permute(ctx, x, perm))])
    permute(ctx, y, back, node.outputs[0])


@register("Softmax", since=1)
def lower_softmax_1(ctx, node):
    _coerced(ctx, node, "softmax")


@register("Softmax", since=13)
def lower_softmax_13(ctx, node):
    _one_axis(ctx, node, "softmax")


@register("LogSoftmax", since=1)
def lower_log_softmax_1(ctx, node):
    _coerced(ctx, node, "log_softmax")


@register("LogSoftmax", since=13)
def lower_log_softmax_13(ctx, node):
    _one_axis(ctx, node, "log_softmax")
