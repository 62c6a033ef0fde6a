"""The linear family (runtime/ops/linear.py, compiler/lowering/linear.py): Gemm and MatMul."""

from __future__ import annotations

from harness import OpCase, generate, sandwich


def _gemm(transB, alpha=1.0, beta=1.0):
    def apply(b, x, shape):
        n = shape[1]
        w = b.weight(n, n) if transB else b.weight(n, n)
        c = b.const(b.rng.normal(0, 0.1, (n,)))
        return b.op("Gemm", [x, b.const(w), c], transB=transB, alpha=alpha, beta=beta), shape
    return apply


def _matmul(b, x, shape):
    n = shape[-1]
    h = b.op("MatMul", [x, b.const(b.weight(n, n))])
    return b.op("Add", [h, b.const(b.rng.normal(0, 0.1, (n,)))]), shape


def _matmul_3d(rng, opset):
    """MatMul over the last axis of a (1, 3, 4) input (a linear node on a 2-D sample)."""
    return sandwich(rng, opset, (3, 4), _matmul)


CASES = [
    OpCase("gemm_transB", "Gemm", lambda rng, o: sandwich(rng, o, (6,), _gemm(1)), opsets=(13,)),
    OpCase("gemm_alpha_beta", "Gemm", lambda rng, o: sandwich(rng, o, (6,), _gemm(0, 0.7, 1.3)),
           opsets=(9,)),
    OpCase("matmul_add", "MatMul", lambda rng, o: sandwich(rng, o, (6,), _matmul), opsets=(13,)),
    OpCase("matmul_3d", "MatMul", _matmul_3d, opsets=(13,)),
]

generate(CASES, globals())
