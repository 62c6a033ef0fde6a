"""The reduction family: ReduceSum and ReduceMean over any axes (-> `reduce_sum`, kernels in
runtime/ops/reduction.py), keepdims either way (the kernel keeps the reduced axes; a reshape
view drops them), axes as an attribute or, from opset 13 (ReduceSum) / 18 (ReduceMean), an
optional input with `noop_with_empty_axes`. Summing over the size-1 batch axis changes nothing,
so only the sample axes are reduced (the output loses the batch axis when keepdims is 0 and it
is among the axes: compiler/context.py)."""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import register


def _reduce(ctx, node, axes, mean: bool):
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    rank = len(full)
    if not axes:
        if int(node.attrs.get("noop_with_empty_axes", 0)):
            ctx.alias(node.outputs[0], x)
            return
        axes = list(range(rank))
    if any(not -rank <= int(a) < rank for a in axes):
        raise ctx.error(f"axes {list(axes)} are out of range for a rank-{rank} tensor")
    axes = sorted({int(a) % rank for a in axes})
    lead = 1 if x.batched else 0
    sample_axes = tuple(a - lead for a in axes if a >= lead)
    if int(node.attrs.get("keepdims", 1)):
        out = tuple(1 if a in axes else d for a, d in enumerate(full))
    else:
        out = tuple(d for a, d in enumerate(full) if a not in axes)
    y = ctx.emit("reduce_sum", [x], attrs={"axes": sample_axes, "mean": mean}) if sample_axes else x
    ctx.reshaped(y, out, node.outputs[0], node.op)


def _axes_input(ctx, node):
    t = ctx.optional_input(node, 1)
    return None if t is None else [int(a) for a in np.asarray(ctx.const(t, "axes")).reshape(-1)]


@register("ReduceSum", since=1)
def lower_reduce_sum_1(ctx, node):
    """Opsets 1-12: the `axes` attribute (default: every axis)."""
    _reduce(ctx, node, [int(a) for a in node.attrs.get("axes", [])], mean=False)


@register("ReduceSum", since=13)
def lower_reduce_sum_13(ctx, node):
    """Opset 13 on: axes are an optional (constant) input; noop_with_empty_axes."""
    _reduce(ctx, node, _axes_input(ctx, node), mean=False)


@register("ReduceMean", since=1)
def lower_reduce_mean_1(ctx, node):
    """Opsets 1-17: the `axes` attribute."""
    _reduce(ctx, node, [int(a) for a in node.attrs.get("axes", [])], mean=True)


@register("ReduceMean", since=18)
def lower_reduce_mean_18(ctx, node):
    """Opset 18 on: axes are an optional input; noop_with_empty_axes."""
    _reduce(ctx, node, _axes_input(ctx, node), mean=True)
