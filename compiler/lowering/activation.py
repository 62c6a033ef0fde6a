"""The activation family: ReLU and the other piecewise-linear activations (kernels in
runtime/ops/activation.py)."""

from __future__ import annotations

from shardbound.compiler.lowering import register


@register("Relu", since=1)
def lower_relu(ctx, node):
    ctx.emit("relu", [ctx.computed(node.inputs[0])], node.outputs[0])
