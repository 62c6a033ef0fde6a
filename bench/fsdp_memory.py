"""FSDP memory benchmark: resident weights, tracked peak and peak RSS, single mode vs fsdp.

Usage:
    python bench/fsdp_memory.py [--widths 784-4096-4096-4096-10] [--nprocs 1,2,4]
                                [--method crown|ibp] [--models mlp,cnn] [--seed 0] [--eps 0.01]

Two networks are built in code with onnx.helper (weights fixed by --seed):

- mlp: a wide MLP, Gemm (transB=1) + Relu per hidden layer, widths from --widths
  (default 784-4096-4096-4096-10, about 147 MB of float32 weights);
- cnn: input 3x32x32, Conv 3->32 3x3 stride 2 pad 1, Relu, Conv 32->64 3x3 stride 2 pad 1,
  Relu, Flatten, Gemm 4096->512, Relu, Gemm 512->10 (about 8 MiB of weights, almost all in
  the first Gemm). The first conv has stride 2 on purpose: with stride 1 (32x32x32 = 32768
  ReLU inputs, then Gemm 16384->512) CROWN's A-matrix through the second conv is
  16384 x 32768 floats (2 GiB, twice, plus temporaries); one rank reached 12 GB RSS and the
  P=2 run was killed by the OOM killer on a 23 GB machine after more than 5 minutes.

Each is compiled in single and in fsdp mode into a temporary directory, a box of radius
--eps around a seeded random point in [0, 1] is written, and `shardbound run` is started
through subprocess (`sys.executable -m shardbound.compiler.cli run ...`, --threads 1) once in
single mode (one process) and once per P in --nprocs in fsdp mode. Per run the table shows
the memory report of OUT.json (each figure the max over ranks): resident weight bytes, the
peak of all tracked bytes (weights, gathered weights, CROWN A-matrices, bounds) and the peak
RSS from the OS; the bound time (OUT.json `seconds`) and the wall time of the whole process
(start-up, loading, rendezvous included); each as a ratio to single mode; and whether
bounds_sha256 equals single mode's (fsdp is meant to reproduce single mode bit for bit).

Notes on reading the numbers:
- P ranks each run with one thread; on a 2-core machine P=4 oversubscribes the cores, so its
  times measure contention as much as fsdp.
- Peak RSS includes the Python interpreter, torch and the safetensors file mapping of each
  rank (a few hundred MiB that do not shrink with P), so its cut is smaller than the cut in
  tracked bytes.
- Peak RSS is `ru_maxrss` (runtime/ledger.py), and Linux copies the parent's RSS high-water
  mark into a child at fork and keeps it across exec: a run started from a process that
  once held 1.4 GB reports at least 1.4 GB. So this driver stays small: each model is built
  and compiled in a child process (`--prepare`, internal), and the driver prints its own peak
  RSS (the floor every run inherits) at the end. (In fsdp with P > 1 the ranks inherit from
  the `shardbound run` launcher, which never loads the weights, so they are not affected.)
- The last lines compare the measured cuts at P=2 with the published anchor for FSDP.

CROWN on the default 4096-wide MLP, measured on the 2-core development machine (shared, one
thread per rank): bound time 14 s single, 11 s fsdp P=1, 24 s P=2, 44 s P=4; the whole
default run (both models) takes about 3 minutes. If that is too slow for a machine, pass a
narrower --widths such as 784-2048-2048-2048-10.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

OPSET = 13
MIB = 1024.0 * 1024.0
ANCHOR = "published FSDP (P=2): resident weight memory cut 80-90%, peak memory cut 34-39%"


# ----------------------------------------------------------------------------- models

class _Graph:
    """A minimal onnx.helper graph builder (one float input `x`, one output)."""

    def __init__(self, rng, input_shape):
        self.rng = rng
        self.input_shape = tuple(input_shape)
        self.nodes, self.inits = [], []
        self.count = 0

    def const(self, array) -> str:
        import numpy as np
        from onnx import numpy_helper

        self.count += 1
        name = f"c{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    def op(self, op_type, inputs, **attrs) -> str:
        from onnx import helper

        self.count += 1
        out = f"t{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out],
                                           name=f"{op_type.lower()}{self.count}", **attrs))
        return out

    def weight(self, *shape):
        import numpy as np

        fan_in = int(np.prod(shape[1:]))
        return self.rng.normal(0, 1.0 / np.sqrt(fan_in), size=shape).astype(np.float32)

    def bias(self, n):
        import numpy as np

        return self.rng.normal(0, 0.1, size=(n,)).astype(np.float32)

    def gemm(self, x, n_in, n_out) -> str:
        return self.op("Gemm", [x, self.const(self.weight(n_out, n_in)),
                                self.const(self.bias(n_out))], transB=1)

    def conv(self, x, c_in, c_out, k, stride, pad) -> str:
        return self.op("Conv", [x, self.const(self.weight(c_out, c_in, k, k)),
                                self.const(self.bias(c_out))],
                       kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)

    def build(self, out: str, n_out: int):
        import onnx
        from onnx import TensorProto, helper

        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, *self.input_shape])
        y = helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, n_out])
        graph = helper.make_graph(self.nodes, "fsdp_memory", [x], [y], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def build_mlp(rng, widths):
    g = _Graph(rng, (widths[0],))
    h = "x"
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        h = g.gemm(h, n_in, n_out)
        if i < len(widths) - 2:
            h = g.op("Relu", [h])
    return g.build(h, widths[-1]), g.input_shape


def build_cnn(rng):
    g = _Graph(rng, (3, 32, 32))
    h = g.op("Relu", [g.conv("x", 3, 32, 3, 2, 1)])      # 32x16x16
    h = g.op("Relu", [g.conv(h, 32, 64, 3, 2, 1)])       # 64x8x8
    h = g.op("Flatten", [h], axis=1)
    h = g.op("Relu", [g.gemm(h, 64 * 8 * 8, 512)])
    return g.build(g.gemm(h, 512, 10), 10), g.input_shape


# ----------------------------------------------------------------------------- runs

def prepare(name: str, mdir: str, args) -> None:
    """In a child process (see the module docstring): build the ONNX model, compile it in
    single and fsdp mode, write the box and meta.json (total weight bytes)."""
    import numpy as np
    import onnx
    from safetensors import safe_open

    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    rng = np.random.default_rng(args.seed)
    model, input_shape = build_mlp(rng, args.widths) if name == "mlp" else build_cnn(rng)
    onnx_path = os.path.join(mdir, "model.onnx")
    onnx.save(model, onnx_path)
    del model
    for mode in ("single", "fsdp"):
        compile_model(onnx_path, os.path.join(mdir, mode),
                      PassOptions(mode=mode, method=args.method))
    center = np.random.default_rng(args.seed + 1).uniform(0.0, 1.0, size=int(np.prod(input_shape)))
    with open(os.path.join(mdir, "box.json"), "w", encoding="utf-8") as f:
        json.dump({"lower": (center - args.eps).tolist(), "upper": (center + args.eps).tolist()}, f)
    total = 0
    with safe_open(os.path.join(mdir, "single", "weights.safetensors"), framework="pt") as f:
        for k in f.keys():
            total += int(np.prod(f.get_slice(k).get_shape(), dtype=np.int64)) * 4
    with open(os.path.join(mdir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({"weight_bytes": total}, f)


def run_once(program_dir, box, out_json, nproc, method, timeout) -> dict:
    cmd = [sys.executable, "-m", "shardbound.compiler.cli", "run", program_dir, "--box", box,
           "--json", out_json, "--nproc", str(nproc), "--threads", "1", "--method", method,
           "--timeout", str(timeout), "--quiet"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} exited with code {proc.returncode}:\n"
                 f"{proc.stdout}{proc.stderr}")
    with open(out_json, encoding="utf-8") as f:
        result = json.load(f)
    result["process_seconds"] = wall
    return result


def bench_model(name, args, argv, work) -> None:
    mdir = os.path.join(work, name)
    os.makedirs(mdir)
    print(f"# {name}: building and compiling ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--prepare", name, mdir],
                   check=True)
    dirs = {mode: os.path.join(mdir, mode) for mode in ("single", "fsdp")}
    box = os.path.join(mdir, "box.json")
    with open(os.path.join(mdir, "meta.json"), encoding="utf-8") as f:
        total = json.load(f)["weight_bytes"]

    runs = [("single", 1)] + [("fsdp", p) for p in args.nprocs]
    rows = []
    for i, (mode, p) in enumerate(runs):
        print(f"# {name}: {mode} P={p} ...", file=sys.stderr, flush=True)
        out = os.path.join(mdir, f"out_{i}.json")
        rows.append((mode, p, run_once(dirs[mode], box, out, p, args.method, args.timeout)))

    base = rows[0][2]
    print(f"\n### {name} ({args.method}): {model_desc(name, args)}; "
          f"total weight bytes {total} ({total / MIB:.2f} MiB)\n")
    print("| mode | P | resident weights MiB | x single | peak tracked MiB | x single "
          "| peak RSS MiB | x single | bound s | x single | process s | x single "
          "| bounds = single |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")

    def pair(r, key, scale=1.0, fmt=".2f"):
        v, b = r_get(r, key), r_get(base, key)
        return f"{v / scale:{fmt}} | {v / b:.3f}" if b else f"{v / scale:{fmt}} | -"

    for mode, p, r in rows:
        same = "yes" if r["bounds_sha256"] == base["bounds_sha256"] else "**NO**"
        print(f"| {mode} | {p} | {pair(r, 'resident_param_bytes', MIB)} "
              f"| {pair(r, 'peak_tracked_bytes', MIB)} | {pair(r, 'peak_rss_bytes', MIB, '.1f')} "
              f"| {pair(r, 'seconds', 1.0, '.3f')} | {pair(r, 'process_seconds', 1.0, '.2f')} "
              f"| {same} |")

    p2 = [r for mode, p, r in rows if mode == "fsdp" and p == 2]
    if p2:
        r = p2[0]

        def cut(key):
            return 100.0 * (1.0 - r_get(r, key) / r_get(base, key))

        print(f"\n{ANCHOR}; measured ({name}, fsdp P=2 vs single): resident weights cut "
              f"{cut('resident_param_bytes'):.1f}%, peak tracked cut "
              f"{cut('peak_tracked_bytes'):.1f}%, peak RSS cut {cut('peak_rss_bytes'):.1f}%")
    sys.stdout.flush()


def r_get(r: dict, key: str) -> float:
    return float(r[key] if key in ("seconds", "process_seconds") else r["memory"][key])


def model_desc(name, args) -> str:
    if name == "mlp":
        return "MLP " + "-".join(str(w) for w in args.widths)
    return "CNN 3x32x32, conv 3->32 s2 p1, conv 32->64 s2 p1, gemm 4096->512->10"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="784-4096-4096-4096-10",
                        help="MLP layer widths, input first (default 784-4096-4096-4096-10)")
    parser.add_argument("--nprocs", default="1,2,4", help="fsdp world sizes (default 1,2,4)")
    parser.add_argument("--method", choices=("crown", "ibp"), default="crown")
    parser.add_argument("--models", default="mlp,cnn", help="comma list of mlp, cnn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eps", type=float, default=0.01, help="box radius (default 0.01)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="collective timeout of each run in seconds (default 900)")
    parser.add_argument("--prepare", nargs=2, metavar=("MODEL", "DIR"), help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split("-")]
    args.nprocs = [int(p) for p in args.nprocs.split(",")]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in ("mlp", "cnn"):
            parser.error(f"unknown model {m!r}")

    if args.prepare:
        prepare(args.prepare[0], args.prepare[1], args)
        return
    print(f"# shardbound fsdp memory benchmark: method {args.method}, threads 1, "
          f"nprocs {args.nprocs}, seed {args.seed}, eps {args.eps}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="fsdp_memory_") as work:
        for name in models:
            bench_model(name, args, argv, work)
    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(f"\n(peak RSS of this driver process, inherited by every run as a floor of its "
          f"ru_maxrss: {floor:.1f} MiB)")


if __name__ == "__main__":
    main()
