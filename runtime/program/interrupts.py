"""Ctrl-C, SIGTERM and the verify deadline: stop at once, say so in one line, leave nothing.

A Python signal handler runs only between bytecodes of the main thread, which spends its time
inside long torch calls: single-process verify took 9 s to react to Ctrl-C, and then printed
a `KeyboardInterrupt` traceback. So `install` blocks SIGINT and SIGTERM in the main thread
(threads started later inherit that) and one daemon thread waits for them with `sigwait`; torch
releases the GIL in its kernels, so the thread acts within milliseconds. It runs the
registered cleanups (the launcher's: kill every rank; verify's: delete its temporary
directory), prints `interrupted` and leaves with exit code 130 through os._exit: nothing
unwinds, so nothing more is written.

Final output (result files, the verdict line) is written inside `final_output()`, under the
lock `stop` takes: a write that began before the signal completes, none begins after it, and
the verify watchdog (`Deadline`) and the main thread never both answer.

Ranks started by our launcher (SHARDBOUND_LAUNCHER set) instead die at once and silently on
SIGINT/SIGTERM (the default action: the launcher reports), and stop by themselves when the
launcher is gone (a thread watches the parent), so no rank outlives its job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "SHARDBOUND_LAUNCHER"        # the launcher's pid, in the environment of ranks
INTERRUPTED = 130
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.RLock()
_ended = False                  # the final output was produced (or the process is stopping)
_stopping = False               # `stop` has begun: nothing else may print
_cleanups: list = []
_installed = False


def installed() -> bool:
    return _installed


def add_cleanup(fn) -> None:
    """Run `fn()` (no arguments, exceptions ignored) before the process stops on a signal or
    at the deadline; cleanups run newest first."""
    with _lock:
        _cleanups.append(fn)


def remove_cleanup(fn) -> None:
    with _lock:
        if fn in _cleanups:
            _cleanups.remove(fn)


@contextlib.contextmanager
def final_output():
    """`with final_output() as ok:` write the job's result only if ok; afterwards no
    interruption or deadline adds output. (Called from Python, without `install`, every
    call is ok: one process may then run many commands.)"""
    global _ended
    with _lock:
        ok = not _ended
        _ended = _installed
        yield ok


@contextlib.contextmanager
def output():
    """`with output() as ok:` print a message only if ok: never while the process stops on
    a signal (its cleanups kill ranks and delete files, which the main thread may notice
    and report: that would be a second line after `interrupted`)."""
    with _lock:
        yield not _stopping


def stopping() -> bool:
    return _stopping


def wait_for_stop() -> None:
    """Block until the stopping thread ends the process (call only when `stopping()`)."""
    with _lock:
        pass
    while True:
        time.sleep(1)


def run_cleanups() -> None:
    with _lock:
        fns = list(reversed(_cleanups))
        _cleanups.clear()
    for fn in fns:
        try:
            fn()
        except Exception:
            pass


def stop(code: int = INTERRUPTED, line: str | None = "interrupted", stream=None) -> None:
    """End the process now: cleanups, one line (on stderr by default), exit `code`. Never
    returns; a second caller waits here until the first one has ended the process."""
    global _ended, _stopping
    _lock.acquire()             # held until os._exit: no final output starts after this
    _ended = _stopping = True
    run_cleanups()
    if line:
        out = stream or sys.stderr
        try:
            out.write(line + "\n")
            out.flush()
        except Exception:
            pass
    try:
        sys.stdout.flush()
    except Exception:
        pass
    os._exit(code)


def _on_signal(signum, frame=None) -> None:
    stop()


def _wait_for_signals() -> None:
    signum = signal.sigwait(set(STOP_SIGNALS))
    _on_signal(signum)


def install() -> None:
    """Take over SIGINT and SIGTERM for this process (call it first thing in an entry point)."""
    global _installed
    if _installed:
        return
    _installed = True
    if os.environ.get(LAUNCHER_ENV):
        _install_rank()
        return
    for s in STOP_SIGNALS:      # a signal reaching Python's handler in the main thread anyway
        signal.signal(s, _on_signal)
    if hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
        threading.Thread(target=_wait_for_signals, name="shardbound-signals", daemon=True).start()


def unblocked_for_children():
    """Context for starting child processes: they inherit the signal mask of the calling
    thread, so it is lifted around the start (the Python handler covers that moment)."""
    @contextlib.contextmanager
    def ctx():
        if not (_installed and hasattr(signal, "pthread_sigmask")):
            yield
            return
        old = signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return ctx()


def _install_rank() -> None:
    """A rank of our launcher's job: default (silent, immediate) death on SIGINT/SIGTERM,
    and stop when the launcher is gone."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    try:
        launcher = int(os.environ[LAUNCHER_ENV])
    except ValueError:
        return

    def watch():
        while True:
            if os.getppid() != launcher:
                os._exit(INTERRUPTED)
            time.sleep(0.25)

    threading.Thread(target=watch, name="shardbound-parent-watch", daemon=True).start()


class Deadline:
    """The verify backstop: if the answer is not out `grace` seconds after the deadline (a
    stage stuck in one long torch call), answer `timeout` from this thread and end the
    process. `answer()` writes the result; it runs inside `final_output`, so it never races
    the main thread's own answer."""

    def __init__(self, deadline: float, answer, grace: float):
        self.fire_at = deadline + grace
        self.answer = answer
        self._cancel = threading.Event()
        threading.Thread(target=self._run, name="shardbound-deadline", daemon=True).start()

    def cancel(self) -> None:
        self._cancel.set()

    def _run(self) -> None:
        while not self._cancel.wait(max(0.0, self.fire_at - time.monotonic())):
            if time.monotonic() >= self.fire_at:
                break
        if self._cancel.is_set():
            return
        with final_output() as ok:
            if not ok:
                return
            try:
                self.answer()
            except Exception:
                pass
            run_cleanups()
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except Exception:
                pass
            os._exit(0)
