"""The exponential family: Exp, Log, Reciprocal, Sqrt, Pow, Softplus, Elu, Selu, Celu (kernels
in runtime/ops/exponential.py), the product pattern x^m * x^n -> x^(m+n) (Mul(x, x) is how
torch exports x * x, and x ** 3 inside the tanh Gelu as Mul(x, Mul(x, x))), and the quotient
c / x -> c * reciprocal(x) for a constant c (torch.rsqrt exports as Div(1, Sqrt(x))).

- Pow(x, p) with a constant p (one value): p = 1 is x, p = 0 is 1, p = 0.5 is sqrt, p = -1 a
  reciprocal, any other p the `pow` kernel. Pow(c, x) with a constant c > 0 is exp(x log c).
- Elu (alpha = 0 is a ReLU), Selu -> `elu` with alpha and gamma; Celu(alpha > 0) is
  alpha * elu(x / alpha).
- Log, Sqrt and fractional powers whose input can be shown to lie outside their domain (from
  the declared ranges of the kernels before it, through affine maps: Log(-Sigmoid(x))) are a
  compile-time error; otherwise an input box that leaves the domain gets infinite bounds at
  run time (runtime/ops/exponential.py).

All since opset 1 (Celu 12): later versions only add types (opset 1's `consumed_inputs` is an
in-place hint without meaning for the result, ignored).
"""

from __future__ import annotations

import math

import numpy as np

from shardbound.compiler import univariate as uv
from shardbound.compiler.lowering import register, register_product, register_quotient
from shardbound.runtime.ops import OP_TYPES

SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875


def _unary(ctx, node, kind, attrs=None):
    ctx.emit(kind, [ctx.computed(node.inputs[0])], node.outputs[0], attrs=attrs)


def _scale(ctx, x, scale: float, out=None, shift: float = 0.0):
    """x * scale + shift (an affine node; nothing when it is the identity)."""
    if scale == 1.0 and shift == 0.0:
        if out is not None:
            ctx.alias(out, x)
        return x
    params = {"scale": np.full(x.shape, scale, np.float32)}
    if shift:
        params["shift"] = np.full(x.shape, shift, np.float32)
    return ctx.emit("affine", [x], out, params=params)


def known_range(ctx, v) -> tuple[float, float]:
    """An interval that holds every value of v, from the declared value_range of the kernel
    that computes it, mapped through scalar affines ((-inf, inf) when nothing is declared)."""
    s, t, base = uv.peel(ctx, v)
    node = uv.producer(ctx, base)
    r = getattr(OP_TYPES.get(node.op) if node is not None else None, "value_range", None)
    if not isinstance(r, tuple):
        return -math.inf, math.inf
    with np.errstate(invalid="ignore"):
        ends = [s * r[0] + t, s * r[1] + t]
    if any(math.isnan(e) for e in ends):
        return -math.inf, math.inf
    return min(ends), max(ends)


def _check_domain(ctx, x, what: str, positive: bool):
    low, high = known_range(ctx, x)
    if high < 0 or (positive and high <= 0):
        raise ctx.error(f"its input lies in [{low:g}, {high:g}] by construction, where {what} is "
                        "undefined; check the model")


@register("Exp", since=1)
def lower_exp(ctx, node):
    _unary(ctx, node, "exp")


@register("Log", since=1)
def lower_log(ctx, node):
    _check_domain(ctx, ctx.computed(node.inputs[0]), "log", positive=True)
    _unary(ctx, node, "log")


@register("Reciprocal", since=1)
def lower_reciprocal(ctx, node):
    _unary(ctx, node, "reciprocal")


@register("Sqrt", since=1)
def lower_sqrt(ctx, node):
    _check_domain(ctx, ctx.computed(node.inputs[0]), "sqrt", positive=False)
    _unary(ctx, node, "sqrt")


@register("Softplus", since=1)
def lower_softplus(ctx, node):
    _unary(ctx, node, "softplus")


def _scalar(ctx, tensor, what: str) -> float:
    value = np.asarray(ctx.const(tensor, what), dtype=np.float64).reshape(-1)
    if value.size == 0 or not np.all(value == value[0]):
        raise ctx.error(f"its {what} must be one constant value for all elements; "
                        f"got {value.size} different values")
    v = float(np.float32(value[0]))
    if not math.isfinite(v):
        raise ctx.error(f"its {what} is {v}; it must be finite")
    return v


@register("Pow", since=1)
def lower_pow(ctx, node):
    base, exponent = node.inputs[0], node.inputs[1]
    if ctx.is_const(base):
        c = _scalar(ctx, base, "constant base")
        if c <= 0:
            raise ctx.error(f"a constant base {c} to a computed power is supported only for "
                            "bases > 0 (c ** x = exp(x log c))")
        y = _scale(ctx, ctx.computed(exponent), math.log(c))
        ctx.emit("exp", [y], node.outputs[0])
        return
    x = ctx.computed(base)
    if not ctx.is_const(exponent):
        raise ctx.error("a computed exponent of a computed base is not supported; only a "
                        "constant exponent (or a constant base)")
    p = _scalar(ctx, exponent, "exponent")
    if p == 1.0:
        ctx.alias(node.outputs[0], x)
    elif p == 0.0:                          # x ** 0 = 1 for every x (NaN included)
        _scale(ctx, x, 0.0, node.outputs[0], shift=1.0)
    elif p == 0.5:
        _check_domain(ctx, x, "a square root", positive=False)
        ctx.emit("sqrt", [x], node.outputs[0])
    elif p == -1.0:
        ctx.emit("reciprocal", [x], node.outputs[0])
    else:
        if p != round(p):
            _check_domain(ctx, x, f"x ** {p}", positive=p < 0)
        ctx.emit("pow", [x], node.outputs[0], attrs={"exponent": p})


def _float_attr(node, name, default) -> float:
    return float(np.float32(node.attrs.get(name, default)))


@register("Elu", since=1)
def lower_elu(ctx, node):
    alpha = _float_attr(node, "alpha", 1.0)
    if alpha == 0.0:
        _unary(ctx, node, "relu")
    else:
        _unary(ctx, node, "elu", {"alpha": alpha, "gamma": 1.0})


@register("Selu", since=1)
def lower_selu(ctx, node):
    _unary(ctx, node, "elu", {"alpha": _float_attr(node, "alpha", SELU_ALPHA),
                              "gamma": _float_attr(node, "gamma", SELU_GAMMA)})


@register("Celu", since=12)
def lower_celu(ctx, node):
    alpha = _float_attr(node, "alpha", 1.0)
    if not alpha > 0:
        raise ctx.error(f"alpha is {alpha}; Celu needs alpha > 0")
    y = _scale(ctx, ctx.computed(node.inputs[0]), 1.0 / alpha)
    ctx.emit("elu", [y], node.outputs[0], attrs={"alpha": 1.0, "gamma": alpha})


# -- x^m * x^n ---------------------------------------------------------------------------------
def _monomial(coeffs):
    """(c, n) with coeffs = c r^n, or None."""
    terms = uv.degree_terms(coeffs, rel=0.0)
    if len(terms) != 1:
        return None
    (n, c), = terms.items()
    return (c, n) if n >= 1 else None


@register_product
def fuse_powers(ctx, node, a, b) -> bool:
    """c1 r^m * c2 r^n -> (c1 c2) r^(m+n), r the operands' common base."""
    roots = [a, b]
    for v in (a, b):
        base = uv.peel(ctx, v)[2]
        n = uv.producer(ctx, base)
        if n is not None and n.op == "pow":
            roots.append(uv.Computed(n.inputs[0], next(m.shape for m in ctx.nodes
                                                       if m.name == n.inputs[0])))
    for r in roots:
        pa, pb = uv.polynomial(ctx, a, r), uv.polynomial(ctx, b, r)
        ma = None if pa is None else _monomial(pa)
        mb = None if pb is None else _monomial(pb)
        if ma is None or mb is None or ma[1] + mb[1] > uv.MAX_DEGREE:
            continue
        y = ctx.emit("pow", [r], attrs={"exponent": float(ma[1] + mb[1])})
        _scale(ctx, y, ma[0] * mb[0], node.outputs[0])
        return True
    return False


@register_quotient
def constant_over(ctx, node, a, b) -> bool:
    """c / x = c * reciprocal(x) for a constant c (broadcast into x)."""
    if not isinstance(a, np.ndarray):
        return False
    y = ctx.emit("reciprocal", [b])
    c = np.asarray(a, dtype=np.float64)
    if c.size == 1:
        _scale(ctx, y, float(c.reshape(-1)[0]), node.outputs[0])
    else:
        ctx.emit("affine", [y], node.outputs[0],
                 params={"scale": ctx.sample_constant(c, y, "the numerator")})
    return True
