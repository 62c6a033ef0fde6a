"""Parameters as the program sees them: whole tensors (single mode) or fsdp shards.

In fsdp every parameter is split evenly over the P ranks as a flat, zero-padded vector; each
rank reads only the rows of weights.safetensors that cover its slice (safetensors slices are
read lazily from the file), and `gather` all-gathers the slices into a contiguous tensor of the
original layout right before a node uses it. The arithmetic is then exactly that of single mode.

A whole gathered matrix is the one tensor whose size does not fall with P, so large matrices
can also be streamed: `gather_block` rebuilds just a (rows x columns) block of it, each owner
broadcasting the part of its flat slice that falls in the block. Nodes whose products are
invariant to how the output is cut (the `blocked` and `exact` orders) use it in chunks of
`--stream-chunk-kib` (plan.json's
`stream_chunk_bytes`), so a rank never holds more than one chunk of any weight matrix.
"""

from __future__ import annotations

import math

import torch
from safetensors import safe_open

from shardbound.runtime.accounting.ledger import MemoryBudgetExceeded
from shardbound.runtime.errors import ShardboundError

from shardbound.options import STREAM_CHUNK_KIB  # noqa: E402  (the one default, `--stream-chunk-kib`)

STREAM_CHUNK_BYTES = STREAM_CHUNK_KIB * 1024   # the most of one weight matrix a rank streams at once


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, stop, shard size) of this rank's flat slice; the last ranks may be padding."""
    size = -(-numel // world)
    start = min(rank * size, numel)
    return start, min(start + size, numel), size


class ShardedParam:
    """One rank's slice of a parameter; `gather()` rebuilds the whole tensor."""

    def __init__(self, handle, key: str, comm, ledger, chunk_bytes: int = STREAM_CHUNK_BYTES):
        sl = handle.get_slice(key)
        self.chunk_bytes = int(chunk_bytes)
        self.key = key
        self.shape = tuple(sl.get_shape())
        self.numel = math.prod(self.shape)
        self.comm, self.ledger = comm, ledger
        start, stop, size = shard_range(self.numel, comm.rank, comm.world)
        ledger.reserve(size * 4, "resident_param")          # --memory-budget: before reading
        row = math.prod(self.shape[1:]) if len(self.shape) > 1 else 1
        shard = torch.zeros(size, dtype=torch.float32)
        if stop > start:
            r0, r1 = start // row, -(-stop // row)
            rows = sl[r0:r1] if self.shape else sl[:]
            flat = rows.reshape(-1)[start - r0 * row: stop - r0 * row]
            shard[: stop - start] = flat.to(torch.float32)
        if not bool(torch.isfinite(shard).all()):
            raise ShardboundError(f"tensor {key!r} holds inf or nan values; recompile the model")
        self.shard = shard.to(comm.device)
        ledger.add("resident_param", self.shard.numel() * 4)

    def gather(self) -> torch.Tensor:
        self.ledger.reserve(self._gathered_bytes(), "gathered_param")
        full = self.comm.all_gather_flat(self.shard)[: self.numel].reshape(self.shape).contiguous()
        self.ledger.add("gathered_param", self._gathered_bytes())
        return full

    def release(self, full: torch.Tensor) -> None:
        self.ledger.add("gathered_param", -self._gathered_bytes())

    # -- streaming: one block of a 2-D weight at a time ------------------------------------------
    @property
    def streams(self) -> bool:
        """Whether products with this parameter should stream it in chunks: a 2-D weight
        larger than one chunk, split over several ranks."""
        return (self.comm.world > 1 and len(self.shape) == 2
                and self.numel * 4 > self.chunk_bytes)

    def row_chunks(self) -> list[tuple[int, int]]:
        """Row ranges [r0, r1) of at most one chunk each (the same on every rank)."""
        return _chunks(self.shape[0], max(1, self.chunk_bytes // 4 // self.shape[1]))

    def column_chunks(self) -> list[tuple[int, int]]:
        return _chunks(self.shape[1], max(1, self.chunk_bytes // 4 // self.shape[0]))

    def gather_block(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """W[r0:r1, c0:c1] as a new contiguous tensor, on every rank (a collective).

        In row-major order the block's elements have increasing flat index, so the elements
        one rank owns form one contiguous segment of the block: each owner packs its segment
        and broadcasts it straight into place."""
        cols = self.shape[1]
        width = c1 - c0
        self.ledger.reserve((r1 - r0) * width * 4, "gathered_param")
        out = torch.empty((r1 - r0) * width, dtype=torch.float32, device=self.shard.device)
        size = self.shard.numel()

        def before(flat: int) -> int:
            """How many block elements have a flat index below `flat`."""
            row, col = divmod(min(max(flat, 0), self.numel), cols)
            full = min(max(row - r0, 0), r1 - r0) * width
            part = min(max(col - c0, 0), width) if r0 <= row < r1 else 0
            return full + part

        for owner in range(self.comm.world):
            lo, hi = before(owner * size), before((owner + 1) * size)
            if hi == lo:
                continue
            segment = out[lo:hi]
            if owner == self.comm.rank:
                pos = torch.arange(lo, hi, device=out.device)
                flat = (r0 + pos // width) * cols + c0 + pos % width - owner * size
                segment.copy_(self.shard[flat])
            self.comm.broadcast_(segment, owner)
        self.ledger.add("gathered_param", out.numel() * 4)
        return out.reshape(r1 - r0, width)

    def release_block(self, block: torch.Tensor) -> None:
        self.ledger.add("gathered_param", -block.numel() * 4)

    def _gathered_bytes(self) -> int:
        # With one rank the "gathered" tensor is a view of the shard: no extra memory.
        return self.numel * 4 if self.comm.world > 1 else 0


def _chunks(total: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(i + step, total)) for i in range(0, total, step)]


def open_params(path: str, mode: str, comm, ledger,
                chunk_bytes: int = STREAM_CHUNK_BYTES) -> dict:
    """The `params` mapping a program's build() takes."""
    try:
        with safe_open(path, framework="pt") as f:
            if mode == "fsdp":
                return {k: ShardedParam(f, k, comm, ledger, chunk_bytes) for k in f.keys()}
            ledger.reserve(sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()),
                           "resident_param")            # --memory-budget: before reading
            params = {k: f.get_tensor(k).to(comm.device) for k in f.keys()}
        for k, t in params.items():
            if t.dtype != torch.float32:
                raise ShardboundError(f"{path}: tensor {k!r} is {t.dtype}, not float32; "
                                      "recompile the model")
            if not bool(torch.isfinite(t).all()):
                raise ShardboundError(f"{path}: tensor {k!r} holds inf or nan values; "
                                      "recompile the model")
    except FileNotFoundError:
        raise ShardboundError(f"{path}: missing; recompile the model") from None
    except MemoryBudgetExceeded:
        raise
    except ShardboundError as e:
        text = str(e)
        raise ShardboundError(text if text.startswith(path) else f"{path}: {text}") from None
    except Exception as e:
        raise ShardboundError(f"{path}: unreadable weights ({type(e).__name__}); recompile") from None
    ledger.add("resident_param", sum(t.numel() * t.element_size() for t in params.values()))
    return params
