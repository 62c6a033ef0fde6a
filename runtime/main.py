"""Running a compiled program: `python DIR/program.py --box BOX.json` and `shardbound run DIR`.

Both print one line per output (lower, upper) and, with --json, write lower, upper and
bounds_sha256. User errors print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from shardbound.runtime.errors import ShardboundError


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--box", required=True, metavar="BOX.json",
                        help='input box: {"lower": [...], "upper": [...]} (flattened input)')
    parser.add_argument("--json", metavar="OUT.json", help="also write lower, upper, bounds_sha256")
    parser.add_argument("--method", choices=("ibp", "crown"),
                        help="bound method (default: the one compiled in)")
    parser.add_argument("--threads", type=int, default=1, metavar="T",
                        help="torch intra-op threads (default 1; set explicitly so runs repeat)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def run(directory: str, args: argparse.Namespace) -> int:
    import torch

    from shardbound.runtime.boxes import read_box_file
    from shardbound.runtime.loader import load
    from shardbound.runtime.report import bounds_sha256, format_table

    if args.threads < 1:
        raise ShardboundError(f"--threads must be at least 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    verifier = load(directory)
    lower, upper = read_box_file(args.box)
    method = args.method or verifier.method
    start = time.perf_counter()
    lb, ub = verifier.bounds(lower, upper, method=method)
    elapsed = time.perf_counter() - start
    digest = bounds_sha256(lb, ub)
    if not args.quiet:
        print(f"# {method} bounds, {lb.numel()} outputs, {elapsed:.3f} s")
        print(format_table(lb, ub))
        print(f"# bounds_sha256 {digest}")
    if args.json:
        result = {"method": method, "lower": lb.reshape(-1).tolist(),
                  "upper": ub.reshape(-1).tolist(), "bounds_sha256": digest,
                  "threads": args.threads, "seconds": round(elapsed, 6)}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


def guarded(fn, *a) -> int:
    """Run fn; a ShardboundError becomes one line on stderr and exit code 2."""
    try:
        return fn(*a)
    except ShardboundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def program_main(directory: str, argv=None) -> None:
    parser = argparse.ArgumentParser(prog="program.py", description="Run a compiled shardbound program.")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    sys.exit(guarded(run, directory, args))
