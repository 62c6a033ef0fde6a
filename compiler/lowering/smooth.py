"""The smooth family: Sigmoid and Tanh (kernels in runtime/ops/smooth.py).

Both ops have three schema versions (1, 6, 13); the signature changed once for us: opset 1
has the legacy `consumed_inputs` attribute (an in-place hint without meaning for the
result, ignored), dropped in 6; 13 only adds bfloat16. So one handler each, since opset 1.
"""

from __future__ import annotations

from shardbound.compiler.lowering import register


@register("Sigmoid", since=1)
def lower_sigmoid(ctx, node):
    ctx.emit("sigmoid", [ctx.computed(node.inputs[0])], node.outputs[0])


@register("Tanh", since=1)
def lower_tanh(ctx, node):
    ctx.emit("tanh", [ctx.computed(node.inputs[0])], node.outputs[0])
