"""Compile and inspect time against depth: long chains must cost linear time.

    python3 bench/compile_scale.py [--nodes 2000,20000] [--patterns relu,gemm_relu,affine]

Builds chains of N ONNX nodes with onnx.helper (patterns: `relu` N Relus on a 4-wide input;
`gemm_relu` alternating 4x4 Gemm and Relu; `affine` alternating Relu, Mul and Add by constants,
which canonicalize folds), then times `compile` (import, passes, codegen, writing the three
files) and `inspect` in this process, one after the other. Prints seconds, seconds per 1,000
nodes and the ratio of per-node cost between the largest and the smallest N (1.0 is linear;
quadratic work shows as a ratio near N_max / N_min).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
WIDTH = 4


def chain(pattern: str, n: int) -> onnx.ModelProto:
    """A chain of `n` ONNX nodes of the given pattern (input (1, WIDTH), output (1, WIDTH))."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    cur = "x"
    for i in range(n):
        out = f"t{i}"
        if pattern == "relu" or (pattern == "gemm_relu" and i % 2) or (pattern == "affine"
                                                                         and i % 3 == 0):
            nodes.append(helper.make_node("Relu", [cur], [out], name=f"relu{i}"))
        elif pattern == "gemm_relu":
            w = numpy_helper.from_array(rng.uniform(-1, 1, (WIDTH, WIDTH)).astype(np.float32),
                                        f"w{i}")
            b = numpy_helper.from_array(np.zeros(WIDTH, np.float32), f"b{i}")
            inits += [w, b]
            nodes.append(helper.make_node("Gemm", [cur, f"w{i}", f"b{i}"], [out], name=f"gemm{i}",
                                          transB=1))
        else:
            op = "Mul" if i % 3 == 1 else "Add"
            c = numpy_helper.from_array(rng.uniform(0.5, 1.5, (WIDTH,)).astype(np.float32),
                                        f"c{i}")
            inits.append(c)
            nodes.append(helper.make_node(op, [cur, f"c{i}"], [out], name=f"{op.lower()}{i}"))
        cur = out
    graph = helper.make_graph(
        nodes, f"{pattern}_{n}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [1, WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def measure(pattern: str, n: int, tmp: str) -> tuple[float, float]:
    from shardbound.compiler.driver import compile_model, inspect_model
    from shardbound.passes.manager import PassOptions

    path = os.path.join(tmp, f"{pattern}_{n}.onnx")
    onnx.save(chain(pattern, n), path)
    start = time.perf_counter()
    compile_model(path, os.path.join(tmp, f"{pattern}_{n}_prog"), PassOptions())
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    inspect_model(path, PassOptions())
    return compiled, time.perf_counter() - start


def main(argv=None) -> int:
    sys.path.insert(0, ROOT)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2000,20000", help="comma-separated chain lengths")
    p.add_argument("--patterns", default="relu,gemm_relu,affine")
    args = p.parse_args(argv)
    sizes = sorted(int(s) for s in args.nodes.split(","))
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print("| pattern | nodes | compile s | inspect s | compile s / 1k nodes |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for pattern in args.patterns.split(","):
            per_node = []
            for n in sizes:
                c, i = measure(pattern, n, tmp)
                per_node.append(c / n)
                print(f"| {pattern} | {n} | {c:.2f} | {i:.2f} | {1000 * c / n:.3f} |", flush=True)
            if len(sizes) > 1:
                print(f"| {pattern} | ratio of per-node cost {sizes[-1]} / {sizes[0]} | "
                      f"{per_node[-1] / per_node[0]:.2f} | | |", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
