"""`program.py --verify SPEC.json [--result FILE]`: one rank of a verification run.

The budget is `--verify-timeout` seconds from this rank's start, or the wall-clock
`--verify-deadline` the launching command computed from its own start, whichever comes
first. Collectives time out with the budget (a hung peer cannot hold the job past it), and
outside a job of our launcher (which kills late ranks itself) a watchdog answers `timeout`
HARD_STOP_GRACE seconds after the deadline if a stage is still inside one long computation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

COLLECTIVE_GRACE = 1.0     # a collective may block this long past the deadline
HARD_STOP_GRACE = 1.0      # seconds past the deadline before the watchdog answers


@dataclass(frozen=True)
class VerifyDeadline:
    """One deadline, as a time.monotonic() value (for this process) and as wall-clock time
    (for other processes on this machine)."""

    monotonic: float
    wall: float

    @classmethod
    def at_wall(cls, wall: float) -> "VerifyDeadline":
        return cls(time.monotonic() + (wall - time.time()), wall)

    @classmethod
    def from_args(cls, args) -> "VerifyDeadline":
        mine = cls.at_wall(time.time() + args.verify_timeout)
        given = getattr(args, "verify_deadline", None)
        if given is not None and math.isfinite(given) and given < mine.wall:
            return cls.at_wall(given)
        return mine

    def remaining(self) -> float:
        return self.monotonic - time.monotonic()


def collective_timeout(requested: float, deadline: VerifyDeadline) -> float:
    """The collective timeout of a verify rank: never past the budget (plus a grace)."""
    return max(1.0, min(requested, deadline.remaining() + COLLECTIVE_GRACE))


def answer_timeout(result_path: str | None) -> None:
    """The verdict `timeout`: printed, and written to the result file if one is asked for."""
    from shardbound.runtime.program.interrupts import final_output
    from shardbound.runtime.program.report import write_output

    with final_output() as ok:
        if not ok:
            return
        print("timeout", flush=True)
        if result_path:
            write_output(result_path, "timeout\n")


def run_verify_rank(directory: str, args) -> int:
    import os

    from shardbound.runtime.parallel import dist
    from shardbound.runtime.program import interrupts
    from shardbound.runtime.program.loader import load
    from shardbound.runtime.program.report import write_output
    from shardbound.runtime.verification.spec import read_spec
    from shardbound.runtime.verification.verdict import verify

    deadline = VerifyDeadline.from_args(args)
    spec = read_spec(args.verify)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    watchdog = None
    if (interrupts.installed() and not os.environ.get(interrupts.LAUNCHER_ENV)
            and not getattr(args, "no_watchdog", False)):
        from shardbound.runtime.program.report import write_output as _write

        def answer():
            if rank0:
                print("timeout", flush=True)
                if args.result:
                    _write(args.result, "timeout\n")

        watchdog = interrupts.Deadline(deadline.monotonic, answer, HARD_STOP_GRACE)
    try:
        timeout = collective_timeout(args.timeout, deadline)
        with dist.rank_session(args.threads, timeout, getattr(args, "device", "cpu")) as comm:
            verifier = load(directory, comm=comm)
            result = verify(verifier, spec, deadline.remaining(), comm,
                            quiet=args.quiet or comm.rank != 0, deadline=deadline.monotonic)
            comm.barrier()
        if comm.rank != 0:
            return 0
        with interrupts.final_output() as ok:
            if not ok:
                return 0
            if args.result:
                write_output(args.result, result.vnncomp_text())
            print(result.verdict)
            if not args.quiet:
                print(f"# {spec.source}: {result.verdict} in {result.seconds:.2f} s "
                      f"({', '.join(result.stages) or 'no bounding needed'})")
        return 0
    finally:
        if watchdog is not None:
            watchdog.cancel()
