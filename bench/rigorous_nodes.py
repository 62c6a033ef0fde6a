"""CPU seconds per CROWN-bounded node: the engine's CROWN beside the rigorous one of
`--soundness real` (windowed rows, and dense rows on the first N neurons, extrapolated), on
the first box of a VNN-LIB property (issue 17).

    python3 bench/rigorous_nodes.py --onnx NET.onnx --vnnlib PROP.vnnlib [--dense-rows 18]
                                    [--no-dense] [--no-engine] [--save BOUNDS.pt] [--work DIR]

One thread; process CPU time (less sensitive to a shared machine's load than wall time, not
immune to it: say the load). Rows: the neurons each pass bounds (the engine's: its inexact
ones from its own bounds; the rigorous pass recomputes IBP from its tighter earlier nodes,
so it may have fewer). `--save`: the windowed pass's bounds of every node (torch.save), to
compare two versions bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.rigorous import RigorousBounds

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--onnx", required=True)
    p.add_argument("--vnnlib", required=True)
    p.add_argument("--dense-rows", type=int, default=18)
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--save", default=None)
    p.add_argument("--work", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    work = args.work or tempfile.mkdtemp(prefix="rigorous_nodes_")
    out = os.path.join(work, "program")
    if not os.path.exists(out):
        compile_model(args.onnx, out, PassOptions(summation="fast"))
    v = load(out)
    net = v.network
    case = parse_vnnlib(args.vnnlib).cases[0]
    shape = (1, *v.input_shape)
    lo = torch.tensor(case.lower, dtype=torch.float32).reshape(shape)
    hi = torch.tensor(case.upper, dtype=torch.float32).reshape(shape)
    engine = {}
    crown_node = net.crown_node

    def timed(node, *a, **k):
        t = time.process_time()
        r = crown_node(node, *a, **k)
        engine[node.name] = (time.process_time() - t, net.crown_rows.get(node.name))
        return r
    net.crown_node = timed
    if not args.no_engine:
        with torch.no_grad():
            net.intermediate_bounds(lo, hi)

    def rigorous(windowed, limit=None):
        rig = RigorousBounds(net, "real")
        rig.windowed = windowed
        got, rows = {}, {}
        inexact, node_bounds = rig._inexact, rig._node_bounds

        def restricted(n, bounds):
            m = inexact(n, bounds)
            flat = m.reshape(-1)
            rows[n.name] = int(flat.sum())
            if limit is None:
                return m
            keep = torch.zeros_like(flat)
            keep[torch.nonzero(flat).reshape(-1)[:limit]] = True
            return keep.reshape(m.shape)

        def node(n, bounds, lo64, hi64):
            t = time.process_time()
            r = node_bounds(n, bounds, lo64, hi64)
            dt = time.process_time() - t
            got[n.name] = dt if limit is None else dt / min(limit, rows[n.name]) * rows[n.name]
            return r
        rig._inexact, rig._node_bounds = restricted, node
        blo, bhi = rig.outward(case.lower[None], case.upper[None])
        with torch.no_grad():
            bounds = rig.all_bounds(blo, bhi)
        if windowed and args.save:
            torch.save({k: (a.clone(), b.clone()) for k, (a, b) in bounds.items()}, args.save)
        return got, rows

    windowed, rows = rigorous(True)
    dense = {} if args.no_dense else rigorous(False, args.dense_rows)[0]
    print(f"| node | shape | engine CROWN CPU s (rows) | rigorous dense CPU s "
          f"(from {args.dense_rows} rows) | rigorous windowed CPU s (rows) |")
    print("|---|---|---:|---:|---:|")
    shapes = {n.name: "x".join(map(str, n.shape)) for n in net.nodes}
    for name, t in windowed.items():
        e, er = engine.get(name, (float("nan"), None))
        d = dense.get(name)
        print(f"| {name} | {shapes[name]} | {e:.1f} ({er}) | "
              f"{'-' if d is None else f'{d:.1f}'} | {t:.1f} ({rows[name]}) |")
    print(f"| total | | {sum(e for e, _ in engine.values()):.1f} | "
          f"{sum(dense.values()):.1f} | {sum(windowed.values()):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
