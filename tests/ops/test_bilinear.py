"""The bilinear family (runtime/ops/bilinear.py, compiler/lowering/bilinear.py): products of
two computed tensors, Mul, Div by a computed divisor and MatMul, with McCormick planes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harness import OpCase, generate, sandwich
from shardbound.runtime.ops.bilinear import MatmulXY, Product


def _two_layers(b, x, n, m):
    return (b.op("MatMul", [x, b.const(b.weight(n, m))]),
            b.op("MatMul", [x, b.const(b.weight(n, m))]))


def _mul(b, x, shape):
    p, q = _two_layers(b, x, shape[-1], 5)
    return b.op("Mul", [p, q]), (1, 5)


def _div(b, x, shape):
    """p / (1.5 + tanh(q)): a computed divisor in (0.5, 2.5)."""
    p, q = _two_layers(b, x, shape[-1], 4)
    d = b.op("Add", [b.op("Tanh", [q]), b.const(np.float32(1.5))])
    return b.op("Div", [p, d]), (1, 4)


def _attention(b, x, shape):
    """Q (2, 2, 3) @ K^T (2, 3, 2): two heads of scores, plus a broadcast MatMul (2, 2, 2) @
    (2, 3) and a vector one, all of computed operands."""
    n = shape[-1]
    q = b.op("Reshape", [b.op("MatMul", [x, b.const(b.weight(n, 12))]),
                         b.const(np.array([1, 2, 2, 3], np.int64))])
    k = b.op("Reshape", [b.op("MatMul", [x, b.const(b.weight(n, 12))]),
                         b.const(np.array([1, 2, 3, 2], np.int64))])
    s = b.op("MatMul", [q, k])                                         # (1, 2, 2, 2)
    v = b.op("Reshape", [b.op("MatMul", [x, b.const(b.weight(n, 6))]),
                         b.const(np.array([2, 3], np.int64))])
    o = b.op("MatMul", [s, v])                                         # (1, 2, 2, 3)
    w = b.op("Reshape", [b.op("MatMul", [x, b.const(b.weight(n, 3))]),
                         b.const(np.array([3], np.int64))])
    return b.op("MatMul", [o, w]), (1, 2, 2)                          # (1, 2, 2)


CASES = [
    OpCase("mul_computed", "Mul", lambda rng, o: sandwich(rng, o, (6,), _mul),
           boxes=("narrow", "degenerate")),
    OpCase("div_computed", "Div", lambda rng, o: sandwich(rng, o, (6,), _div),
           boxes=("wide",)),
    # (alpha-CROWN too: the attention pattern's shares, through sampling and PGD)
    OpCase("matmul_computed", "MatMul", lambda rng, o: sandwich(rng, o, (6,), _attention),
           boxes=("wide", "degenerate")),
]

generate(CASES, globals())


# -- the planes alone, on boxes of every kind ------------------------------------------------------
def _boxes(rng, shape):
    """Bounds of every regime at once: narrow, wide, degenerate, huge, one side of 0."""
    c = rng.uniform(-1, 1, shape)
    r = rng.choice([0.0, 1e-6, 1e-3, 1.0, 1e3, 1e15], size=shape)
    c = np.where(rng.uniform(size=shape) < 0.2, c * 1e3, c)
    lo, hi = (c - r).astype(np.float32), (c + r).astype(np.float32)
    return torch.from_numpy(lo), torch.from_numpy(np.maximum(hi, lo))


def _points(lo, hi, rng, n):
    u = torch.from_numpy(rng.uniform(size=(n, *lo.shape)).astype(np.float32))
    u[: n // 4] = (u[: n // 4] > 0.5).float()
    return torch.minimum(torch.maximum(lo + u * (hi - lo), lo), hi)


@pytest.mark.parametrize("kind", ["product", "matmul"])
def test_planes_sound_in_every_regime(kind):
    """One backward step from random A-matrices: the linear bounds it gives hold at every
    sampled point (corners included) in float64, for intervals from degenerate to 1e15 wide;
    never NaN, and an infinite bound only as the vacuous side."""
    rng = np.random.default_rng(3)
    if kind == "product":
        op = Product("p", ["x", "y"], [(4, 5), (4, 5)], order="blocked")
    else:
        op = MatmulXY("m", ["x", "y"], [(2, 3, 4), (2, 4, 5)], order="blocked")
    xs, ys = op.in_shapes
    (xl, xu), (yl, yu) = _boxes(rng, (1, *xs)), _boxes(rng, (1, *ys))
    A = torch.from_numpy(rng.normal(size=(1, 6, *op.shape)).astype(np.float32))
    A[:, :, 0] = 0.0            # zero coefficients too
    for alpha in (None, torch.from_numpy(rng.uniform(size=(1, 6, 2, *op.shape)).astype(np.float32))):
        (lx, ly), (ux, uy), lb, ub = op.crown_backward(A, A, [(xl, xu), (yl, yu)], alpha)
        assert not any(bool(torch.isnan(t).any()) for t in (lx, ly, ux, uy, lb, ub))
        x, y = _points(xl[0], xu[0], rng, 400), _points(yl[0], yu[0], rng, 400)
        z = op.forward(x.double(), y.double()) if kind == "product" else x.double() @ y.double()
        true = (A.double()[0].unsqueeze(0) * z.unsqueeze(1)).flatten(2).sum(-1)     # (N, S)

        def lin(Ax, Ay, bias):
            return ((Ax.double()[0].unsqueeze(0) * x.double().unsqueeze(1)).flatten(2).sum(-1)
                    + (Ay.double()[0].unsqueeze(0) * y.double().unsqueeze(1)).flatten(2).sum(-1)
                    + bias.double())
        low, up = lin(lx, ly, lb), lin(ux, uy, ub)
        scale = 1e-5 * (1 + (A.double().abs()[0].unsqueeze(0) * z.abs().unsqueeze(1)
                             ).flatten(2).sum(-1))
        finite = torch.isfinite(low)
        assert bool((low[finite] <= true[finite] + scale[finite]).all())
        assert bool((up[torch.isfinite(up)] >= true[torch.isfinite(up)] - scale[torch.isfinite(up)]).all())
        assert not bool((lb == math.inf).any() or (ub == -math.inf).any())


def test_infinite_operand_bounds_make_only_their_rows_vacuous():
    """An operand interval with an infinite end (a reciprocal across 0 upstream): rows whose
    coefficients reach it are vacuous on that side, the others stay finite; IBP's 0 * inf is 0."""
    op = Product("p", ["x", "y"], [(3,), (3,)], order="blocked")
    xl = torch.tensor([[1.0, -1.0, 0.0]])
    xu = torch.tensor([[2.0, 1.0, 0.0]])
    yl = torch.tensor([[-math.inf, 0.5, -math.inf]])
    yu = torch.tensor([[1.0, 1.5, math.inf]])
    lo, hi = op.ibp((xl, xu), (yl, yu))
    assert lo[0, 2] == 0 and hi[0, 2] == 0 and lo[0, 0] == -math.inf
    A = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, -1.0, 0.0]]])
    _, _, lb, ub = op.crown_backward(A, A, [(xl, xu), (yl, yu)])
    assert lb[0, 0] == -math.inf and ub[0, 0] == math.inf
    assert bool(torch.isfinite(lb[0, 1:]).all() and torch.isfinite(ub[0, 1:]).all())


def test_division_by_an_interval_holding_zero_is_infinite_not_wrong(tmp_path):
    """p / q with q's interval across 0: the bounds are infinite (never NaN, never finite and
    wrong); with q bounded away from 0 they are finite."""
    import onnx
    import zoo
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    b = zoo.Builder(np.random.default_rng(0), (2,))
    q = b.op("Add", [b.op("Mul", ["x", b.const(np.float32(1))]), b.const(np.float32(0.0))])
    y = b.op("Div", [b.op("Mul", ["x", b.const(np.float32(2))]), q])
    onnx.save(b.build(y), tmp_path / "m.onnx")
    compile_model(str(tmp_path / "m.onnx"), str(tmp_path / "p"), PassOptions())
    v = load(str(tmp_path / "p"))
    for method in ("ibp", "crown"):
        lb, ub = v.bounds(torch.tensor([-1.0, 0.5]), torch.tensor([1.0, 1.0]), method=method)
        lb, ub = lb.reshape(1, -1), ub.reshape(1, -1)
        assert not bool(torch.isnan(lb).any() or torch.isnan(ub).any())
        assert lb[0, 0] == -math.inf and ub[0, 0] == math.inf, method
        assert bool(torch.isfinite(lb[0, 1]) and lb[0, 1] <= 2.0 <= ub[0, 1]), method
