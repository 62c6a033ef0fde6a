"""What the piecewise-linear activations cost next to ReLU: CROWN and alpha-CROWN time of one
MLP with each activation in every hidden layer, measured side by side (interleaved runs,
medians), as ratios to ReLU's time.

Usage:
    python bench/activations.py [--sizes 64,256,256,256,10] [--repeat N] [--threads T]

The exact intercepts (runtime/ops/activation.py: float64, rounded outward) cost a fixed
number of elementwise ops per relaxed node, so the ratio is largest on narrow layers and
tends to 1 as layers widen.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import shardbound  # noqa: E402,F401  (first: MKL settings)
import zoo  # noqa: E402

ACTIVATIONS = {
    "relu": lambda b, h: b.op("Relu", [h]),
    "leaky_relu": lambda b, h: b.op("LeakyRelu", [h], alpha=0.1),
    "prelu": lambda b, h, n=None: b.op("PRelu", [h, b.const(b.rng.uniform(-0.5, 1.5, (n,)))]),
    "abs": lambda b, h: b.op("Abs", [h]),
    "clip": lambda b, h: b.op("Clip", [h, b.const(np.float32(-0.5)), b.const(np.float32(0.5))]),
    "max_const": lambda b, h, n=None: b.op("Max", [h, b.const(b.rng.uniform(-0.3, 0.3, (n,)))]),
}


def mlp(kind, sizes):
    b = zoo.Builder(np.random.default_rng(0), (sizes[0],))
    h = "x"
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        h = b.gemm(h, n_in, n_out)
        if i < len(sizes) - 2:
            act = ACTIVATIONS[kind]
            h = act(b, h, n_out) if kind in ("prelu", "max_const") else act(b, h)
    return b.build(h)


def main():
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256,256,256,10")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    tmp = tempfile.mkdtemp(prefix="bench-act-")
    verifiers = {}
    for kind in ACTIVATIONS:
        path = os.path.join(tmp, f"{kind}.onnx")
        onnx.save(mlp(kind, sizes), path)
        compile_model(path, os.path.join(tmp, kind), PassOptions(summation="blocked"))
        verifiers[kind] = load(os.path.join(tmp, kind))
    x = np.random.default_rng(1).uniform(-1, 1, sizes[0]).astype(np.float32)
    lo, hi = x - np.float32(0.05), x + np.float32(0.05)
    print(f"MLP {sizes}, box radius 0.05, threads {args.threads}, blocked summation")
    print("| method | " + " | ".join(ACTIVATIONS) + " |")
    print("|---" * (len(ACTIVATIONS) + 1) + "|")
    for method, repeat in (("crown", args.repeat), ("alpha-crown", max(3, args.repeat // 3))):
        times = {k: [] for k in verifiers}
        for v in verifiers.values():            # warm-up
            v.bounds(lo, hi, method=method)
        for _ in range(repeat):
            for kind, v in verifiers.items():   # interleaved: load changes hit every kind
                t = time.perf_counter()
                v.bounds(lo, hi, method=method)
                times[kind].append(time.perf_counter() - t)
        med = {k: statistics.median(t) for k, t in times.items()}
        cells = [f"{1000 * med[k]:.1f} ms ({med[k] / med['relu']:.2f}x)" for k in ACTIVATIONS]
        print(f"| {method} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
