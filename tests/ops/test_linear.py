"""The linear family (runtime/ops/linear.py, compiler/lowering/linear.py): Gemm (transA,
transB, alpha, beta, a bias per row) and MatMul with a constant on either side, 1-D operands."""

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


# -- transA, W @ x, 1-D operands (issue 14) ---------------------------------------------------------
def _net(shape, apply):
    from test_movement import twice

    return lambda rng, o: twice(rng, o, shape, lambda b, x, f: apply(b, x, f))


def _gemm_trans_a(b, x, full):
    """(1, 2, 3) -> Reshape (3, 2) -> Gemm transA: (2, 3)^T... y = A^T B + C."""
    import numpy as np

    a = b.op("Reshape", [x, b.const(np.array([3, 2], dtype=np.int64))])
    return b.op("Gemm", [a, b.const(b.weight(3, 4)), b.const(b.rng.normal(0, 0.1, (2, 4)))],
                transA=1)


def _gemm_trans_a_row(b, x, full):
    """A (1, 6) with transA: an outer product (6, 1) @ (1, 3)."""
    import numpy as np

    a = b.op("Reshape", [x, b.const(np.array([1, 6], dtype=np.int64))])
    return b.op("Gemm", [a, b.const(b.weight(1, 3)), b.const(b.rng.normal(0, 0.1, (3,)))],
                transA=1, transB=0, alpha=0.5)


def _matmul_left(b, x, full):
    """W (5, 3) @ x (1, 2, 3, 4) -> (1, 2, 5, 4)."""
    return b.op("MatMul", [b.const(b.weight(5, 3)), x])


def _matmul_left_row(b, x, full):
    """ml4acopf's pattern: a (1, K) row, transposed to (K, 1), W @ it, transposed back."""
    import numpy as np

    h = b.op("Reshape", [x, b.const(np.array([1, -1], dtype=np.int64))])
    h = b.op("Transpose", [h], perm=[1, 0])
    h = b.op("MatMul", [b.const(b.weight(7, 24)), h])
    return b.op("Transpose", [h], perm=[1, 0])


def _matmul_vectors(b, x, full):
    """1-D operands: x flattened to (24,) (no batch axis), W (9, 24) @ v, v @ W2 (9, 5),
    w (5,) @ ... and a vector-vector product broadcast back."""
    import numpy as np

    v = b.op("Reshape", [x, b.const(np.array([-1], dtype=np.int64))])      # (24,)
    u = b.op("MatMul", [b.const(b.weight(9, 24)), v])                       # (9,)
    t = b.op("MatMul", [u, b.const(b.weight(9, 5))])                        # (5,)
    s = b.op("MatMul", [t, b.const(b.weight(5))])                           # ()
    w = b.op("MatMul", [b.const(b.weight(2, 3)[0]), x])                     # (1, 2, 4)
    return b.op("Add", [w, s])


CASES += [
    OpCase("gemm_transA", "Gemm", _net((2, 3), _gemm_trans_a), opsets=(11, 13)),
    OpCase("gemm_transA_row", "Gemm", _net((6,), _gemm_trans_a_row)),
    OpCase("matmul_const_left", "MatMul", _net((2, 3, 4), _matmul_left)),
    OpCase("matmul_const_left_row", "MatMul", _net((24,), _matmul_left_row)),
    OpCase("matmul_1d", "MatMul", _net((2, 3, 4), _matmul_vectors), opsets=(9, 13)),
]

generate(CASES, globals())
