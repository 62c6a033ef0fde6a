"""The periodic family (runtime/ops/periodic.py, compiler/lowering/periodic.py): Sin and Cos.

- the harness cases (forward vs onnxruntime / onnx.reference per opset, IBP / CROWN /
  alpha-CROWN sound on every box kind), at unit scale and at scale 4 (boxes across several
  periods: neither convex nor concave);
- the relaxation itself (tests/ops/lines_check.py): intervals of every kind, random feasible
  alphas, on a dense grid with the touching points and the pieces' boundaries;
- the pieces: an interval narrower than a period within three alternating pieces, and IBP's
  extrema inside an interval;
- position independence of the bits.
"""

from __future__ import annotations

import math
import os
import sys

import shardbound  # noqa: F401  (first: sets MKL_CBWR before any BLAS call)
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lines_check as lc  # noqa: E402
from harness import OpCase, generate, sandwich  # noqa: E402

from shardbound.runtime.ops import periodic as Pd  # noqa: E402


def _unary(op):
    def apply(b, x, shape):
        return b.op(op, [x]), shape
    return apply


CASES = [
    OpCase("sin", "Sin", lambda rng, o: sandwich(rng, o, (6,), _unary("Sin")), opsets=(7, 22)),
    OpCase("cos", "Cos", lambda rng, o: sandwich(rng, o, (6,), _unary("Cos")), opsets=(7, 22)),
    OpCase("sin_x4", "Sin", lambda rng, o: sandwich(rng, o, (6,), _unary("Sin")), scale=4.0),
    OpCase("cos_x4", "Cos", lambda rng, o: sandwich(rng, o, (6,), _unary("Cos")), scale=4.0),
]

generate(CASES, globals())

KERNELS = {"sin": (Pd.Sin, np.sin), "cos": (Pd.Cos, np.cos)}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_relaxation_lines_are_sound_and_tight(name):
    cls, ref = KERNELS[name]
    kernel = lc.make_kernel(cls)
    rng = np.random.default_rng(sum(map(ord, name)))
    lo, hi = lc.intervals(rng, "real", n=80)
    # and intervals around the pieces' boundaries and just below a period wide
    k = rng.integers(-50, 50, 200).astype(np.float64) * math.pi - cls.phase
    extra_lo = np.concatenate([k - rng.uniform(0, 1e-3, 200), k - rng.uniform(0, 3, 200),
                               k - 0.1, rng.uniform(-8, 8, 200)])
    extra_hi = np.concatenate([k + rng.uniform(0, 1e-3, 200), k + rng.uniform(0, 3, 200),
                               k - 0.1 + 2 * math.pi - 1e-2, extra_lo[-200:] + 2 * math.pi - 2e-3])
    lo = np.concatenate([lo, extra_lo.astype(np.float32)])
    hi = np.concatenate([hi, np.maximum(extra_hi.astype(np.float32), extra_lo.astype(np.float32))])
    gaps = lc.check_all(kernel, ref, lo, hi, rng, points=301)
    narrow = slice(0, 160)
    assert (gaps[narrow] <= 1e-5 * (1 + np.abs(lo[narrow]))).all(), gaps[narrow].max()
    lc.position_independent(kernel, lo, hi)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_pieces_alternate_and_ibp_finds_the_extrema(name):
    cls, ref = KERNELS[name]
    kernel = lc.make_kernel(cls)
    lo = torch.tensor([0.3, -2.0, 10.0, -1e7, 0.0], dtype=torch.float64)
    hi = torch.tensor([0.4, 4.0, 10.0 + 2 * math.pi - 0.01, -1e7 + 1, 7.0], dtype=torch.float64)
    pieces = kernel.pieces64(lo, hi)
    assert len(pieces) == 3
    (_, b1, c0), (_, b2, c1), (_, _, c2) = pieces
    assert torch.equal(c0, c2) and torch.equal(c1, ~c0)
    # f is convex exactly where it is <= 0: check at the middle piece
    mid = (b1 + b2) / 2
    assert bool(((ref(mid.numpy()) < 0) == c1.numpy())[:3].all())
    il, iu = kernel.ibp((lo.float(), hi.float()))
    x = np.linspace(lo.numpy(), hi.numpy(), 20001)
    f = ref(x)
    assert (il.double().numpy() <= f.min(0)).all() and (iu.double().numpy() >= f.max(0)).all()
    # tight where the interval holds an extremum; [-1, 1] beyond |x| = 2^20 and over a period
    assert abs(iu[1].item() - 1) < 1e-6 and abs(il[1].item() + 1) < 1e-6
    assert il[3].item() == -1 and iu[3].item() == 1 and il[4].item() == -1 and iu[4].item() == 1
    assert abs(il[0].item() - f[:, 0].min()) < 1e-6 and abs(iu[0].item() - f[:, 0].max()) < 1e-6


def test_crown_envelope_lines_across_a_zero():
    """sin on [-1, 2] (convex, then concave from 0): the lower line is the supporting line of
    the convex envelope at the midpoint 0.5 -- the tangent at t in [-1, 0] through the far end
    (2, sin 2) -- and the upper one the tangent at the midpoint (in the concave part)."""
    kernel = lc.make_kernel(Pd.Sin)
    wl, bl, wu, bu = lc.lines(kernel, np.array([-1.0], np.float32), np.array([2.0], np.float32))
    np.testing.assert_allclose(wu[0], math.cos(0.5), rtol=1e-5)
    assert abs(wl[0] * 2 + bl[0] - math.sin(2)) < 1e-5
    t = -math.acos(wl[0])
    assert -1 <= t <= 0 and abs(wl[0] * t + bl[0] - math.sin(t)) < 1e-5


def test_alpha_crown_beats_crown_on_the_zoo(tmp_path):
    lc.assert_alpha_beats_crown(tmp_path, ("sincos_mlp",))
