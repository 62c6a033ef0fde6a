"""The layout family: Flatten, Reshape, Squeeze, Unsqueeze and Transpose (a `reshape` node, or a
`transpose` when the element order really changes; the batch axis stays first), the
pass-through ops Identity and Dropout (inference), the constant
sources Constant and Shape, and Pad (constant / reflect / edge / wrap, negative pads crop: a
`pad` node, an index map). Cast is the discrete family's (between floats it passes
through)."""

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
    if axes is None:        # every size-1 axis (the batch axis too: see context.py)
        out = np.squeeze(_dummy(x)).shape
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
    permute(ctx, x, perm, node.outputs[0])


def permute(ctx, x, perm, out_tensor=None):
    """x's ONNX axes permuted: a view when only size-1 axes move, a `transpose` of the sample
    axes when the batch axis stays first, else a `move` (the batch axis of size 1 goes
    elsewhere: context.py)."""
    from shardbound.compiler.lowering.movement import emit_move

    full = x.full_shape
    perm = [int(p) for p in perm]
    order = np.arange(int(np.prod(full))).reshape(full).transpose(perm)
    if np.array_equal(order.reshape(-1), np.arange(order.size)):
        return ctx.reshaped(x, order.shape, out_tensor, "Transpose")   # only size-1 axes move
    if x.batched and perm[0] == 0 and len(order.shape) >= 2 and order.shape[0] == 1:
        return ctx.emit("transpose", [x], out_tensor, attrs={"perm": tuple(p - 1 for p in perm[1:])})
    return emit_move(ctx, [x], [("transpose", tuple(perm))], order.shape, out_tensor)


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


# -- Pad ----------------------------------------------------------------------------------------
def _pad(ctx, node, pads, value, axes=None):
    """Pads `pads` (ONNX layout: every begin, then every end, over `axes` or all axes) of the
    computed input, as a `pad` node over the per-sample axes; the batch axis is not padded."""
    from shardbound.runtime.ops.layout import PAD_MODES, pad_axis_source

    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    rank = len(full)
    mode = node.attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in PAD_MODES or (mode == "wrap" and ctx.opset < 19):
        raise ctx.error(f"pad mode {mode!r} is not supported at this opset; use constant, "
                        "reflect or edge" + (" (or wrap from opset 19)" if mode == "wrap" else ""))
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    if axes is None:
        axes = list(range(rank))
    axes = [a + rank if a < 0 else a for a in axes]
    if any(not 0 <= a < rank for a in axes) or len(set(axes)) != len(axes):
        raise ctx.error(f"axes {axes} are not distinct axes of the rank-{rank} input")
    if len(pads) != 2 * len(axes):
        raise ctx.error(f"pads {pads} must have 2 entries per padded axis ({2 * len(axes)})")
    per_axis = [(0, 0)] * rank
    for i, a in enumerate(axes):
        per_axis[a] = (pads[i], pads[i + len(axes)])
    if x.batched and per_axis[0] != (0, 0):
        raise ctx.error(f"pads {pads} pad the batch axis; only per-sample axes can be padded")
    lead = 1 if x.batched else 0
    value = float(np.asarray(value, dtype=np.float32).reshape(-1)[0]) if value is not None else 0.0
    if not np.isfinite(value):
        raise ctx.error(f"constant value {value} is not finite; bounds through it would be "
                        "meaningless")
    try:
        for n, (b, e) in zip(full[lead:], per_axis[lead:]):
            pad_axis_source(n, b, e, mode)
    except ValueError as err:
        raise ctx.error(f"{err}") from None
    if all(p == (0, 0) for p in per_axis):
        ctx.alias(node.outputs[0], x)
        return
    ctx.emit("pad", [x], node.outputs[0],
             attrs={"pads": tuple(per_axis[lead:]), "mode": mode,
                    "value": value if mode == "constant" else 0.0})


def _const_value(ctx, node, i):
    v = ctx.optional_input(node, i)
    if v is None:
        return None
    value = np.asarray(ctx.const(v, "constant_value"))
    if value.size != 1:
        raise ctx.error(f"constant_value must be a scalar, got shape {value.shape}")
    return value


@register("Pad", since=2)
def lower_pad_2(ctx, node):
    """Opset 2: the `pads` and `value` attributes. (Opset 1's `paddings` spelling is not
    registered: onnxruntime runs no opset below 7, so it could not be checked.)"""
    _pad(ctx, node, node.attrs.get("pads", []), node.attrs.get("value", 0.0))


@register("Pad", since=11)
def lower_pad_11(ctx, node):
    """Opset 11: pads and the constant value are inputs (constants here)."""
    _pad(ctx, node, ctx.const(node.inputs[1], "pads"), _const_value(ctx, node, 2))


@register("Pad", since=18)
def lower_pad_18(ctx, node):
    """Opset 18: an optional `axes` input says which axes `pads` covers (19 adds wrap mode)."""
    axes_in = ctx.optional_input(node, 3)
    axes = None if axes_in is None else [int(a) for a in
                                         np.asarray(ctx.const(axes_in, "axes")).reshape(-1)]
    _pad(ctx, node, ctx.const(node.inputs[1], "pads"), _const_value(ctx, node, 2), axes)
