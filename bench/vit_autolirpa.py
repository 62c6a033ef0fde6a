"""The tiny ViT of issue 15 (tests/zoo.py vit_tiny) beside auto_LiRPA: CROWN and IBP widths
and times on the same weights and boxes.

    python bench/vit_autolirpa.py --lirpa CHECKOUT --lirpa-python LIRPA_VENV/bin/python \
        [--radii 0.005,0.02,0.05] [--repeat 3]

auto_LiRPA gets the torch module itself (it has no ONNX loader; its own GELU op stands in
for torch's, whose Erf it does not bound), shardbound the module's torch.onnx.export. Each
tool runs in its own process with 1 thread, one tool after another (shardbound fast,
shardbound blocked, auto_LiRPA: not interleaved, so wall times at load say little); times are
medians over --repeat bound calls after a warm-up, and the CPU time (`time.process_time`, the
minimum over the calls: less sensitive to a shared machine's load than wall time) with its
ratio to auto_LiRPA's.
Without --lirpa only shardbound's columns are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
SEED, BOX_SEED = 0, 3

_LIRPA_WORKER = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
checkout, oracle, tests, radii, repeat = sys.argv[1:6]
sys.path[:0] = [checkout, oracle, tests]
import numpy as np, torch
torch.set_num_threads(1)
try:
    import lirpa_compat  # noqa: F401  (../shared/oracle: torch >= 2.9 fixes)
except ImportError:
    pass
from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm
from auto_LiRPA.operators.gelu import GELUOp
import zoo
net = zoo.vit_tiny_module(np.random.default_rng(%(seed)d), gelu=GELUOp.apply)
x0 = torch.from_numpy(np.random.default_rng(%(box)d).uniform(0, 1, size=(1, 1, 8, 8)).astype(np.float32))
bm = BoundedModule(net, torch.empty_like(x0), device="cpu")
out = {}
for eps in map(float, radii.split(",")):
    bx = BoundedTensor(x0, PerturbationLpNorm(norm=float("inf"), x_L=x0 - eps, x_U=x0 + eps))
    for method in ("IBP", "CROWN"):
        bm.compute_bounds(x=(bx,), method=method)
        times, cpu = [], []
        for _ in range(int(repeat)):
            t, c = time.perf_counter(), time.process_time()
            lb, ub = bm.compute_bounds(x=(bx,), method=method)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        out[f"{eps}/{method.lower()}"] = dict(times=times, cpu=cpu, lb=lb.reshape(-1).tolist(),
                                               ub=ub.reshape(-1).tolist())
print(json.dumps(out))
""" % {"seed": SEED, "box": BOX_SEED}


def shardbound_bounds(radii, repeat, order, work):
    import numpy as np
    import onnx
    import torch

    sys.path.insert(0, TESTS)
    import zoo
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    torch.set_num_threads(1)
    model, _ = zoo.build("vit_tiny", SEED)
    path = os.path.join(work, "vit_tiny.onnx")
    onnx.save(model, path)
    compile_model(path, os.path.join(work, order), PassOptions(summation=order))
    v = load(os.path.join(work, order))
    x0 = np.random.default_rng(BOX_SEED).uniform(0, 1, size=(1, 1, 8, 8)).astype(np.float32)
    out = {}
    for eps in radii:
        lo = torch.from_numpy(x0 - np.float32(eps)).reshape(-1)
        hi = torch.from_numpy(x0 + np.float32(eps)).reshape(-1)
        for method in ("ibp", "crown"):
            v.bounds(lo, hi, method=method)
            times, cpu = [], []
            for _ in range(repeat):
                t, c = time.perf_counter(), time.process_time()
                lb, ub = v.bounds(lo, hi, method=method)
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            out[f"{eps}/{method}"] = dict(times=times, cpu=cpu, lb=lb.reshape(-1).tolist(),
                                           ub=ub.reshape(-1).tolist())
    return out


def _width(r):
    return sum(u - l for l, u in zip(r["lb"], r["ub"])) / len(r["lb"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lirpa", help="an auto_LiRPA checkout (../shared/oracle/README.md)")
    ap.add_argument("--lirpa-python", help="the python of auto_LiRPA's venv")
    ap.add_argument("--radii", default="0.005,0.02,0.05")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    radii = [float(r) for r in args.radii.split(",")]
    if args.worker:                     # one shardbound order in its own process
        with tempfile.TemporaryDirectory() as work:
            print(json.dumps(shardbound_bounds(radii, args.repeat, args.worker, work)))
        return 0
    tools = ["sb-fast", "sb-blocked"] + (["lirpa"] if args.lirpa else [])
    oracle = os.path.join(os.path.dirname(HERE), "..", "shared", "oracle")
    print(f"# vit_tiny: load average {os.getloadavg()[0]:.2f} at start, 1 thread per tool")
    results = {}
    for tool in tools:
        if tool == "lirpa":
            cmd = [args.lirpa_python or sys.executable, "-c", _LIRPA_WORKER, args.lirpa,
                   oracle, TESTS, args.radii, str(args.repeat)]
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", tool[3:],
                   "--radii", args.radii, "--repeat", str(args.repeat)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[tool] = json.loads(done.stdout.strip().splitlines()[-1])
    print("| radius | method | tool | time s | CPU s (min) | CPU x auto_LiRPA | mean width | "
          "width / auto_LiRPA's |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for eps in radii:
        for method in ("ibp", "crown"):
            key = f"{eps}/{method}"
            ref = _width(results["lirpa"][key]) if "lirpa" in results else None
            ref_cpu = min(results["lirpa"][key]["cpu"]) if "lirpa" in results else None
            for tool in tools:
                r = results[tool][key]
                w = _width(r)
                ratio = f"{w / ref:.4f}" if ref else ""
                cpu_x = f"{min(r['cpu']) / ref_cpu:.2f}" if ref_cpu else ""
                print(f"| {eps:g} | {method} | {tool} | {statistics.median(r['times']):.3f} | "
                      f"{min(r['cpu']):.3f} | {cpu_x} | {w:.6g} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
