"""`shardbound run DIR --nproc P`: start P ranks of DIR/program.py on this machine.

The ranks rendezvous through env:// on 127.0.0.1, joining a store the launcher hosts (as
torchrun's agent does), and the launcher watches them:
- when one exits with an error, the others get FAILURE_GRACE seconds to stop on their own
  (and say why in their log), then they are killed; the message names the rank that failed
  first and how (exit code or signal);
- with a `deadline` (verify's budget), ranks still running DEADLINE_GRACE seconds after it
  are killed: a hung or stopped rank never holds the job past the budget;
- on SIGINT/SIGTERM (runtime/program/interrupts.py) every rank is killed at once, and the
  process prints `interrupted` and exits 130.

The ranks' stderr -- one-line errors, and on a failure the backend's C++ traces (a rank whose
peer died can print tens of thousands of TCPStore lines) -- goes to a log file, never to the
user's terminal. The launcher prints one line: a rank's own `error:` line for a user error,
else what failed, with the first error a rank reported and the log's path. The log is deleted
when the job succeeds, is interrupted or fails on user input.

Exit codes: 0 done; 2 a user error (reported by a rank); 3 a rank failed, was killed, or hung.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from shardbound.runtime.program import interrupts

USER_ERROR = 2
RANK_FAILED = 3
FAILURE_GRACE = 3.0       # seconds the other ranks get to stop after one failed
HUNG_AFTER = 5.0          # seconds behind the others without progress: a hung rank
DEADLINE_GRACE = 1.0      # seconds past the verify deadline before ranks are killed
POLL = 0.05


def _rendezvous_store(timeout_s: float):
    """The job's rendezvous store, hosted by the launcher on a port the OS picks while the
    store binds it (so no other process can take it in between, as it could when a free port
    was looked up first and bound later by rank 0). The ranks join it as clients, the way
    torchrun's agent store works (TORCHELASTIC_USE_AGENT_STORE)."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def _describe(code: int | None) -> str:
    if code is None:
        return "did not stop (hung or stopped) and was killed"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _first_error_line(path: str | None) -> str | None:
    """The first `error: ...` line a rank wrote to the log (without the prefix)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("error: "):
                    return line[len("error: "):].strip()
    except OSError:
        pass
    return None


@dataclass
class Outcome:
    code: int                   # the job's exit code (0, 2 or 3)
    at_deadline: bool = False   # ranks were still running at the deadline and were killed


def launch(program: str, argv: list[str], nproc: int, timeout_s: float, stderr=None,
           deadline: float | None = None) -> int:
    """Run `program argv` as `nproc` ranks; the exit code of the job (0, 2 or 3; see the
    module docstring). `stderr`: an open file for the ranks' stderr (default: a log file the
    launcher names on failure). `deadline`: a time.monotonic() value past which (plus
    DEADLINE_GRACE) running ranks are killed."""
    return launch_job(program, argv, nproc, timeout_s, stderr, deadline).code


def launch_job(program: str, argv: list[str], nproc: int, timeout_s: float, stderr=None,
               deadline: float | None = None, on_deadline=None) -> Outcome:
    """`launch`, also saying whether the job was stopped at the deadline. Ranks killed there
    are a failure (code 3) only if one of them hung: stopped (SIGSTOP) or behind the others'
    collective count; ranks that were merely not done (a slow start on a busy machine) make
    an answer of `timeout`, code 0. `on_deadline()` runs right after those kills, before
    anything else (verify answers `timeout` there, as early as it can)."""
    log_path = None
    if stderr is None:
        fd, log_path = tempfile.mkstemp(prefix="shardbound-ranks-", suffix=".log")
        stderr = os.fdopen(fd, "w")
    procs: list[subprocess.Popen] = []

    def cleanup():
        _kill_all(procs)
        if log_path is not None:
            try:
                os.unlink(log_path)
            except OSError:
                pass

    interrupts.add_cleanup(cleanup)
    try:
        store = _rendezvous_store(timeout_s)
        with interrupts.unblocked_for_children():
            for rank in range(nproc):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                           WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                           TORCHELASTIC_USE_AGENT_STORE="True",
                           **{interrupts.LAUNCHER_ENV: str(os.getpid())})
                procs.append(subprocess.Popen([sys.executable, program, *argv], env=env,
                                              stderr=stderr))
        failure, killed, late, hung = _watch(procs, deadline, timeout_s, store)
        if late and on_deadline is not None:
            on_deadline()
        code = _report(failure, killed, late, hung, nproc, log_path, stderr)
    finally:
        interrupts.remove_cleanup(cleanup)
        _kill_all(procs)
        if log_path is not None:
            stderr.close()
    if log_path is not None and code in (0, USER_ERROR):
        try:
            os.unlink(log_path)
        except OSError:
            pass
    return Outcome(code, at_deadline=late)


def _stopped(proc) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): Linux /proc."""
    try:
        with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("T", "t")
    except (OSError, IndexError):
        return False


class _Progress:
    """Each rank's count of collectives entered (progress.progress_key, in the store the launcher
    hosts) and when it last moved: a rank is hung when it is stopped (SIGSTOP, a debugger) or
    has been behind the furthest rank, without moving, for HUNG_AFTER seconds. (Ranks are
    often one collective apart for a moment: being behind alone proves nothing.)"""

    def __init__(self, store, nproc: int):
        self.store, self.nproc = store, nproc
        self.steps = [0] * nproc
        self.moved = [time.monotonic()] * nproc

    def poll(self) -> None:
        from shardbound.runtime.parallel.progress import progress_key

        now = time.monotonic()
        for rank in range(self.nproc):
            try:
                key = progress_key(rank)
                step = int(self.store.get(key)) if self.store.check([key]) else 0
            except Exception:
                continue
            if step != self.steps[rank]:
                self.steps[rank], self.moved[rank] = step, now

    def hung(self, procs, alive) -> list[int]:
        self.poll()
        now, top = time.monotonic(), max(self.steps)
        return [r for r in alive if _stopped(procs[r])
                or (self.steps[r] < top and now - self.moved[r] >= HUNG_AFTER)]


def _watch(procs, deadline, timeout_s, store):
    """Poll the ranks until all have exited or were killed: (the first failure as (rank,
    exit code) or None, the ranks that had to be killed, whether that was at the deadline,
    which of them hung).
    After a failure the others get FAILURE_GRACE; after a rank finished cleanly (past the
    job's last barrier), the others get the collective timeout and 5 s."""
    failure = None
    kill_at = None
    progress = _Progress(store, len(procs))
    polled = 0.0
    while True:
        codes = [p.poll() for p in procs]
        if deadline is not None and time.monotonic() - polled > 0.25:
            progress.poll()
            polled = time.monotonic()
        if kill_at is None and 0 in codes:
            kill_at = time.monotonic() + timeout_s + 5
        if failure is None:
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    if code in (-signal.SIGINT, -signal.SIGTERM) and interrupts.installed():
                        interrupts.stop()       # the ranks got the user's Ctrl-C or kill
                    failure = (rank, code)
                    kill_at = min(kill_at or float("inf"), time.monotonic() + FAILURE_GRACE)
                    break
        if all(c is not None for c in codes):
            return failure, [], False, []
        now = time.monotonic()
        late = deadline is not None and now > deadline + DEADLINE_GRACE
        if late or (kill_at is not None and now > kill_at):
            codes = [p.poll() for p in procs]       # the ranks may have just finished
            if all(c is not None for c in codes):
                continue
            killed = [r for r, c in enumerate(codes) if c is None]
            hung = progress.hung(procs, killed) if failure is None and late else killed
            _kill_all(procs)
            return failure, killed, late, hung
        time.sleep(POLL)


def _ranks(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _report(failure, killed, late, hung, nproc, log_path, stderr) -> int:
    with interrupts.output() as ok:
        if not ok:
            interrupts.wait_for_stop()      # the ranks were killed by the interrupt
        return _describe_job(failure, killed, late, hung, nproc, log_path, stderr)


def _describe_job(failure, killed, late, hung, nproc, log_path, stderr) -> int:
    if failure is None and not hung:
        return 0                    # done, or stopped at the deadline while still working
    if failure is not None and failure[1] == USER_ERROR:
        line = _first_error_line(log_path)      # the rank's own line says it all
        if line is not None:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return USER_ERROR
    if failure is not None:
        rank, code = failure
        parts = [f"error: rank {rank} of {nproc} {_describe(code)}"]
        if killed:
            parts.append(f"{_ranks(killed)} killed")
        else:
            parts.append("the other ranks stopped")
    else:
        when = (f"{DEADLINE_GRACE:g} s after the verify deadline" if late
                else "after the others had exited")
        parts = [f"error: {_ranks(hung)} of {nproc} hung (stopped, or behind the others' "
                 f"collectives) and still running {when}; killed"]
    said = _first_error_line(log_path)
    if said:
        parts.append(said)
    if log_path is not None:
        parts.append(f"the ranks' output is in {log_path}")
    print("; ".join(parts), file=sys.stderr if log_path is not None else stderr, flush=True)
    return RANK_FAILED
