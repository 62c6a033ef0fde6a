"""A memory ledger: bytes of what bound propagation keeps alive, per category, with peaks.

Categories: `resident_param` (what a rank holds of the weights between uses: everything in
single mode, its 1/P shards in fsdp), `gathered_param` (full parameters gathered for one node),
`a_matrix` (live CROWN A-matrices), `bounds` (intermediate bounds and IBP tensors),
`collective` (tp: send and receive buffers of the reduction of Partial tensors), and for
alpha-CROWN `alpha` (the slopes with the optimiser's two moment tensors) and `autograd` (what
the autograd graph saves for the gradient: mostly earlier A-matrices and slopes). The
tracked peak is the peak of the sum; peak RSS comes from the OS, so single and sharded runs
compare directly.
"""

from __future__ import annotations

import resource
import sys

CATEGORIES = ("resident_param", "gathered_param", "a_matrix", "bounds", "collective", "alpha",
              "autograd")


class MemoryLedger:
    def __init__(self):
        self.current = {c: 0 for c in CATEGORIES}
        self.peak = {c: 0 for c in CATEGORIES}
        self.peak_total = 0

    def add(self, category: str, nbytes: int) -> None:
        self.set(category, self.current[category] + int(nbytes))

    def set(self, category: str, nbytes: int) -> None:
        self.current[category] = int(nbytes)
        self.peak[category] = max(self.peak[category], int(nbytes))
        self.peak_total = max(self.peak_total, sum(self.current.values()))

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
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
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
