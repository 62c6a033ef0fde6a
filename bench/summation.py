"""End-to-end CROWN time under each summation order, relative to `fast`, side by side.

    python bench/summation.py [--repeat 3] [--threads 1]

An MLP (784-1024-1024-1024-10) and a CNN (3x32x32: conv 16 s2, conv 32 s2, gemm 256, gemm 10)
are built with onnx.helper (fixed seed), compiled once per order, and bounded over one box
(eps 0.01); the orders run interleaved (fast, blocked, exact, fast, ...) so that background
load hits them alike; the table gives the median wall time of `bounds(method="crown")`, the
median over rounds of the time relative to that round's `fast` run, and the largest difference
to the `fast` bounds (they differ in the last bits).
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
from onnx import TensorProto, helper, numpy_helper

ORDERS = ("fast", "blocked", "exact")


def _model(nodes, inits, in_shape, out_dim):
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, *in_shape])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out_dim])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def mlp(rng, widths=(784, 1024, 1024, 1024, 10)):
    nodes, inits, x = [], [], "x"
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        inits += [numpy_helper.from_array(rng.normal(0, a ** -0.5, (b, a)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.normal(0, 0.1, b).astype(np.float32), f"b{i}")]
        out = "y" if i == len(widths) - 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [out], transB=1))
        if out != "y":
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"]))
            x = f"r{i}"
    return _model(nodes, inits, (widths[0],), widths[-1]), (widths[0],)


def cnn(rng):
    def w(name, shape, fan):
        inits.append(numpy_helper.from_array(rng.normal(0, fan ** -0.5, shape).astype(np.float32), name))
        return name
    inits = []
    nodes = [helper.make_node("Conv", ["x", w("c1", (16, 3, 3, 3), 27)], ["a"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["a"], ["ra"]),
             helper.make_node("Conv", ["ra", w("c2", (32, 16, 3, 3), 144)], ["b"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["b"], ["rb"]),
             helper.make_node("Flatten", ["rb"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", w("g1", (256, 2048), 2048)], ["c"], transB=1),
             helper.make_node("Relu", ["c"], ["rc"]),
             helper.make_node("Gemm", ["rc", w("g2", (10, 256), 256)], ["y"], transB=1)]
    return _model(nodes, inits, (3, 32, 32), 10), (3, 32, 32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    torch.set_num_threads(args.threads)
    print(f"# end-to-end CROWN time by summation order: torch {torch.__version__}, threads "
          f"{args.threads}, median of {args.repeat} interleaved runs after a warm-up, load average "
          f"{os.getloadavg()[0]:.2f} at start\n")
    print("| model | order | CROWN s | x fast | max |bound - fast bound| |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in (("mlp 784-1024x3-10", mlp), ("cnn 3x32x32", cnn)):
            model, shape = build(np.random.default_rng(0))
            path = os.path.join(tmp, "m.onnx")
            onnx.save(model, path)
            x = np.random.default_rng(1).uniform(0, 1, shape).astype(np.float32)
            lo, hi = x - 0.01, x + 0.01
            verifiers, runs, bounds = {}, {o: [] for o in ORDERS}, {}
            for order in ORDERS:
                out = os.path.join(tmp, f"{name[:3]}_{order}")
                compile_model(path, out, PassOptions(summation=order))
                verifiers[order] = load(out)
                verifiers[order].bounds(lo, hi)                 # warm-up
            for _ in range(args.repeat):                        # interleaved: load hits all alike
                for order in ORDERS:
                    t = time.perf_counter()
                    bounds[order] = verifiers[order].bounds(lo, hi)
                    runs[order].append(time.perf_counter() - t)
            times = {o: statistics.median(r) for o, r in runs.items()}
            for order in ORDERS:      # ratio: median over rounds of this round's time / fast's
                ratio = statistics.median(t / f for t, f in zip(runs[order], runs["fast"]))
                diff = max(float((bounds[order][i] - bounds["fast"][i]).abs().max()) for i in (0, 1))
                print(f"| {name} | {order} | {times[order]:.3f} | {ratio:.2f} | {diff:.2e} |")
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
