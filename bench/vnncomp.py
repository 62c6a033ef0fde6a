"""Run VNN-COMP instances through vnncomp/run_instance.sh and check every answer.

    python3 bench/vnncomp.py [--instances CSV] [--only SUBSTRING] [--limit N]
                             [--timeout-scale F] [--direct] [--keep DIR]
                             [--beside OTHER_ROOT --beside-bin OTHER_VENV/bin]

Per instance it reports the wall time of the whole run (process start to exit, as a harness
measures it) against the instance's timeout, and lists every instance that ran over.

Reads `family,onnx,vnnlib,timeout_s,expected` (paths relative to the CSV; default
../shared/benchmarks/instances.csv), runs prepare_instance.sh + run_instance.sh per instance
(or `shardbound verify ... --result` with --direct), and prints a markdown table, per-family
counts and the list of WRONG answers. A WRONG answer is `unsat` where `sat` is expected, `sat`
where `unsat` is expected, or a `sat` whose counterexample does not check out: the X/Y values
of the result file are parsed, onnxruntime runs the model on X (float32, split over the
model's inputs in order and reshaped to their shapes; its outputs flattened in order), its
output must match the reported Y (max |diff| <= 1e-4 * max(1, max |y|)), X must lie in a
box of the property (1e-6 slack) and onnxruntime's output must violate one of that box's
disjuncts (C @ y <= d, no slack). Exit code 1 on any WRONG answer.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT_CSV = os.path.normpath(os.path.join(ROOT, "..", "shared", "benchmarks", "instances.csv"))
PREPARE = os.path.join(ROOT, "vnncomp", "prepare_instance.sh")
RUN = os.path.join(ROOT, "vnncomp", "run_instance.sh")
_ASSIGNMENT = re.compile(r"\(\s*([XY])_(\d+)\s+([^\s()]+)\s*\)")
Y_RTOL = 1e-4
X_TOL = 1e-6


@dataclass
class Outcome:
    name: str
    family: str
    expected: str
    verdict: str
    seconds: float
    status: str           # ok / WRONG / unsolved
    note: str = ""
    timeout: float = 0.0  # the instance's limit (scaled), against which `seconds` is judged
    cpu: float = 0.0      # CPU seconds of the run (its processes, user + system)
    prep_seconds: float = 0.0   # prepare_instance.sh's wall time (untimed by the harness)
    prep_cpu: float = 0.0       # its CPU seconds, with a prestarted verifier's before the request

    @property
    def over(self) -> float:
        """Seconds past the timeout (negative: the time left)."""
        return self.seconds - self.timeout


def parse_result(text: str):
    """(verdict, x, y) from a VNN-COMP result file; x and y are None unless sat.
    Raises ValueError when a sat assignment is malformed."""
    lines = text.strip().splitlines()
    verdict = lines[0].strip() if lines else ""
    if verdict != "sat":
        return verdict, None, None
    values = {"X": {}, "Y": {}}
    body = "\n".join(lines[1:])
    for kind, index, value in _ASSIGNMENT.findall(body):
        if int(index) in values[kind]:
            raise ValueError(f"{kind}_{index} assigned twice")
        values[kind][int(index)] = float(value)
    leftover = _ASSIGNMENT.sub(" ", body).replace("(", " ").replace(")", " ").split()
    if leftover:
        raise ValueError(f"unparsed text in the assignment: {' '.join(leftover[:3])!r}")
    out = []
    for kind in "XY":
        n = len(values[kind])
        if sorted(values[kind]) != list(range(n)) or n == 0:
            raise ValueError(f"the {kind} indices are not 0..{n - 1}")
        out.append(np.array([values[kind][i] for i in range(n)], dtype=np.float64))
    return verdict, out[0], out[1]


class ModelCache:
    def __init__(self):
        self.sessions = {}

    def run(self, onnx_path: str, x: np.ndarray) -> np.ndarray:
        import onnxruntime as ort

        if onnx_path not in self.sessions:
            self.sessions[onnx_path] = ort.InferenceSession(
                onnx_path, providers=["CPUExecutionProvider"])
        s = self.sessions[onnx_path]
        feeds, k = {}, 0          # X holds the inputs' flattened values in input order
        for inp in s.get_inputs():
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in inp.shape]
            n = int(np.prod(shape))
            feeds[inp.name] = x[k:k + n].astype(np.float32).reshape(shape)
            k += n
        if k != x.size:
            raise ValueError(f"{x.size} inputs given, the model takes {k} values")
        ys = s.run(None, feeds)    # Y: the outputs' flattened values in output order
        return np.concatenate([np.asarray(y, dtype=np.float64).reshape(-1) for y in ys])


def check_counterexample(models: ModelCache, onnx_path, vnnlib_path, x, y) -> str | None:
    """None when (x, y) is a genuine counterexample, else what is wrong with it."""
    from shardbound.compiler.vnnlib import parse_vnnlib

    prop = parse_vnnlib(vnnlib_path)
    if x.size != prop.num_inputs or y.size != prop.num_outputs:
        return (f"{x.size} X / {y.size} Y values, the property has {prop.num_inputs} inputs "
                f"and {prop.num_outputs} outputs")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return "non-finite values in the counterexample"
    y_ort = models.run(onnx_path, x)
    if y_ort.size != y.size:
        return f"the model has {y_ort.size} outputs, the result file {y.size}"
    diff = float(np.max(np.abs(y_ort - y)))
    if diff > Y_RTOL * max(1.0, float(np.max(np.abs(y_ort)))):
        return f"reported Y differs from onnxruntime's output by {diff:.3g}"
    boxes = [c for c in prop.cases if c.contains_input(x, X_TOL)]
    if not boxes:
        excess = min(float(np.max(np.maximum(c.lower - x, x - c.upper))) for c in prop.cases)
        return f"X lies outside every input box (by {excess:.3g})"
    # margin of a disjunct: min over its rows of d - C @ y (>= 0: violated)
    margins = [float(np.min(k.d - k.C @ y_ort)) if len(k.d) else np.inf
               for c in boxes for k in c.disjuncts]
    if max(margins, default=-np.inf) >= 0:
        return None
    return (f"onnxruntime's output does not violate the property "
            f"(best margin {max(margins, default=-np.inf):.3g})")


def run_one(row, base, tmp, models, args, env, root=ROOT) -> Outcome:
    onnx_path = os.path.join(base, row["onnx"])
    vnnlib_path = os.path.join(base, row["vnnlib"])
    family, expected = row["family"], row["expected"].strip()
    name = f"{family}/{os.path.basename(row['onnx'])}/{os.path.basename(row['vnnlib'])}"
    timeout = float(row["timeout_s"]) * args.timeout_scale
    result = os.path.join(tmp, re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".txt")
    if args.direct:
        exe = shutil.which("shardbound")
        cmd = ([exe] if exe else [sys.executable, "-m", "shardbound.compiler.cli"])
        cmd += ["verify", onnx_path, vnnlib_path, "--timeout", f"{timeout:g}",
                "--result", result, "--quiet", "--summation", "fast",
                *shlex.split(args.verify_args)]
    else:
        state = env.get("SHARDBOUND_VNNCOMP_STATE", "")
        cpu_file = os.path.join(state, "cpu")
        if state and os.path.exists(cpu_file):
            os.remove(cpu_file)
        prep_start, prep_cpu0 = time.monotonic(), _children_cpu()
        prep = subprocess.run(["bash", os.path.join(root, "vnncomp", "prepare_instance.sh"),
                               "v1", family, onnx_path, vnnlib_path],
                              capture_output=True, text=True, env=env)
        prep_seconds, prep_cpu = time.monotonic() - prep_start, _children_cpu() - prep_cpu0
        if prep.returncode != 0:
            return Outcome(name, family, expected, "error", 0.0, "unsolved",
                           f"prepare_instance.sh failed: {prep.stderr.strip()[-200:]}", timeout)
        cmd = ["bash", os.path.join(root, "vnncomp", "run_instance.sh"), "v1", family,
               onnx_path, vnnlib_path, result, f"{timeout:g}"]
    start = time.monotonic()
    cpu0 = _children_cpu()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 60)
        stderr = proc.stderr.strip()
    except subprocess.TimeoutExpired:
        stderr = "the bench killed the run"
    seconds = time.monotonic() - start
    cpu = _children_cpu() - cpu0
    if not args.direct:         # a verifier prestarted by prepare_instance.sh: not our child
        ahead, during = _prestart_cpu(cpu_file)
        prep_cpu += ahead
        cpu += during
    try:
        with open(result, encoding="utf-8") as f:
            verdict, x, y = parse_result(f.read())
    except FileNotFoundError:
        return Outcome(name, family, expected, "no result", seconds, "unsolved", stderr[-200:],
                       timeout)
    except ValueError as e:
        return Outcome(name, family, expected, "sat", seconds, "WRONG",
                       f"malformed counterexample: {e}", timeout)
    outcome = _judge(name, family, expected, verdict, seconds, stderr, models, onnx_path,
                     vnnlib_path, x, y)
    outcome.timeout = timeout
    outcome.cpu = cpu
    if not args.direct:
        outcome.prep_seconds, outcome.prep_cpu = prep_seconds, prep_cpu
    return outcome


def _prestart_cpu(path: str) -> tuple[float, float]:
    """(CPU s before the request, CPU s of the request) that a verifier prestarted by
    prepare_instance.sh (compiler/prestart.py) wrote to STATE_DIR/cpu; zeros without one."""
    try:
        with open(path, encoding="ascii") as f:
            ahead, during = (float(v) for v in f.read().split())
        return ahead, during
    except (OSError, ValueError):
        return 0.0, 0.0


def _children_cpu() -> float:
    """User + system CPU seconds of the finished child processes (and theirs) so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def print_beside(pairs) -> None:
    """The --beside table: per instance and family, the other checkout's and this one's
    verdicts, wall and CPU seconds, and the ratios (this / other)."""
    print("| instance | expected | other | this | other (s) | this (s) | other CPU s | "
          "this CPU s |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for o, t in pairs:
        print(f"| {t.name} | {t.expected} | {o.verdict} ({o.status}) | {t.verdict} ({t.status}) "
              f"| {o.seconds:.2f} | {t.seconds:.2f} | {o.cpu:.2f} | {t.cpu:.2f} |")
    print()
    print("| family | instances | other: solved | this: solved | other (s) | this (s) | "
          "wall ratio | other CPU s | this CPU s | CPU ratio | prepare CPU s other / this |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by_family = defaultdict(list)
    for o, t in pairs:
        by_family[t.family].append((o, t))
    for family, rows in by_family.items():
        ow, tw = sum(o.seconds for o, _ in rows), sum(t.seconds for _, t in rows)
        oc, tc = sum(o.cpu for o, _ in rows), sum(t.cpu for _, t in rows)
        solved = lambda k: sum(1 for r in rows if r[k].status == "ok")  # noqa: E731
        op, tp = sum(o.prep_cpu for o, _ in rows), sum(t.prep_cpu for _, t in rows)
        print(f"| {family} | {len(rows)} | {solved(0)} | {solved(1)} | {ow:.1f} | {tw:.1f} | "
              f"{tw / max(ow, 1e-9):.2f} | {oc:.1f} | {tc:.1f} | {tc / max(oc, 1e-9):.2f} | "
              f"{op:.1f} / {tp:.1f} |")
    print()
    print("(run_instance.sh's wall and CPU seconds, as the harness times it; prepare_instance.sh"
          " is untimed: its CPU seconds, a prestarted verifier's imports and compilation "
          "included, are the last column)")


def _judge(name, family, expected, verdict, seconds, stderr, models, onnx_path, vnnlib_path,
           x, y) -> Outcome:
    if verdict == "sat":
        try:
            problem = check_counterexample(models, onnx_path, vnnlib_path, x, y)
        except Exception as e:  # noqa: BLE001 - any failure to check is a failed check
            problem = f"checking the counterexample failed: {type(e).__name__}: {e}"
        if problem:
            return Outcome(name, family, expected, verdict, seconds, "WRONG", problem)
        if expected == "unsat":
            return Outcome(name, family, expected, verdict, seconds, "WRONG",
                           "sat where unsat is expected, yet the counterexample checks out "
                           "with onnxruntime: check the expected verdict")
        return Outcome(name, family, expected, verdict, seconds, "ok")
    if verdict == "unsat":
        if expected == "sat":
            return Outcome(name, family, expected, verdict, seconds, "WRONG",
                           "unsat where a counterexample exists (soundness bug)")
        return Outcome(name, family, expected, verdict, seconds, "ok")
    note = stderr[-200:] if verdict == "error" else ""
    return Outcome(name, family, expected, verdict, seconds, "unsolved", note)


def read_instances(path, only, limit):
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f)]
    missing = {"family", "onnx", "vnnlib", "timeout_s", "expected"} - set(rows[0] if rows else {})
    if missing:
        sys.exit(f"error: {path}: missing columns {sorted(missing)}")
    if only:
        rows = [r for r in rows if only in f"{r['family']}/{r['onnx']}/{r['vnnlib']}"]
    return rows[:limit] if limit is not None else rows


def print_report(outcomes):
    print("| instance | expected | verdict | time (s) | timeout (s) | over (s) | ok? |")
    print("|---|---|---|---:|---:|---:|---|")
    for o in outcomes:
        flag = " **OVER**" if o.over > 0 else ""
        print(f"| {o.name} | {o.expected} | {o.verdict} | {o.seconds:.2f} | {o.timeout:g} | "
              f"{o.over:+.2f}{flag} | {o.status} |")
    print()
    print("| family | instances | sat found | unsat proved | unsolved | WRONG | time (s) | "
          "over timeout | worst over (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    by_family = defaultdict(list)
    for o in outcomes:
        by_family[o.family].append(o)
    for family, rows in by_family.items():
        count = lambda pred: sum(1 for o in rows if pred(o))  # noqa: E731
        print(f"| {family} | {len(rows)} | {count(lambda o: o.status == 'ok' and o.verdict == 'sat')}"
              f" | {count(lambda o: o.status == 'ok' and o.verdict == 'unsat')}"
              f" | {count(lambda o: o.status == 'unsolved')} | {count(lambda o: o.status == 'WRONG')}"
              f" | {sum(o.seconds for o in rows):.1f} | {count(lambda o: o.over > 0)}"
              f" | {max(o.over for o in rows):+.2f} |")
        print(f"\n{family}: run_instance.sh {sum(o.cpu for o in rows):.1f} CPU s; "
              f"prepare_instance.sh (untimed) {sum(o.prep_seconds for o in rows):.1f} s wall, "
              f"{sum(o.prep_cpu for o in rows):.1f} CPU s\n")
    wrong = [o for o in outcomes if o.status == "WRONG"]
    print()
    if wrong:
        print(f"WRONG answers ({len(wrong)}):")
        for o in wrong:
            print(f"- {o.name}: expected {o.expected}, got {o.verdict}: {o.note}")
    else:
        print("WRONG answers: none")
    over = [o for o in outcomes if o.over > 0]
    print(f"instances over their timeout: {len(over)}"
          + "".join(f"\n- {o.name}: {o.seconds:.2f} s of {o.timeout:g} s" for o in over))
    errors = [o for o in outcomes if o.verdict in ("error", "no result")]
    for o in errors:
        print(f"- error on {o.name}: {o.note}")
    return 1 if wrong else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", default=DEFAULT_CSV, metavar="CSV")
    p.add_argument("--only", metavar="SUBSTRING", help="instances whose family/onnx/vnnlib "
                   "contains SUBSTRING")
    p.add_argument("--limit", type=int, metavar="N", help="at most N instances")
    p.add_argument("--timeout-scale", type=float, default=1.0, metavar="F",
                   help="multiply every timeout by F (default 1.0)")
    p.add_argument("--direct", action="store_true",
                   help="call `shardbound verify` directly instead of run_instance.sh")
    p.add_argument("--keep", metavar="DIR", help="keep the result files in DIR")
    p.add_argument("--verify-args", default="", metavar="ARGS",
                   help="more `shardbound verify` options, e.g. \"--mode tp --nproc 2\" "
                        "(implies --direct)")
    p.add_argument("--beside", metavar="ROOT", help="also run every instance with the "
                   "scripts of another checkout ROOT (its `shardbound` first on PATH: see "
                   "--beside-bin), alternating instance by instance, and print both with "
                   "the ratios of wall and CPU seconds")
    p.add_argument("--beside-bin", metavar="DIR", help="with --beside: the bin directory of "
                   "the environment that has ROOT installed (put first on PATH for its runs)")
    args = p.parse_args(argv)
    args.direct = args.direct or bool(args.verify_args)
    if args.beside and args.direct:
        sys.exit("error: --beside runs the vnncomp/ scripts of both checkouts (no --direct)")
    if not os.path.exists(args.instances):
        sys.exit(f"error: {args.instances}: no such instances file")
    rows = read_instances(args.instances, args.only, args.limit)
    if not rows:
        sys.exit("error: no instance matches")
    base = os.path.dirname(os.path.abspath(args.instances))
    models = ModelCache()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="shardbound-vnncomp-bench-") as tmp:
        results = args.keep or tmp
        os.makedirs(results, exist_ok=True)
        # our own state dir: prepare_instance.sh then only ever stops runs of this bench
        env = dict(os.environ, SHARDBOUND_VNNCOMP_STATE=os.path.join(tmp, "state"))
        other_env = dict(env)
        if args.beside_bin:
            other_env["PATH"] = os.path.abspath(args.beside_bin) + os.pathsep + env["PATH"]
        pairs = []
        for i, row in enumerate(rows):
            if args.beside:
                b = run_one(row, base, results, models, args, other_env,
                            root=os.path.abspath(args.beside))
            o = run_one(row, base, results, models, args, env)
            print(f"[{i + 1}/{len(rows)}] {o.name}: {o.verdict} ({o.status}) {o.seconds:.1f} s "
                  f"of {o.timeout:g} s" + (f"; beside: {b.verdict} ({b.status}) {b.seconds:.1f} s"
                                          if args.beside else ""), file=sys.stderr, flush=True)
            outcomes.append(o)
            if args.beside:
                pairs.append((b, o))
    if args.beside:
        print_beside(pairs)
        print()
        with open("/proc/loadavg", encoding="ascii") as f:
            print(f"load average at the end: {f.read().split()[0]}")
        print()
    return print_report(outcomes)


if __name__ == "__main__":
    sys.exit(main())
