"""Sample a network's property box against the rigorous bounds of `--soundness real|float32`.

    python3 bench/rigorous_sampling.py --onnx MODEL.onnx --vnnlib PROP.vnnlib [--samples 200]
                                       [--modes real,float32] [--seed 0] [--max-outputs 64]
                                       [--rows auto|property|outputs] [--intermediate plan|grid|ibp]
                                       [--shrink F] [--name NAME]

Per mode, on the property's first input box: the rigorous bounds of every output
(runtime/rigorous/, spec rows +-identity, as `verify --soundness MODE` computes them; a network
of more than --max-outputs outputs gets its property's rows C y instead, +-C) and the
network evaluated at --samples points of the box, a quarter of them vertices: in float64 for
`real` (RigorousBounds.forward64, the real-valued network to float64 rounding) and in float32
for `float32` (torch's forward and the four summation orders of tests/test_soundness_modes.py:
numpy, left to right, right to left, pairwise). `--rows property` bounds the property's rows
C y (the rows the verdict depends on) whatever the output's size. `--intermediate plan`
bounds the intermediate nodes as `verify --soundness MODE` does (rigorous CROWN of the nodes
the compiler's bound plan marks for CROWN), `ibp` by rigorous IBP alone (the final pass is
still CROWN): for networks where CROWN of every planned neuron takes too long; `grid` keeps
CROWN for the planned (C, H, W) nodes (windowed rows, runtime/rigorous/window.py) and bounds
the flat ones by IBP. `--shrink F` scales the box about its centre by F (a property box on
which even the engine's CROWN is vacuous, traffic_signs', samples nothing but the output's
range; a smaller box tests the relaxations where they bite). Prints per
mode one row: the violations (a sampled output outside its bounds: 0 expected), the
smallest slack to a bound, the mean width, and the CPU seconds the bounds took. The test suite samples the zoo and, with ../shared, ACAS Xu and
mnistfc the same way (tests/test_soundness_modes.py); this script reaches the larger shared
networks, whose rigorous CROWN takes minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main(argv=None) -> int:
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.rigorous import RigorousBounds, window
    from test_soundness_modes import _all_float32

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--onnx", required=True)
    p.add_argument("--vnnlib", required=True)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--modes", default="real,float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-outputs", type=int, default=64)
    p.add_argument("--rows", choices=("auto", "property", "outputs"), default="auto",
                   help="auto: every output up to --max-outputs, else the property's rows")
    p.add_argument("--intermediate", choices=("plan", "grid", "ibp"), default="plan")
    p.add_argument("--shrink", type=float, default=1.0)
    p.add_argument("--name", help="the network's name in the table (default: the file's)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    case = parse_vnnlib(args.vnnlib).cases[0]
    lower = np.asarray(case.lower, np.float64)
    upper = np.asarray(case.upper, np.float64)
    if args.shrink != 1.0:
        mid, rad = (lower + upper) / 2, (upper - lower) / 2 * args.shrink
        lower = (mid - rad).astype(np.float32).astype(np.float64)
        upper = np.maximum((mid + rad).astype(np.float32).astype(np.float64), lower)
    rng = np.random.default_rng(args.seed)
    xs = rng.uniform(lower, upper, (args.samples, lower.size))
    k = args.samples // 4
    xs[:k] = np.where(rng.random((k, lower.size)) < 0.5, lower, upper)          # vertices
    xs = xs.astype(np.float32).astype(np.float64).clip(lower, upper)
    shrunk = f" scaled by {args.shrink:g}" if args.shrink != 1.0 else ""
    print(f"# {os.path.basename(args.onnx)}, the first box of {os.path.basename(args.vnnlib)}"
          f"{shrunk}, "
          f"{args.samples} points ({k} vertices), load average {os.getloadavg()[0]:.2f}")
    name = args.name or os.path.basename(args.onnx)
    print("| network | mode | intermediates | rows | points | evaluations | violations | "
          "smallest slack | mean width | bounds CPU s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="shardbound-rigsample-") as tmp:
        compile_model(args.onnx, os.path.join(tmp, "prog"), PassOptions())
        v = load(os.path.join(tmp, "prog"))
        m = int(np.prod(v.output_shape))
        prop = args.rows == "property" or (args.rows == "auto" and m > args.max_outputs)
        rows = torch.eye(m, dtype=torch.float64)
        if prop:                            # the property's rows (the spec rows verify bounds)
            rows = torch.from_numpy(np.concatenate([c.C for c in case.disjuncts])).double()
        r = len(rows)
        what = f"{r} property" if prop else f"{r} outputs"
        bad = 0
        for mode in args.modes.split(","):
            rig = RigorousBounds(v.network, mode)
            planned = len(rig.crown_nodes)
            if args.intermediate == "ibp":
                rig.crown_nodes = set()
            elif args.intermediate == "grid":
                rig.crown_nodes = {k for k in rig.crown_nodes
                                   if window.is_grid(rig.by_name[k].shape)}
            how = {"plan": f"CROWN ({planned} planned nodes)",
                   "grid": f"CROWN of {len(rig.crown_nodes)} grid nodes, IBP of "
                           f"{planned - len(rig.crown_nodes)} flat ones",
                   "ibp": f"IBP ({planned} planned for CROWN)"}[args.intermediate]
            t0 = time.process_time()
            lo, hi = rig.outward(lower[None], upper[None])
            both = rig.spec_lower(lo, hi, torch.cat([rows, -rows]))[0].numpy()
            seconds = time.process_time() - t0
            lb, ub = both[:r], -both[r:]
            if mode == "real":
                ys = rig.forward64(torch.from_numpy(xs)).numpy()[None]
            else:
                ys = _all_float32(v, rig, xs)
            ys = ys @ rows.numpy().T                    # float64 products of the evaluations
            out = int(((ys < lb) | (ys > ub)).sum())
            bad += out
            slack = float(min((ys - lb).min(), (ub - ys).min()))
            print(f"| {name} | {mode} | {how} | {what} | {args.samples} | "
                  f"{ys.shape[0] * ys.shape[1]} | {out} | {slack:.3g} | "
                  f"{float(np.mean(ub - lb)):.4g} | {seconds:.1f} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
