"""`--soundness real|float32` on the ops that used to be refused (issue 17): the discrete
family (runtime/rigorous/discrete.py), Softmax / LogSoftmax (rigorous/softmax.py) and
LayerNorm's `normalize` (rigorous/normalization.py).

- Each discrete kernel's rigorous step on boxes whose ends sit on its jumps (Floor of an
  integer upper bound, Round's ties, Cast-to-int truncation and the int32 conversion limit,
  comparisons at equality, Where's condition at 0, ArgMax ties, OneHot's negative index):
  its IBP holds every float64 value at points drawn from the ends, the jumps and the inside,
  and every float32 value at the float32 points in the box; its CROWN constant bounds L . f
  from below at the same points.
- A cancellation network (2^24-sized terms) feeding Less: in real mode the comparison is fixed
  (the exact value is 0.5, not below 0.25), in float32 mode it is not, because the reversed
  summation gives 0: the rigorous float32 bounds hold that evaluation.
- Sampling of networks with every newly covered op (float64 evaluations inside `real`'s
  bounds, float32 ones in five summation orders inside `float32`'s), on narrow, wide and
  degenerate boxes, and as tight as the engine's CROWN to 1% where the box is not wide.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from onnx import TensorProto

import zoo
from test_soundness_modes import _all_float32, _check_sampling, _compile

F32 = np.float32
I31 = 2.0 ** 31


def _kernel(cls, n_in, shape, params=None, **attrs):
    return cls("k", [f"x{i}" for i in range(n_in)], [shape] * n_in, params=params, **attrs)


def _discrete_cases():
    from shardbound.runtime.ops import discrete as d

    t = torch.tensor
    near2 = 2.0 - 2.0 ** -40
    floor_box = [([0.5, -1.0, near2, -3.0, -0.0], [2.0, -1.0, 2.0, -2.5, 0.0])]
    return [
        ("floor", _kernel(d.Floor, 1, (5,)), floor_box),
        ("ceil", _kernel(d.Ceil, 1, (5,)), floor_box),
        ("round", _kernel(d.Round, 1, (4,)), [([0.5, -2.5, 1.5, 0.2], [2.5, -0.5, 1.5, 0.4])]),
        ("cast_int32", _kernel(d.CastInt, 1, (4,), to="int32"),
         [([-1.5, -0.0, I31 - 1, -I31 - 1], [-0.0, 0.99, I31, -I31])]),
        ("cast_int8", _kernel(d.CastInt, 1, (3,), to="int8"),
         [([126.5, -129.0, -128.5], [128.0, -128.0, 127.5])]),
        ("cast_bool", _kernel(d.CastBool, 1, (4,)),
         [([0.0, -1.0, 0.0, 1e-30], [0.0, 0.0, 1.0, 1.0])]),
        ("less", _kernel(d.Less, 2, (3,)), [([0, 0, 1], [1, 0.5, 2]), ([1, 0.5, 0], [1, 0.5, 1])]),
        ("less_equal", _kernel(d.LessOrEqual, 2, (3,)),
         [([0, 0, 1], [1, 0.5, 2]), ([1, 0.5, 0], [1, 0.5, 1])]),
        ("equal", _kernel(d.Equal, 2, (3,)),
         [([1, 0, 1], [1, 0.5, 2]), ([1, 0.5, 0], [1, 0.5, 1])]),
        ("less_const", _kernel(d.Less, 1, (3,), params={"const1": t([0.5, 0.25, -1.0])},
                               operands=("computed", "const")), [([0, 0.25, -1], [0.5, 1, -1])]),
        ("xor", _kernel(d.Xor, 2, (3,)), [([0, 0, -1], [0, 1, 1]), ([0, 1, 0], [1, 1, 0])]),
        ("where", _kernel(d.Where, 3, (3,)),
         [([0, -0.0, 0], [0, 0.0, 1]), ([1, 2, 3], [1.5, 2, 4]), ([-1, -2, 5], [0, -2, 6])]),
        ("argmax", _kernel(d.ArgMax, 1, (4,)), [([0, 1, 1, 0.5], [1, 1, 1, 0.9])]),
        ("argmax_last", _kernel(d.ArgMax, 1, (4,), select_last_index=True),
         [([0, 1, 1, 0.5], [1, 1, 1, 0.9])]),
        ("argmin", _kernel(d.ArgMin, 1, (4,)), [([0, 0, 0.5, -1], [1, 0, 0.9, 0])]),
        ("one_hot", _kernel(d.OneHot, 1, (2,), axis=1, depth=3, off=-1.0, on=2.0),
         [([0.5, -1.0], [2.0, -1.0])]),
    ]


def _points(lo, hi, rng, count):
    """count points of the box: each coordinate an end, an integer or half-integer inside,
    the float32 neighbours of the ends inside, or a uniform draw."""
    pts = np.empty((count, len(lo)))
    for k, (a, b) in enumerate(zip(lo, hi)):
        special = [a, b, np.nextafter(a, b), np.nextafter(b, a)]
        special += [float(v) for v in np.arange(math.ceil(2 * a), math.floor(2 * b) + 1) / 2]
        special += [float(np.nextafter(F32(a), F32(b))), float(np.nextafter(F32(b), F32(a)))]
        special = [v for v in special if a <= v <= b]
        pick = rng.integers(0, len(special) + 2, count)
        uniform = rng.uniform(a, b, count)
        pts[:, k] = np.where(pick < len(special), np.array(special)[np.minimum(
            pick, len(special) - 1)], uniform)
    return pts


@pytest.mark.parametrize("name,kernel,boxes", _discrete_cases(), ids=lambda v: v if
                         isinstance(v, str) else "")
def test_discrete_steps_hold_at_their_jumps(name, kernel, boxes):
    from shardbound.runtime.rigorous.core import DT, step_class

    step = step_class(kernel)(kernel)
    rng = np.random.default_rng(0)
    bounds = [(torch.tensor([lo], dtype=DT), torch.tensor([hi], dtype=DT)) for lo, hi in boxes]
    pts = [_points(lo, hi, rng, 300) for lo, hi in boxes]
    L = torch.from_numpy(rng.choice([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0], (1, 3, *step.shape)))
    mags = [torch.maximum(lo.abs(), hi.abs()).unsqueeze(1) for lo, hi in bounds]
    parts, bias = step.back(L, bounds, mags)
    assert parts == [] and torch.isfinite(bias).all()
    for float32 in (False, True):
        step.float32 = float32
        lo, hi = step.ibp(bounds, float32)
        if float32:     # the float32 program: float32 inputs in the box, float32 kernel
            xs = [torch.from_numpy(p.astype(F32)) for p in pts]
            inside = np.all([((p.astype(F32) >= b[0]) & (p.astype(F32) <= b[1])).all(1)
                             for p, b in zip(pts, boxes)], axis=0)
            with torch.no_grad():
                y = kernel.forward(*xs).double()[torch.from_numpy(inside)]
            assert inside.sum() > 50
        else:
            y = step.forward([torch.from_numpy(p) for p in pts])
        assert (y >= lo).all() and (y <= hi).all(), (name, float32)
    flat = L.reshape(3, -1)
    y64 = step.forward([torch.from_numpy(p) for p in pts]).reshape(len(pts[0]), -1)
    assert ((y64 @ flat.T) >= bias).all(), name


def _flip_net():
    """y = [Less(2^24 x0 - 2^24 x1 + x2, 0.25), the sum itself]: at (1, 1, 0.5) the exact sum is
    0.5 (not below 0.25); summed right to left in float32 it is 0 (the Less flips)."""
    b = zoo.Builder(np.random.default_rng(0), (3,))
    h = b.op("Gemm", ["x", b.const(np.array([[2.0 ** 24, -2.0 ** 24, 1.0]])),
                      b.const(np.zeros(1))], transB=1)
    lt = b.op("Cast", [b.op("Less", [h, b.const(F32(0.25))])], to=TensorProto.FLOAT)
    return b.build(b.op("Concat", [lt, h], axis=1))


def test_float32_mode_holds_a_comparison_that_rounding_flips(tmp_path):
    from shardbound.runtime.rigorous import RigorousBounds

    v = _compile(tmp_path, _flip_net(), "flip")
    x = np.array([[1.0, 1.0, 0.5]])
    ys = _all_float32(v, RigorousBounds(v.network, "float32"), x)[:, 0, 0]
    assert set(ys.tolist()) == {0.0, 1.0}          # the orders disagree on the comparison
    eye = torch.eye(2, dtype=torch.float64)
    got = {}
    for mode in ("real", "float32"):
        rig = RigorousBounds(v.network, mode)
        lo, hi = rig.outward(x, x)
        both = rig.spec_lower(lo, hi, torch.cat([eye, -eye]))[0]
        got[mode] = (float(both[0]), float(-both[2]))
    tiny = 1e-200                                   # the spec row's dot product: TINY
    assert abs(got["real"][0]) < tiny and abs(got["real"][1]) < tiny   # 0.5 < 0.25: false
    assert abs(got["float32"][0]) < tiny and got["float32"][1] >= 1.0


@pytest.mark.parametrize("name", ["discrete_mix", "norm_softmax_mlp"])
def test_newly_covered_ops_hold_for_float64_and_float32(tmp_path, name):
    """zoo.discrete_mix: Floor, Round, Cast int32, Where(Less), And, Equal, ArgMax,
    OneHot(ArgMin); zoo.norm_softmax_mlp: LayerNorm, Softmax and LogSoftmax."""
    v = _compile(tmp_path, zoo.build(name)[0], name)
    rng = np.random.default_rng(1)
    centre = rng.uniform(-0.5, 0.5, 4)
    for r, tight in ((0.0, False), (0.05, True), (0.5, True), (3.0, False)):
        _check_sampling(v, centre - r, centre + r, 60, rng, tight=tight)
