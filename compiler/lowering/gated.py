"""The gated family: Gelu (opset 20; approximate "none" / "tanh"), HardSwish, Swish (kernels in
runtime/ops/gated.py), HardSigmoid (an affine map and a clamp: the activation family's kernel),
and the product pattern that fuses the exports of x * gate(x) into one kernel.

torch exports nn.SiLU as Mul(x, Sigmoid(x)), nn.GELU as Mul(x, Add(Erf(Div(x, sqrt 2)), 1))
then Mul(0.5), its tanh form as Mul(x, Add(Tanh(Mul(b, Add(x, Mul(k, Mul(x, Mul(x, x)))))), 1))
(the powers fuse first: exponential.py), and nn.Hardswish before opset 14 as
Mul(x, HardSigmoid(x)). A product of two computed tensors is not a kernel, but these are
functions of one tensor, and `fuse_gate` recognises them: with a = s x + t (any scalar affine
of some tensor x) and the other operand g = gs * G(w) + gt (G sigmoid, erf, tanh or the 0..1
clamp, w computed from x), a * g is

- a sigmoid(mu a) (gt = 0, w = mu a):          (gs / mu) silu(mu a)
- a (1 +- erf(w)) (gt = +-gs, w = mu a):         gt (2 / l) gelu(l a),       l = +-sqrt(2) mu
- a (1 +- tanh(w)) (w = b (y + k y^3), y = l a): gt (2 / l) gelu_tanh(l a)   (e0 = e2 = 0)
- a clamp(alpha a + beta, 0, 1) (gt = 0):        gs hard_swish(a; alpha, beta)  (alpha < 0: of -a)

matched to 2^-20 relative (an export's float32 constants agree to ~2^-23: the fused kernel is
the same function up to their rounding); the affine maps around the kernel fold into the layers
next to it (canonicalize). Anything else stays an error (the arithmetic family's Mul).
"""

from __future__ import annotations

import math

import numpy as np

from shardbound.compiler import univariate as uv
from shardbound.compiler.lowering import register, register_product
from shardbound.runtime.ops.gated import TANH_BETA, TANH_KAPPA

SNAP = 2.0 ** -22       # a scale this close to 1 is 1 (the export's rounding of sqrt 2)


def _scale(ctx, x, scale: float, out=None):
    if abs(scale - 1.0) <= SNAP:
        if out is not None:
            ctx.alias(out, x)
        return x
    return ctx.emit("affine", [x], out, params={"scale": np.full(x.shape, scale, np.float32)})


def _emit(ctx, node, kind, x, inner: float, outer: float, attrs=None):
    """node's output = outer * kind(inner * x)."""
    y = ctx.emit(kind, [_scale(ctx, x, inner)], attrs=attrs)
    _scale(ctx, y, outer, node.outputs[0])


@register("Gelu", since=20)
def lower_gelu(ctx, node):
    approximate = node.attrs.get("approximate", "none")
    approximate = approximate.decode() if isinstance(approximate, bytes) else str(approximate)
    kinds = {"none": "gelu", "tanh": "gelu_tanh"}
    if approximate not in kinds:
        raise ctx.error(f"approximate={approximate!r}; Gelu takes 'none' or 'tanh'")
    ctx.emit(kinds[approximate], [ctx.computed(node.inputs[0])], node.outputs[0])


@register("HardSwish", since=14)
def lower_hard_swish(ctx, node):
    ctx.emit("hard_swish", [ctx.computed(node.inputs[0])], node.outputs[0],
             attrs={"alpha": 1.0 / 6.0, "beta": 0.5})


@register("HardSigmoid", since=1)
def lower_hard_sigmoid(ctx, node):
    """max(0, min(1, alpha x + beta)): an affine map and the 0..1 clamp."""
    x = ctx.computed(node.inputs[0])
    alpha = float(np.float32(node.attrs.get("alpha", 0.2)))
    beta = float(np.float32(node.attrs.get("beta", 0.5)))
    y = ctx.emit("affine", [x], params={"scale": np.full(x.shape, alpha, np.float32),
                                        "shift": np.full(x.shape, beta, np.float32)})
    ctx.emit("clamp", [y], node.outputs[0], params={"min": np.zeros(x.shape, np.float32),
                                                     "max": np.ones(x.shape, np.float32)})


@register("Swish", since=24)
def lower_swish(ctx, node):
    """x sigmoid(alpha x) = silu(alpha x) / alpha."""
    x = ctx.computed(node.inputs[0])
    alpha = float(np.float32(node.attrs.get("alpha", 1.0)))
    if alpha == 0.0:
        _scale(ctx, x, 0.5, node.outputs[0])
        return
    _emit(ctx, node, "silu", x, alpha, 1.0 / alpha)


# -- x * gate(x) ---------------------------------------------------------------------------------
def _argument(ctx, gate_node, a, s, t):
    """The gate's argument w as a polynomial in a = s r + t ({degree: coefficient}), or None."""
    w = uv.Computed(gate_node.inputs[0], next(n.shape for n in ctx.nodes
                                              if n.name == gate_node.inputs[0]))
    coeffs = uv.polynomial(ctx, w, uv.peel(ctx, a)[2])
    return None if coeffs is None else uv.degree_terms(uv.in_terms_of(coeffs, s, t))


def _linear(terms) -> float | None:
    """mu with w = mu a, or None."""
    return terms[1] if set(terms) == {1} else None


def _gate(ctx, node, a, g) -> bool:
    s, t, _ = uv.peel(ctx, a)
    if s == 0:
        return False
    gs, gt, inner = uv.peel(ctx, g)
    gate_node = uv.producer(ctx, inner)
    if gate_node is None or gate_node.op not in ("sigmoid", "erf", "tanh", "clamp") or gs == 0:
        return False
    terms = _argument(ctx, gate_node, a, s, t)
    if terms is None:
        return False
    op = gate_node.op
    if op == "sigmoid":
        mu = _linear(terms)
        if gt != 0 or mu is None:
            return False
        _emit(ctx, node, "silu", a, mu, gs / mu)
        return True
    if op in ("erf", "tanh"):
        if not (uv.close(gt, gs) or uv.close(gt, -gs)):
            return False
        sign = 1.0 if uv.close(gt, gs) else -1.0
        if op == "erf":
            mu = _linear(terms)
            if mu is None:
                return False
            lam = math.sqrt(2.0) * sign * mu
            _emit(ctx, node, "gelu", a, lam, gt * 2.0 / lam)
            return True
        if set(terms) != {1, 3}:
            return False
        lam = sign * terms[1] / TANH_BETA
        if not uv.close(sign * terms[3], TANH_BETA * TANH_KAPPA * lam ** 3):
            return False
        _emit(ctx, node, "gelu_tanh", a, lam, gt * 2.0 / lam)
        return True
    # the 0..1 clamp of a HardSigmoid: a clamp(alpha a + beta, 0, 1)
    low, high = uv.uniform(ctx, gate_node, "min", -math.inf), uv.uniform(ctx, gate_node, "max", math.inf)
    if gt != 0 or low != 0.0 or high != 1.0 or not set(terms) <= {0, 1} or 1 not in terms:
        return False
    alpha, beta = terms[1], terms.get(0, 0.0)
    if alpha > 0:
        _emit(ctx, node, "hard_swish", a, 1.0, gs, attrs={"alpha": alpha, "beta": beta})
    else:                               # a clamp(alpha a + beta) = -(y clamp(-alpha y + beta)), y = -a
        y = ctx.emit("affine", [a], params={"scale": np.full(a.shape, -1.0, np.float32)})
        _emit(ctx, node, "hard_swish", y, 1.0, -gs, attrs={"alpha": -alpha, "beta": beta})
    return True


@register_product
def fuse_gate(ctx, node, a, b) -> bool:
    """a * gate(a) in either order (see the module docstring)."""
    return _gate(ctx, node, a, b) or _gate(ctx, node, b, a)
