"""runtime/parallel/progress.py: a rank's collective count reaches the store without a store
write per collective (the count names dead and hung ranks: tests/test_fsdp.py and
tests/test_budget.py run the failures themselves)."""

from __future__ import annotations

import threading
import time

from shardbound.runtime.parallel.progress import PERIOD, ProgressPublisher, progress_key


class _Store:
    """The store calls the publisher makes, recorded."""

    def __init__(self):
        self.values, self.writes, self.lock = {}, 0, threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.values[key], self.writes = value, self.writes + 1


def _until(cond, limit=10.0):
    end = time.monotonic() + limit
    while not cond() and time.monotonic() < end:
        time.sleep(PERIOD / 5)
    return cond()


def test_the_thread_publishes_the_latest_count_once_per_change():
    store = _Store()
    pub = ProgressPublisher(store, rank=3)
    try:
        for step in range(1, 1001):     # a thousand collectives between two publications
            pub.step = step
        assert _until(lambda: store.values.get(progress_key(3)) == "1000")
        writes = store.writes
        time.sleep(3 * PERIOD)          # no change: no write
        assert store.writes == writes and writes < 1000
    finally:
        pub.close()


def test_flush_writes_at_once_and_close_stops_the_thread():
    store = _Store()
    pub = ProgressPublisher(store, rank=0)
    pub.close()
    assert not pub._thread.is_alive()
    pub.step = 7
    pub.flush()
    assert store.values == {progress_key(0): "7"}
    pub.flush()                         # already published: no second write
    assert store.writes == 1


def test_a_failing_store_is_not_an_error():
    class Gone:
        def set(self, key, value):
            raise RuntimeError("connection reset")

    pub = ProgressPublisher(Gone(), rank=1)
    pub.step = 2
    pub.flush()
    pub.close()
