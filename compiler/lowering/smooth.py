"""The smooth family: Sigmoid, Tanh, Erf and Softsign (kernels in runtime/ops/smooth.py).

Sigmoid and Tanh have three schema versions (1, 6, 13); the signature changed once for us:
opset 1 has the legacy `consumed_inputs` attribute (an in-place hint without meaning for the
result, ignored), dropped in 6; 13 only adds bfloat16. So one handler each, since opset 1.
Erf (9, 13) and Softsign (1, 22) only add types after their first version. torch exports
nn.Softsign as Div(x, Add(Abs(x), 1)): the quotient pattern `fuse_softsign` makes that the
softsign kernel (x / (c + d |mu x|) = softsign(k x) / (c k), k = d |mu| / c, c, d > 0).
"""

from __future__ import annotations

import numpy as np

from shardbound.compiler import univariate as uv
from shardbound.compiler.lowering import register, register_quotient


@register("Sigmoid", since=1)
def lower_sigmoid(ctx, node):
    ctx.emit("sigmoid", [ctx.computed(node.inputs[0])], node.outputs[0])


@register("Tanh", since=1)
def lower_tanh(ctx, node):
    ctx.emit("tanh", [ctx.computed(node.inputs[0])], node.outputs[0])


@register("Erf", since=9)
def lower_erf(ctx, node):
    ctx.emit("erf", [ctx.computed(node.inputs[0])], node.outputs[0])


@register("Softsign", since=1)
def lower_softsign(ctx, node):
    ctx.emit("softsign", [ctx.computed(node.inputs[0])], node.outputs[0])


def _scale(ctx, x, scale: float, out=None):
    if scale == 1.0:
        if out is not None:
            ctx.alias(out, x)
        return x
    return ctx.emit("affine", [x], out, params={"scale": np.full(x.shape, scale, np.float32)})


@register_quotient
def fuse_softsign(ctx, node, a, b) -> bool:
    """a / (c + d |w|) with w = mu a, c, d > 0 (see the module docstring)."""
    if isinstance(a, np.ndarray):
        return False
    s, t, root = uv.peel(ctx, a)
    d, c, inner = uv.peel(ctx, b)
    abs_node = uv.producer(ctx, inner)
    if abs_node is None or abs_node.op != "abs" or not (c > 0 and d > 0) or s == 0:
        return False
    w = uv.Computed(abs_node.inputs[0], next(n.shape for n in ctx.nodes
                                             if n.name == abs_node.inputs[0]))
    coeffs = uv.polynomial(ctx, w, root)
    terms = None if coeffs is None else uv.degree_terms(uv.in_terms_of(coeffs, s, t))
    if terms is None or set(terms) != {1}:
        return False
    k = d * abs(terms[1]) / c
    y = ctx.emit("softsign", [_scale(ctx, a, k)])
    _scale(ctx, y, 1.0 / (c * k), node.outputs[0])
    return True
