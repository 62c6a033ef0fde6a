"""Branching graphs of data movement in fsdp mode: one tensor feeding several branches (Slice,
Transpose, Gather, Resize, ConvTranspose, Mul / Add by constants) merged again by Concat, Add
and Sum, bitwise equal to single mode (IBP, CROWN, alpha-CROWN, `blocked`) on 2 ranks in one
multi-rank job, with weights streamed in small blocks (a linear layer's weight larger than
the stream chunk) and fill / index parameters sharded like weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import zoo
from multirank import compile_pairs, run_job


def _ints(*v):
    return np.array(v, dtype=np.int64)


def branching_cnn(rng):
    """(3, 8, 8) -> Conv 6 -> ReLU -> four branches of (6, 8, 8)-ish tensors -> Concat (with
    a constant block) + Sum -> ReLU -> ReduceMean -> Gemm 48 -> 64 -> ReLU -> Gemm -> 5."""
    b = zoo.Builder(rng, (3, 8, 8))
    h = b.relu(b.op("Conv", ["x", b.const(b.weight(6, 3, 3, 3)), b.const(rng.normal(0, 0.1, (6,)))],
                    pads=[1, 1, 1, 1]))                                                # (6, 8, 8)
    t = b.op("Mul", [b.op("Transpose", [h], perm=[0, 1, 3, 2]), b.const(np.float32(0.7))])
    s = b.op("Slice", [h, b.const(_ints(7, 0)), b.const(_ints(-9, 8)), b.const(_ints(2, 3)),
                       b.const(_ints(-1, 1))])                                         # flipped rows
    down = b.op("Resize", [h, b.const(np.zeros(0, np.float32)),
                           b.const(np.array([1, 1, 0.5, 0.5], np.float32))], mode="linear")
    up = b.op("ConvTranspose", [down, b.const(b.weight(6, 6, 2, 2)),
                                b.const(rng.normal(0, 0.1, (6,)))], strides=[2, 2])    # (6, 8, 8)
    g = b.op("Gather", [h, b.const(rng.integers(0, 8, 80).astype(np.int64))], axis=3)  # (6, 8, 80)
    g = b.op("ReduceMean", [g], axes=[3], keepdims=1)                                 # (6, 8, 1)
    c = b.op("Concat", [t, b.const(rng.normal(0, 0.3, (1, 2, 8, 8))), s], axis=1)      # (14, 8, 8)
    d = b.op("Concat", [up, b.const(np.zeros((1, 2, 8, 8), np.float32)), h], axis=1)  # (14, 8, 8)
    e = b.op("Expand", [b.op("Concat", [g, g, b.const(np.ones((1, 2, 8, 1), np.float32))],
                             axis=1), b.const(_ints(1, 14, 8, 8))])                    # (14, 8, 8)
    c = b.op("Sum", [c, d, e])
    r = b.relu(b.op("ReduceMean", [c], axes=[3], keepdims=0))                          # (14, 8)
    f = b.op("Flatten", [r], axis=1)
    return b.build(b.gemm(b.relu(b.gemm(f, 112, 64)), 64, 5)), b.input_shape


@pytest.mark.multirank
@pytest.mark.parametrize("summation", ["blocked"])
def test_branching_graph_fsdp_bitwise_single(tmp_path, summation):
    model, shape = branching_cnn(np.random.default_rng(3))
    path = tmp_path / "branching.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(4)
    center = rng.uniform(-1, 1, int(np.prod(shape))).astype(np.float32)
    lo, hi = center - np.float32(0.05), center + np.float32(0.05)
    pairs = compile_pairs(tmp_path, [("branching", str(path), lo, hi)], "fsdp",
                          summation=summation, stream_chunk_bytes=8 * 1024)
    methods = ["ibp", "crown", "alpha-crown"]
    single = run_job(tmp_path, [s for _, s, _ in pairs], methods, 1, tag="single")
    fsdp = run_job(tmp_path, [f for _, _, f in pairs], methods, 2, tag="fsdp")
    for name, s, f in pairs:
        for m in methods:
            assert fsdp[(f["dir"], m)]["sha"] == single[(s["dir"], m)]["sha"], (name, m)
