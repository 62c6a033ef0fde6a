"""Running a compiled program: `python DIR/program.py --box BOX.json` and `shardbound run DIR`.

Both print one line per output (lower, upper) and, with --json, write lower, upper and
bounds_sha256. User errors print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from shardbound.runtime.errors import ShardboundError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a user error like any other: one `error:` line, exit 2
    (instead of the usage block followed by a second line)."""

    def error(self, message: str):
        message = " ".join(str(message).split())
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--box", metavar="BOX.json",
                      help='input box: {"lower": [...], "upper": [...]} (flattened input)')
    what.add_argument("--verify", metavar="SPEC.json",
                      help="verify a property (written by `shardbound verify`) instead")
    parser.add_argument("--result", metavar="FILE",
                        help="with --verify: write the VNN-COMP result file")
    parser.add_argument("--verify-timeout", type=float, default=300.0, metavar="S",
                        help="with --verify: give up after S seconds (default 300)")
    parser.add_argument("--json", metavar="OUT.json", help="also write lower, upper, bounds_sha256")
    parser.add_argument("--method", choices=("ibp", "crown", "alpha-crown"),
                        help="bound method (default: the one compiled in)")
    parser.add_argument("--threads", type=int, default=1, metavar="T",
                        help="torch intra-op threads (default 1; set explicitly so runs repeat)")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                        help="where to bound: cpu (default; gloo between ranks), cuda (nccl), "
                             "or auto (cuda when available)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="collective timeout in seconds for sharded runs (default 60)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")


def run(directory: str, args: argparse.Namespace) -> int:
    """Bound the program in `directory` over the box: in this process, as one rank of a
    torchrun job (WORLD_SIZE set), or by launching --nproc ranks."""
    nproc = getattr(args, "nproc", 1)
    if nproc < 1:
        raise ShardboundError(f"--nproc must be at least 1, got {nproc}")
    if args.threads < 1:
        raise ShardboundError(f"--threads must be at least 1, got {args.threads}")
    if nproc > 1:
        return _launch(directory, args)
    if args.verify:
        from shardbound.runtime.program.verify_main import run_verify_rank

        return run_verify_rank(directory, args)
    return _run_rank(directory, args)


def _launch(directory: str, args) -> int:
    import os

    from shardbound.runtime.parallel.launch import launch
    from shardbound.runtime.program.loader import read_plan

    read_plan(directory)  # fail here, once, if DIR is not a program
    if args.verify:
        argv = ["--verify", os.path.abspath(args.verify),
                "--verify-timeout", str(args.verify_timeout)]
        if args.result:
            argv += ["--result", os.path.abspath(args.result)]
    else:
        argv = ["--box", os.path.abspath(args.box)]
    argv += ["--threads", str(args.threads), "--timeout", str(args.timeout),
             "--device", getattr(args, "device", "cpu")]
    if args.json:
        argv += ["--json", os.path.abspath(args.json)]
    if args.method:
        argv += ["--method", args.method]
    if args.quiet:
        argv.append("--quiet")
    return launch(os.path.join(directory, "program.py"), argv, args.nproc, args.timeout)


def _run_rank(directory: str, args) -> int:
    from shardbound.runtime.parallel import dist
    from shardbound.runtime.program.boxes import as_boxes, read_box_file
    from shardbound.runtime.accounting.ledger import max_over_ranks
    from shardbound.runtime.program.loader import load
    from shardbound.runtime.program.report import bounds_sha256, format_table, write_output

    lower, upper = read_box_file(args.box)
    with dist.rank_session(args.threads, args.timeout, args.device) as comm:
        verifier = load(directory, comm=comm)
        as_boxes(lower, upper, verifier.input_shape, where=args.box)  # errors name the file
        method = args.method or verifier.method
        start = time.perf_counter()
        lb, ub = verifier.bounds(lower, upper, method=method)
        elapsed = time.perf_counter() - start
        memory = max_over_ranks(comm.all_gather_objects(verifier.network.ledger.report()))
        memory["predicted_peak_tracked_bytes"] = predicted_peak(verifier, comm, method, lb)
        rows = verifier.network.rows_over_ranks(comm.all_gather_objects(
            verifier.network.crown_rows))
        comm.barrier()
    if comm.rank != 0:
        return 0
    digest = bounds_sha256(lb, ub)
    if not args.quiet:
        ranks = f", {comm.world} ranks" if comm.world > 1 else ""
        print(f"# {method} bounds, {lb.numel()} outputs, {elapsed:.3f} s, mode "
              f"{verifier.plan['mode']}{ranks}")
        print(format_table(lb, ub))
        print(f"# bounds_sha256 {digest}")
    if args.json:
        result = {"method": method, "mode": verifier.plan["mode"], "world_size": comm.world,
                  "lower": lb.reshape(-1).tolist(), "upper": ub.reshape(-1).tolist(),
                  "bounds_sha256": digest, "threads": args.threads,
                  "seconds": round(elapsed, 6), "memory": memory, "crown_rows": rows}
        write_output(args.json, json.dumps(result, indent=1) + "\n")
    return 0


def predicted_peak(verifier, comm, method: str, lb) -> int | None:
    """The memory model's prediction for this very run (None for alpha-CROWN: not modelled)."""
    from shardbound.runtime.program.loader import stream_chunk_bytes
    from shardbound.runtime.accounting.memory_model import network_shapes, predict_peak

    if method not in ("ibp", "crown") or verifier.plan["mode"] == "tp":
        return None                     # tp: not modelled (bench/tp_memory.py measures it)
    net = verifier.network
    fsdp = verifier.plan["mode"] == "fsdp"
    pred = predict_peak(network_shapes(net), net.output.name, comm.world,
                        batch=lb.shape[0] if lb.dim() > 1 else 1, spec_rows=lb.shape[-1],
                        shard_rows=net.rows.enabled if fsdp else None, method=method,
                        stream_chunk_bytes=stream_chunk_bytes(verifier.plan),
                        crown_rows=net.bounded_rows)
    return pred["peak_tracked_bytes"]


def guarded(fn, *a) -> int:
    """Run fn; a ShardboundError becomes one line on stderr and exit code 2."""
    try:
        return fn(*a)
    except ShardboundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def program_main(directory: str, argv=None) -> None:
    parser = ArgumentParser(prog="program.py", description="Run a compiled shardbound program.")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    code = guarded(run, directory, args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:   # one rank of a job: see dist.exit_rank
        from shardbound.runtime.parallel.dist import exit_rank

        exit_rank(code)
    sys.exit(code)
