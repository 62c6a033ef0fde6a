"""tp_zones: Megatron-style tensor-parallel zones and the placement of every node.

A zone is a column-parallel layer (linear split on output neurons, conv split on output
channels; output Shard(0)) -> a chain of elementwise ops (relu, affine; each rank applies them
to its own channels) -> a row-parallel layer (linear split on input neurons, conv split on input
channels; output Partial, finished by the summation order's fixed-order reduction, then
Replicate). Zones are found greedily in topological order along single-consumer chains: the
column layer and every op in the chain feed only the next op of the chain. Everything else is
Replicate: every rank holds it whole and computes it identically.

Bound plan in zones: zone nodes that feed a ReLU get their intermediate bounds from
`--tp-intermediate` (default ibp: local, no communication, looser with every zone; crown: the
collectives of the backward pass, bitwise single mode's bounds under `blocked`). For a CROWN
target in a zone with no zone upstream of it, each rank bounds only its own neurons ("local
rows": no communication); otherwise every rank carries all rows through the reductions.

Annotations: `tp` per node, a `Placement` (a str, shown by `inspect` and in program comments,
written to plan.json) that also carries what codegen needs (role, zone, channel count, rows).
"""

from __future__ import annotations

from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.ir import Graph, Node
from shardbound.runtime.tp_reduce import REDUCTIONS, channel_ranges

ELEMENTWISE = ("relu", "affine")
TP_INTERMEDIATE = ("ibp", "crown")


class Placement(str):
    """Human-readable placement text with the zone facts attached (role: replicate, column,
    elementwise or row)."""

    role: str = "replicate"
    zone: int = -1
    channels: int = 0
    local_rows: bool = False

    @classmethod
    def make(cls, text, role="replicate", zone=-1, channels=0, local_rows=False):
        p = cls(text)
        p.role, p.zone, p.channels, p.local_rows = role, zone, channels, local_rows
        return p


def _column_channels(n: Node) -> int | None:
    if n.op == "linear" and len(n.shape) == 1:
        return n.shape[0]
    if n.op == "conv2d" and n.attr_dict().get("groups", 1) == 1 and len(n.shape) == 3:
        return n.shape[0]
    return None


def _is_row(n: Node, graph: Graph, channels: int, src: Node) -> bool:
    if n.inputs != (src.name,):
        return False
    if n.op == "linear" and len(src.shape) == 1:
        return graph.tensors[n.param("weight")].shape[1] == channels
    if n.op == "conv2d" and n.attr_dict().get("groups", 1) == 1 and len(src.shape) == 3:
        return graph.tensors[n.param("weight")].shape[1] == channels
    return False


def find_zones(graph: Graph) -> list[tuple[Node, list[Node], Node]]:
    """(column, elementwise chain, row) for every zone, in topological order."""
    consumers: dict[str, list[Node]] = {n.name: [] for n in graph.nodes}
    for n in graph.nodes:
        for i in n.inputs:
            consumers[i].append(n)
    taken: set[str] = set()
    zones = []
    for col in graph.nodes:
        channels = _column_channels(col)
        if channels is None or col.name in taken:
            continue
        chain, cur = [], col
        while cur.name != graph.output and len(consumers[cur.name]) == 1:
            nxt = consumers[cur.name][0]
            if nxt.name in taken:
                break
            if _is_row(nxt, graph, channels, cur):
                zones.append((col, chain, nxt))
                taken.update([col.name, nxt.name, *(c.name for c in chain)])
                break
            if nxt.op not in ELEMENTWISE or nxt.inputs != (cur.name,):
                break
            chain.append(nxt)
            cur = nxt
    return zones


def _ancestors(graph: Graph) -> dict[str, set[str]]:
    acc: dict[str, set[str]] = {}
    for n in graph.nodes:
        s = set()
        for i in n.inputs:
            s |= acc[i] | {i}
        acc[n.name] = s
    return acc


def tp_zones(graph: Graph, options) -> Graph:
    if options.summation not in REDUCTIONS:
        raise ShardboundError(f"--mode tp does not support --summation {options.summation} "
                              f"yet; use blocked (bitwise single mode's bounds) or fast")
    tp_intermediate = getattr(options, "tp_intermediate", "ibp")
    if tp_intermediate not in TP_INTERMEDIATE:
        raise ShardboundError(f"unknown --tp-intermediate {tp_intermediate!r}; choose ibp or crown")
    zones = find_zones(graph)
    ancestors = _ancestors(graph)
    zone_nodes = {n.name for col, chain, row in zones for n in (col, *chain, row)}
    plan = dict(graph.annotations.get("bounds", {}))
    reduce = f"{options.summation} reduction" + (" (block-aligned tree)"
                                                 if options.summation == "blocked" else "")
    notes: dict[str, Placement] = {}
    for z, (col, chain, row) in enumerate(zones):
        C = col.shape[0]
        local = not (ancestors[col.name] & zone_nodes)
        split = ""
        if options.nproc > 1:
            parts = " ".join(f"[{a},{b})" for a, b in channel_ranges(options.summation, C,
                                                                      options.nproc))
            split = f"; channels on P={options.nproc}: {parts}"
        for n in (col, *chain):
            if n.name in plan:
                plan[n.name] = tp_intermediate
        rows = " local" if local else " all"

        def crown_note(n):
            return f"; crown rows{rows}" if plan.get(n.name) == "crown" else ""

        notes[col.name] = Placement.make(
            f"zone{z} column: out Shard(0) of {C}, weight Shard(0), bias Shard(0){crown_note(col)}"
            f"{split}", "column", z, C, local)
        for n in chain:
            notes[n.name] = Placement.make(f"zone{z} elementwise: out Shard(0){crown_note(n)}",
                                           "elementwise", z, C, local)
        notes[row.name] = Placement.make(
            f"zone{z} row: in Shard(0), out Partial -> {reduce} -> Replicate; weight Shard(1), "
            "bias Replicate", "row", z, C, local)
    summary = (f"Replicate; {len(zones)} zone(s), intermediate bounds in zones by "
               f"{tp_intermediate}" if zones else
               "Replicate; no tp zones found: every node Replicate (every rank runs the whole "
               "network, like single mode)")
    for n in graph.nodes:
        if n.name not in notes:
            notes[n.name] = Placement.make(summary if n is graph.input else "Replicate")
    return graph.annotate("bounds", plan).annotate("tp", notes)
