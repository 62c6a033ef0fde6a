"""Running a compiled program: `python DIR/program.py --box BOX.json` and `shardbound run DIR`.

Both print one line per output (lower, upper) and, with --json, write lower, upper and
bounds_sha256. Exit codes: 0 done, 2 a user error (one `error:` line), 3 a rank failed or
hung (one line naming it and the ranks' log), 130 interrupted (one line `interrupted`).
"""

from __future__ import annotations

import json
import os
import sys
import time

from shardbound.options import ArgumentParser, RunOptions, parser_for, positive_seconds  # noqa: F401
from shardbound.runtime.errors import ShardboundError

USER_ERROR = 2
RANK_FAILED = 3
INTERNAL_ERROR = 4      # a bug in shardbound, not in the input: one line, unless asked


def run(directory: str, args: RunOptions) -> int:
    """Bound the program in `directory` over the box: in this process, as one rank of a
    torchrun job (WORLD_SIZE set), or by launching --nproc ranks (default: the rank count
    the program was compiled for, `compile --nproc`)."""
    nproc = job_ranks(directory, args)
    if nproc < 1:
        raise ShardboundError(f"--nproc must be at least 1, got {nproc}")
    if args.threads < 1:
        raise ShardboundError(f"--threads must be at least 1, got {args.threads}")
    if nproc > 1:
        return _launch(directory, args, nproc)
    if args.verify:
        from shardbound.runtime.program.verify_main import run_verify_rank

        return run_verify_rank(directory, args)
    return _run_rank(directory, args)


def job_ranks(directory: str, args: RunOptions) -> int:
    """How many ranks to launch: --nproc, else the program's own rank count; 1 inside a
    job (this process is one of its ranks)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or os.environ.get("SHARDBOUND_LAUNCHER"):
        return 1
    if args.nproc is not None:
        return args.nproc
    from shardbound.runtime.program.loader import read_plan

    return int(read_plan(directory).get("nproc", 1))


def _launch(directory: str, args: RunOptions, nproc: int) -> int:
    """Run the job on --nproc ranks; for verify, answer `timeout` when the job is stopped at
    its deadline without an answer."""
    from shardbound.runtime.parallel.launch import launch_job
    from shardbound.runtime.program import interrupts
    from shardbound.runtime.program.loader import read_plan

    read_plan(directory)  # fail here, once, if DIR is not a program
    argv, deadline = _rank_argv(args)
    before = _stat(args.result) if args.verify and args.result else None

    def answer_late():
        from shardbound.runtime.program.verify_main import answer_timeout

        if not args.result or _stat(args.result) == before:     # no answer from rank 0
            answer_timeout(args.result, args.json, started_at=args.started_at)

    def drop_partial_outputs():
        _drop_partial([args.result if args.verify else None, args.json])

    interrupts.add_cleanup(drop_partial_outputs)
    try:
        job = launch_job(os.path.join(directory, "program.py"), argv, nproc,
                         args.collective_timeout,
                         deadline=deadline, on_deadline=answer_late if args.verify else None)
    finally:
        interrupts.remove_cleanup(drop_partial_outputs)
    if args.verify and job.code == RANK_FAILED and time.monotonic() >= deadline:
        answer_late()       # a rank failed at the deadline (a collective timed out)
    return job.code


def _rank_argv(args) -> tuple[list[str], float | None]:
    """The ranks' command line, and the verify deadline (time.monotonic()) or None."""
    deadline = None
    if args.verify:
        from shardbound.runtime.program.verify_main import VerifyDeadline

        budget = VerifyDeadline.from_args(args)
        deadline = budget.monotonic
        argv = ["--verify", os.path.abspath(args.verify),
                "--verify-timeout", repr(max(budget.remaining(), 1e-3)),
                "--verify-deadline", repr(budget.wall)]
        if args.started_at is not None:
            argv += ["--started-at", repr(args.started_at)]
        if args.result:
            argv += ["--result", os.path.abspath(args.result)]
    else:
        argv = ["--box", os.path.abspath(args.box)]
    argv += ["--threads", str(args.threads), "--collective-timeout",
             repr(args.collective_timeout), "--device", args.device, "--nproc", "1"]
    if args.json:
        argv += ["--json", os.path.abspath(args.json)]
    if args.method:
        argv += ["--method", args.method]
    if args.memory_budget is not None:
        argv += ["--memory-budget", str(args.memory_budget or "none")]   # 0: none
    if args.soundness != "default":
        argv += ["--soundness", args.soundness]
    if args.milp != "auto":
        argv += ["--milp", args.milp]
    if args.quiet:
        argv.append("--quiet")
    return argv, deadline


def _drop_partial(paths) -> None:
    """A rank killed between writing a result and renaming it leaves FILE.PID.tmp."""
    import glob

    for path in paths:
        if not path:
            continue
        for tmp in glob.glob(glob.escape(os.path.abspath(path)) + ".*.tmp"):
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _stat(path: str):
    """What tells a result file written by this job from an older one."""
    try:
        st = os.stat(path)
        return st.st_ino, st.st_mtime_ns, st.st_size
    except OSError:
        return None


def _run_rank(directory: str, args) -> int:
    from shardbound.runtime.parallel import dist
    from shardbound.runtime.program.boxes import as_boxes, read_box_file
    from shardbound.runtime.accounting.ledger import max_over_ranks
    from shardbound.runtime.program.loader import load
    from shardbound.runtime.program.report import bounds_sha256, format_table, write_output

    lower, upper = read_box_file(args.box)
    with dist.rank_session(args.threads, args.collective_timeout, args.device) as comm:
        verifier = load(directory, comm=comm, memory_budget=args.memory_budget)
        as_boxes(lower, upper, verifier.input_shape, where=args.box)  # errors name the file
        method = args.method or verifier.method
        start = time.perf_counter()
        lb, ub = verifier.bounds(lower, upper, method=method)
        if args.soundness != "default":
            from shardbound.runtime.rigorous import rigorous_box_bounds

            lb, ub = rigorous_box_bounds(verifier, lower, upper, args.soundness, lb, ub)
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
        how = "" if args.soundness == "default" else f" (--soundness {args.soundness}: rigorous)"
        print(f"# {method} bounds{how}, {lb.numel()} outputs, {elapsed:.3f} s, mode "
              f"{verifier.plan['mode']}{ranks}")
        print(format_table(lb, ub))
        print(f"# bounds_sha256 {digest}")
    if args.json:
        result = {"method": method, "mode": verifier.plan["mode"], "world_size": comm.world,
                  "lower": lb.reshape(-1).tolist(), "upper": ub.reshape(-1).tolist(),
                  "bounds_sha256": digest, "threads": args.threads,
                  "seconds": round(elapsed, 6), "memory": memory, "crown_rows": rows}
        if args.soundness != "default":
            result["soundness"] = args.soundness
        from shardbound.runtime.program.interrupts import final_output

        with final_output() as ok:
            if ok:
                write_output(args.json, json.dumps(result, indent=1) + "\n")
    return 0


def predicted_peak(verifier, comm, method: str, lb) -> int | None:
    """The memory model's prediction for this very run (tp: tp_model.py's, max over ranks)."""
    from shardbound.runtime.accounting.memory_model import (METHOD_MODELS, network_shapes,
                                                             predict_peak)

    if method not in ("ibp", "crown", "full-alpha-crown") and method not in METHOD_MODELS:
        return None
    net = verifier.network
    if verifier.plan["mode"] == "tp":
        return _tp_predicted_peak(net, comm, method, lb)
    fsdp = verifier.plan["mode"] == "fsdp"
    if method == "full-alpha-crown" and net.alpha_rows is None:
        method = "crown"                # no optimisation ran (full_alpha.py): CROWN's figure
    pred = predict_peak(network_shapes(net), net.output.name, comm.world,
                        batch=lb.shape[0] if lb.dim() > 1 else 1, spec_rows=lb.shape[-1],
                        shard_rows=net.rows.enabled if fsdp else None, method=method,
                        stream_chunk_bytes=net.memory_setup["stream_chunk_bytes"],
                        crown_rows=net.bounded_rows, row_tile=net.row_tile,
                        alpha_rows=net.alpha_rows, alpha_neurons=net.alpha_neurons,
                        order=net.order)
    return pred["peak_tracked_bytes"]


def _tp_predicted_peak(net, comm, method: str, lb) -> int:
    """tp: the largest prediction over the ranks (runtime/accounting/tp_model.py), from every
    rank's own row counts (a collective: every rank calls this)."""
    from functools import partial

    from shardbound.runtime.accounting import tp_model
    from shardbound.runtime.parallel.tp_reduce import channel_ranges

    if method == "full-alpha-crown" and net.alpha_rows is None:
        method = "crown"                # no optimisation ran (full_alpha.py): CROWN's figure
    rows = comm.all_gather_objects(net.bounded_rows)
    alpha_rows = alpha_neurons = None
    if method == "full-alpha-crown":    # each rank's start rows and sparse alphas
        alpha_rows, alpha_neurons = zip(*comm.all_gather_objects((net.alpha_rows,
                                                                  net.alpha_neurons)))
    nodes, places = tp_model.network_places(net)
    pred = tp_model.predict_tp_peak(nodes, places, net.output.name, comm.world,
                                    partial(channel_ranges, net.order), order=net.order,
                                    batch=lb.shape[0] if lb.dim() > 1 else 1,
                                    spec_rows=lb.shape[-1], method=method, crown_rows=rows,
                                    row_tile=net.row_tile, refine=tp_model.refines(net),
                                    ibp_planned=tp_model.ibp_planned(net),
                                    alpha_rows=alpha_rows, alpha_neurons=alpha_neurons)
    return pred["peak_tracked_bytes"]


def one_line(text: str) -> str:
    """An error message as one printable line: control characters (terminal escape
    sequences from a hostile file, newlines) are shown escaped, never sent to the terminal."""
    out = []
    for ch in str(text):
        if ch == "\n":
            out.append(" ")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def guarded(fn, *a, own: bool = False) -> int:
    """Run fn; a ShardboundError becomes one line on stderr and exit code 2 (3 when a peer
    rank failed or hung). Any other exception is a bug of ours: owning the process (a
    console script), it too becomes one line (its type, message and where it was raised)
    and exit code 4, since a user should never read a traceback; SHARDBOUND_TRACEBACK=1, or
    a call from Python (tests), lets it propagate with its traceback."""
    from shardbound.runtime.program import interrupts

    try:
        return fn(*a)
    except BaseException as e:
        from shardbound.runtime.parallel.dist import RankFailure     # torch: only now

        if interrupts.stopping():       # a signal's cleanups pulled files or ranks away
            interrupts.wait_for_stop()
        if isinstance(e, ShardboundError):
            code = RANK_FAILED if isinstance(e, RankFailure) else USER_ERROR
            with interrupts.output() as ok:
                if not ok:
                    interrupts.wait_for_stop()
                print(f"error: {one_line(e)}", file=sys.stderr)
            return code
        if (own and isinstance(e, Exception)
                and os.environ.get("SHARDBOUND_TRACEBACK", "") != "1"):
            print(f"error: internal error: {_raised_at(e)}: {type(e).__name__}: "
                  f"{one_line(e)}; this is a bug in shardbound, not in your input: rerun with "
                  "SHARDBOUND_TRACEBACK=1 for the traceback and report it", file=sys.stderr)
            return INTERNAL_ERROR
        raise


def _raised_at(e: BaseException) -> str:
    """file:line of the innermost frame of e's traceback (where a bug report starts)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    return f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"


def own_process(argv) -> bool:
    """Whether an entry point runs as the process itself (a console script, program.py:
    argv None) rather than called from Python with its arguments (tests)."""
    if argv is not None:
        return False
    from shardbound.runtime.program import interrupts

    interrupts.install()
    return True


def leave(code: int, own: bool) -> None:
    """End an entry point. Owning the process, skip the interpreter's teardown of torch
    (measured: 1-3 s on a loaded machine after the verdict was out, which a harness counts
    against the timeout); the results are written and closed by now."""
    if not own:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def program_main(directory: str, argv=None) -> None:
    own = own_process(argv)
    args = RunOptions.from_namespace(parser_for("program", "program.py").parse_args(argv))
    code = guarded(run, directory, args, own=own)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:   # one rank of a job: see dist.exit_rank
        from shardbound.runtime.parallel.dist import exit_rank

        exit_rank(code)
    leave(code, own)
