"""The softmax family (runtime/ops/softmax.py, compiler/lowering/softmax.py): Softmax and
LogSoftmax with the opset-dependent axis semantics, their planes alone in every regime, and
CROWN through them against exp / sum / reciprocal composed."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch

import zoo
from harness import OpCase, generate, sandwich
from shardbound.runtime.ops.softmax import LogSoftmax, Softmax


def _over(op, axis):
    """(1, n) -> (1, 2, n / 2) -> op(axis): before opset 13 the trailing dims from `axis` on
    are flattened into one softmax, from 13 on it runs over the one axis."""
    def apply(b, x, shape):
        n = shape[-1]
        h = b.op("Reshape", [x, b.const(np.array([1, 2, n // 2], np.int64))])
        return b.op(op, [h], axis=axis), (1, 2, n // 2)
    return apply


def _net(op, axis):
    return lambda rng, o: sandwich(rng, o, (6,), _over(op, axis))


# onnx.reference (1.23) runs Softmax / LogSoftmax before opset 13 over the one axis, not the
# coerced 2-D input the spec (and onnxruntime) says: the opset-11 forms check onnxruntime only,
# and their soundness is the opset-13 kernel's.
CASES = [
    OpCase("softmax_axis1", "Softmax", _net("Softmax", 1),
           boxes=("narrow", "wide", "degenerate")),
    OpCase("softmax_axis1_coerced", "Softmax", _net("Softmax", 1), opsets=(11,),
           reference=False, boxes=()),
    OpCase("log_softmax_last", "LogSoftmax", _net("LogSoftmax", -1),
           boxes=("wide", "degenerate")),
    OpCase("log_softmax_axis1_coerced", "LogSoftmax", _net("LogSoftmax", 1), opsets=(11,),
           reference=False, boxes=()),
]

generate(CASES, globals())


# -- the lines alone ------------------------------------------------------------------------------
def _box(rng, R, n, width):
    lo = rng.uniform(-3, 3, (1, R, n)) - width / 2
    if width == 0:
        hi = lo.copy()
    else:
        hi = lo + width * rng.uniform(0.2, 1.0, (1, R, n))
    lo, hi = lo.astype(np.float32), hi.astype(np.float32)
    return torch.from_numpy(lo), torch.from_numpy(np.maximum(hi, lo))


@pytest.mark.parametrize("cls", [Softmax, LogSoftmax], ids=["softmax", "log_softmax"])
def test_lines_sound_and_never_nan(cls):
    """Each output's lower and upper line holds at 3,000 points of the box (a third on
    vertices), in float64, for widths 0, 1e-6 .. 1e3 and rows of 1 .. 17 entries; IBP holds
    there too and contains every line's value range; nothing is NaN."""
    rng = np.random.default_rng(5)
    for n in (1, 2, 17):
        op = cls("s", ["x"], [(3, n)], order="blocked")
        for width in (0.0, 1e-6, 1e-3, 0.5, 4.0, 60.0, 1e3):
            lo, hi = _box(rng, 3, n, width)
            aL, cL, aU, cU = op.lines(lo, hi)
            il, iu = op.ibp((lo, hi))
            for t in (aL, cL, aU, cU, il, iu):
                assert not bool(torch.isnan(t).any())
            u = torch.from_numpy(rng.uniform(size=(3000, 1, 3, n)))
            u[:1000] = (u[:1000] > 0.5).double()
            x = lo.double() + u * (hi.double() - lo.double())
            f = (torch.log_softmax if op.log else torch.softmax)(x, dim=-1)
            low = (aL.double() * x.unsqueeze(-2)).sum(-1) + cL.double()
            up = (aU.double() * x.unsqueeze(-2)).sum(-1) + cU.double()
            tol = 1e-7 * (1 + f.abs())
            assert bool((low <= f + tol).all()), (cls.kind, n, width, float((low - f).max()))
            assert bool((up >= f - tol).all()), (cls.kind, n, width, float((f - up).max()))
            assert bool((il.double() <= f + tol).all() and (iu.double() >= f - tol).all())


def _exact_gap(a32, c32, x):
    """a32 . x + c32 rounded once: products of float32 numbers are
    exact in float64, fsum rounds the sum once. (points, rows, n) for x, lines per row."""
    P, R, n = x.shape
    out = np.empty((P, R, n))
    for p in range(P):
        for r in range(R):
            for i in range(n):
                out[p, r, i] = math.fsum([*(a32[r, i] * x[p, r]), c32[r, i]])
    return out


@pytest.mark.parametrize("cls", [Softmax, LogSoftmax], ids=["softmax", "log_softmax"])
def test_lines_hold_where_coefficients_cancel(cls):
    """Inputs near 1e5 .. 1e7, one entry of each row 5 .. 30 below the others: the gradient
    rows of softmax sum to zero, so the upper plane of the small output (1 minus the others'
    lower planes) is a sum of terms near 1e5 that cancel to about its value, 1e-12 .. 1e-3
    (issue 17: a margin of 1e-12 relative to the results, not to the terms, left that line
    up to 800 times the output's value below it). Each line holds at float32 points of the
    box (vertices, centre, uniform) in exact arithmetic, against the float64 function within
    16 ulps."""
    rng = np.random.default_rng(11)
    R, n = 24, 3
    for off in (1e5, 1e6, 1e7):
        for width in (0.0, 0.25, 1.0):
            base = off + np.concatenate([-rng.uniform(5, 30, (1, R, 1)),
                                         rng.uniform(-1, 1, (1, R, n - 1))], axis=-1)
            lo = base.astype(np.float32)
            hi = np.maximum((base + width * rng.uniform(0, 1, base.shape)).astype(np.float32), lo)
            op = cls("s", ["x"], [(R, n)], order="blocked")
            aL, cL, aU, cU = (t.double().numpy()[0] for t in
                              op.lines(torch.from_numpy(lo), torch.from_numpy(hi)))
            u = rng.uniform(size=(40, R, n))
            u[:16] = u[:16] > 0.5
            u[16] = 0.5
            x = (lo + u * (hi.astype(np.float64) - lo)).astype(np.float32)
            x = np.clip(x, lo, hi).astype(np.float64)
            f = (torch.log_softmax if op.log else torch.softmax)(torch.from_numpy(x), dim=-1)
            f = f.numpy()
            tol = 2.0 ** -49 * np.abs(f) + 1e-300
            low, up = _exact_gap(aL, cL, x), _exact_gap(aU, cU, x)
            assert (low <= f + tol).all(), (off, width, float((low - f).max()))
            assert (up >= f - tol).all(), (off, width, float((f - up).max()))


def test_infinite_input_bounds_give_ibp_lines():
    lo = torch.tensor([[[-math.inf, 0.0, 1.0]]])
    hi = torch.tensor([[[2.0, 0.5, 1.0]]])
    for cls in (Softmax, LogSoftmax):
        op = cls("s", ["x"], [(1, 3)], order="blocked")
        aL, cL, aU, cU = op.lines(lo, hi)
        assert not any(bool(torch.isnan(t).any()) for t in (aL, cL, aU, cU))
        assert bool((aL == 0).all() and (aU == 0).all())
        A = torch.ones(1, 2, 1, 3)
        (lA,), (uA,), lb, ub = op.crown_backward(A, A, [(lo, hi)])
        assert not bool(torch.isnan(lb).any() or torch.isnan(ub).any())


def _attention_scores(rng, composed: bool):
    """x (6) -> scores (2, 4) -> softmax over the last axis -> a linear head: the Softmax op,
    or the exp / ReduceSum / Div composition of it."""
    b = zoo.Builder(rng, (6,))
    h = b.op("Reshape", [b.gemm("x", 6, 8), b.const(np.array([1, 2, 4], np.int64))])
    if composed:
        e = b.op("Exp", [h])
        s = b.op("ReduceSum", [e, b.const(np.array([-1], np.int64))], keepdims=1)
        p = b.op("Div", [e, s])
    else:
        p = b.op("Softmax", [h], axis=-1)
    p = b.op("Flatten", [p], axis=1)
    return b.build(b.gemm(p, 8, 3))


def test_crown_tighter_than_the_composition(tmp_path):
    """The dedicated relaxation beats exp / sum / reciprocal / product composed on the same
    network and boxes (mean width), and both hold the sampled points."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from soundness import assert_sound

    widths = {}
    for composed, radius in ((False, 0.01), (True, 0.01), (False, 0.3), (True, 0.3)):
        model = _attention_scores(np.random.default_rng(1), composed)
        onnx.save(model, tmp_path / f"m{composed}.onnx")
        compile_model(str(tmp_path / f"m{composed}.onnx"), str(tmp_path / f"p{composed}"),
                      PassOptions())
        v = load(str(tmp_path / f"p{composed}"))
        lo, hi = torch.full((6,), -radius), torch.full((6,), radius)
        lb, ub = v.bounds(lo, hi)
        forward = lambda x, v=v: v.network.forward(x.reshape(-1, 6)).reshape(x.shape[0], -1)
        assert_sound(forward, lo, hi, lb.reshape(-1), ub.reshape(-1), n=2000)
        widths[composed, radius] = float((ub - lb).mean())
    for radius in (0.01, 0.3):      # measured: 0.00579 vs 0.00588, 0.277 vs 0.463
        assert widths[False, radius] < widths[True, radius], widths
