"""`program.py --verify SPEC.json [--result FILE]`: one rank of a verification run.

The budget is `--verify-timeout` seconds from this rank's start, or the wall-clock
`--verify-deadline` the launching command computed from its own start, whichever comes
first. Collectives time out with the budget (a hung peer cannot hold the job past it), and
outside a job of our launcher (which kills late ranks itself) a watchdog answers `timeout`
HARD_STOP_GRACE seconds after the deadline if a stage is still inside one long computation.
"""

from __future__ import annotations

import math
import sys
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


def process_age() -> float:
    """Seconds since this process started (Linux /proc; 0 where unknown)."""
    import os

    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def command_start(args) -> float:
    """Wall-clock time the command started: `shardbound verify`'s (passed to its ranks),
    else this process's."""
    given = getattr(args, "started_at", None)
    if given is not None and math.isfinite(given):
        return given
    return time.time() - process_age()


REPORT_FORMAT = "shardbound-verify-report/1"


def report_json(verdict: str, source: str, since_start: float, records=(), decided=None,
                boxes: int | None = None, x=None, y=None, extra: dict | None = None) -> str:
    """The `verify --json` report: what the final line says, for machines."""
    import json

    report = {
        "format": REPORT_FORMAT, "property": source, "verdict": verdict,
        "decided_by": (None if decided is None or decided.box is None else
                       {"stage": decided.stage, "label": decided.label, "box": decided.box}),
        "boxes": boxes, "seconds_since_start": round(since_start, 6),
        "stages": [r.as_json() for r in records],
        "counterexample": (None if x is None else
                           {"x": [float(v) for v in x], "y": [float(v) for v in y]}),
    }
    report.update(extra or {})
    return json.dumps(report, indent=1) + "\n"


def answer_timeout(result_path: str | None, json_path: str | None = None,
                   source: str = "", started_at: float | None = None) -> None:
    """The verdict `timeout`: printed, and written to the result file (and the --json
    report) if asked for."""
    from shardbound.runtime.program.interrupts import final_output
    from shardbound.runtime.program.report import write_output

    with final_output() as ok:
        if not ok:
            return
        print("timeout", flush=True)
        if result_path:
            write_output(result_path, "timeout\n")
        if json_path:
            since = time.time() - started_at if started_at is not None else 0.0
            write_output(json_path, report_json("timeout", source, since))


def read_prelude(path: str) -> list:
    """The stages `shardbound verify` ran before the ranks (compile, launch), as it wrote
    them into the spec file; [] for a spec without them."""
    import json

    from shardbound.runtime.verification.stages import StageRecord

    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f).get("prelude", [])
        return [StageRecord(str(r["stage"]), None, float(r["started_s"]),
                            None if r.get("seconds") is None else float(r["seconds"]))
                for r in raw]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []


def read_budget_plan(path: str) -> dict | None:
    """The memory plan `shardbound verify` wrote into the spec file (its budget, the budget's
    source and what it chose: the --json report's `plan`); None for a spec without one."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            plan = json.load(f).get("plan")
        return plan if isinstance(plan, dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def run_verify_rank(directory: str, args) -> int:
    import os

    from shardbound.runtime.parallel import dist
    from shardbound.runtime.program import interrupts
    from shardbound.runtime.program.loader import load
    from shardbound.runtime.program.report import write_output
    from shardbound.runtime.verification.spec import read_spec
    from shardbound.runtime.verification.stages import StageLog, final_line
    from shardbound.runtime.verification.verdict import verify

    deadline = VerifyDeadline.from_args(args)
    started_at = command_start(args)
    spec = read_spec(args.verify)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    watchdog = None
    if (interrupts.installed() and not os.environ.get(interrupts.LAUNCHER_ENV)
            and not args.no_watchdog):
        def answer():
            if rank0:
                print("timeout", flush=True)
                if args.result:
                    write_output(args.result, "timeout\n")
                if args.json:
                    write_output(args.json, report_json("timeout", spec.source,
                                                        time.time() - started_at))

        watchdog = interrupts.Deadline(deadline.monotonic, answer, HARD_STOP_GRACE)
    try:
        timeout = collective_timeout(args.collective_timeout, deadline)
        with dist.rank_session(args.threads, timeout, args.device) as comm:
            stages = StageLog(started_at, quiet=args.quiet or comm.rank != 0,
                              boxes=len(spec.cases), records=read_prelude(args.verify))
            verifier = load(directory, comm=comm, memory_budget=args.memory_budget)
            result = verify(verifier, spec, deadline.remaining(), comm,
                            deadline=deadline.monotonic, stages=stages,
                            soundness=args.soundness, milp=args.milp)
            comm.barrier()
        if comm.rank != 0:
            return 0
        since = time.time() - started_at
        with interrupts.final_output() as ok:
            if not ok:
                return 0
            if args.result:
                write_output(args.result, result.vnncomp_text())
            if args.json:
                extra = {"mode": verifier.plan["mode"], "world_size": comm.world,
                         "summation": verifier.plan["summation"],
                         "soundness": args.soundness,
                         "verify_seconds": round(result.seconds, 6)}
                plan = read_budget_plan(args.verify)
                if plan is not None:
                    extra["plan"] = plan
                write_output(args.json, report_json(
                    result.verdict, spec.source, since, result.records, result.decided,
                    len(spec.cases), result.x, result.y, extra))
            print(result.verdict)
            if not args.quiet:
                print(final_line(spec.source, result.verdict, result.decided, len(spec.cases),
                                 since))
            sys.stdout.flush()
        return 0
    finally:
        if watchdog is not None:
            watchdog.cancel()
