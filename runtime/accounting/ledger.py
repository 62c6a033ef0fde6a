"""A memory ledger: bytes of what bound propagation keeps alive, per category, with peaks.

Categories: `resident_param` (what a rank holds of the weights between uses: everything in
single mode, its 1/P shards in fsdp), `gathered_param` (full parameters gathered for one node),
`a_matrix` (live CROWN A-matrices), `bounds` (intermediate bounds and IBP tensors),
`collective` (tp: send and receive buffers of the reduction of Partial tensors), and for
alpha-CROWN `alpha` (the slopes with the optimiser's two moment tensors) and `autograd` (what
the autograd graph saves for the gradient: mostly earlier A-matrices and slopes). The
tracked peak is the peak of the sum; peak RSS comes from the OS, so single and sharded runs
compare directly.

With a budget (`--memory-budget`, per rank) the ledger is also the run-time guard: the engine
asks `reserve(nbytes)` before it allocates a large tensor (a backward step's outputs, a
gathered parameter or block, a node's IBP bounds), and any tracked total past the budget
raises `MemoryBudgetExceeded`, one line naming the node being visited and the bytes: the run
stops before the allocation (never an out-of-memory kill), exit code 2 like any user error.
"""

from __future__ import annotations

import resource
import sys

from shardbound.runtime.errors import ShardboundError

CATEGORIES = ("resident_param", "gathered_param", "a_matrix", "bounds", "collective", "alpha",
              "autograd")


class MemoryBudgetExceeded(ShardboundError):
    """A run that would pass its per-rank memory budget (a user error: exit code 2)."""


def format_bytes(n: float) -> str:
    """Bytes as a person reads them (binary units, as --memory-budget accepts them)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{int(n)}B"


class MemoryLedger:
    def __init__(self, budget: int | None = None):
        self.current = {c: 0 for c in CATEGORIES}
        self.peak = {c: 0 for c in CATEGORIES}
        self.peak_total = 0
        self.budget = budget            # per-rank tracked bytes a run may hold (None: any)
        self.where = ""                 # the node being visited (the engine keeps it current)

    def add(self, category: str, nbytes: int) -> None:
        self.set(category, self.current[category] + int(nbytes))

    def set(self, category: str, nbytes: int) -> None:
        grows = int(nbytes) > self.current[category]
        self.current[category] = int(nbytes)
        self.peak[category] = max(self.peak[category], int(nbytes))
        total = sum(self.current.values())
        self.peak_total = max(self.peak_total, total)
        if self.budget is not None and grows and total > self.budget:
            self._exceeded(total, category)

    def reserve(self, nbytes: int, category: str = "a_matrix") -> None:
        """Before allocating `nbytes` more: stop if the total would pass the budget."""
        if self.budget is None:
            return
        total = sum(self.current.values()) + int(nbytes)
        if total > self.budget:
            self._exceeded(total, category)

    def _exceeded(self, total: int, category: str):
        where = (f"at node {self.where!r}" if self.where
                 else "while loading the weights" if category == "resident_param" else "")
        raise MemoryBudgetExceeded(
            f"memory budget exceeded {where}: it needs {format_bytes(total)} ({total} bytes "
            f"tracked, {category.replace('_', ' ')} growing) of a per-rank budget of "
            f"{format_bytes(self.budget)} ({self.budget} bytes); stopped before allocating. "
            "Recompile with a larger --memory-budget (the planner then picks more ranks or "
            "smaller row tiles), or run with a larger one")

    def reset_peaks(self) -> None:
        """Start a new measurement: peaks restart from what is held now (the resident
        parameters), so consecutive runs on one loaded program are measured separately."""
        self.peak = dict(self.current)
        self.peak_total = sum(self.current.values())

    def report(self) -> dict:
        return {"resident_param_bytes": self.peak["resident_param"],
                "peak_tracked_bytes": self.peak_total,
                "peak_gathered_param_bytes": self.peak["gathered_param"],
                "peak_a_matrix_bytes": self.peak["a_matrix"],
                "peak_bounds_bytes": self.peak["bounds"],
                "peak_collective_bytes": self.peak["collective"],
                "peak_alpha_bytes": self.peak["alpha"],
                "peak_autograd_bytes": self.peak["autograd"],
                "peak_rss_bytes": peak_rss_bytes()}


def peak_rss_bytes() -> int:
    """This process's own peak resident set. On Linux, VmHWM from /proc: ru_maxrss of a child
    process starts from its parent's peak, which would hide the child's own use."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensor storages among `tensors` (views of one storage count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()       # one storage object per tensor (it is made per call)
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


class SavedTensorCounter:
    """Counts, in the ledger's `autograd` category, the distinct storages the autograd graph
    saves while it is built (a saved_tensors_hooks pack hook); `clear` when the graph is gone."""

    def __init__(self, ledger: MemoryLedger):
        self.ledger = ledger
        self.seen: dict[int, int] = {}

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen[storage.data_ptr()] = storage.nbytes()
            self.ledger.set("autograd", sum(self.seen.values()))
        return t

    @staticmethod
    def unpack(t):
        return t

    def clear(self) -> None:
        self.seen.clear()
        self.ledger.set("autograd", 0)


def max_over_ranks(reports: list[dict]) -> dict:
    return {k: max(r[k] for r in reports) for k in reports[0]}
