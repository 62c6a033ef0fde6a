"""What `--soundness real|float32` costs on one instance against the default mode: the same
`shardbound verify` command line per mode, started together (side by side, so both see the
same load), CPU seconds of each process (user + system, its children included) and wall
seconds (issue 17).

    python3 bench/soundness_cost.py --onnx NET.onnx --vnnlib PROP.vnnlib [--timeout 300]
                                    [--summation fast] [--modes default,real] [--threads T]

Each mode runs `shardbound verify ONNX VNNLIB --timeout T --summation S [--soundness M]
--json OUT` in a fresh process; the table has the verdict, the stage that decided it,
CPU and wall seconds and CPU over the default mode's. CPU time is less sensitive than wall
time to a shared machine's load, not immune to it: the load average is printed before and
after. Timeouts are wall clock, so on a loaded machine a mode may time out whose CPU time
would fit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--onnx", required=True)
    p.add_argument("--vnnlib", required=True)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--summation", default="fast")
    p.add_argument("--modes", default="default,real")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--work", default=None)
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="soundness_cost_")
    modes = args.modes.split(",")
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    procs = {}
    for m in modes:
        out = os.path.join(work, f"{m}.json")
        cmd = [sys.executable, "-m", "shardbound", "verify", args.onnx, args.vnnlib,
               "--timeout", str(args.timeout), "--summation", args.summation,
               "--json", out, "-o", os.path.join(work, f"program_{m}"), "-q"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if m != "default":
            cmd += ["--soundness", m]
        print("$", " ".join(cmd[2:]))
        procs[m] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
                    time.monotonic(), out)
    rows = {}
    for m, (proc, started, out) in procs.items():
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        cpu = usage.ru_utime + usage.ru_stime
        verdict, decided = "error", (err[-1] if err else "")
        if os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                rep = json.load(f)
            verdict = rep.get("verdict", "?")
            decided = (rep.get("decided_by") or {}).get("label", "-")
        rows[m] = (verdict, decided, cpu, wall)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    base = rows.get("default", (None, None, None, None))[2]
    print("| mode | verdict | decided by | CPU s | wall s | CPU / default |")
    print("|---|---|---|---:|---:|---:|")
    for m, (verdict, decided, cpu, wall) in rows.items():
        ratio = f"{cpu / base:.2f}" if base else "-"
        print(f"| {m} | {verdict} | {decided} | {cpu:.1f} | {wall:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
