"""Each rank's count of collectives entered, published to the rendezvous store off the hot path.

The count is what names a dead or hung rank: a failing collective compares its own count with
its peers' (dist.Comm._failed), and the launcher calls a rank hung when it stays behind the
furthest one (launch._Progress). Writing the count into the TCP store on every collective
doubled the CPU cost of a small collective (measured on gloo, 2 ranks on loopback, a 4-float
all_reduce: 502 -> 250 us of CPU and 1018 -> 652 us of wall time per collective without the
write), and branch and bound or alpha-CROWN over ranks make thousands of small collectives.

So the rank only bumps an integer, and a daemon thread writes the latest value every PERIOD
seconds when it changed. A rank blocked in a collective (the case the count exists for) has
its count in the store within PERIOD of entering it; `flush()` writes it at once before the
failure path reads the peers' counts. Both readers tolerate a count a fraction of a second
old: the launcher waits HUNG_AFTER (seconds) before calling a rank hung, and the failure path
reads after its peers have been blocked for the whole collective timeout.
"""

from __future__ import annotations

import threading

PERIOD = 0.05


def progress_key(rank: int) -> str:
    """The store key where a rank counts the collectives it has entered."""
    return f"shardbound/progress/{rank}"


class ProgressPublisher:
    """Publishes `step` (set by the owner, read here) to `store` under the rank's key."""

    def __init__(self, store, rank: int):
        self.store, self.key = store, progress_key(rank)
        self.step = 0
        self._published = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardbound-progress",
                                        daemon=True)
        self._thread.start()

    def flush(self) -> None:
        """Write the current count now if the store has an older one."""
        with self._lock:
            step = self.step
            if step == self._published:
                return
            try:
                self.store.set(self.key, str(step))
                self._published = step
            except Exception:       # a store gone with its host: the count is advisory
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(PERIOD):
            self.flush()
