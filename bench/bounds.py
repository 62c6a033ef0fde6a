"""Bound-propagation benchmark: compile time, IBP / CROWN / alpha-CROWN time and tightness per model.

Usage:
    python bench/bounds.py [--repeat N] [--threads T] [--models a,b,...]

Models: every model of the test zoo (tests/zoo.py: ZOO, the op-family models of OP_ZOO and
the torch-exported TORCH_ZOO: the tiny ViT), box of radius 0.05 around a seeded random center), plus two real VNN-COMP 2021 networks from ../shared/benchmarks when that folder is
there (ACAS Xu 1_1 with prop_1's box, mnist-net_256x2 with prop_0_0.03's box).

Per model it reports: IR nodes and parameters of the compiled graph, the full compile_model
time (import, passes, codegen and writing the directory), the median IBP, CROWN and
alpha-CROWN time for one input box over --repeat runs after one warm-up, and the mean width
(ub - lb) of the final outputs under IBP and CROWN with their ratio, and alpha-CROWN's mean
lower-bound gain over CROWN. The table is markdown, for the README.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

import zoo  # noqa: E402

from shardbound.compiler.driver import compile_model  # noqa: E402
from shardbound.passes.manager import PassOptions  # noqa: E402
from shardbound.runtime.program.loader import load  # noqa: E402

SHARED = os.path.normpath(os.path.join(REPO, "..", "shared", "benchmarks"))
ZOO_SEED = 0
BOX_SEED = 1234
ZOO_RADIUS = 0.05

# name -> (onnx path relative to SHARED, vnnlib path relative to SHARED)
REAL = {
    "acasxu_1_1/prop_1": ("acasxu/ACASXU_run2a_1_1_batch_2000.onnx", "acasxu/prop_1.vnnlib"),
    "mnist_256x2/prop_0_0.03": ("mnistfc/mnist-net_256x2.onnx", "mnistfc/prop_0_0.03.vnnlib"),
}


# ----------------------------------------------------------------------------- input boxes

_BOUND_RE = re.compile(
    r"\(\s*assert\s*\(\s*(<=|>=)\s*X_(\d+)\s+([-+0-9.eE]+)\s*\)\s*\)")


def _regex_box(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Fallback reader: only `(assert (<= X_i v))` / `(assert (>= X_i v))` lines."""
    lo: dict[int, float] = {}
    hi: dict[int, float] = {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for op, i, v in _BOUND_RE.findall(text):
        (hi if op == "<=" else lo)[int(i)] = float(v)
    n = max(max(lo, default=-1), max(hi, default=-1)) + 1
    if n == 0 or set(lo) != set(range(n)) or set(hi) != set(range(n)):
        raise ValueError(f"{path}: could not read a complete input box")
    return (np.array([lo[i] for i in range(n)], dtype=np.float64),
            np.array([hi[i] for i in range(n)], dtype=np.float64))


def vnnlib_box(path: str) -> tuple[np.ndarray, np.ndarray, str]:
    """The first case's box; the third item says which reader was used."""
    try:
        from shardbound.compiler.vnnlib import parse_vnnlib
    except ImportError:
        lo, hi = _regex_box(path)
        return lo, hi, "regex"
    case = parse_vnnlib(path).cases[0]
    return (np.array(case.lower, dtype=np.float64), np.array(case.upper, dtype=np.float64),
            "parse_vnnlib")


def zoo_box(shape) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(BOX_SEED)
    center = rng.uniform(-1.0, 1.0, size=int(np.prod(shape)))
    return center - ZOO_RADIUS, center + ZOO_RADIUS


# ----------------------------------------------------------------------------- measuring

def count_params(graph) -> int:
    """Scalars in the tensors that the compiled graph's nodes use as parameters."""
    keys = {key for n in graph.nodes for _, key in n.params}
    return int(sum(np.asarray(graph.tensors[k]).size for k in keys if k in graph.tensors))


def time_bounds(verifier, lo, hi, method: str, repeat: int):
    lo_t = torch.as_tensor(lo, dtype=torch.float32)
    hi_t = torch.as_tensor(hi, dtype=torch.float32)
    lb, ub = verifier.bounds(lo_t, hi_t, method=method)  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        lb, ub = verifier.bounds(lo_t, hi_t, method=method)
        times.append(time.perf_counter() - t0)
    width = float((ub - lb).double().mean())
    return statistics.median(times) * 1e3, width, lb


def bench_one(name: str, onnx_path: str, lo, hi, workdir: str, repeat: int) -> dict:
    out = os.path.join(workdir, re.sub(r"[^A-Za-z0-9_]", "_", name) + "_prog")
    t0 = time.perf_counter()
    graph = compile_model(onnx_path, out, PassOptions())
    compile_s = time.perf_counter() - t0
    verifier = load(out)
    ibp_ms, ibp_w, _ = time_bounds(verifier, lo, hi, "ibp", repeat)
    crown_ms, crown_w, crown_lb = time_bounds(verifier, lo, hi, "crown", repeat)
    alpha_ms, _, alpha_lb = time_bounds(verifier, lo, hi, "alpha-crown", repeat)
    return dict(model=name, nodes=len(graph.nodes), params=count_params(graph),
                compile_s=compile_s, ibp_ms=ibp_ms, crown_ms=crown_ms, alpha_ms=alpha_ms,
                ibp_w=ibp_w, crown_w=crown_w,
                ratio=crown_w / ibp_w if ibp_w > 0 else float("nan"),
                alpha_gain=float((alpha_lb - crown_lb).double().mean()))


# ----------------------------------------------------------------------------- table

COLUMNS = [
    ("model", "model", "{}"),
    ("IR nodes", "nodes", "{}"),
    ("params", "params", "{:,}"),
    ("compile (s)", "compile_s", "{:.3f}"),
    ("IBP (ms)", "ibp_ms", "{:.3f}"),
    ("CROWN (ms)", "crown_ms", "{:.3f}"),
    ("alpha-CROWN (ms)", "alpha_ms", "{:.3f}"),
    ("IBP width", "ibp_w", "{:.4g}"),
    ("CROWN width", "crown_w", "{:.4g}"),
    ("CROWN/IBP", "ratio", "{:.3f}"),
    ("alpha lb gain", "alpha_gain", "{:.4g}"),
]


def print_table(rows: list[dict]) -> None:
    cells = [[fmt.format(r[key]) for _, key, fmt in COLUMNS] for r in rows]
    heads = [h for h, _, _ in COLUMNS]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    left = {0}

    def line(values):
        return "| " + " | ".join(v.ljust(w) if i in left else v.rjust(w)
                                 for i, (v, w) in enumerate(zip(values, widths))) + " |"

    print(line(heads))
    print("|" + "|".join((":" if i in left else "") + "-" * (w + 1) + ("" if i in left else ":")
                         for i, w in enumerate(widths)) + "|")
    for c in cells:
        print(line(c))


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per method (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--models", default="", help="comma-separated subset (default: all)")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.threads < 1:
        ap.error("--repeat and --threads must be at least 1")

    torch.set_num_threads(args.threads)
    built = {**zoo.ZOO, **getattr(zoo, "OP_ZOO", {}), **getattr(zoo, "TORCH_ZOO", {})}
    all_names = (sorted(zoo.ZOO) + sorted(getattr(zoo, "OP_ZOO", {}))
                 + sorted(getattr(zoo, "TORCH_ZOO", {})) + list(REAL))
    wanted = [m.strip() for m in args.models.split(",") if m.strip()] or all_names
    unknown = [m for m in wanted if m not in all_names]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(all_names)}")

    print(f"shardbound bounds benchmark: torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, CPUs {os.cpu_count()}, "
          f"python {platform.python_version()}, repeat {args.repeat} (median after 1 warm-up), "
          f"one input box, default PassOptions()")
    print()

    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="shardbound-bench-") as workdir:
        for name in wanted:
            if name in built:
                model, shape = zoo.build(name, ZOO_SEED)
                path = os.path.join(workdir, f"{name}.onnx")
                onnx.save(model, path)
                lo, hi = zoo_box(shape)
            else:
                rel_onnx, rel_spec = REAL[name]
                path = os.path.join(SHARED, rel_onnx)
                spec = os.path.join(SHARED, rel_spec)
                if not (os.path.isfile(path) and os.path.isfile(spec)):
                    notes.append(f"{name}: skipped ({SHARED} or its files not present)")
                    continue
                lo, hi, reader = vnnlib_box(spec)
                if reader != "parse_vnnlib":
                    notes.append(f"{name}: box read by the regex fallback")
            try:
                rows.append(bench_one(name, path, lo, hi, workdir, args.repeat))
            except Exception as e:  # keep going: one failing model should not hide the rest
                notes.append(f"{name}: failed: {type(e).__name__}: {e}")

    print_table(rows)
    print()
    print(f"zoo boxes: radius {ZOO_RADIUS} around a uniform(-1, 1) center (seed {BOX_SEED}); "
          f"zoo weights seed {ZOO_SEED}. Width = mean(ub - lb) over the outputs (C = identity).")
    for n in notes:
        print(f"note: {n}")
    return 1 if any("failed" in n for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
