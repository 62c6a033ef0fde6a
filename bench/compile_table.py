"""Which shared-benchmark networks compile: one row per ONNX file of instances.csv.

    python3 bench/compile_table.py [--shared DIR] [--modes single,fsdp,tp] [--only SUBSTRING]

Reads `family,onnx,...` from DIR/benchmarks/instances.csv (DIR defaults to ../shared relative
to the repository root), plans every distinct model as `shardbound inspect` does (import and
passes, in process) in each mode, and prints a markdown table: the nodes after the passes, and
`compiles` or the refusal (for an unsupported op, only the op list of the one-line error, not
the list of supported ops). Exit code 0 whatever the outcome: this is a census, not a test.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT_SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared"))
_REFUSED = re.compile(r"(\d+ unsupported op\(s\): .*?); supported ops:")


def models(shared: str, only: str | None) -> list[tuple[str, str]]:
    """(family, path relative to benchmarks/) per distinct model, in file order."""
    base = os.path.join(shared, "benchmarks")
    seen: dict[str, str] = {}
    with open(os.path.join(base, "instances.csv"), newline="") as f:
        for row in csv.DictReader(f):
            if (only is None or only in row["onnx"]) and row["onnx"] not in seen:
                seen[row["onnx"]] = row["family"]
    return [(family, onnx) for onnx, family in seen.items()]


def outcome(path: str, mode: str) -> tuple[str, str]:
    """(nodes, what happened) for one model in one mode."""
    from shardbound.compiler.driver import plan_model
    from shardbound.runtime.errors import ShardboundError
    from shardbound.passes.manager import PassOptions

    try:
        graph, _ = plan_model(path, PassOptions(mode=mode))
    except ShardboundError as e:
        text = str(e).splitlines()[0]
        found = _REFUSED.search(text)
        return "", "refused: " + (found.group(1) if found else text.split(": ", 1)[-1])
    return str(len(graph.nodes)), "compiles"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=DEFAULT_SHARED,
                        help="the shared folder holding benchmarks/ (default ../shared)")
    parser.add_argument("--modes", default="single", help="comma-separated: single,fsdp,tp")
    parser.add_argument("--only", default=None, help="only models whose path contains this")
    args = parser.parse_args(argv)
    rows = models(args.shared, args.only)
    modes = args.modes.split(",")
    print("| family | model | " + " | ".join(f"{m} (nodes: outcome)" for m in modes) + " | s |")
    print("|---|---|" + "---|" * len(modes) + "---|")
    for family, onnx in rows:
        start = time.perf_counter()
        cells = []
        for mode in modes:
            nodes, what = outcome(os.path.join(args.shared, "benchmarks", onnx), mode)
            cells.append(f"{nodes}: {what}" if nodes else what)
        seconds = time.perf_counter() - start
        print(f"| {family} | {os.path.basename(onnx)} | " + " | ".join(cells) +
              f" | {seconds:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
