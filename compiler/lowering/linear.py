"""Gemm and MatMul with a constant operand -> one `linear` node with W as (N, K), contiguous,
contracting the last axis (transposes around it where the constant is the left operand).

ONNX transB (and MatMul's (K, N) layout) are resolved here, at compile time, so that every mode
multiplies one canonical operand layout (a transposed view changes bits in BLAS). Gemm's
transA and MatMul's W @ x contract another axis of the computed operand: it is moved last
(compiler/lowering/layout.py `permute`: a view when only size-1 axes move, as for a (1, K)
row), multiplied, and moved back. 1-D operands follow numpy's matmul: a 1-D computed x is
a vector (no batch axis: compiler/context.py), a 1-D constant w gives a size-1 axis that is
dropped again (a view).
"""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import register
from shardbound.compiler.lowering.bilinear import lower_matmul_xy
from shardbound.compiler.lowering.layout import permute


def _swap_last(rank):
    perm = list(range(rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return perm


@register("Gemm", since=1)
def lower_gemm(ctx, node):
    a = node.attrs
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    x = ctx.computed(node.inputs[0], "input A")
    if len(x.full_shape) != 2:
        raise ctx.error(f"input A of shape {x.full_shape} must be 2-D")
    if int(a.get("transA", 0)):
        x = permute(ctx, x, (1, 0))
    B = np.asarray(ctx.const(node.inputs[1], "weight B"))
    # alpha == 1 and float32 weights: the float64 round trip would change no bit, and for a
    # wide layer it cost 4x the weight's memory (a 2 GiB matrix took 14 GiB to lower)
    if not (alpha == 1.0 and B.dtype == np.float32):
        B = B.astype(np.float64)
    if B.ndim != 2:
        raise ctx.error(f"weight B must be 2-D, got shape {B.shape}")
    W = B if int(a.get("transB", 0)) else B.T            # (N, K)
    M, K = x.full_shape
    if K != W.shape[1]:
        raise ctx.error(f"input of shape {x.full_shape} does not match weight {W.shape[::-1]} "
                        "(Gemm expects (M, K))")
    c_in = ctx.optional_input(node, 2)
    bias = None
    if c_in is not None:
        C = ctx.const(c_in, "bias C").astype(np.float64)
        try:
            full = np.broadcast_to(C, (M, W.shape[0])) * beta
        except ValueError:
            raise ctx.error(f"bias C of shape {C.shape} does not broadcast to ({M}, "
                            f"{W.shape[0]})") from None
        if np.all(full == full[:1]):
            bias = full[0]
        else:       # a bias per output row: the linear node's bias is per column only
            y = ctx.emit("linear", [x], params={"weight": W if alpha == 1.0 else alpha * W})
            ctx.emit("affine", [y], node.outputs[0],
                     params={"shift": ctx.sample_constant(full, y, "bias C")})
            return
    ctx.emit("linear", [x], node.outputs[0],
             params={"weight": W if alpha == 1.0 else alpha * W, "bias": bias})


def _weight(ctx, node, i):
    W = np.asarray(ctx.const(node.inputs[i], "the constant operand"))
    if W.ndim > 2:
        if any(d != 1 for d in W.shape[:-2]):
            raise ctx.error(f"a constant operand of shape {W.shape} (a batch of matrices) is "
                            "not supported; only 1-D and 2-D constants")
        W = W.reshape(W.shape[-2:])
    return W


@register("MatMul", since=1)
def lower_matmul(ctx, node):
    if ctx.is_const(node.inputs[0]):
        _constant_left(ctx, node)
        return
    x = ctx.computed(node.inputs[0], "input A")
    if not ctx.is_const(node.inputs[1]):            # X @ Y: the bilinear family
        lower_matmul_xy(ctx, node, x, ctx.computed(node.inputs[1], "input B"))
        return
    W = _weight(ctx, node, 1)
    full = x.full_shape
    K = W.shape[0]
    if not full or full[-1] != K:
        raise ctx.error(f"input of shape {full} does not match weight {W.shape}")
    if W.ndim == 1:                                     # x @ w: the last axis goes
        y = ctx.emit("linear", [x], params={"weight": W.reshape(1, K)})
        ctx.reshaped(y, full[:-1], node.outputs[0], "MatMul")
        return
    ctx.emit("linear", [x], node.outputs[0], params={"weight": W.T})


def _constant_left(ctx, node):
    """W @ x: contract x's second-to-last axis (its only axis when x is 1-D)."""
    W = _weight(ctx, node, 0)
    x = ctx.computed(node.inputs[1], "input B")
    full = x.full_shape
    K = W.shape[-1]
    if len(full) == 1:                                  # W @ v: a matrix-vector product
        if full[0] != K:
            raise ctx.error(f"constant {W.shape} does not match the vector {full}")
        if W.ndim == 1:
            y = ctx.emit("linear", [x], params={"weight": W.reshape(1, K)})
            ctx.reshaped(y, (), node.outputs[0], "MatMul")
        else:
            ctx.emit("linear", [x], node.outputs[0], params={"weight": W})
        return
    if full[-2] != K:
        raise ctx.error(f"constant {W.shape} does not match the input {full}")
    xt = permute(ctx, x, _swap_last(len(full)))          # (..., N, K)
    y = ctx.emit("linear", [xt], params={"weight": W.reshape(-1, K)})    # (..., N, M)
    if W.ndim == 1:                                     # w @ x: (..., N)
        ctx.reshaped(y, (*full[:-2], full[-1]), node.outputs[0], "MatMul")
        return
    permute(ctx, y, _swap_last(len(full)), node.outputs[0])
