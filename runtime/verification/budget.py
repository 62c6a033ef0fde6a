"""One time budget for a verification run, checked by every stage and agreed by every rank.

`verify --timeout S` promises the verdict S seconds after the command started. Each stage
(attack, CROWN, alpha-CROWN, the intermediate-bound optimiser, every branch-and-bound round)
asks `expired()` at its natural steps: a PGD step, a projected-Adam iteration (the shared
loop's `stop`), a node with CROWN bounds, a round. Stopping there is always sound: an
optimiser keeps the best bound found so far, and a stopped CROWN pass or round raises
`BudgetExhausted`, which the verifier turns into the verdict `timeout`.

In a job of several ranks every rank must take the same branch at the same collective, and
clocks differ by scheduling: `expired()` is then itself a collective (the flag OR-ed over
ranks), called at the same points on every rank because they run the same program on the
same bounds.
"""

from __future__ import annotations

import math
import time

import torch


class BudgetExhausted(Exception):
    """The verification budget ran out (on every rank at once)."""


class Budget:
    def __init__(self, deadline: float | None = None, comm=None):
        """`deadline`: a time.monotonic() value, or None for no limit; `comm`: the job's
        communicator (None or world size 1: a local decision)."""
        self.deadline = deadline
        self.comm = comm if comm is not None and comm.world > 1 else None

    @classmethod
    def seconds(cls, timeout_s: float, comm=None) -> "Budget":
        return cls(time.monotonic() + timeout_s if math.isfinite(timeout_s) else None, comm)

    def remaining(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def expired(self) -> bool:
        """Whether the budget is spent, the same answer on every rank."""
        local = self.deadline is not None and time.monotonic() >= self.deadline
        if self.comm is None:
            return local
        return bool(self.comm.all_reduce_max(torch.tensor([float(local)]))[0] > 0)

    def check(self) -> None:
        if self.expired():
            raise BudgetExhausted()

    __call__ = expired          # a Budget is the `stop` callable the loops take
