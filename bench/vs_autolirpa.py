"""CROWN and alpha-CROWN time, tightness and memory: shardbound (`fast`, `blocked`) beside auto_LiRPA.

    python bench/vs_autolirpa.py [--lirpa PATH] [--lirpa-python PY] [--lirpa-compat FILE]
                                 [--repeat 3] [--models acasxu,cnn] [--methods crown,alpha-crown]
                                 [--one-bound]

Models, built in code with onnx.helper (weights seeded, so every run and every tool sees the
same network): `acasxu` (5-50x6-5, ACAS Xu's shape), `mnist256x2` (784-256-256-10), `mlp1024`
(784-1024x3-10), `mlp4096` (784-4096x3-10), `cnn` (3x32x32: conv 32 3x3 s2, conv 64 3x3 s2,
fc 512, fc 10), `resnet` (3x32x32: conv 16 3x3 s2, two residual blocks of two 3x3 convs, fc
100, fc 10). One box per model (radius `EPS` around a seeded point) and one spec: the rows
y_0 - y_j (j != 0) of a robustness property.

Every (tool, model, method) runs in its own worker process with one thread
(`torch.set_num_threads(1)`); the parent asks the workers of a model for one bound each in turn,
round after round (the order rotates every round), so background load hits every tool alike.
Per row the table gives the median bound time, the median over rounds of the time relative to
auto_LiRPA's in the same round (`x auto_LiRPA`: below 1 is faster), the CPU time of a bound
(`time.process_time` around the same call: min / median over rounds) and the ratio of the
minima (`CPU x`: on a shared machine the wall time also holds the time other processes took
the core, which the CPU time leaves out), how much tighter the bound is than auto_LiRPA's (min
and max over spec rows of shardbound's lower bound minus auto_LiRPA's, and for CROWN also auto_LiRPA's
upper bound minus shardbound's: positive means tighter), and the peak memory of one bound, measured in a
worker of its own (glibc's mmap threshold fixed at 128 KiB so freed tensors leave the heap):
peak RSS (VmHWM, reset through /proc/self/clear_refs after a warm-up bound) minus the RSS
then (weights, caches made by the warm-up such as shardbound's transposed weights, the
interpreter and one-time lazy set-up are not counted; the bound's own temporaries are). alpha-CROWN: 20 iterations in
both tools; auto_LiRPA's alpha-CROWN (alphas per relaxed op and start node) for both rows,
shardbound's `alpha-crown` (the final pass's alphas) and `full-alpha-crown`
(runtime/engine/full_alpha.py: alphas per start node too); auto_LiRPA bounds the lower side
only (its upper side would be a second optimisation), shardbound's upper side is CROWN (on
the tightened intermediate bounds for full-alpha-crown). shardbound's CROWN rows per node (how
many neurons each intermediate backward pass bounded) are printed under the table, and per
row what a timed bound cost besides its CPU time (medians): wall minus CPU time, system time,
page faults and context switches (voluntary: waits, e.g. on a thread pool; involuntary: the
core taken by another process), which is where the wall-clock ratio and the CPU ratio part.

`--malloc keep` (the default): every tool's timed worker runs with glibc keeping freed memory
for reuse (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_), the setting shardbound's runs
make themselves (runtime/program/allocator.py), so both tools are timed alike; `--malloc
default` times glibc's own behaviour (the memory workers always use their own setting).

`--one-bound` (models whose bound takes minutes, e.g. mlp4096's full alpha-CROWN): one bound per
tool in a worker of its own, tools one after another, no warm-up, its peak counted from before
that bound (one-time lazy set-up included); time and CPU columns are that one bound's.

The tiny ViT of issue 15 beside auto_LiRPA is bench/vit_autolirpa.py (auto_LiRPA bounds
the torch module there, with its own GELU op: this script's ONNX interpreter has no attention).

`--baseline PATH` (a source tree of another shardbound commit, e.g. `git archive main | tar -x
-C PATH`) adds the tools `base-fast` and `base-blocked`: that tree's compiler and runtime in
workers of their own, in the same rounds, so a change is measured before/after side by side;
the notes give each tool's bits (sha256 of its float32 lower and upper bounds) to compare.

auto_LiRPA is not a dependency: give a checkout with `--lirpa PATH` (see
../shared/oracle/README.md: it needs a venv of its own, `--lirpa-python`, and the torch-2.13
shim `lirpa_compat.py`, `--lirpa-compat`, found in ../shared/oracle by default). Without it the
auto_LiRPA columns are skipped and ratios are given relative to shardbound `fast`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from onnx_graph import Graph

MODELS = ("acasxu", "mnist256x2", "mlp1024", "mlp4096", "cnn", "resnet", "sigmoid_mlp",
          "tanh_mlp")
METHODS = ("crown", "alpha-crown", "full-alpha-crown")
EPS = {"acasxu": 0.05, "mnist256x2": 0.02, "mlp1024": 0.01, "mlp4096": 0.005, "cnn": 0.005,
       "resnet": 0.005, "sigmoid_mlp": 0.02, "tanh_mlp": 0.01}
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# ----------------------------------------------------------------------------- models
def _mlp(rng, widths, activation="Relu"):
    g = Graph(rng, (widths[0],))
    h = "x"
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        h = g.gemm(h, n_in, n_out)
        if i < len(widths) - 2:
            h = g.op(activation, [h])
    return g.build(h, widths[-1], "vs_autolirpa"), g.input_shape


def _cnn(rng):
    g = Graph(rng, (3, 32, 32))
    h = g.op("Relu", [g.conv("x", 3, 32, 3, 2, 1)])      # 32x16x16
    h = g.op("Relu", [g.conv(h, 32, 64, 3, 2, 1)])       # 64x8x8
    h = g.op("Flatten", [h], axis=1)
    h = g.op("Relu", [g.gemm(h, 64 * 8 * 8, 512)])
    return g.build(g.gemm(h, 512, 10), 10, "vs_autolirpa"), g.input_shape


def _resnet(rng):
    g = Graph(rng, (3, 32, 32))
    h = g.op("Relu", [g.conv("x", 3, 16, 3, 2, 1)])      # 16x16x16
    for _ in range(2):                                    # two residual blocks
        r = g.op("Relu", [g.conv(h, 16, 16, 3, 1, 1)])
        r = g.conv(r, 16, 16, 3, 1, 1)
        h = g.op("Relu", [g.op("Add", [h, r])])
    h = g.op("Flatten", [h], axis=1)
    h = g.op("Relu", [g.gemm(h, 16 * 16 * 16, 100)])
    return g.build(g.gemm(h, 100, 10), 10, "vs_autolirpa"), g.input_shape


def build_model(name: str, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    if name == "acasxu":
        return _mlp(rng, [5] + [50] * 6 + [5])
    if name == "mnist256x2":
        return _mlp(rng, [784, 256, 256, 10])
    if name == "mlp1024":
        return _mlp(rng, [784, 1024, 1024, 1024, 10])
    if name == "mlp4096":
        return _mlp(rng, [784, 4096, 4096, 4096, 10])
    if name == "cnn":
        return _cnn(rng)
    if name == "resnet":
        return _resnet(rng)
    if name in ("sigmoid_mlp", "tanh_mlp"):        # issue 15: smooth activations
        return _mlp(rng, [784, 256, 256, 10], activation=name.split("_")[0].capitalize())
    raise KeyError(name)


def prepare(name: str, work: str, seed: int) -> str:
    """Write DIR/model.onnx, DIR/box.json (lower, upper, spec C) for model `name`."""
    import numpy as np
    import onnx

    mdir = os.path.join(work, name)
    os.makedirs(mdir, exist_ok=True)
    model, shape = build_model(name, seed)
    onnx.save(model, os.path.join(mdir, "model.onnx"))
    n_out = model.graph.output[0].type.tensor_type.shape.dim[1].dim_value
    lo_c, hi_c = (-1.0, 1.0) if name == "acasxu" else (0.0, 1.0)
    center = np.random.default_rng(seed + 1).uniform(lo_c, hi_c, size=shape).astype(np.float32)
    C = np.zeros((n_out - 1, n_out), dtype=np.float32)
    for row, j in enumerate(range(1, n_out)):
        C[row, 0], C[row, j] = 1.0, -1.0
    with open(os.path.join(mdir, "box.json"), "w", encoding="utf-8") as f:
        json.dump({"shape": list(shape), "lower": (center - EPS[name]).reshape(-1).tolist(),
                   "upper": (center + EPS[name]).reshape(-1).tolist(), "C": C.tolist()}, f)
    return mdir


# ----------------------------------------------------------------------------- workers
def _rss_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    """Reset the process's peak RSS (VmHWM) to its current RSS and return that RSS."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return _rss_bytes("VmRSS")


def _use_tree(tree: str) -> None:
    """Import `shardbound` from the source tree `tree` (its pyproject's package-dir mapping),
    ahead of the installed one: the `base-*` tools (`--baseline`)."""
    import importlib.machinery
    import importlib.util
    import re

    with open(os.path.join(tree, "pyproject.toml"), encoding="utf-8") as f:
        mapping = dict(re.findall(r'"(shardbound[\w.]*)" = "([^"]+)"',
                                  re.search(r"package-dir = \{([^}]*)\}", f.read()).group(1)))

    class Finder:
        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            if fullname in mapping:
                where = os.path.join(tree, mapping[fullname])
                return importlib.util.spec_from_file_location(
                    fullname, os.path.join(where, "__init__.py"),
                    submodule_search_locations=[where])
            parent = fullname.rpartition(".")[0]
            if parent in mapping:
                return importlib.machinery.PathFinder.find_spec(
                    fullname, [os.path.join(tree, mapping[parent])])
            return None

    sys.meta_path.insert(0, Finder)


class _ShardboundTool:
    def __init__(self, mdir: str, order: str, box, prefix: str = "shardbound"):
        from shardbound.compiler.driver import compile_model
        from shardbound.passes.manager import PassOptions
        from shardbound.runtime import load

        out = os.path.join(mdir, f"{prefix}_{order}")
        if not os.path.isdir(out):
            compile_model(os.path.join(mdir, "model.onnx"), out, PassOptions(summation=order))
        self.verifier = load(out)
        self.box = box

    def bound(self, method: str):
        import torch

        lo, hi, C = self.box
        lb, ub = self.verifier.bounds(lo, hi, C=C, method=method)
        return lb.reshape(-1), ub.reshape(-1)

    def rows(self):
        return dict(getattr(self.verifier.network, "crown_rows", {}) or {})


class _LirpaTool:
    """auto_LiRPA on a torch module interpreted from the same ONNX file."""

    def __init__(self, mdir: str, box):
        import torch

        from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm

        lo, hi, C = box
        self.model = _torch_module(os.path.join(mdir, "model.onnx"))
        self.x = ((lo + hi) / 2).unsqueeze(0)
        self.lo, self.hi = lo.unsqueeze(0), hi.unsqueeze(0)
        self.C = C.unsqueeze(0)
        self.BoundedTensor, self.Perturbation = BoundedTensor, PerturbationLpNorm
        self.module = BoundedModule(self.model, torch.empty_like(self.x), device="cpu",
                                    bound_opts={"optimize_bound_args": {"iteration": 20}})

    def bound(self, method: str):
        import torch

        ptb = self.Perturbation(norm=float("inf"), x_L=self.lo, x_U=self.hi)
        bx = self.BoundedTensor(self.x, ptb)
        with torch.no_grad() if method == "crown" else torch.enable_grad():
            if method == "crown":
                lb, ub = self.module.compute_bounds(x=(bx,), method="CROWN", C=self.C)
            else:
                lb, ub = self.module.compute_bounds(x=(bx,), method="alpha-CROWN", C=self.C,
                                                    bound_upper=False)
        lb = lb.detach().reshape(-1)
        ub = None if ub is None else ub.detach().reshape(-1)
        return lb, ub

    def rows(self):
        return {}


def _torch_module(path: str):
    """A torch.nn.Module that evaluates the benchmark's ONNX graphs (Gemm transB=1, Conv,
    Relu, Sigmoid, Tanh, Add, Flatten): auto_LiRPA has no ONNX loader."""
    import onnx
    import torch
    from onnx import numpy_helper

    graph = onnx.load(path).graph
    inits = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in graph.initializer}

    class Interpreted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList()
            self.steps = []
            for node in graph.node:
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                if node.op_type == "Gemm":
                    w, b = inits[node.input[1]], inits[node.input[2]]
                    layer = torch.nn.Linear(w.shape[1], w.shape[0])
                    layer.weight.data, layer.bias.data = w, b
                elif node.op_type == "Conv":
                    w, b = inits[node.input[1]], inits[node.input[2]]
                    pads = attrs.get("pads", [0, 0, 0, 0])
                    layer = torch.nn.Conv2d(w.shape[1], w.shape[0], tuple(w.shape[2:]),
                                            stride=tuple(attrs.get("strides", [1, 1])),
                                            padding=(pads[0], pads[1]))
                    layer.weight.data, layer.bias.data = w, b
                elif node.op_type == "Relu":
                    layer = torch.nn.ReLU()
                elif node.op_type == "Sigmoid":
                    layer = torch.nn.Sigmoid()
                elif node.op_type == "Tanh":
                    layer = torch.nn.Tanh()
                elif node.op_type == "Flatten":
                    layer = torch.nn.Flatten()
                elif node.op_type == "Add":
                    layer = None
                else:
                    raise ValueError(f"unsupported op {node.op_type}")
                if layer is not None:
                    self.layers.append(layer)
                self.steps.append((node.op_type, list(node.input), node.output[0],
                                   len(self.layers) - 1))
            self.out = graph.output[0].name

        def forward(self, x):
            values = {graph.input[0].name: x}
            for op_type, inputs, out, index in self.steps:
                if op_type == "Add":
                    values[out] = values[inputs[0]] + values[inputs[1]]
                else:
                    values[out] = self.layers[index](values[inputs[0]])
            return values[self.out]

    return Interpreted().eval()


def worker(args) -> int:
    """One tool on one model: load, then answer `bound` requests on stdin with JSON lines."""
    import torch

    torch.set_num_threads(1)
    if args.lirpa_compat:
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.lirpa_compat)))
        __import__(os.path.splitext(os.path.basename(args.lirpa_compat))[0])
    with open(os.path.join(args.model_dir, "box.json"), encoding="utf-8") as f:
        spec = json.load(f)
    shape = tuple(spec["shape"])
    box = (torch.tensor(spec["lower"]).reshape(shape), torch.tensor(spec["upper"]).reshape(shape),
           torch.tensor(spec["C"]))
    if args.worker == "lirpa":
        tool = _LirpaTool(args.model_dir, box)
    else:
        prefix, order = args.worker.split("-", 1)
        if prefix == "base":
            _use_tree(args.baseline)
        tool = _ShardboundTool(args.model_dir, order, box,
                               "shardbound" if prefix == "sb" else "baseline")
    base = None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["do"] == "quit":
            break
        if request["do"] == "reset_peak":   # after the warm-up: lazy one-time set-up is out
            base = _reset_peak()
            print(json.dumps({"reset": True}), flush=True)
            continue
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0, c0 = time.perf_counter(), time.process_time()
        lb, ub = tool.bound(request["method"])
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        bits = hashlib.sha256(torch.cat([lb.float(), ub.float()]).numpy().tobytes()
                              if ub is not None else lb.float().numpy().tobytes()).hexdigest()
        print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "bits": bits[:16],
                          "sys_seconds": r1.ru_stime - r0.ru_stime,
                          "faults": r1.ru_minflt - r0.ru_minflt,
                          "switches": (r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw),
                          "lower": lb.tolist(),
                          "upper": None if ub is None else ub.tolist(),
                          "peak_bytes": _rss_bytes("VmHWM") - (base or 0),
                          "rows": tool.rows()}),
              flush=True)
    return 0


class _Worker:
    def __init__(self, tool: str, method: str, mdir: str, args, memory: bool = False):
        self.tool, self.method = tool, method
        python = args.lirpa_python if tool == "lirpa" else sys.executable
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if args.malloc == "keep" and not memory:
            # every tool's timed worker with the allocator setting shardbound's runs make
            # (runtime/program/allocator.py), given as glibc's own variables so that
            # auto_LiRPA's worker gets it too
            from shardbound.runtime.program.allocator import MMAP_BELOW, TRIM_ABOVE

            env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_BELOW))
            env.setdefault("MALLOC_TRIM_THRESHOLD_", str(TRIM_ABOVE))
        if memory:
            # A fixed mmap threshold: large tensors are mapped and unmapped, never kept in the
            # heap after a bound, so a bound's peak RSS is its own (every tool alike). Only
            # for the memory workers: it costs page faults that timed runs should not pay.
            env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        cmd = [python, os.path.abspath(__file__), "--worker", tool, "--model-dir", mdir]
        if tool.startswith("base-"):
            cmd += ["--baseline", args.baseline]
        if tool == "lirpa":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.lirpa,
                                                              env.get("PYTHONPATH")]))
            if args.lirpa_compat:
                cmd += ["--lirpa-compat", args.lirpa_compat]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)
        self._read()

    def _read(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.tool} ({self.method}) exited "
                                   f"(code {self.proc.wait()})")
            if line.startswith("{"):        # auto_LiRPA prints notes of its own to stdout
                return json.loads(line)

    def bound(self):
        self.proc.stdin.write(json.dumps({"do": "bound", "method": self.method}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def reset_peak(self):
        self.proc.stdin.write(json.dumps({"do": "reset_peak"}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"do": "quit"}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        self.proc.wait()


# ----------------------------------------------------------------------------- driver
def _tighter(sb: dict, ref: dict, method: str) -> tuple[float, float]:
    """(min, max) over spec rows of how much tighter shardbound is than the reference."""
    diffs = [a - b for a, b in zip(sb["lower"], ref["lower"])]
    if method == "crown" and sb["upper"] is not None and ref["upper"] is not None:
        diffs += [b - a for a, b in zip(sb["upper"], ref["upper"])]
    return min(diffs), max(diffs)


def _row(name, method, tool, is_reference, tighter, seconds, ratio, cpu, cpu_x, peak) -> str:
    """One table row: wall seconds and its ratio, CPU ms (min / median of `cpu`), the CPU
    ratio, how much tighter (blank for the reference tool) and the peak in MiB."""
    tight = "" if is_reference else f"{tighter[0]:+.2e} / {tighter[1]:+.2e}"
    return (f"| {name} | {method} | {tool} | {seconds:.4f} | {ratio:.2f} | "
            f"{min(cpu) * 1e3:.2f} / {statistics.median(cpu) * 1e3:.2f} | {cpu_x:.2f} | "
            f"{tight} | {peak / 2 ** 20:.1f} |")


def _one_bound_rows(name, mdir, tools, method, reference, args):
    """`--one-bound`: each tool bounds once, in a worker of its own (the memory workers' mmap
    threshold), its peak RSS reset before that bound (so lazy one-time set-up counts in the
    peak), tools one after another. For models where one bound takes minutes (mlp4096's full
    alpha-CROWN: ~6 CPU min per tool), where the default's four bounds per tool take hours."""
    got = {}
    for t in tools:
        w = _Worker(t, method, mdir, args, memory=True)
        try:
            w.reset_peak()
            got[t] = w.bound()
        finally:
            w.close()
    rows = []
    for t in tools:
        g, ref = got[t], got[reference]
        rows.append(_row(name, method, t, t == reference, _tighter(g, ref, method), g["seconds"],
                         g["seconds"] / ref["seconds"], [g["cpu_seconds"]],
                         g["cpu_seconds"] / ref["cpu_seconds"], g["peak_bytes"]))
    notes = [f"{name} {method} {t}: one bound, bits {got[t]['bits']}" for t in tools]
    return rows, notes


def bench_model(name: str, mdir: str, tools: list[str], methods: list[str], args):
    reference = "lirpa" if "lirpa" in tools else "sb-fast"
    rows, notes = [], []
    for method in methods:
        if args.one_bound:
            one_rows, one_notes = _one_bound_rows(name, mdir, tools, method, reference, args)
            rows, notes = rows + one_rows, notes + one_notes
            continue
        peaks = {}
        for t in tools:                             # peak memory: a worker of its own
            w = _Worker(t, method, mdir, args, memory=True)
            try:
                w.bound()                           # warm-up: lazy one-time set-up is out
                w.reset_peak()
                peaks[t] = w.bound()["peak_bytes"]
            finally:
                w.close()
        workers = [_Worker(t, method, mdir, args) for t in tools]
        try:
            for w in workers:                       # warm-up, not timed
                w.bound()
            runs = {t: [] for t in tools}
            got = {t: [] for t in tools}
            last = {}
            for r in range(args.repeat):
                order = workers[r % len(workers):] + workers[:r % len(workers)]
                for w in order:
                    last[w.tool] = w.bound()
                    runs[w.tool].append(last[w.tool]["seconds"])
                    got[w.tool].append(last[w.tool])
        finally:
            for w in workers:
                w.close()
        cpu = {t: [g["cpu_seconds"] for g in got[t]] for t in tools}
        for t in tools:
            ratio = statistics.median(a / b for a, b in zip(runs[t], runs[reference]))
            rows.append(_row(name, method, t, t == reference,
                             _tighter(last[t], last[reference], method),
                             statistics.median(runs[t]), ratio, cpu[t],
                             min(cpu[t]) / min(cpu[reference]), peaks[t]))
            notes.append(f"{name} {method} {t}: per bound (medians) wall - CPU "
                         f"{statistics.median(a - b for a, b in zip(runs[t], cpu[t])) * 1e3:.2f}"
                         f" ms, sys {statistics.median(g['sys_seconds'] for g in got[t]) * 1e3:.2f}"
                         f" ms, page faults {statistics.median(g['faults'] for g in got[t]):.0f}, "
                         f"context switches voluntary / involuntary "
                         f"{statistics.median(g['switches'][0] for g in got[t]):.0f} / "
                         f"{statistics.median(g['switches'][1] for g in got[t]):.0f}, "
                         f"bits {last[t]['bits']}")
            if last[t]["rows"] and method == "crown":
                notes.append(f"{name} {t}: CROWN rows per node "
                             + ", ".join(f"{k} {v}" for k, v in last[t]["rows"].items()))
    return rows, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lirpa", metavar="PATH", help="an auto_LiRPA checkout (else skipped)")
    ap.add_argument("--lirpa-python", default=sys.executable, metavar="PY",
                    help="the python of auto_LiRPA's venv (default: this one)")
    ap.add_argument("--lirpa-compat", metavar="FILE",
                    help="lirpa_compat.py (default: ../shared/oracle/lirpa_compat.py if present)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds (after one warm-up)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of crown, alpha-crown, full-alpha-crown")
    ap.add_argument("--tools", default="sb-fast,sb-blocked",
                    help="shardbound tools (sb-fast, sb-blocked); lirpa is added with --lirpa")
    ap.add_argument("--baseline", metavar="PATH",
                    help="a source tree of another shardbound commit: adds base-fast and "
                         "base-blocked (before/after in the same rounds)")
    ap.add_argument("--one-bound", action="store_true",
                    help="one bound per tool, no warm-up, peak RSS from that bound (models "
                         "whose bound takes minutes); --repeat is ignored")
    ap.add_argument("--malloc", choices=("keep", "default"), default="keep",
                    help="keep: every tool's timed worker keeps freed memory for reuse, as "
                         "shardbound's runs do (runtime/program/allocator.py); default: "
                         "glibc's own behaviour for every tool")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", help="keep models and compiled programs here (default: temporary)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    models = [m for m in args.models.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    tools = [t for t in args.tools.split(",") if t]
    if args.baseline:
        args.baseline = os.path.abspath(args.baseline)
        tools += [t.replace("sb-", "base-", 1) for t in tools if t.startswith("sb-")]
    if args.lirpa:
        default_compat = os.path.join(REPO, "..", "shared", "oracle", "lirpa_compat.py")
        if args.lirpa_compat is None and os.path.isfile(default_compat):
            args.lirpa_compat = default_compat
        tools.append("lirpa")
    import torch

    ref = "auto_LiRPA" if args.lirpa else "shardbound fast"
    print(f"# shardbound vs auto_LiRPA: torch {torch.__version__}, 1 thread per tool, "
          f"{args.repeat} round-robin rounds after a warm-up, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} at start; timed workers' malloc: "
          f"{args.malloc}\n")
    print(f"| model | method | tool | time s | x {ref} | CPU ms min / median | CPU x (min) | "
          f"tighter than {ref} (min / max) | peak MiB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    all_notes = []
    with tempfile.TemporaryDirectory(prefix="vs_autolirpa_") as tmp:
        work = args.work or tmp
        for name in models:
            mdir = prepare(name, work, args.seed)
            rows, notes = bench_model(name, mdir, tools, methods, args)
            print("\n".join(rows), flush=True)
            all_notes += notes
    print(f"\nload average {os.getloadavg()[0]:.2f} at end; eps per model "
          + ", ".join(f"{m} {EPS[m]}" for m in models))
    for note in all_notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
