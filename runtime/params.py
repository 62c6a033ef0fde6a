"""Parameters as the program sees them: whole tensors (single mode) or fsdp shards.

In fsdp every parameter is split evenly over the P ranks as a flat, zero-padded vector; each
rank reads only the rows of weights.safetensors that cover its slice (safetensors slices are
read lazily from the file), and `gather` all-gathers the slices into a contiguous tensor of the
original layout right before a node uses it. The arithmetic is then exactly that of single mode.
"""

from __future__ import annotations

import math

import torch
from safetensors import safe_open

from shardbound.runtime.errors import ShardboundError


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, stop, shard size) of this rank's flat slice; the last ranks may be padding."""
    size = -(-numel // world)
    start = min(rank * size, numel)
    return start, min(start + size, numel), size


class ShardedParam:
    """One rank's slice of a parameter; `gather()` rebuilds the whole tensor."""

    def __init__(self, handle, key: str, comm, ledger):
        sl = handle.get_slice(key)
        self.key = key
        self.shape = tuple(sl.get_shape())
        self.numel = math.prod(self.shape)
        self.comm, self.ledger = comm, ledger
        start, stop, size = shard_range(self.numel, comm.rank, comm.world)
        row = math.prod(self.shape[1:]) if len(self.shape) > 1 else 1
        shard = torch.zeros(size, dtype=torch.float32)
        if stop > start:
            r0, r1 = start // row, -(-stop // row)
            rows = sl[r0:r1] if self.shape else sl[:]
            flat = rows.reshape(-1)[start - r0 * row: stop - r0 * row]
            shard[: stop - start] = flat.to(torch.float32)
        self.shard = shard.to(comm.device)
        ledger.add("resident_param", self.shard.numel() * 4)

    def gather(self) -> torch.Tensor:
        full = self.comm.all_gather_flat(self.shard)[: self.numel].reshape(self.shape).contiguous()
        self.ledger.add("gathered_param", self._gathered_bytes())
        return full

    def release(self, full: torch.Tensor) -> None:
        self.ledger.add("gathered_param", -self._gathered_bytes())

    def _gathered_bytes(self) -> int:
        # With one rank the "gathered" tensor is a view of the shard: no extra memory.
        return self.numel * 4 if self.comm.world > 1 else 0


def open_params(path: str, mode: str, comm, ledger) -> dict:
    """The `params` mapping a program's build() takes."""
    try:
        with safe_open(path, framework="pt") as f:
            if mode == "fsdp":
                return {k: ShardedParam(f, k, comm, ledger) for k in f.keys()}
            params = {k: f.get_tensor(k).to(comm.device) for k in f.keys()}
    except FileNotFoundError:
        raise ShardboundError(f"{path}: missing; recompile the model") from None
    except ShardboundError:
        raise
    except Exception as e:
        raise ShardboundError(f"{path}: unreadable weights ({type(e).__name__}); recompile") from None
    ledger.add("resident_param", sum(t.numel() * t.element_size() for t in params.values()))
    return params
