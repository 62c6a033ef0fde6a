"""How late `verify --timeout T` answers, per mode, on properties it cannot settle in time.

    python3 bench/verify_timeout.py [--timeout 10] [--modes single,fsdp,tp] [--models mlp,cnn]

Models (built with tests/zoo.py, seeded): `mlp` 20-48-48-48-2 on [-1, 1]^20 with
y0 - y1 <= -2 (no attack reaches it, ReLU branch and bound needs far longer than T); `cnn`
3x24x24 -> conv 8 (3x3) -> conv 8 (3x3, stride 2) -> gemm 10 on a wide box, where one CROWN
pass over a conv layer is a long computation of its own (the watchdog's case). Each run is
a fresh process, timed from its start as a harness times it: when the result file appears
and when the process exits, against T. `over` is exit time - T (negative: early).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def write_property(path, lower, upper, row, d):
    lines = [f"(declare-const X_{i} Real)" for i in range(len(lower))]
    lines += [f"(declare-const Y_{j} Real)" for j in range(len(row))]
    for i, (lo, hi) in enumerate(zip(lower, upper)):
        lines += [f"(assert (>= X_{i} {float(lo)!r}))", f"(assert (<= X_{i} {float(hi)!r}))"]
    terms = " ".join(f"(* {float(c)!r} Y_{j})" for j, c in enumerate(row) if c != 0)
    lines.append(f"(assert (<= (+ {terms} 0.0) {float(d)!r}))")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def hard_threshold(path, n, row, tmp) -> float:
    """A threshold below what PGD reaches but above CROWN's bound: neither an attack nor the
    first bounds settle it."""
    import torch

    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    compile_model(path, os.path.join(tmp, "probe"), PassOptions(summation="fast"))
    v = load(os.path.join(tmp, "probe"))
    c = torch.tensor(row)
    x = (torch.rand(64, n, generator=torch.Generator().manual_seed(0)) * 2 - 1).requires_grad_()
    for _ in range(60):
        m = v.network.forward(x.reshape(-1, *v.input_shape)).reshape(64, -1) @ c
        (g,) = torch.autograd.grad(m.sum(), x)
        x = (x - 0.05 * g.sign()).clamp(-1, 1).detach().requires_grad_()
    with torch.no_grad():
        low = float((v.network.forward(x.reshape(-1, *v.input_shape)).reshape(64, -1) @ c).min())
    lb, _ = v.bounds(-torch.ones(n), torch.ones(n), C=c.reshape(1, -1))
    return low - 0.1 * (low - float(lb))


def build(name: str, tmp: str) -> tuple[str, str]:
    import onnx

    import zoo

    if name == "mlp":
        model, _ = zoo.mlp(np.random.default_rng(7), sizes=(20, 48, 48, 48, 2))
        n, row, d = 20, [1.0, -1.0], -2.0
    else:
        b = zoo.Builder(np.random.default_rng(3), (3, 24, 24))
        h = b.relu(b.op("Conv", ["x", b.const(b.weight(8, 3, 3, 3)),
                                 b.const(np.zeros(8, np.float32))], pads=[1, 1, 1, 1]))
        h = b.relu(b.op("Conv", [h, b.const(b.weight(8, 8, 3, 3)),
                                 b.const(np.zeros(8, np.float32))], pads=[1, 1, 1, 1],
                        strides=[2, 2]))
        h = b.op("Flatten", [h], axis=1)
        model = b.build(b.gemm(h, 8 * 12 * 12, 10))
        n, row = 3 * 24 * 24, [1.0, -1.0] + [0.0] * 8
    path = os.path.join(tmp, f"{name}.onnx")
    onnx.save(model, path)
    if name != "mlp":
        d = hard_threshold(path, n, row, tmp)
    prop = os.path.join(tmp, f"{name}.vnnlib")
    write_property(prop, -np.ones(n), np.ones(n), row, d)
    return path, prop


def run(model, prop, mode, timeout, tmp):
    result = os.path.join(tmp, "result.txt")
    if os.path.exists(result):
        os.unlink(result)
    cmd = [sys.executable, "-m", "shardbound.compiler.cli", "verify", model, prop, "--timeout",
           f"{timeout:g}", "--result", result, "-q"]
    if mode != "single":
        cmd += ["--mode", mode, "--nproc", "2"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    written = None
    while proc.poll() is None:
        if written is None and os.path.exists(result):
            written = time.monotonic() - start
        time.sleep(0.01)
    end = time.monotonic() - start
    if written is None and os.path.exists(result):
        written = end
    verdict = open(result).read().split()[0] if os.path.exists(result) else "(none)"
    return verdict, written, end, proc.returncode, proc.stderr.read().strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--modes", default="single,fsdp,tp")
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print("| model | mode | timeout (s) | verdict | result at (s) | exit at (s) | over (s) | rc |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model, prop = build(name, tmp)
            for mode in args.modes.split(","):
                for _ in range(args.repeat):
                    verdict, written, end, rc, err = run(model, prop, mode, args.timeout, tmp)
                    w = f"{written:.2f}" if written is not None else "-"
                    print(f"| {name} | {mode} | {args.timeout:g} | {verdict} | {w} | {end:.2f} | "
                          f"{end - args.timeout:+.2f} | {rc} |", flush=True)
                    if err:
                        print(f"|  | stderr: {err[-150:]} | | | | | | |", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
