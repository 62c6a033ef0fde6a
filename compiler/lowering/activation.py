"""The activation family: ReLU and the other piecewise-linear activations (kernels in
runtime/ops/activation.py).

Relu, LeakyRelu (-> leaky_relu; relu when alpha = 0), PRelu with a constant slope (-> prelu),
Abs, Sign, Clip (attributes before opset 11, optional constant inputs from 11; HardTanh and
Relu6 export as Clip) and Max / Min of one computed tensor and constants (-> clamp; Max with
0 -> relu).
"""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import register

F32_MAX = float(np.finfo(np.float32).max)


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
    curvature = ("convex" if (slope <= 1).all() else "concave" if (slope > 1).all()
                 else "mixed")
    ctx.emit("prelu", [x], node.outputs[0], params={"slope": slope},
             attrs={"curvature": curvature})


@register("Abs", since=6)
def lower_abs(ctx, node):
    ctx.emit("abs", [ctx.computed(node.inputs[0])], node.outputs[0])


@register("Sign", since=9)
def lower_sign(ctx, node):
    ctx.emit("sign", [ctx.computed(node.inputs[0])], node.outputs[0])


# -- clamps ---------------------------------------------------------------------------------------
def _bound(ctx, x, array, role: str, what: str):
    """A clamp bound as a per-sample float32 array, or None when it bounds nothing (beyond
    the float32 range on its side); infinite entries of the harmless sign become the float32
    extreme (the same function for finite inputs)."""
    if array is None:
        return None
    array = np.asarray(array, dtype=np.float64)
    harmless, harmful = (-np.inf, np.inf) if role == "min" else (np.inf, -np.inf)
    if np.isnan(array).any() or (array == harmful).any():
        raise ctx.error(f"{what} holds {'nan' if np.isnan(array).any() else harmful}; the "
                        "output would not be finite")
    array = np.clip(array, -F32_MAX, F32_MAX)
    if (array == np.clip(harmless, -F32_MAX, F32_MAX)).all():
        return None
    return ctx.sample_constant(array, x, what)


def _emit_clamp(ctx, node, x, low, high):
    """clamp(x, low, high) with per-sample bounds (None: unbounded); low above high clamps to
    high (ONNX Clip: Min(max, Max(x, min)))."""
    if low is not None and high is not None:
        low = np.minimum(low, high)
    params = {"min": low, "max": high}
    if high is None and low is None:
        ctx.alias(node.outputs[0], x)
    elif high is None and not low.any():
        ctx.emit("relu", [x], node.outputs[0])
    else:
        ctx.emit("clamp", [x], node.outputs[0], params=params)


@register("Clip", since=6)
def lower_clip_attributes(ctx, node):
    x = ctx.computed(node.inputs[0])
    low = _bound(ctx, x, node.attrs.get("min"), "min", "min")
    high = _bound(ctx, x, node.attrs.get("max"), "max", "max")
    _emit_clamp(ctx, node, x, low, high)


@register("Clip", since=11)
def lower_clip_inputs(ctx, node):
    x = ctx.computed(node.inputs[0])
    found = []
    for i, role in ((1, "min"), (2, "max")):
        tensor = ctx.optional_input(node, i)
        if tensor is not None and not ctx.is_const(tensor):
            raise ctx.error(f"its {role} is computed from the network input; only constant "
                            "Clip bounds are supported")
        found.append(None if tensor is None else
                     _bound(ctx, x, ctx.const(tensor, role), role, role))
    _emit_clamp(ctx, node, x, *found)


def _max_min(ctx, node, role: str):
    """Max (role "min": the constants bound x from below) or Min of one computed tensor and
    any number of constants."""
    computed = [t for t in node.inputs if not ctx.is_const(t)]
    if len(computed) > 1:
        raise ctx.error(f"{node.op} of {len(computed)} computed tensors is not supported yet; "
                        "only of one computed tensor and constants")
    if not computed:
        raise ctx.error(f"{node.op} of constants only should have been folded")
    x = ctx.computed(computed[0])
    consts = [np.asarray(ctx.const(t, "operand"), dtype=np.float64) for t in node.inputs
              if ctx.is_const(t)]
    if not consts:
        ctx.alias(node.outputs[0], x)
        return
    try:
        c = (np.maximum if role == "min" else np.minimum).reduce(np.broadcast_arrays(*consts))
    except ValueError:
        raise ctx.error(f"its constants of shapes {[k.shape for k in consts]} do not "
                        "broadcast together") from None
    bound = _bound(ctx, x, c, role, "the constant operand")
    _emit_clamp(ctx, node, x, *((bound, None) if role == "min" else (None, bound)))


@register("Max", since=6)
@register("Max", since=8)
def lower_max(ctx, node):
    _max_min(ctx, node, "min")


@register("Min", since=6)
@register("Min", since=8)
def lower_min(ctx, node):
    _max_min(ctx, node, "max")
