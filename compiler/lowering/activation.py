"""The activation family: ReLU and the other piecewise-linear activations (kernels in
runtime/ops/activation.py).

Relu, LeakyRelu (-> leaky_relu; relu when alpha = 0), PRelu with a constant slope (-> prelu),
Abs.
"""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import register


@register("Relu", since=1)
def lower_relu(ctx, node):
    ctx.emit("relu", [ctx.computed(node.inputs[0])], node.outputs[0])


@register("LeakyRelu", since=6)
def lower_leaky_relu(ctx, node):
    x = ctx.computed(node.inputs[0])
    alpha = float(np.float32(node.attrs.get("alpha", 0.01)))
    if not np.isfinite(alpha):
        raise ctx.error(f"alpha is {alpha}; a LeakyRelu slope must be finite")
    if alpha == 0.0:
        ctx.emit("relu", [x], node.outputs[0])
    else:
        ctx.emit("leaky_relu", [x], node.outputs[0], attrs={"alpha": alpha})


@register("PRelu", since=7)
def lower_prelu(ctx, node):
    x = ctx.computed(node.inputs[0])
    if not ctx.is_const(node.inputs[1]):
        raise ctx.error("its slope is computed from the network input; only a constant slope "
                        "(a trained parameter) is supported")
    slope = ctx.sample_constant(ctx.const(node.inputs[1], "slope"), x, "the slope")
    ctx.emit("prelu", [x], node.outputs[0], params={"slope": slope})


@register("Abs", since=6)
def lower_abs(ctx, node):
    ctx.emit("abs", [ctx.computed(node.inputs[0])], node.outputs[0])
