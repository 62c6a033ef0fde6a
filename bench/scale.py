"""Networks one rank cannot bound within a memory budget, bounded by several (issue 19).

Builds (seeded random weights) either a wide MLP 784 -> W -> W -> 10 (W = 23170: 2.07 GiB of
float32 weights, saved with ONNX external data) or a ResNet with the layout of VNN-COMP's
CIFAR-100 "ResNet-large" (CIFAR100_resnet_large.onnx, the 2022 benchmark reused in 2024:
conv 3->64, four stages of two BasicBlocks at 64, 128, 128, 256 channels with strides 1, 2, 2,
2 and 1x1 conv + BN shortcuts, BatchNorm after every conv, flatten 256x4x4, Gemm 4096->100,
ReLU, Gemm 100->100; 3,808,152 parameters, which is the count VNN-COMP lists for that file),
followed by a constant Gemm with the property's margin rows (y_0 - y_j, `--spec-rows` of
them) so CROWN's final pass has few rows. Then:

1. the planner under `--memory-budget` (per rank): `compile --memory-budget B` (its choice:
   the fewest ranks that fit), and `inspect --mode single --memory-budget B` (refused: one
   line with the smallest peak);
2. each P of `--nprocs` (1 = single mode, compiled without a budget: the budget lifted; P > 1
   = the fsdp program, and with `--modes fsdp,tp` the tp program (compiled `--mode tp
   --tp-intermediate ibp --memory-budget B --nproc max(P)`: the MLP's first two layers are
   one zone), run with `--nproc P`, the budget enforced by the ledger) and each method:
   resident, peak tracked per rank (measured and predicted), peak RSS, wall time,
   bounds_sha256; single mode under the budget is refused by the run-time guard;
3. the table in Markdown, with "= single" (bitwise, under blocked).

Intermediate bounds are by IBP (`--intermediate ibp`, the default here): CROWN intermediate
passes over these layers are (W x W) and (65,536 x 65,536) A-matrices -- the memory model
fits them only in row tiles, and their time (W^3 flops for the MLP's streamed second layer;
every neuron of every conv layer for the ResNet) is out of reach on 2 shared cores.

    python3 bench/scale.py --model mlp --width 23170 --budget 768MiB --nprocs 1,3,4
    python3 bench/scale.py --model mlp --width 23170 --budget 640MiB --nprocs 1,4 --modes tp
    python3 bench/scale.py --model resnet --budget 48MiB --nprocs 1,2,4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from onnx_graph import Graph

MIB = 1 << 20


# -- models ------------------------------------------------------------------------------------

class _Onnx(Graph):
    """onnx_graph.Graph whose initializers over EXTERNAL_BYTES go straight to one external
    data file (`path`.data), written block by block as they are drawn, so building a 2 GiB
    model holds one block in memory, not the model three times (array, proto, serialised)."""

    EXTERNAL_BYTES = 16 << 20

    def __init__(self, rng, input_shape, path):
        super().__init__(rng, input_shape)
        self.path, self.location = path, os.path.basename(path) + ".data"
        self.data = None

    def external(self, shape, blocks) -> str:
        """An initializer of `shape` whose rows come from `blocks` (arrays of whole rows)."""
        from onnx import TensorProto

        if self.data is None:
            self.data = open(os.path.join(os.path.dirname(self.path), self.location), "wb")
        self.count += 1
        name = f"c{self.count}"
        offset = self.data.tell()
        for block in blocks:
            self.data.write(np.ascontiguousarray(block, np.float32).tobytes())
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape),
                        data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self.location), ("offset", str(offset)),
                           ("length", str(self.data.tell() - offset))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self.inits.append(t)
        return name

    def normal(self, shape, fan_in):
        w = self.rng.standard_normal(shape, dtype=np.float32)
        w *= np.float32(np.sqrt(2.0 / fan_in))
        return w

    def gemm(self, x, n_in, n_out):
        if n_out * n_in * 4 > self.EXTERNAL_BYTES:
            step = max(1, self.EXTERNAL_BYTES // (4 * n_in))
            w = self.external((n_out, n_in), (self.normal((min(step, n_out - r), n_in), n_in)
                                              for r in range(0, n_out, step)))
        else:
            w = self.const(self.normal((n_out, n_in), n_in))
        return self.op("Gemm", [x, w, self.const(self.rng.normal(0, 0.01, n_out))], transB=1)

    def conv(self, x, c_in, c_out, k, stride):
        w = self.const(self.normal((c_out, c_in, k, k), c_in * k * k))
        y = self.op("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride],
                    pads=[k // 2] * 4)
        bn = [self.rng.uniform(0.5, 1.5, c_out), self.rng.normal(0, 0.1, c_out),
              self.rng.normal(0, 0.1, c_out), self.rng.uniform(0.5, 1.5, c_out)]
        return self.op("BatchNormalization", [y] + [self.const(v) for v in bn])

    def save(self, out, n_out):
        import onnx

        if self.data is not None:
            self.data.close()
        onnx.save(self.model(out, n_out, "scale"), self.path)


def _spec(b: _Onnx, y, n_out: int, rows: int) -> str:
    """The property as a last constant layer: margins y_0 - y_j for j = 1..rows."""
    C = np.zeros((rows, n_out), np.float32)
    C[:, 0] = 1
    C[np.arange(rows), np.arange(1, rows + 1)] = -1
    return b.op("Gemm", [y, b.const(C), b.const(np.zeros(rows))], transB=1)


def build_mlp(path: str, width: int, rows: int, seed: int = 0) -> tuple[int, ...]:
    b = _Onnx(np.random.default_rng(seed), (784,), path)
    h = b.op("Relu", [b.gemm("x", 784, width)])
    h = b.op("Relu", [b.gemm(h, width, width)])
    y = _spec(b, b.gemm(h, width, 10), 10, rows)
    b.save(y, rows)
    return (784,)


def build_resnet_large(path: str, rows: int, seed: int = 0) -> tuple[int, ...]:
    b = _Onnx(np.random.default_rng(seed), (3, 32, 32), path)
    h = b.op("Relu", [b.conv("x", 3, 64, 3, 1)])
    c = 64
    for width, stride in ((64, 1), (128, 2), (128, 2), (256, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            r = b.op("Relu", [b.conv(h, c, width, 3, s)])
            r = b.conv(r, width, width, 3, 1)
            short = h if (s == 1 and c == width) else b.conv(h, c, width, 1, s)
            h = b.op("Relu", [b.op("Add", [r, short])])
            c = width
    h = b.op("Flatten", [h], axis=1)
    h = b.op("Relu", [b.gemm(h, 256 * 4 * 4, 100)])
    y = _spec(b, b.gemm(h, 100, 100), 100, rows)
    b.save(y, rows)
    return (3, 32, 32)


# -- runs --------------------------------------------------------------------------------------

def _cli(args, timeout=7200):
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "shardbound", *args], capture_output=True,
                       text=True, timeout=timeout)
    return p, time.perf_counter() - start


def _box(path, shape, eps, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, size=int(np.prod(shape)))
    with open(path, "w") as f:
        json.dump({"lower": (x - eps).tolist(), "upper": (x + eps).tolist()}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "resnet"), default="mlp")
    ap.add_argument("--width", type=int, default=23170, help="MLP hidden width")
    ap.add_argument("--spec-rows", type=int, default=4)
    ap.add_argument("--budget", default="768MiB", help="--memory-budget per rank")
    ap.add_argument("--nprocs", default="1,4")
    ap.add_argument("--methods", default="crown,alpha-crown")
    ap.add_argument("--modes", default="fsdp", help="sharded modes run for P > 1: fsdp, tp")
    ap.add_argument("--intermediate", default="ibp", choices=("ibp", "crown"))
    ap.add_argument("--eps", type=float, default=1 / 255)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="keep the models and programs here")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the model already in --workdir (same options) instead of building")
    ap.add_argument("--skip-single-plan", action="store_true",
                    help="do not ask the planner for single mode (one more model import)")
    args = ap.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="shardbound-scale-")
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, f"{args.model}.onnx")
    t0 = time.perf_counter()
    if args.model == "mlp":
        name = f"MLP 784-{args.width}-{args.width}-10"
        build, shape = (lambda: build_mlp(model, args.width, args.spec_rows)), (784,)
    else:
        name = "ResNet-large (CIFAR-100 layout)"
        build, shape = (lambda: build_resnet_large(model, args.spec_rows)), (3, 32, 32)
    if not (args.reuse and os.path.exists(model)):
        build()
    print(f"# built {name} in {time.perf_counter() - t0:.1f} s -> {model}", flush=True)
    box = os.path.join(work, "box.json")
    _box(box, shape, args.eps)
    methods = args.methods.split(",")
    planned_for = "alpha-crown" if "alpha-crown" in methods else methods[0]
    common = ["--summation", "blocked", "--intermediate", args.intermediate,
              "--max-elements", str(1 << 30), "--method", planned_for, "--quiet"]
    fsdp_dir, single_dir = os.path.join(work, "fsdp"), os.path.join(work, "single")
    tp_dir = os.path.join(work, "tp")
    nprocs = [int(p) for p in args.nprocs.split(",")]
    modes = args.modes.split(",")
    lines = []
    if not args.skip_single_plan:
        p, dt = _cli(["inspect", model, "--mode", "single", "--memory-budget", args.budget,
                      *[c for c in common if c != "--quiet"]])
        lines.append(f"planner, --mode single: {(p.stderr or p.stdout).strip().splitlines()[-1]}"
                     f" (exit {p.returncode}, {dt:.0f} s)")
        print("#", lines[-1], flush=True)
    if "tp" in modes and any(P > 1 for P in nprocs):
        p, dt = _cli(["compile", model, "-o", tp_dir, "--mode", "tp", "--tp-intermediate", "ibp",
                      "--memory-budget", args.budget, "--nproc", str(max(nprocs)),
                      *[c for c in common if c != "--quiet"]])
        if p.returncode != 0:
            print(p.stderr.strip())
            return p.returncode
        plan = [ln for ln in p.stdout.splitlines() if ln.startswith("plan:")]
        lines.append(f"planner, --mode tp (compile, {dt:.0f} s): "
                     f"{plan[-1] if plan else p.stdout.strip()}")
        print("#", lines[-1], flush=True)
    if "fsdp" in modes and any(P > 1 for P in nprocs):
        p, dt = _cli(["compile", model, "-o", fsdp_dir, "--memory-budget", args.budget,
                      *[c for c in common if c != "--quiet"]])
        if p.returncode != 0:
            print(p.stderr.strip())
            return p.returncode
        plan = [ln for ln in p.stdout.splitlines() if ln.startswith("plan:")]
        lines.append(f"planner (compile, {dt:.0f} s): {plan[-1] if plan else p.stdout.strip()}")
        print("#", lines[-1], flush=True)
        with open(os.path.join(fsdp_dir, "plan.json")) as f:
            planned = json.load(f)
        if planned["mode"] != "fsdp":       # the planner chose single: compile fsdp as well
            p, _ = _cli(["compile", model, "-o", fsdp_dir, "--mode", "fsdp",
                         "--memory-budget", args.budget, "--nproc", str(max(nprocs)), *common])
    if 1 in nprocs:
        p, dt = _cli(["compile", model, "-o", single_dir, "--mode", "single", *common])
        if p.returncode != 0:
            print(p.stderr.strip())
            return p.returncode
        print(f"# compiled single in {dt:.0f} s", flush=True)
    rows, single_sha = [], {}
    runs = [(P, "single" if P == 1 else mode) for P in nprocs for mode in
            (["single"] if P == 1 else modes)]
    for method in methods:
        for P, mode in runs:
            d = {"single": single_dir, "fsdp": fsdp_dir, "tp": tp_dir}[mode]
            out = os.path.join(work, f"run_{method}_{mode}_{P}.json")
            cmd = ["run", d, "--box", box, "--json", out, "--method", method,
                   "--threads", str(args.threads), "--quiet", "--collective-timeout", "3600"]
            if P > 1:
                cmd += ["--nproc", str(P)]
            p, dt = _cli(cmd)
            if p.returncode != 0:
                rows.append((method, P, None, dt, (p.stderr or "").strip()[:300], mode))
                print(f"# {method} {mode} P={P}: exit {p.returncode}: "
                      f"{p.stderr.strip()[:300]}", flush=True)
                continue
            with open(out) as f:
                result = json.load(f)
            if P == 1:
                single_sha[method] = result["bounds_sha256"]
            rows.append((method, P, result, dt, "", mode))
            m = result["memory"]
            print(f"# {method} {mode} P={P}: peak {m['peak_tracked_bytes'] / MIB:.1f} MiB "
                  f"(predicted {(m['predicted_peak_tracked_bytes'] or 0) / MIB:.1f}), "
                  f"rss {m['peak_rss_bytes'] / MIB:.0f} MiB, {dt:.1f} s", flush=True)
        if 1 in nprocs:                     # single mode under the budget: the guard refuses
            p, dt = _cli(["run", single_dir, "--box", box, "--method", method, "--quiet",
                          "--memory-budget", args.budget])
            lines.append(f"single, {method}, run --memory-budget {args.budget}: exit "
                         f"{p.returncode}: {p.stderr.strip()[:400]}")
            print("#", lines[-1], flush=True)
    print()
    print(f"{name}, budget {args.budget} per rank (planned for {planned_for}), intermediate "
          f"bounds {args.intermediate}, {args.spec_rows} spec rows, eps {args.eps:g}, "
          f"threads {args.threads}:")
    print()
    print("| method | mode | P | resident MiB | peak tracked MiB | predicted MiB | x single | "
          "peak RSS MiB | bound s | wall s | bounds = single |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    base = {}
    for method, P, result, dt, err, mode in rows:
        if result is None:
            print(f"| {method} | {mode} | {P} | - | - | - | - | - | - | "
                  f"{dt:.1f} | {err} |")
            continue
        m = result["memory"]
        peak = m["peak_tracked_bytes"]
        if P == 1:
            base[method] = peak
        ratio = f"{peak / base[method]:.3f}" if method in base else "-"
        same = ("-" if method not in single_sha else
                "yes" if result["bounds_sha256"] == single_sha[method] else "NO")
        pred = m.get("predicted_peak_tracked_bytes")
        print(f"| {method} | {result['mode']} | {P} | {m['resident_param_bytes'] / MIB:.2f} | "
              f"{peak / MIB:.2f} | {'-' if pred is None else f'{pred / MIB:.2f}'} | {ratio} | "
              f"{m['peak_rss_bytes'] / MIB:.0f} | {result['seconds']:.1f} | {dt:.1f} | {same} |")
    print()
    for line in lines:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
