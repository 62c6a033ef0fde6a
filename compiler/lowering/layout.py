"""The layout family: Flatten, Reshape, Squeeze, Unsqueeze and Transpose (a `reshape` node, or a
`transpose` when the element order really changes; the batch axis stays first), the
pass-through ops Identity, Dropout (inference) and Cast between floats, and the constant
sources Constant and Shape."""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from shardbound.compiler.lowering import register


def _dummy(x):
    return np.empty(x.full_shape, dtype=np.uint8)


@register("Flatten", since=1)
def lower_flatten(ctx, node):
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    axis = int(node.attrs.get("axis", 1))
    axis = axis + len(full) if axis < 0 else axis
    if not 0 <= axis <= len(full):
        raise ctx.error(f"axis {axis} is out of range for shape {full}")
    out = (int(np.prod(full[:axis])), int(np.prod(full[axis:])))
    ctx.reshaped(x, out, node.outputs[0], "Flatten")


@register("Reshape", since=1)
def lower_reshape(ctx, node):
    x = ctx.computed(node.inputs[0])
    if "shape" in node.attrs:                        # opset < 5
        target = [int(d) for d in node.attrs["shape"]]
    else:
        target = [int(d) for d in ctx.const(node.inputs[1], "target shape").reshape(-1)]
    allowzero = int(node.attrs.get("allowzero", 0))
    full = x.full_shape
    resolved = []
    for i, d in enumerate(target):
        if d == 0 and not allowzero:
            if i >= len(full):
                raise ctx.error(f"target shape {target}: 0 at axis {i} copies a missing axis")
            d = full[i]
        resolved.append(d)
    try:
        out = np.reshape(_dummy(x), resolved).shape
    except ValueError:
        raise ctx.error(f"cannot reshape {full} into {target}") from None
    ctx.reshaped(x, out, node.outputs[0], "Reshape")


def _axes(ctx, node, required: bool):
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    axes_in = ctx.optional_input(node, 1)
    if axes_in is not None:
        return [int(a) for a in ctx.const(axes_in, "axes").reshape(-1)]
    if required:
        raise ctx.error("axes are required")
    return None


@register("Squeeze", since=1)
def lower_squeeze(ctx, node):
    x = ctx.computed(node.inputs[0])
    axes = _axes(ctx, node, required=False)
    if axes is None:        # every size-1 axis, but the batch axis stays
        out = (1, *(d for d in x.shape if d != 1))
    else:
        try:
            out = np.squeeze(_dummy(x), axis=tuple(axes)).shape
        except ValueError as e:
            raise ctx.error(f"cannot squeeze {x.full_shape} on axes {axes}: {e}") from None
    ctx.reshaped(x, out, node.outputs[0], "Squeeze")


@register("Unsqueeze", since=1)
def lower_unsqueeze(ctx, node):
    x = ctx.computed(node.inputs[0])
    axes = _axes(ctx, node, required=True)
    rank = len(x.full_shape) + len(axes)
    axes = sorted(a + rank if a < 0 else a for a in axes)
    out = list(x.full_shape)
    for a in axes:
        if not 0 <= a <= len(out):
            raise ctx.error(f"axis {a} is out of range")
        out.insert(a, 1)
    ctx.reshaped(x, tuple(out), node.outputs[0], "Unsqueeze")


@register("Transpose", since=1)
def lower_transpose(ctx, node):
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    perm = [int(p) for p in node.attrs.get("perm", list(range(len(full)))[::-1])]
    if sorted(perm) != list(range(len(full))):
        raise ctx.error(f"perm {perm} is not a permutation of the {len(full)} axes")
    order = np.arange(int(np.prod(full))).reshape(full).transpose(perm)
    if np.array_equal(order.reshape(-1), np.arange(order.size)):
        ctx.reshaped(x, order.shape, node.outputs[0], "Transpose")   # only size-1 axes move
    elif perm[0] == 0:
        ctx.emit("transpose", [x], node.outputs[0], attrs={"perm": tuple(p - 1 for p in perm[1:])})
    else:
        raise ctx.error(f"perm {perm} moves the batch axis; only per-sample transposes are supported")


@register("Constant", since=1, constant_output=True)
def lower_constant(ctx, node):
    a = node.attrs
    if "value" in a:
        v = a["value"]
        value = v.values if hasattr(v, "values") else numpy_helper.to_array(v)
    elif "value_float" in a:
        value = np.float32(a["value_float"])
    elif "value_floats" in a:
        value = np.asarray(a["value_floats"], dtype=np.float32)
    elif "value_int" in a:
        value = np.int64(a["value_int"])
    elif "value_ints" in a:
        value = np.asarray(a["value_ints"], dtype=np.int64)
    else:
        raise ctx.error(f"Constant with attributes {sorted(a)} is not supported")
    ctx.set_const(node.outputs[0], np.asarray(value))


@register("Shape", since=1, constant_output=True)
def lower_shape(ctx, node):
    """The shape of a computed tensor is known at compile time (batch 1)."""
    x = ctx.computed(node.inputs[0])
    shape = np.asarray(x.full_shape, dtype=np.int64)
    start, end = node.attrs.get("start"), node.attrs.get("end")
    if start is not None or end is not None:
        shape = shape[slice(start, end)]
    ctx.set_const(node.outputs[0], shape)


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
