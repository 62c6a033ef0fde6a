"""The bilinear family: products of two computed tensors (runtime/ops/bilinear.py).

- Mul(a, b), both computed, that no product pattern of another family fuses (x * sigmoid(x)
  is silu, x * x a power: those are tried first) -> `product`, after broadcasting both to
  the output's shape.
- Div(a, b) with a computed divisor that no quotient pattern takes (c / x, x / (1 + |x|))
  -> a * reciprocal(b): the reciprocal's bound is infinite for an interval holding 0, and the
  product's rows that depend on it are then vacuous, never wrong.
- MatMul(a, b), both computed -> `matmul_xy` over (G, M, K) x (G, K, N): ONNX's (numpy's)
  broadcasting of the batch axes by `expand` moves, the batch axes merged into G (a view),
  1-D operands as numpy treats them (a row / column that is dropped again).

The arithmetic and linear families call these when their constant-operand forms do not
apply (`lower_product_xy`, `lower_quotient_xy`, `lower_matmul_xy`).
"""

from __future__ import annotations

import math

from shardbound.compiler.lowering.movement import expand_to


def lower_product_xy(ctx, node, a, b, out_tensor=None):
    """a * b elementwise for computed a, b (numpy broadcasting)."""
    out = ctx.broadcast_shape(a.full_shape, b.full_shape)
    a = ctx.canonical(expand_to(ctx, a, out))
    b = ctx.canonical(expand_to(ctx, b, out))
    return ctx.emit("product", [a, b], node.outputs[0] if out_tensor is None else out_tensor)


def lower_quotient_xy(ctx, node, a, b):
    """a / b = a * reciprocal(b) for computed a, b."""
    r = ctx.emit("reciprocal", [b])
    return lower_product_xy(ctx, node, a, r)


def lower_matmul_xy(ctx, node, a, b):
    fa, fb = a.full_shape, b.full_shape
    if not fa or not fb:
        raise ctx.error(f"MatMul of shapes {fa} and {fb}: operands must be at least 1-D")
    vec_a, vec_b = len(fa) == 1, len(fb) == 1
    if vec_a:
        a = ctx.reshaped(a, (1, fa[0]), None, "MatMul")
        fa = (1, fa[0])
    if vec_b:
        b = ctx.reshaped(b, (fb[0], 1), None, "MatMul")
        fb = (fb[0], 1)
    (M, K), (K2, N) = fa[-2:], fb[-2:]
    if K != K2:
        raise ctx.error(f"MatMul of shapes {a.full_shape} and {b.full_shape}: the inner "
                        f"dimensions {K} and {K2} differ")
    batch = ctx.broadcast_shape(fa[:-2], fb[:-2], what="the batch axes of the operands")
    a = expand_to(ctx, a, (*batch, M, K))
    b = expand_to(ctx, b, (*batch, K, N))
    G = math.prod(batch)
    a3 = ctx.reshaped(a, (1, G, M, K), None, "MatMul")
    b3 = ctx.reshaped(b, (1, G, K, N), None, "MatMul")
    z = ctx.emit("matmul_xy", [a3, b3])
    out = (*batch, *(() if vec_a else (M,)), *(() if vec_b else (N,)))
    return ctx.reshaped(z, out, node.outputs[0], "MatMul")
