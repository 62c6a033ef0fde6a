"""The lowered IR seen as functions of one tensor: what the product patterns match.

While a model is lowered, `Mul(a, b)` of two computed tensors is a product the bound kernels
cannot take, unless a and b are functions of one tensor r, elementwise: then a * b is a function
of r alone, and some such functions have kernels (x * sigmoid(x) is silu, x * x a power). The
patterns (compiler/lowering/exponential.py, gated.py; registered with `register_product`) read
the IR emitted so far through these helpers:

- `peel(ctx, v)`: v = s * base + t through a chain of `affine` nodes with one scale and shift
  for every element (Mul / Add / Sub / Div by scalars), base the first other node;
- `polynomial(ctx, v, r)`: v as a polynomial in r (coefficients, lowest degree first) through
  uniform affines, sums (`add`) and integer powers (`pow`), or None.
"""

from __future__ import annotations

import numpy as np
from numpy.polynomial import polynomial as P

from shardbound.compiler.context import Computed

MAX_DEGREE = 8          # polynomials of higher degree are not what any pattern looks for


def producer(ctx, v: Computed):
    """The IR node that computes v."""
    for n in reversed(ctx.nodes):
        if n.name == v.node:
            return n
    return None


def _inputs(ctx, node) -> list[Computed]:
    by_name = {n.name: n for n in ctx.nodes}
    return [Computed(i, by_name[i].shape) for i in node.inputs]


def uniform(ctx, node, role: str, default: float) -> float | None:
    """The node's parameter `role` when every element holds one value (the default when the
    node has none), else None."""
    key = node.param(role)
    if key is None:
        return default
    values = np.asarray(ctx.tensors[key], dtype=np.float64).reshape(-1)
    if values.size == 0 or not np.all(values == values[0]):
        return None
    return float(values[0])


def scalar_affine(ctx, node):
    """(scale, shift) of an affine node with one scale and shift for all elements, or None."""
    if node is None or node.op != "affine":
        return None
    s, t = uniform(ctx, node, "scale", 1.0), uniform(ctx, node, "shift", 0.0)
    return None if s is None or t is None else (s, t)


def peel(ctx, v: Computed) -> tuple[float, float, Computed]:
    """(s, t, base) with v = s * base + t."""
    s, t = 1.0, 0.0
    while True:
        node = producer(ctx, v)
        st = scalar_affine(ctx, node)
        if st is None:
            return s, t, v
        s, t = s * st[0], t + s * st[1]
        v = _inputs(ctx, node)[0]


def polynomial(ctx, v: Computed, root: Computed, depth: int = 0):
    """Coefficients c (lowest degree first) with v = sum_k c_k root^k, or None."""
    if v.node == root.node:
        return np.array([0.0, 1.0])
    if depth > 32:
        return None
    node = producer(ctx, v)
    if node is None:
        return None
    st = scalar_affine(ctx, node)
    if st is not None:
        inner = polynomial(ctx, _inputs(ctx, node)[0], root, depth + 1)
        return None if inner is None else P.polyadd(inner * st[0], [st[1]])
    if node.op == "add":
        coeffs = dict(node.attrs).get("coeffs", (1.0,) * len(node.inputs))
        total = np.array([0.0])
        for c, x in zip(coeffs, _inputs(ctx, node)):
            inner = polynomial(ctx, x, root, depth + 1)
            if inner is None:
                return None
            total = P.polyadd(total, inner * c)
        return total
    if node.op == "pow":
        p = float(dict(node.attrs).get("exponent", 0))
        if p != round(p) or not 1 <= p <= MAX_DEGREE:
            return None
        inner = polynomial(ctx, _inputs(ctx, node)[0], root, depth + 1)
        return None if inner is None else P.polypow(inner, int(p), maxpower=MAX_DEGREE * 4)
    return None


def in_terms_of(coeffs, s: float, t: float):
    """The polynomial coeffs(r) rewritten in a = s r + t (s != 0): r = (a - t) / s."""
    r_of_a = np.array([-t / s, 1.0 / s])
    out = np.array([0.0])
    power = np.array([1.0])
    for c in coeffs:
        out = P.polyadd(out, c * power)
        power = P.polymul(power, r_of_a)
    return out


def close(a: float, b: float, rel: float = 2.0 ** -20) -> bool:
    """a and b agree to `rel` relative (float32 constants of one export agree to ~2^-23)."""
    return abs(a - b) <= rel * max(abs(a), abs(b))


def degree_terms(coeffs, rel: float = 2.0 ** -20) -> dict[int, float]:
    """The coefficients that are not negligible next to the largest one."""
    coeffs = np.asarray(coeffs, dtype=np.float64)
    scale = float(np.abs(coeffs).max()) if coeffs.size else 0.0
    return {k: float(c) for k, c in enumerate(coeffs) if abs(c) > rel * scale}
