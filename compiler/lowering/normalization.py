"""The normalization family: LayerNormalization (opset 17, any axis, scale and optional bias)
and the patterns older exporters emit for it, lowered to `normalize` (runtime/ops/
normalization.py) between linear nodes:

    x -> c = x - mean(x)       (reduce_sum with mean, an expand, add: exact linear nodes)
      -> n = c / sqrt(mean(c^2) + eps)      (`normalize`: the one relaxed node)
      -> n * gamma + beta      (affine; canonicalize folds it into the next layer)

CROWN thus bounds the centred value c as a linear function of the network before the kernel
relaxes the rest. torch.onnx.export of nn.LayerNorm before opset 17 writes ReduceMean, Sub,
Pow 2 (or Mul c * c), ReduceMean, Add eps, Sqrt, Div, Mul gamma, Add beta: the quotient
pattern `fuse_normalize` recognises c / (s * sqrt(k * mean(c^2) + t)) (the mean may be a
ReduceSum scaled by 1 / D; c * Reciprocal(Sqrt(...)) and c * Pow(..., -0.5) are the product
pattern `fuse_normalize_product`), for any reduced axes, and emits `normalize` (the centring,
Mul and Add lower as they stand, to the same nodes as above). The import drops the Pow,
ReduceMean, Add and Sqrt nodes the pattern left unused.
"""

from __future__ import annotations

import math

import numpy as np

from shardbound.compiler import univariate as uv
from shardbound.compiler.lowering import register, register_product, register_quotient
from shardbound.compiler.lowering.arithmetic import _affine
from shardbound.compiler.lowering.movement import expand_to


def _sample_axes(x, axes) -> tuple[int, ...]:
    """ONNX axes of x's full shape -> its sample axes (the size-1 batch axis dropped)."""
    lead = 1 if x.batched else 0
    return tuple(sorted(a - lead for a in axes if a >= lead))


def _check_eps(ctx, eps: float) -> None:
    if not eps > 0 or not math.isfinite(eps):
        raise ctx.error(f"epsilon is {eps}; it must be a positive number (var + epsilon "
                        "divides)")


def normalize(ctx, c, v, sample_axes, eps: float, out_tensor=None):
    """c / sqrt(v), v = mean(c^2 over sample_axes) + eps (computed by the nodes before)."""
    _check_eps(ctx, eps)
    return ctx.emit("normalize", [c, v], out_tensor, attrs={"axes": tuple(sample_axes),
                                                              "eps": float(eps)})


def _scaled(ctx, x, scale: float, shift: float = 0.0, out_tensor=None):
    """x * scale + shift with one scale and shift for every element (x itself if identity)."""
    if scale == 1.0 and shift == 0.0:
        if out_tensor is not None:
            ctx.alias(out_tensor, x)
        return x
    params = {}
    if scale != 1.0:
        params["scale"] = np.full(x.shape, scale, np.float32)
    if shift:
        params["shift"] = np.full(x.shape, shift, np.float32)
    return ctx.emit("affine", [x], out_tensor, params=params)


@register("LayerNormalization", since=17)
def lower_layer_normalization(ctx, node):
    if any(ctx.used(o) for o in node.outputs[1:]):
        raise ctx.error("its Mean / InvStdDev outputs are used; only the normalised output Y "
                        "is supported")
    x = ctx.canonical(ctx.computed(node.inputs[0]))
    full = x.full_shape
    rank = len(full)
    axis = int(node.attrs.get("axis", -1))
    if not -rank <= axis < rank:
        raise ctx.error(f"axis {axis} is out of range for a rank-{rank} input")
    axis %= rank
    eps = float(np.float32(node.attrs.get("epsilon", 1e-5)))
    _check_eps(ctx, eps)
    gamma = ctx.const(node.inputs[1], "scale")
    t = ctx.optional_input(node, 2)
    beta = None if t is None else ctx.const(t, "bias")
    axes = _sample_axes(x, range(axis, rank))
    if not axes:                    # only the size-1 batch axis: x - mean(x) = 0
        _affine(ctx, node.outputs[0], x, scale=np.zeros(full[axis:], np.float32),
                shift=beta if beta is not None else np.zeros(full[axis:], np.float32))
        return
    mean = ctx.emit("reduce_sum", [x], attrs={"axes": axes, "mean": True})
    spread = ctx.canonical(expand_to(ctx, mean, full))
    c = ctx.emit("add", [x, spread], attrs={"coeffs": (1.0, -1.0)})
    square = ctx.emit("pow", [c], attrs={"exponent": 2.0})
    var = ctx.emit("reduce_sum", [square], attrs={"axes": axes, "mean": True})
    n = normalize(ctx, c, _scaled(ctx, var, 1.0, eps), axes, eps)
    _affine(ctx, node.outputs[0], n, scale=gamma, shift=beta)


# -- the patterns of older exports ----------------------------------------------------------------
def _mean_square(ctx, v, a):
    """(k, t, axes) with v = k * mean(a^2 over the sample axes) + t, k > 0, t > 0; or None.
    v is affine nodes over a reduce_sum of a polynomial in a that is c a^2."""
    s, t, base = uv.peel(ctx, v)
    red = uv.producer(ctx, base)
    if red is None or red.op != "reduce_sum":
        return None
    attrs = dict(red.attrs)
    axes = tuple(attrs.get("axes", ()))
    (inner,) = uv._inputs(ctx, red)
    if tuple(inner.shape) != tuple(a.shape) or not axes:
        return None
    coeffs = uv.polynomial(ctx, inner, a)
    terms = None if coeffs is None else uv.degree_terms(coeffs)
    if terms is None or set(terms) != {2}:
        return None
    D = math.prod(a.shape[i] for i in axes)
    k = s * terms[2] * (1 if attrs.get("mean") else D)
    if not (k > 0 and t > 0):
        return None
    return k, t, axes


def _root_of(ctx, b, power: float):
    """(s, v) with b = s * v^power, through `sqrt` (power 0.5), `reciprocal` of `sqrt` or
    `pow` -0.5 (power -0.5), s > 0; or None."""
    s, t, base = uv.peel(ctx, b)
    node = uv.producer(ctx, base)
    if node is None or t != 0 or not s > 0:
        return None
    if power == 0.5 and node.op == "sqrt":
        return s, uv._inputs(ctx, node)[0]
    if power == -0.5:
        if node.op == "pow" and float(dict(node.attrs).get("exponent", 0)) == -0.5:
            return s, uv._inputs(ctx, node)[0]
        if node.op == "reciprocal":
            inner = _root_of(ctx, uv._inputs(ctx, node)[0], 0.5)
            if inner is not None:
                return s / inner[0], inner[1]
    return None


def _emit_normalized(ctx, node, a, b, factor: float, v) -> bool:
    """a * factor / sqrt(v) (that is b), v = k mean(a^2) + t: normalize(a) * factor /
    sqrt(k), when b has the reduced shape of a and broadcasts into it."""
    found = _mean_square(ctx, v, a)
    if found is None:
        return False
    k, t, axes = found
    reduced = tuple(1 if i in axes else d for i, d in enumerate(a.shape))
    if tuple(b.shape) != reduced or b.batched != a.batched:
        return False
    y = normalize(ctx, a, _scaled(ctx, v, 1.0 / k), axes, t / k)
    _scaled(ctx, y, factor / math.sqrt(k), out_tensor=node.outputs[0])
    return True


@register_quotient
def fuse_normalize(ctx, node, a, b) -> bool:
    """a / (s * sqrt(k * mean(a^2) + t))."""
    if isinstance(a, np.ndarray):
        return False
    root = _root_of(ctx, b, 0.5)
    return root is not None and _emit_normalized(ctx, node, a, b, 1.0 / root[0], root[1])


@register_product
def fuse_normalize_product(ctx, node, a, b) -> bool:
    """a * s / sqrt(k * mean(a^2) + t) (either operand order)."""
    for x, y in ((a, b), (b, a)):
        root = _root_of(ctx, y, -0.5)
        if root is not None and _emit_normalized(ctx, node, x, y, root[0], root[1]):
            return True
    return False
