"""The arithmetic family: arithmetic with constants (-> `affine`: Add, Sub, Mul, Div, Neg,
BatchNormalization in inference as a per-channel affine that canonicalize folds into the layer
before it), sums of computed tensors and constants (-> `add`: Add, Sub, Sum) and Where with a
constant condition (a select: x * c + y * (1 - c), exact for c in {0, 1}; a computed
condition: compiler/lowering/discrete.py). A product of two
computed tensors goes to the product patterns other families register (`register_product`:
x * sigmoid(x) is silu), a division by one to their quotient patterns (`register_quotient`:
c / x is a reciprocal); what none of them takes is a general product (the bilinear family:
McCormick planes; a / b as a * reciprocal(b)).

Broadcasting is ONNX's (numpy's) on either side: a constant or another operand that grows a
computed tensor first expands it (a `move`, compiler/lowering/movement.py), so the affine
and add kernels always see operands of the output's shape."""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import lower_product, lower_quotient, register
from shardbound.compiler.lowering.bilinear import lower_product_xy, lower_quotient_xy
from shardbound.compiler.lowering.discrete import lower_where_computed
from shardbound.compiler.lowering.movement import expand_to


def _affine(ctx, out_tensor, x, scale=None, shift=None):
    """x * scale + shift (constants on x's ONNX shape or broadcasting into the result) into
    `out_tensor` (None: an intermediate value)."""
    consts = [np.asarray(c) for c in (scale, shift) if c is not None]
    out = ctx.broadcast_shape(x.full_shape, *(c.shape for c in consts))
    x = expand_to(ctx, x, out)
    params = {}
    if scale is not None:
        params["scale"] = ctx.sample_constant(scale, x, "the constant factor")
    if shift is not None:
        params["shift"] = ctx.sample_constant(shift, x, "the constant term")
    if not params:
        if out_tensor is not None:
            ctx.alias(out_tensor, x)
        return x
    return ctx.emit("affine", [x], out_tensor, params=params)


def _binary(ctx, node):
    """(computed, constant-or-computed, constant_on_left) with the computed operand first."""
    a, b = node.inputs[0], node.inputs[1]
    if ctx.is_const(a):
        return ctx.computed(b), ctx.const(a, "operand"), True
    x = ctx.computed(a)
    return x, ctx.value(b), False


def weighted_sum(ctx, node, terms, const=None):
    """sum of coeff * x over (coeff, computed x) terms, + const: each term expanded to the
    broadcast ONNX shape, repeated tensors merged."""
    shapes = [x.full_shape for _, x in terms] + ([np.shape(const)] if const is not None else [])
    out = ctx.broadcast_shape(*shapes)
    merged: dict = {}
    for c, x in terms:
        x = ctx.canonical(expand_to(ctx, x, out))
        merged[x] = merged.get(x, 0.0) + float(c)
    if len(merged) == 1:
        (x, c), = merged.items()
        _affine(ctx, node.outputs[0], x, scale=None if c == 1.0 else np.float32(c), shift=const)
        return
    target = node.outputs[0] if const is None else None
    y = ctx.emit("add", list(merged), target, attrs={"coeffs": tuple(merged.values())})
    if const is not None:
        _affine(ctx, node.outputs[0], y, shift=const)


@register("Add", since=1)
def lower_add(ctx, node):
    x, other, _ = _binary(ctx, node)
    if isinstance(other, np.ndarray):
        _affine(ctx, node.outputs[0], x, shift=other)
    else:
        weighted_sum(ctx, node, [(1.0, x), (1.0, other)])


@register("Sub", since=1)
def lower_sub(ctx, node):
    x, other, const_left = _binary(ctx, node)
    if not isinstance(other, np.ndarray):
        weighted_sum(ctx, node, [(1.0, x), (-1.0, other)])
    elif const_left:                       # c - x
        _affine(ctx, node.outputs[0], x, scale=np.float32(-1.0), shift=other)
    else:                                  # x - c
        _affine(ctx, node.outputs[0], x, shift=-np.asarray(other, dtype=np.float64))


@register("Sum", since=6)
def lower_sum(ctx, node):
    """Any number of computed tensors and constants (broadcasting from opset 8)."""
    terms, consts = [], []
    for t in node.inputs:
        v = ctx.value(t)
        if isinstance(v, np.ndarray):
            consts.append(np.asarray(v, dtype=np.float64))
        else:
            terms.append((1.0, v))
    const = None
    if consts:
        try:
            const = sum(np.broadcast_arrays(*consts))
        except ValueError:
            raise ctx.error(f"constants of shapes {[c.shape for c in consts]} do not "
                            "broadcast together") from None
    weighted_sum(ctx, node, terms, const)


@register("Mul", since=1)
def lower_mul(ctx, node):
    x, other, _ = _binary(ctx, node)
    if not isinstance(other, np.ndarray):
        if lower_product(ctx, node, x, other):      # x * sigmoid(x), x * x, ...
            return
        lower_product_xy(ctx, node, x, other)       # McCormick (the bilinear family)
        return
    _affine(ctx, node.outputs[0], x, scale=other)


@register("Div", since=1)
def lower_div(ctx, node):
    if not ctx.is_const(node.inputs[1]):
        a, b = ctx.value(node.inputs[0]), ctx.computed(node.inputs[1])
        if lower_quotient(ctx, node, a, b):
            return                                  # c / x, x / (1 + |x|), ...
        lower_quotient_xy(ctx, node, a, b)          # a * reciprocal(b)
        return
    x = ctx.computed(node.inputs[0])
    c = ctx.const(node.inputs[1], "divisor").astype(np.float64)
    if np.any(c == 0):
        raise ctx.error("division by a constant that holds zeros")
    _affine(ctx, node.outputs[0], x, scale=1.0 / c)


@register("Neg", since=1)
def lower_neg(ctx, node):
    _affine(ctx, node.outputs[0], ctx.computed(node.inputs[0]), scale=np.float32(-1.0))


@register("Where", since=9)
def lower_where(ctx, node):
    """A constant condition selects elementwise between two operands (computed or constant);
    a computed condition is the discrete family's `where_select`."""
    cond, a, b = node.inputs[:3]
    if not ctx.is_const(cond):          # a piecewise choice: the discrete family's
        lower_where_computed(ctx, node)
        return
    c = np.asarray(ctx.const(cond, "condition")).astype(bool)
    keep = c.astype(np.float64)
    values = [ctx.value(a), ctx.value(b)]
    out = ctx.broadcast_shape(c.shape, *(np.shape(v) if isinstance(v, np.ndarray)
                                         else v.full_shape for v in values))
    keep = np.broadcast_to(keep, out)
    scales = (keep, 1.0 - keep)
    terms, const = [], np.zeros(out)
    for v, s in zip(values, scales):
        if isinstance(v, np.ndarray):
            const = const + np.where(s > 0, np.broadcast_to(np.asarray(v, np.float64), out), 0.0)
        else:
            terms.append((v, s))
    parts = [_affine(ctx, None, expand_to(ctx, v, out), scale=s) for v, s in terms]
    shift = const if np.any(const) else None
    if len(parts) == 1:
        _affine(ctx, node.outputs[0], parts[0], shift=shift)
        return
    y = ctx.emit("add", parts, None if shift is not None else node.outputs[0],
                 attrs={"coeffs": (1.0, 1.0)})
    if shift is not None:
        _affine(ctx, node.outputs[0], y, shift=shift)


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
    full = x.full_shape
    if len(full) < 2 or scale.size != full[1]:
        raise ctx.error(f"{scale.size} channels of statistics for an input {full} (channels "
                        "are axis 1)")
    per_channel = (1, full[1]) + (1,) * (len(full) - 2)
    ctx.emit("affine", [x], node.outputs[0],
             params={"scale": ctx.sample_constant(scale.reshape(per_channel), x, "the scale"),
                     "shift": ctx.sample_constant(shift.reshape(per_channel), x, "the shift")})
