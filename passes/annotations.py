"""The passes' annotations as types, and the one printer that `inspect` and program.py share.

Each pass annotates nodes with one of these frozen dataclasses (they used to be prose strings,
and tp's placement a `str` subclass carrying attributes): codegen reads their fields (a tp
zone's role and channel count, the bound plan's method), plan.json stores `as_json()`, and
`text()` is what a person reads, in full, in `inspect` (`key=text` on the node's line) and in
program.py (`# key: text` in the node's block, wrapped, never cut).

Keys and their order: bounds (bound_plan), tp (tp_zones), fsdp (fsdp_schedule), summation
(summation_order), memory (memory_plan, on the input node).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

ORDER = ("bounds", "tp", "fsdp", "summation", "memory", "budget")


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


class Annotation:
    """What every annotation offers: `text()` (the printer) and `as_json()` (plan.json)."""

    def text(self) -> str:
        raise NotImplementedError

    def as_json(self) -> dict:
        return {"type": type(self).__name__, **_jsonable(asdict(self)), "text": self.text()}

    def __str__(self) -> str:
        return self.text()


@dataclass(frozen=True)
class BoundPlan(Annotation):
    """bound_plan: this node feeds relaxed ops, so CROWN needs its bounds, by `method`."""

    method: str                          # "crown" | "ibp"
    feeds: tuple[str, ...] = ()          # the relaxed consumers that need them

    def text(self) -> str:
        return f"{self.method} (feeds {', '.join(self.feeds)})" if self.feeds else self.method


@dataclass(frozen=True)
class PhaseRun:
    """Consecutive phases of a run: `first` .. `last`, `count` of them."""

    first: str
    last: str
    count: int

    def text(self) -> str:
        if self.count == 1:
            return self.first
        sep = " " if self.count == 2 else " .. "
        return f"{self.first}{sep}{self.last}" + (f" ({self.count})" if self.count > 2 else "")


@dataclass(frozen=True)
class FsdpUse(Annotation):
    """fsdp_schedule: the parameters this node all-gathers right before it runs and frees
    right after, and every phase in which that happens (runs of consecutive phases)."""

    params: tuple[str, ...]
    phases: int
    runs: tuple[PhaseRun, ...]
    streamed: tuple[str, ...] = ()       # 2-D weights gathered block by block, never whole
    stream_chunk_kib: int = 0            # 0: chosen per layer and P (plan.json stream_chunks)

    def text(self) -> str:
        whole = [r for r in self.params if r not in self.streamed]
        parts = []
        if whole:
            parts.append(f"all-gather {', '.join(whole)} right before this node runs, free "
                         "right after")
        if self.streamed and self.stream_chunk_kib:
            parts.append(f"{', '.join(self.streamed)} streamed in blocks of at most "
                         f"{self.stream_chunk_kib} KiB (on P > 1 ranks), never gathered whole")
        elif self.streamed:
            parts.append(f"{', '.join(self.streamed)} streamed in blocks of the chunk chosen "
                         "for this layer and rank count (plan.json stream_chunks)")
        phases = ", ".join(r.text() for r in self.runs)
        return "; ".join(parts) + f"; in {self.phases} phases: {phases}"


@dataclass(frozen=True)
class SummationNote(Annotation):
    """summation_order: the node's contractions (the kernel's `summation_note`) under the
    program's order, with the lengths it sums over and their 256-blocks under blocked."""

    order: str
    note: str
    lengths: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()

    def text(self) -> str:
        return self.note


@dataclass(frozen=True)
class RankMemory:
    ranks: int
    resident_bytes: int
    peak_bytes: int

    def text(self) -> str:
        mib = 2 ** 20
        return (f"P={self.ranks}: resident {self.resident_bytes / mib:.2f}MiB "
                f"peak {self.peak_bytes / mib:.2f}MiB")


@dataclass(frozen=True)
class MemoryPrediction(Annotation):
    """memory_plan: the predicted per-rank peak of a CROWN run over one box, per world size
    (`not_modelled` says why there is none, as in tp)."""

    per_rank: tuple[RankMemory, ...] = ()
    not_modelled: str = ""

    def text(self) -> str:
        if self.not_modelled:
            return self.not_modelled
        return ("predicted per-rank crown peak (1 box): "
                + ", ".join(r.text() for r in self.per_rank))


@dataclass(frozen=True)
class StreamChunks(Annotation):
    """memory_plan (fsdp, no --stream-chunk-kib): each streamable layer's stream chunk in
    bytes per world size, ((P, ((node, bytes), ...)), ...) (runtime/accounting/chunk_choice.py);
    plan.json keeps it as `stream_chunks` for the runtime."""

    per_rank: tuple = ()

    def as_dict(self) -> dict:
        return {str(P): dict(chunks) for P, chunks in self.per_rank}

    def text(self) -> str:
        return "fsdp stream chunks (KiB, per layer): " + "; ".join(
            f"P={P}: " + ", ".join(f"{name} {b // 1024}" for name, b in chunks)
            for P, chunks in self.per_rank)


@dataclass(frozen=True)
class Placement(Annotation):
    """tp_zones: where a node's tensors live over the ranks. `role`: replicate, column,
    elementwise or row (of zone `zone`, splitting `channels`); `split`: each rank's channel
    range for the P the program is planned for (`compile --nproc`), () for P = 1."""

    role: str = "replicate"
    zone: int = -1
    channels: int = 0
    local_rows: bool = False
    crown_rows: str = ""                 # "local" | "all" when CROWN bounds this zone node
    reduction: str = ""                  # how Partial sums are finished, e.g. "blocked ..."
    bias_partial: bool = False           # elementwise: its bias terms are Partial too
    split: tuple[tuple[int, int], ...] = ()
    nproc: int = 1
    summary: str = ""                    # the input node's: zones found, intermediates

    def text(self) -> str:
        crown = f"; crown rows {self.crown_rows}" if self.crown_rows else ""
        split = ""
        if self.split:
            split = (f"; channels on P={self.nproc}: "
                     + " ".join(f"[{a},{b})" for a, b in self.split))
        z = f"zone{self.zone}"
        if self.role == "column":
            return (f"{z} column: out Shard(0) of {self.channels}, weight Shard(0), bias "
                    f"Shard(0); bwd A.W Partial -> {self.reduction}{crown}{split}")
        if self.role == "elementwise":
            bias = f"; bias terms Partial -> {self.reduction}" if self.bias_partial else ""
            return f"{z} elementwise: out Shard(0){bias}{crown}"
        if self.role == "row":
            return (f"{z} row: in Shard(0), out Partial -> {self.reduction} -> Replicate; "
                    f"weight Shard(1), bias Replicate{split}")
        return "Replicate" + (f"; {self.summary}" if self.summary else "")


def notes(graph, name: str) -> list[tuple[str, str]]:
    """(key, text) of every annotation of node `name`, in ORDER then by key: the one printer
    behind `inspect` and the program's comments."""
    keys = [k for k in ORDER if k in graph.annotations]
    keys += sorted(k for k in graph.annotations if k not in ORDER)
    out = []
    for key in keys:
        value = graph.annotations[key].get(name)
        if value is not None:
            out.append((key, value.text() if isinstance(value, Annotation) else str(value)))
    return out


def as_json(value):
    """An annotation for plan.json (plain values pass through)."""
    return value.as_json() if isinstance(value, Annotation) else value
