"""All collectives go through here: one place for the backend choice, timeouts and messages.

`Comm` wraps torch.distributed for one process group; `SingleComm` is the same interface for one
process (world size 1, no torch.distributed at all). Every collective runs under the group's
timeout: a rank that dies or hangs makes the others fail within it, with a message naming the
collective and the ranks that fell behind (read from a progress counter each rank keeps in the
rendezvous store), instead of a hang or a traceback from deep inside torch.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re

import torch

from shardbound.runtime.errors import ShardboundError
from shardbound.runtime.parallel.progress import ProgressPublisher, progress_key

DEFAULT_TIMEOUT_S = 60.0


class RankFailure(ShardboundError):
    """A peer rank died or hung during a collective."""


def resolve_device(name: str = "cpu") -> torch.device:
    """"cpu", "cuda" or "auto" (cuda when available). Under torchrun each rank takes the GPU
    of its LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ShardboundError("--device cuda: no CUDA device is available here; use --device cpu")
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if name != "cpu":
        raise ShardboundError(f"unknown device {name!r}; choose cpu, cuda or auto")
    return torch.device("cpu")


class SingleComm:
    """World size 1: collectives are identities."""

    rank = 0
    world = 1

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def all_gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        return shard

    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return t

    def all_gather_objects(self, obj) -> list:
        return [obj]

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class Comm:
    """A torch.distributed process group: gloo on CPU, nccl when the tensors live on CUDA."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, device="cpu"):
        import torch.distributed as dist

        self.dist = dist
        self.timeout_s = float(timeout_s)
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            try:
                dist.init_process_group(backend, init_method="env://",
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
            except Exception as e:  # rendezvous failures arrive as several error types
                raise RankFailure(f"rank {os.environ.get('RANK', '?')}: could not join the "
                                  f"process group ({_first_line(e)}); check MASTER_ADDR/PORT, "
                                  "WORLD_SIZE and that every rank started") from None
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.step = 0
        self._store = _default_store()
        self._progress = (ProgressPublisher(self._store, self.rank)
                          if self._store is not None else None)

    # -- failure reporting -------------------------------------------------------------------
    def _enter(self, what: str) -> None:
        self.step += 1
        _maybe_inject_fault(self.rank, self.step)
        if self._progress is not None:
            self._progress.step = self.step      # published by its thread (progress.py)
        self._what = what

    def _failed(self, e: Exception) -> RankFailure:
        behind = []
        if self._progress is not None:
            self._progress.flush()
            for r in range(self.world):
                if r == self.rank:
                    continue
                try:
                    self._store.wait([progress_key(r)], datetime.timedelta(seconds=1))
                    step = int(self._store.get(progress_key(r)))
                except Exception:
                    step = -1
                if step < self.step:
                    behind.append(r)
        if behind:
            who = ("rank " if len(behind) == 1 else "ranks ") + ", ".join(map(str, behind))
            who += " stopped responding (died or hung)"
        else:
            who = "a peer rank stopped responding (died or hung)"
        return RankFailure(f"rank {self.rank}: collective {self._what} (step {self.step}) failed: "
                           f"{who} (timeout {self.timeout_s:g} s): {_first_line(e)}")

    def _run(self, what: str, fn):
        self._enter(what)
        try:
            return fn()
        except ShardboundError:
            raise
        except Exception as e:
            raise self._failed(e) from None

    # -- collectives ---------------------------------------------------------------------------
    def all_gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's equally sized 1-D shard, in rank order."""
        shard = shard.contiguous()
        out = torch.empty(shard.numel() * self.world, dtype=shard.dtype, device=shard.device)
        self._run("all_gather", lambda: self.dist.all_gather_single(out, shard))
        return out

    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite the contiguous `t` on every rank with rank `src`'s `t`."""
        self._run("broadcast", lambda: self.dist.broadcast(t, src=src))
        return t

    def all_gather_objects(self, obj) -> list:
        out = [None] * self.world
        self._run("all_gather_object", lambda: self.dist.all_gather_object(out, obj))
        return out

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        self._run("all_reduce_max", lambda: self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX))
        return t

    def barrier(self) -> None:
        self._run("barrier", lambda: self.dist.barrier())

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


@contextlib.contextmanager
def rank_session(threads: int, timeout_s: float, device: str = "cpu"):
    """The communicator of one run: set the thread count, join the job (or not), and on the
    way out close a single process's group; a job's ranks leave through `exit_rank`. The
    process keeps freed memory for reuse (runtime/program/allocator.py)."""
    from shardbound.runtime.program.allocator import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(threads)
    comm = from_environment(timeout_s=timeout_s, device=device)
    try:
        yield comm
    finally:
        if comm.world == 1:
            comm.close()


def exit_rank(code: int) -> None:
    """End a rank of a multi-process job once its work (and the final barrier) is done.

    Measured: letting the interpreter tear down a gloo process group after a peer has already
    exited sometimes aborts the rank in C++ ("terminate called without an active exception",
    SIGABRT), which turned finished jobs into failures. The results are written by then, so a
    rank skips that teardown: flush the standard streams and leave with os._exit.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _maybe_inject_fault(rank: int, step: int) -> None:
    """Fault injection for the failure tests: SHARDBOUND_FAULT="RANK:STEP:die|hang" makes that
    rank exit (or stop responding) when it reaches that collective."""
    spec = os.environ.get("SHARDBOUND_FAULT")
    if not spec:
        return
    r, s, how = spec.split(":")
    if int(r) == rank and int(s) == step:
        if how == "hang":
            import time
            time.sleep(3600)
        os._exit(17)


def _default_store():
    """The job's rendezvous store itself (not torch's prefixed view of it), so that progress
    keys have the plain names the launcher reads (see progress.progress_key)."""
    try:
        from torch.distributed import PrefixStore
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        while isinstance(store, PrefixStore) and hasattr(store, "underlying_store"):
            store = store.underlying_store
        return store
    except Exception:
        return None


def _first_line(e: Exception) -> str:
    """The first line of a backend error, without gloo's source-file prefix."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(e)).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def from_environment(timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu"):
    """A Comm when launched by torchrun or `shardbound run --nproc` (WORLD_SIZE set), else
    a SingleComm. The device ("cpu", "cuda", "auto") picks the backend: gloo on CPU, nccl on
    CUDA."""
    dev = resolve_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        return Comm(timeout_s, dev)
    return SingleComm(dev)
