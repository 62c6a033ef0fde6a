"""Which shared-benchmark networks compile: one row per ONNX file of instances.csv.

    python3 bench/compile_table.py [--shared DIR] [--modes single,fsdp,tp] [--only SUBSTRING]

Reads `family,onnx,...` from DIR/benchmarks/instances.csv (DIR defaults to ../shared relative
to the repository root), plans every distinct model as `shardbound inspect` does (import and
passes, in process) in each mode, and prints a markdown table: `compiles (N nodes)` or the
refusal, shortened to the unsupported op names (with the constant-only reason group, if any)
or the handler's one-line message; one cell when every mode agrees, else one per mode.
Exit code 0 whatever the outcome: this is a census, not a test.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT_SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared"))
_REFUSED = re.compile(r"\d+ unsupported op\(s\): (.*?); supported ops:")
_OP = re.compile(r"([A-Za-z0-9_.]+) \(opset \d+, first node")


def models(shared: str, only: str | None) -> list[tuple[str, str]]:
    """(family, path relative to benchmarks/) per distinct model, in file order."""
    base = os.path.join(shared, "benchmarks")
    seen: dict[str, str] = {}
    with open(os.path.join(base, "instances.csv"), newline="") as f:
        for row in csv.DictReader(f):
            if (only is None or only in row["onnx"]) and row["onnx"] not in seen:
                seen[row["onnx"]] = row["family"]
    return [(family, onnx) for onnx, family in seen.items()]


def outcome(path: str, mode: str) -> str:
    """What happens to one model in one mode, in a few words."""
    from shardbound.compiler.driver import plan_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime.errors import ShardboundError

    try:
        graph, _ = plan_model(path, PassOptions(mode=mode))
    except ShardboundError as e:
        text = str(e).splitlines()[0]
        found = _REFUSED.search(text)
        if not found:
            return "refused: " + text.split(": ", 1)[-1]
        ops = _OP.findall(found.group(1))
        discrete = "discrete" in found.group(1) or "no linear bound" in found.group(1)
        return "refused: " + ", ".join(ops) + (" (some: discrete on the input)" if discrete else "")
    return f"compiles ({len(graph.nodes)} nodes)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=DEFAULT_SHARED,
                        help="the shared folder holding benchmarks/ (default ../shared)")
    parser.add_argument("--modes", default="single", help="comma-separated: single,fsdp,tp")
    parser.add_argument("--only", default=None, help="only models whose path contains this")
    args = parser.parse_args(argv)
    rows = models(args.shared, args.only)
    modes = args.modes.split(",")
    print(f"| family | model | outcome ({', '.join(modes)}) |")
    print("|---|---|---|")
    for family, onnx in rows:
        cells = {m: outcome(os.path.join(args.shared, "benchmarks", onnx), m) for m in modes}
        shown = (next(iter(cells.values())) if len(set(cells.values())) == 1
                 else "; ".join(f"{m}: {c}" for m, c in cells.items()))
        print(f"| {family} | {os.path.basename(onnx)} | {shown} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
