"""Gemm and MatMul with a constant weight -> one `linear` node with W as (N, K), contiguous.

ONNX transB (and MatMul's (K, N) layout) are resolved here, at compile time, so that every mode
multiplies one canonical operand layout (a transposed view changes bits in BLAS).
"""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import register


@register("Gemm", since=1)
def lower_gemm(ctx, node):
    a = node.attrs
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    if int(a.get("transA", 0)):
        raise ctx.error("transA=1 on the computed input would transpose the batch axis; "
                        "export the model without it")
    x = ctx.computed(node.inputs[0], "input A")
    B = ctx.const(node.inputs[1], "weight B").astype(np.float64)
    if B.ndim != 2:
        raise ctx.error(f"weight B must be 2-D, got shape {B.shape}")
    W = B if int(a.get("transB", 0)) else B.T            # (N, K)
    if len(x.shape) != 1 or x.shape[0] != W.shape[1]:
        raise ctx.error(f"input of shape {x.full_shape} does not match weight {W.shape[::-1]} "
                        "(Gemm expects (1, K))")
    bias = None
    c_in = ctx.optional_input(node, 2)
    if c_in is not None:
        C = ctx.const(c_in, "bias C").astype(np.float64)
        try:
            full = np.broadcast_to(C, (1, W.shape[0]))
        except ValueError:
            raise ctx.error(f"bias C of shape {C.shape} does not broadcast to (1, {W.shape[0]})") from None
        bias = beta * full[0]
    ctx.emit("linear", [x], node.outputs[0], params={"weight": alpha * W, "bias": bias})


@register("MatMul", since=1)
def lower_matmul(ctx, node):
    if ctx.is_const(node.inputs[0]):
        raise ctx.error("a constant left operand (W @ x) is not supported; only x @ W with a "
                        "constant W")
    x = ctx.computed(node.inputs[0], "input A")
    W = ctx.const(node.inputs[1], "weight B")
    if W.ndim != 2:
        raise ctx.error(f"weight must be 2-D, got shape {W.shape}")
    if not x.shape or x.shape[-1] != W.shape[0]:
        raise ctx.error(f"input of shape {x.full_shape} does not match weight {W.shape}")
    ctx.emit("linear", [x], node.outputs[0], params={"weight": W.T})
