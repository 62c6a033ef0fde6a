"""The periodic family: Sin and Cos (kernels in runtime/ops/periodic.py). Both since opset 7;
opset 22 only adds types."""

from __future__ import annotations

from shardbound.compiler.lowering import register


@register("Sin", since=7)
def lower_sin(ctx, node):
    ctx.emit("sin", [ctx.computed(node.inputs[0])], node.outputs[0])


@register("Cos", since=7)
def lower_cos(ctx, node):
    ctx.emit("cos", [ctx.computed(node.inputs[0])], node.outputs[0])
