"""MaxPool relaxation benchmark: how much the chord upper line buys over the constant one.

Usage:
    python bench/maxpool_lines.py [--boxes N]

For the zoo's maxpool_cnn (3x3 windows, stride 2, pads 1: overlapping) and a 2x2 / stride 2
variant, on N boxes per radius (uniform(-1, 1) centres, per-input radius in [0.2 r, r]), it
prints the mean output width (ub - lb) of IBP, of CROWN with DeepPoly's constant upper line
y <= max_i u_i on inexact windows (what auto_LiRPA 0.7.1 uses; swapped in by patching
`window_lines`), of CROWN with shardbound's chord upper line, and of alpha-CROWN, side by
side in one run, with the chord's width as a fraction of the constant line's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import onnx
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import zoo  # noqa: E402

from shardbound.compiler.driver import compile_model  # noqa: E402
from shardbound.passes.manager import PassOptions  # noqa: E402
from shardbound.runtime.ops import pooling  # noqa: E402
from shardbound.runtime.program.loader import load  # noqa: E402

RADII = (0.02, 0.1, 0.3)
CHORD = pooling.window_lines


def constant_upper(lo, hi, valid):
    """The chord's lines with the upper line of inexact windows replaced by max_i u_i."""
    lines = CHORD(lo, hi, valid)
    max_hi = torch.where(valid, hi, torch.tensor(float("-inf"))).amax(dim=-1)
    inexact = ~lines.exact
    lines.up_slope = torch.where(inexact.unsqueeze(-1), torch.zeros_like(lines.up_slope),
                                 lines.up_slope)
    lines.up_icpt = torch.where(inexact, max_hi, lines.up_icpt)
    return lines


def maxpool_cnn_k2(rng):
    """maxpool_cnn with non-overlapping 2x2 windows (stride 2, no pads)."""
    b = zoo.Builder(rng, (2, 8, 8))
    h = b.op("Conv", ["x", b.const(b.weight(4, 2, 3, 3)), b.const(rng.normal(0, 0.1, (4,)))],
             pads=[1, 1, 1, 1])
    h = b.op("MaxPool", [b.relu(h)], kernel_shape=[2, 2], strides=[2, 2])
    h = b.op("Conv", [h, b.const(b.weight(4, 4, 3, 3)), b.const(rng.normal(0, 0.1, (4,)))])
    h = b.op("Flatten", [b.relu(h)], axis=1)
    return b.build(b.gemm(h, 16, 5)), b.input_shape


MODELS = {"maxpool_cnn": zoo.OP_ZOO["maxpool_cnn"], "maxpool_cnn_k2": maxpool_cnn_k2}


def box(shape, seed, radius):
    rng = np.random.default_rng(seed)
    c = rng.uniform(-1, 1, size=shape).astype(np.float32)
    r = rng.uniform(0.2 * radius, radius, size=shape).astype(np.float32)
    return c - r, c + r


def widths(verifier, shape, radius, boxes):
    out = {k: [] for k in ("ibp", "constant", "chord", "alpha")}
    for seed in range(boxes):
        lo, hi = box(shape, seed, radius)
        for key, method, lines in (("ibp", "ibp", CHORD), ("constant", "crown", constant_upper),
                                   ("chord", "crown", CHORD), ("alpha", "alpha-crown", CHORD)):
            pooling.window_lines = lines
            try:
                lb, ub = verifier.bounds(lo, hi, method=method)
            finally:
                pooling.window_lines = CHORD
            out[key].append(float((ub - lb).mean()))
    return {k: float(np.mean(v)) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boxes", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | radius | IBP | CROWN, constant upper | CROWN, chord upper | chord / constant "
          "| alpha-CROWN |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in MODELS.items():
            model, shape = make(np.random.default_rng(0))
            path = os.path.join(tmp, f"{name}.onnx")
            onnx.save(model, path)
            compile_model(path, os.path.join(tmp, name), PassOptions(summation="blocked"))
            verifier = load(os.path.join(tmp, name))
            for radius in RADII:
                w = widths(verifier, shape, radius, args.boxes)
                print(f"| {name} | {radius} | {w['ibp']:.4f} | {w['constant']:.4f} | "
                      f"{w['chord']:.4f} | {w['chord'] / w['constant']:.3f} | {w['alpha']:.4f} |")


if __name__ == "__main__":
    main()
