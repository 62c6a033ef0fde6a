"""tp_zones: Megatron-style tensor-parallel zones and the placement of every node.

A zone is a column-parallel layer (linear split on output neurons, conv split on output
channels; output Shard(0)) -> a chain of elementwise ops (any kernel whose `tp_roles` include
"elementwise": it acts on each channel alone, so each rank applies it to its own channels) ->
a row-parallel layer (linear split on input neurons, conv split on input
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
from shardbound.passes.traits import all_facts, op_class
from shardbound.runtime.parallel.tp_reduce import REDUCTIONS, channel_ranges

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


def _channels(facts, n: Node, role: str) -> int | None:
    """How many channels `n` splits as a zone's column or row layer (None: it cannot)."""
    cls = op_class(n)
    if role not in cls.tp_roles_of(facts[n.name]):
        return None
    return cls.tp_channels(facts[n.name], role)


def _is_elementwise(facts, n: Node) -> bool:
    return "elementwise" in op_class(n).tp_roles_of(facts[n.name])


def find_zones(graph: Graph) -> list[tuple[Node, list[Node], Node]]:
    """(column, elementwise chain, row) for every zone, in topological order."""
    consumers: dict[str, list[Node]] = {n.name: [] for n in graph.nodes}
    for n in graph.nodes:
        for i in n.inputs:
            consumers[i].append(n)
    taken: set[str] = set()
    zones = []
    facts = all_facts(graph)
    for col in graph.nodes:
        channels = _channels(facts, col, "column")
        if channels is None or col.name in taken:
            continue
        chain, cur = [], col
        while cur.name != graph.output and len(consumers[cur.name]) == 1:
            nxt = consumers[cur.name][0]
            if nxt.name in taken:
                break
            if nxt.inputs == (cur.name,) and _channels(facts, nxt, "row") == channels:
                zones.append((col, chain, nxt))
                taken.update([col.name, nxt.name, *(c.name for c in chain)])
                break
            if not _is_elementwise(facts, nxt) or nxt.inputs != (cur.name,):
                break
            chain.append(nxt)
            cur = nxt
    return zones


def _after_zone(graph: Graph, zone_nodes: set[str]) -> dict[str, bool]:
    """Per node: whether some zone node is upstream of it (one linear sweep; a set of
    ancestors per node was quadratic in depth)."""
    below: dict[str, bool] = {}
    for n in graph.nodes:
        below[n.name] = any(i in zone_nodes or below[i] for i in n.inputs)
    return below


def tp_zones(graph: Graph, options) -> Graph:
    if options.summation not in REDUCTIONS:
        raise ShardboundError(f"--mode tp does not support --summation {options.summation} "
                              f"yet; use blocked (bitwise single mode's bounds) or fast")
    tp_intermediate = getattr(options, "tp_intermediate", "ibp")
    if tp_intermediate not in TP_INTERMEDIATE:
        raise ShardboundError(f"unknown --tp-intermediate {tp_intermediate!r}; choose ibp or crown")
    zones = find_zones(graph)
    zone_nodes = {n.name for col, chain, row in zones for n in (col, *chain, row)}
    after_zone = _after_zone(graph, zone_nodes)
    plan = dict(graph.annotations.get("bounds", {}))
    reduce = f"{options.summation} reduction" + (" (block-aligned tree)"
                                                 if options.summation == "blocked" else "")
    notes: dict[str, Placement] = {}
    for z, (col, chain, row) in enumerate(zones):
        C = col.shape[0]
        local = not after_zone[col.name]
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
