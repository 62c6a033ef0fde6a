"""Elementwise ops: Relu, arithmetic with constants (-> `affine`), sums of computed tensors
(-> `add`), and the pass-through ops Identity, Dropout (inference) and Cast between floats."""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import register


@register("Relu", since=1)
def lower_relu(ctx, node):
    ctx.emit("relu", [ctx.computed(node.inputs[0])], node.outputs[0])


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
        raise ctx.error("the product of two computed tensors is not linear and is not "
                        "supported; only multiplication by constants")
    _affine(ctx, node, x, scale=other)


@register("Div", since=1)
def lower_div(ctx, node):
    if ctx.is_const(node.inputs[0]):
        raise ctx.error("division by a computed tensor is not supported; only x / constant")
    x = ctx.computed(node.inputs[0])
    c = ctx.const(node.inputs[1], "divisor").astype(np.float64)
    if np.any(c == 0):
        raise ctx.error("division by a constant that holds zeros")
    _affine(ctx, node, x, scale=1.0 / c)


@register("Neg", since=1)
def lower_neg(ctx, node):
    _affine(ctx, node, ctx.computed(node.inputs[0]), scale=np.float32(-1.0))


@register("Identity", since=1)
def lower_identity(ctx, node):
    ctx.alias(node.outputs[0], ctx.value(node.inputs[0]))


@register("Dropout", since=1)
def lower_dropout(ctx, node):
    """Inference: the output is the input; a requested mask output is all ones."""
    training = ctx.optional_input(node, 2)
    if training is not None and bool(np.asarray(ctx.const(training, "training_mode")).item()):
        raise ctx.error("Dropout in training mode is random; export the model in eval mode")
    if int(node.attrs.get("is_test", 1)) == 0 and ctx.opset < 7:
        raise ctx.error("Dropout with is_test=0 is random; export the model in eval mode")
    x = ctx.value(node.inputs[0])
    ctx.alias(node.outputs[0], x)
    if len(node.outputs) > 1 and node.outputs[1].name:
        if node.outputs[1].outputs:
            raise ctx.error("the Dropout mask output is used by other nodes; not supported")


@register("Cast", since=1)
def lower_cast(ctx, node):
    to = int(node.attrs.get("to", 1))
    from onnx import TensorProto
    if to not in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16):
        raise ctx.error("a cast of a computed tensor to a non-float type is not supported")
    ctx.alias(node.outputs[0], ctx.computed(node.inputs[0]))
