"""The rigorous CROWN's dense rows with the conv adjoint's routes against the F.fold one.

    python3 bench/rigorous_conv_back.py --onnx MODEL.onnx --vnnlib PROP.vnnlib --node NAME
                                        [--chunks 20] [--modes real,float32] [--repeat 2]

On the property's first box, every node bounded by rigorous IBP (cheap; the rows' arithmetic
does not depend on how tight the bounds they read are), then the first --chunks row chunks
of node NAME's rigorous CROWN (dense rows, `RigorousBounds._backward`, the engine's row
chunk; lower and upper rows of the neurons some relaxation is inexact on), once with
`ConvGeometry.conv_back`'s routes (runtime/rigorous/conv.py: conv_transpose2d or the flipped
kernel's correlation, by shape) and once with every adjoint forced to the F.fold route, runs
alternating, --repeat times. Prints per mode the CPU seconds of each (the best of the
repeats), the routes taken, whether the bounds are the same bits (torch.equal) and, if not,
the largest difference and the mean of both (the rows' lower bounds: larger is tighter).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch


def main(argv=None) -> int:
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.rigorous import RigorousBounds
    from shardbound.runtime.rigorous.conv import ConvGeometry
    from shardbound.runtime.rigorous.core import DT

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--onnx", required=True)
    p.add_argument("--vnnlib", required=True)
    p.add_argument("--node", required=True, help="the node whose dense rows are timed")
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--modes", default="real,float32")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    case = parse_vnnlib(args.vnnlib).cases[0]
    lower = np.asarray(case.lower, np.float64)[None]
    upper = np.asarray(case.upper, np.float64)[None]
    routes = set()
    real_route = ConvGeometry.adjoint_route

    def logged(self, A, w):
        r = real_route(self, A, w)
        routes.add((tuple(w.shape), tuple(self.strides), r))
        return r

    print(f"# {os.path.basename(args.onnx)}, node {args.node}, {args.chunks} row chunks, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| mode | rows | routes CPU s | fold CPU s | fold / routes | same bits | largest "
          "difference | mean lower bound (routes / fold) |")
    print("|---|---:|---:|---:|---:|---|---:|---|")
    with tempfile.TemporaryDirectory(prefix="shardbound-convback-") as tmp:
        compile_model(args.onnx, os.path.join(tmp, "prog"), PassOptions())
        v = load(os.path.join(tmp, "prog"))
        for mode in args.modes.split(","):
            rig = RigorousBounds(v.network, mode)
            rig.crown_nodes = set()
            lo, hi = rig.outward(lower, upper)
            bounds = rig.all_bounds(lo, hi)
            n = rig.by_name[args.node]
            idx = torch.nonzero(rig._inexact(n, bounds).reshape(1, -1).any(dim=0)).reshape(-1)
            idx = idx[:args.chunks * rig.row_chunk]
            M = int(np.prod(n.shape))

            def rows_bounds():
                mags, out = {}, []
                for at in range(0, len(idx), rig.row_chunk):
                    rows = idx[at:at + rig.row_chunk]
                    eye = torch.zeros(len(rows), M, dtype=DT)
                    eye[torch.arange(len(rows)), rows] = 1.0
                    L0 = torch.cat([eye, -eye]).reshape(1, 2 * len(rows), *n.shape)
                    out.append(rig._backward(n.name, L0, bounds, lo, hi, mags=mags))
                return torch.cat(out, dim=1)

            best = {"routes": np.inf, "fold": np.inf}
            got = {}
            for _ in range(args.repeat):
                for how in ("routes", "fold"):
                    ConvGeometry.adjoint_route = (logged if how == "routes"
                                                  else lambda self, A, w: "fold")
                    t0 = time.process_time()
                    got[how] = rows_bounds()
                    best[how] = min(best[how], time.process_time() - t0)
            ConvGeometry.adjoint_route = real_route
            a, b = got["routes"], got["fold"]
            same = torch.equal(a, b)
            diff = float((a - b).abs().max())
            print(f"| {mode} | {a.shape[1]} | {best['routes']:.2f} | {best['fold']:.2f} | "
                  f"{best['fold'] / best['routes']:.2f} | {same} | {diff:.3g} | "
                  f"{float(a.mean()):.10g} / {float(b.mean()):.10g} |", flush=True)
    print("routes taken: " + ", ".join(f"w{s} stride {st}: {r}" for s, st, r in sorted(routes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
