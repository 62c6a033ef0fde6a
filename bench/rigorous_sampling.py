"""Sample a network's property box against the rigorous bounds of `--soundness real|float32`.

    python3 bench/rigorous_sampling.py --onnx MODEL.onnx --vnnlib PROP.vnnlib [--samples 200]
                                       [--modes real,float32] [--seed 0] [--max-outputs 64]

Per mode, on the property's first input box: the rigorous bounds of every output
(runtime/rigorous/, spec rows +-identity, as `verify --soundness MODE` computes them; a network
of more than --max-outputs outputs gets its property's rows C y instead, +-C) and the
network evaluated at --samples points of the box, a quarter of them vertices: in float64 for
`real` (RigorousBounds.forward64, the real-valued network to float64 rounding) and in float32
for `float32` (torch's forward and the four summation orders of tests/test_soundness_modes.py:
numpy, left to right, right to left, pairwise). Prints per mode the violations (a sampled
output outside its bounds: 0 expected), the smallest slack to a bound, the mean width, and
the seconds the bounds took. The test suite samples the zoo and, with ../shared, ACAS Xu and
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
    from shardbound.runtime.rigorous import RigorousBounds
    from test_soundness_modes import _all_float32

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--onnx", required=True)
    p.add_argument("--vnnlib", required=True)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--modes", default="real,float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-outputs", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    case = parse_vnnlib(args.vnnlib).cases[0]
    lower = np.asarray(case.lower, np.float64)
    upper = np.asarray(case.upper, np.float64)
    rng = np.random.default_rng(args.seed)
    xs = rng.uniform(lower, upper, (args.samples, lower.size))
    k = args.samples // 4
    xs[:k] = np.where(rng.random((k, lower.size)) < 0.5, lower, upper)          # vertices
    xs = xs.astype(np.float32).astype(np.float64).clip(lower, upper)
    print(f"# {os.path.basename(args.onnx)}, the first box of {os.path.basename(args.vnnlib)}, "
          f"{args.samples} points ({k} vertices), load average {os.getloadavg()[0]:.2f}")
    print("| mode | evaluations | violations | smallest slack | mean width | bounds s |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="shardbound-rigsample-") as tmp:
        compile_model(args.onnx, os.path.join(tmp, "prog"), PassOptions())
        v = load(os.path.join(tmp, "prog"))
        m = int(np.prod(v.output_shape))
        rows = torch.eye(m, dtype=torch.float64)
        if m > args.max_outputs:            # the property's rows (the spec rows verify bounds)
            rows = torch.from_numpy(np.concatenate([c.C for c in case.disjuncts])).double()
        r = len(rows)
        print(f"# {'the property rows C y' if m > args.max_outputs else 'every output'} ({r})")
        bad = 0
        for mode in args.modes.split(","):
            rig = RigorousBounds(v.network, mode)
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
            print(f"| {mode} | {ys.shape[0] * ys.shape[1]} | {out} | {slack:.3g} | "
                  f"{float(np.mean(ub - lb)):.4g} | {seconds:.1f} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
