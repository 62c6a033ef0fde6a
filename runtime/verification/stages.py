"""What `verify` tells a person while it works, and what decided its answer.

On a terminal each stage prints one line as it starts (`[  2.31 s] box 1/2  CROWN`), branch
and bound keeps one status line up to date, and the run ends with the verdict, the stage and
the box that decided it and the wall time since the command started. Piped or with `-q`
nothing but the verdict and that final line is written (a harness reads the first line), so
logs stay clean. The same records make the `--json` report.

Times are wall-clock seconds since the command started (`started_at`, passed from the
`shardbound verify` process to its ranks), because that is what a person and a harness see.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

LABELS = {
    "compile": "compile",
    "launch": "start the ranks",
    "attack": "attack (PGD)",
    "crown": "CROWN",
    "intermediate": "intermediate-bound optimisation",
    "alpha-crown": "alpha-CROWN",
    "input-split": "branch and bound (input splitting)",
    "attack-strong": "strong attack (PGD, 32 restarts)",
    "split-refine": "intermediate bounds by split refinement",
    "milp": "MILP over the unstable ReLUs (HiGHS)",
    "relu-split": "branch and bound (ReLU and interval splitting, beta-CROWN)",
}


@dataclass
class StageRecord:
    stage: str                  # a key of LABELS
    box: int | None             # 0-based case of the property; None for compile / launch
    started_s: float            # since the command started
    seconds: float | None = None

    @property
    def label(self) -> str:
        return LABELS.get(self.stage, self.stage)

    def as_json(self) -> dict:
        d = asdict(self)
        d["label"] = self.label
        return d


class StageLog:
    """Stage lines and the branch-and-bound status line; silent unless `live`."""

    def __init__(self, started_at: float, quiet: bool = False, stream=None, boxes: int = 1,
                 records=None):
        self.started_at = started_at
        self.stream = stream or sys.stdout
        self.live = not quiet and _isatty(self.stream)
        self.boxes = boxes
        self.records: list[StageRecord] = list(records or [])
        self._status = False
        self._last = 0.0

    def elapsed(self) -> float:
        return time.time() - self.started_at

    def start(self, stage: str, box: int | None = None) -> None:
        now = self.elapsed()
        if self.records and self.records[-1].seconds is None:
            self.records[-1].seconds = now - self.records[-1].started_s
        self.records.append(StageRecord(stage, box, now))
        if self.live:
            self._clear()
            where = f"box {box + 1}/{self.boxes}  " if box is not None else ""
            self.stream.write(f"[{now:7.2f} s] {where}{LABELS.get(stage, stage)}\n")
            self.stream.flush()

    def end(self) -> None:
        if self.records and self.records[-1].seconds is None:
            self.records[-1].seconds = self.elapsed() - self.records[-1].started_s
        self.done()

    def last(self, box: int | None = None) -> StageRecord | None:
        """The latest stage (of `box`, when given)."""
        for r in reversed(self.records):
            if box is None or r.box == box:
                return r
        return None

    # branch and bound's status line: the callable input_split / relu_split take
    def __call__(self, domains_left, verified, elapsed) -> None:
        if not self.live or time.monotonic() - self._last < 0.2:
            return
        self._last = time.monotonic()
        self.stream.write(f"\r            {domains_left} domains left, {100 * verified:6.2f}% "
                          f"of the box verified, {self.elapsed():7.2f} s ")
        self.stream.flush()
        self._status = True

    def done(self) -> None:
        if self.live:
            self._clear()

    def _clear(self) -> None:
        if self._status:
            self.stream.write("\r" + " " * 78 + "\r")
            self.stream.flush()
            self._status = False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def final_line(source: str, verdict: str, decided: StageRecord | None, boxes: int,
               since_start: float) -> str:
    """`# prop.vnnlib: unsat -- box 2 of 2 decided by alpha-CROWN; 3.41 s since the command
    started`: what decided the answer, in words."""
    if decided is None or decided.box is None:
        how = "no bounding needed" if verdict != "timeout" else "out of time before any stage"
    else:
        box = f"box {decided.box + 1} of {boxes}"
        how = {"sat": f"counterexample in {box}, found by {decided.label}",
               "unsat": f"every box proved, the last ({box}) by {decided.label}",
               "timeout": f"out of time in {box} during {decided.label}",
               }.get(verdict, f"{box} left undecided after {decided.label}")
    return f"# {source}: {verdict} -- {how}; {since_start:.2f} s since the command started"
