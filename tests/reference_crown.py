"""An independent CROWN for ReLU MLPs in float64 numpy, written plainly to check the runtime.

It reads the weights straight from the ONNX file (Gemm, or MatMul + Add, with an optional input
Sub/Div normalisation) and follows the textbook algorithm: pre-activation bounds layer by layer,
each by a backward pass of the linear relaxation, intersected with IBP (as shardbound does).
"""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper


def mlp_layers(model):
    """(input scale, input shift, [(W (out, in), b)]) from a plain ReLU MLP in ONNX."""
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    scale, shift = 1.0, 0.0
    layers = []
    pending = None
    for node in model.graph.node:
        op, ins = node.op_type, list(node.input)
        attrs = {a.name: a for a in node.attribute}
        if op == "Sub" and not layers and pending is None:
            shift = shift - inits[ins[1]].reshape(-1)
        elif op == "Div" and not layers and pending is None:
            d = inits[ins[1]].reshape(-1)
            scale, shift = scale / d, shift / d
        elif op == "Gemm":
            W = inits[ins[1]]
            W = W if attrs.get("transB") and attrs["transB"].i else W.T
            alpha = attrs["alpha"].f if "alpha" in attrs else 1.0
            beta = attrs["beta"].f if "beta" in attrs else 1.0
            b = inits[ins[2]].reshape(-1) * beta if len(ins) > 2 else np.zeros(W.shape[0])
            layers.append((alpha * W, b))
        elif op == "MatMul":
            pending = inits[ins[1]].T
            layers.append((pending, np.zeros(pending.shape[0])))
        elif op == "Add" and pending is not None:
            layers[-1] = (pending, inits[ins[1]].reshape(-1))
            pending = None
        elif op in ("Relu", "Flatten", "Reshape"):
            pending = None if op == "Relu" else pending
        else:
            raise ValueError(f"reference CROWN does not read {op}")
    return scale, shift, layers


def _ibp(layers, lo, hi):
    out = []
    for W, b in layers:
        c, r = (hi + lo) / 2, (hi - lo) / 2
        pl, pu = W @ c + b - np.abs(W) @ r, W @ c + b + np.abs(W) @ r
        out.append((pl, pu))
        lo, hi = np.maximum(pl, 0), np.maximum(pu, 0)
    return out


def _relax(l, u):
    lower = np.where(l >= 0, 1.0, np.where(u <= 0, 0.0, (u > -l).astype(float)))
    unstable = (l < 0) & (u > 0)
    denom = np.where(unstable, u - l, 1.0)
    upper = np.where(l >= 0, 1.0, np.where(u <= 0, 0.0, u / denom))
    icpt = np.where(unstable, -l * u / denom, 0.0)
    return lower, upper, icpt


def _backward(layers, k, A, pre, lo, hi):
    lA, uA = A.copy(), A.copy()
    lb, ub = np.zeros(A.shape[0]), np.zeros(A.shape[0])
    for j in range(k, -1, -1):
        W, b = layers[j]
        lb, ub = lb + lA @ b, ub + uA @ b
        lA, uA = lA @ W, uA @ W
        if j > 0:
            low, up, icpt = _relax(*pre[j - 1])
            lpos, lneg = np.maximum(lA, 0), np.minimum(lA, 0)
            upos, uneg = np.maximum(uA, 0), np.minimum(uA, 0)
            lb = lb + lneg @ icpt
            ub = ub + upos @ icpt
            lA = lpos * low + lneg * up
            uA = upos * up + uneg * low
    c, r = (hi + lo) / 2, (hi - lo) / 2
    return lA @ c - np.abs(lA) @ r + lb, uA @ c + np.abs(uA) @ r + ub


def crown(model, lower, upper):
    """CROWN bounds of the outputs of the MLP in `model` over the box [lower, upper]."""
    scale, shift, layers = mlp_layers(model)
    lower, upper = np.asarray(lower, np.float64).reshape(-1), np.asarray(upper, np.float64).reshape(-1)
    # Fold the input affine into the box's first layer: W (s x + t) + b.
    W0, b0 = layers[0]
    s = np.broadcast_to(scale, lower.shape)
    t = np.broadcast_to(shift, lower.shape)
    layers = [(W0 * s[None, :], b0 + W0 @ t)] + layers[1:]
    ibp = _ibp(layers, lower, upper)
    pre = []
    for k in range(len(layers)):
        l, u = _backward(layers, k, np.eye(layers[k][0].shape[0]), pre, lower, upper)
        pre.append((np.maximum(l, ibp[k][0]), np.minimum(u, ibp[k][1])))
    return pre[-1]
