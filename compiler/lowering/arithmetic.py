"""The arithmetic family: arithmetic with constants (-> `affine`: Add, Sub, Mul, Div, Neg,
BatchNormalization in inference as a per-channel affine that canonicalize folds into the layer
before it) and sums of computed tensors (-> `add`). A product of two computed tensors goes to
the product patterns other families register (`register_product`: x * sigmoid(x) is silu), a
division by one to their quotient patterns (`register_quotient`: c / x is a reciprocal)."""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import lower_product, lower_quotient, register


def _affine(ctx, node, x, scale=None, shift=None):
    params = {}
    if scale is not None:
        params["scale"] = ctx.sample_constant(scale, x, "the constant factor")
    if shift is not None:
        params["shift"] = ctx.sample_constant(shift, x, "the constant term")
    ctx.emit("affine", [x], node.outputs[0], params=params)


def _binary(ctx, node):
    """(computed, constant-or-computed, constant_on_left) with the computed operand first."""
    a, b = node.inputs[0], node.inputs[1]
    if ctx.is_const(a):
        return ctx.computed(b), ctx.const(a, "operand"), True
    x = ctx.computed(a)
    return x, ctx.value(b), False


def _sum_of_computed(ctx, node, x, y, sign: float):
    if x.shape != y.shape:
        raise ctx.error(f"adding computed tensors of shapes {x.full_shape} and {y.full_shape} "
                        "needs broadcasting, which is not supported")
    ctx.emit("add", [x, y], node.outputs[0], attrs={"coeffs": (1.0, sign)})


@register("Add", since=1)
def lower_add(ctx, node):
    x, other, _ = _binary(ctx, node)
    if isinstance(other, np.ndarray):
        _affine(ctx, node, x, shift=other)
    else:
        _sum_of_computed(ctx, node, x, other, 1.0)


@register("Sub", since=1)
def lower_sub(ctx, node):
    x, other, const_left = _binary(ctx, node)
    if not isinstance(other, np.ndarray):
        _sum_of_computed(ctx, node, x, other, -1.0)
    elif const_left:                       # c - x
        _affine(ctx, node, x, scale=np.float32(-1.0), shift=other)
    else:                                  # x - c
        _affine(ctx, node, x, shift=-np.asarray(other, dtype=np.float64))


@register("Mul", since=1)
def lower_mul(ctx, node):
    x, other, _ = _binary(ctx, node)
    if not isinstance(other, np.ndarray):
        if lower_product(ctx, node, x, other):      # x * sigmoid(x), x * x, ...
            return
        raise ctx.error("the product of two computed tensors is not linear and is not "
                        "supported; only multiplication by constants (and the forms of x * f(x) "
                        "that fuse: silu, gelu, hardswish, powers)")
    _affine(ctx, node, x, scale=other)


@register("Div", since=1)
def lower_div(ctx, node):
    if not ctx.is_const(node.inputs[1]):
        if lower_quotient(ctx, node, ctx.value(node.inputs[0]), ctx.computed(node.inputs[1])):
            return                                  # c / x, x / (1 + |x|), ...
        raise ctx.error("division by a computed tensor is not supported; only x / constant "
                        "(and c / x, x / (1 + |x|))")
    x = ctx.computed(node.inputs[0])
    c = ctx.const(node.inputs[1], "divisor").astype(np.float64)
    if np.any(c == 0):
        raise ctx.error("division by a constant that holds zeros")
    _affine(ctx, node, x, scale=1.0 / c)


@register("Neg", since=1)
def lower_neg(ctx, node):
    _affine(ctx, node, ctx.computed(node.inputs[0]), scale=np.float32(-1.0))


@register("BatchNormalization", since=1)
def lower_batchnorm(ctx, node):
    if int(node.attrs.get("training_mode", 0)):
        raise ctx.error("BatchNormalization in training mode; export the model in eval mode")
    if len(node.outputs) > 1 and any(o.outputs for o in node.outputs[1:]):
        raise ctx.error("BatchNormalization's running statistics outputs are used; not supported")
    x = ctx.computed(node.inputs[0])
    gamma, beta, mean, var = (ctx.const(node.inputs[i], what).astype(np.float64) for i, what in
                              ((1, "scale"), (2, "bias"), (3, "mean"), (4, "var")))
    eps = float(node.attrs.get("epsilon", 1e-5))
    scale = gamma / np.sqrt(var + eps)
    shift = beta - mean * scale
    per_channel = (x.shape[0],) + (1,) * (len(x.shape) - 1)
    ctx.emit("affine", [x], node.outputs[0],
             params={"scale": scale.reshape(per_channel), "shift": shift.reshape(per_channel)})
