"""Branch and bound work per instance, in one process: verdict, domains, CPU seconds,
domains per CPU second, for input splitting (ACAS Xu) and ReLU splitting (mnistfc).

    python3 bench/split_rate.py --instances CSV [--only SUBSTRING] [--timeout-scale F]
    python3 bench/split_rate.py --instances CSV --only acasxu --python OTHER_VENV/bin/python

Each instance is compiled (`--summation fast`, as `verify` on VNN-COMP runs) and verified
with `runtime.verification.verdict.verify` inside this process, one thread; the branch and
bounds are wrapped to record their domain counts. CPU seconds are this process's
(time.process_time) over `verify` alone: no interpreter start, import or compile (what
bench/vnncomp.py's wall times add per instance), and less skewed by a loaded machine than
wall seconds. With --python, the same instances run alternately in that interpreter (another
checkout's venv: its shardbound is the one imported) and in this one, instance by
instance, and the table gives both and their ratio: side by side on a shared machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT_CSV = os.path.normpath(os.path.join(ROOT, "..", "shared", "benchmarks", "instances.csv"))


def run_instance(onnx_path: str, vnnlib: str, timeout: float) -> dict:
    """Verify one instance here; a dict of the verdict, domains and CPU seconds."""
    import torch

    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.verification import verdict as vd
    from shardbound.runtime.verification.spec import spec_from_property

    torch.set_num_threads(1)
    domains = []

    def counted(fn):
        def wrapper(*a, **k):
            res = fn(*a, **k)
            domains.append(res.domains)
            return res
        return wrapper

    saved = vd.input_split, vd.relu_split
    vd.input_split, vd.relu_split = counted(saved[0]), counted(saved[1])
    try:
        tmp = tempfile.mkdtemp(prefix="split-rate-")
        compile_model(onnx_path, os.path.join(tmp, "p"), PassOptions(summation="fast"))
        verifier = load(os.path.join(tmp, "p"))
        spec = spec_from_property(parse_vnnlib(vnnlib))
        c0, w0 = time.process_time(), time.monotonic()
        res = vd.verify(verifier, spec, timeout, SingleComm())
        cpu, wall = time.process_time() - c0, time.monotonic() - w0
    finally:
        vd.input_split, vd.relu_split = saved
    return {"verdict": res.verdict, "domains": sum(domains), "cpu": cpu, "wall": wall}


def _rows(args):
    with open(args.instances, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if args.only:
        rows = [r for r in rows if args.only in f"{r['family']}/{r['onnx']}/{r['vnnlib']}"]
    base = os.path.dirname(os.path.abspath(args.instances))
    return [(f"{r['family']}/{os.path.basename(r['onnx'])}/{os.path.basename(r['vnnlib'])}",
             os.path.join(base, r["onnx"]), os.path.join(base, r["vnnlib"]),
             float(r["timeout_s"]) * args.timeout_scale, r["expected"].strip()) for r in rows]


def _in(python: str, onnx_path, vnnlib, timeout) -> dict:
    out = subprocess.run([python, os.path.abspath(__file__), "--one", onnx_path, vnnlib,
                          str(timeout)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", default=DEFAULT_CSV, metavar="CSV")
    p.add_argument("--only", metavar="SUBSTRING")
    p.add_argument("--timeout-scale", type=float, default=1.0, metavar="F")
    p.add_argument("--python", metavar="EXE", help="also run every instance in EXE (another "
                   "checkout's interpreter), alternating with this one")
    p.add_argument("--one", nargs=3, metavar=("ONNX", "VNNLIB", "TIMEOUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_instance(args.one[0], args.one[1], float(args.one[2]))))
        return 0
    rows = _rows(args)
    with open("/proc/loadavg", encoding="ascii") as f:
        print(f"# load average at start: {f.read().split()[0]}")
    if args.python:
        print("| instance | expected | before | after | domains before | after | CPU s before "
              "| after | CPU ratio | domains/CPU s before | after |")
        print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    else:
        print("| instance | expected | verdict | domains | CPU s | wall s | domains / CPU s |")
        print("|---|---|---|---:|---:|---:|---:|")
    tot = {"b": 0.0, "a": 0.0, "db": 0, "da": 0}
    for name, onnx_path, vnnlib, timeout, expected in rows:
        a = _in(sys.executable, onnx_path, vnnlib, timeout)
        if args.python:
            b = _in(args.python, onnx_path, vnnlib, timeout)
            tot["b"] += b["cpu"]
            tot["db"] += b["domains"]
            print(f"| {name} | {expected} | {b['verdict']} | {a['verdict']} | {b['domains']} | "
                  f"{a['domains']} | {b['cpu']:.2f} | {a['cpu']:.2f} | "
                  f"{a['cpu'] / max(b['cpu'], 1e-9):.2f} | "
                  f"{b['domains'] / max(b['cpu'], 1e-9):.0f} | "
                  f"{a['domains'] / max(a['cpu'], 1e-9):.0f} |", flush=True)
        else:
            print(f"| {name} | {expected} | {a['verdict']} | {a['domains']} | {a['cpu']:.2f} | "
                  f"{a['wall']:.2f} | {a['domains'] / max(a['cpu'], 1e-9):.0f} |", flush=True)
        tot["a"] += a["cpu"]
        tot["da"] += a["domains"]
    if args.python:
        print(f"| total | | | | {tot['db']} | {tot['da']} | {tot['b']:.1f} | {tot['a']:.1f} | "
              f"{tot['a'] / max(tot['b'], 1e-9):.2f} | {tot['db'] / max(tot['b'], 1e-9):.0f} | "
              f"{tot['da'] / max(tot['a'], 1e-9):.0f} |")
    else:
        print(f"| total | | | {tot['da']} | {tot['a']:.1f} | | "
              f"{tot['da'] / max(tot['a'], 1e-9):.0f} |")
    with open("/proc/loadavg", encoding="ascii") as f:
        print(f"# load average at end: {f.read().split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
