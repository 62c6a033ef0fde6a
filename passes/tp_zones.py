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

Annotations: `tp` per node, a `Placement` (passes/annotations.py: role, zone, channel count,
rows, the reduction that finishes its Partial sums and, for the P the program is planned for,
each rank's channel range), which codegen reads and `inspect` and the program print.
"""

from __future__ import annotations

from shardbound.compiler.errors import ShardboundError
import dataclasses

from shardbound.compiler.ir import Graph, Node
from shardbound.passes.annotations import Placement
from shardbound.passes.traits import all_facts, op_class
from shardbound.runtime.parallel.tp_reduce import REDUCTIONS, channel_ranges

TP_INTERMEDIATE = ("ibp", "crown")


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
    facts = all_facts(graph)
    for z, (col, chain, row) in enumerate(zones):
        C = col.shape[0]
        local = not after_zone[col.name]
        split = ()
        if options.nproc > 1:
            split = tuple(channel_ranges(options.summation, C, options.nproc))
        for n in (col, *chain):
            if n.name in plan:
                plan[n.name] = dataclasses.replace(plan[n.name], method=tp_intermediate)
        rows = "local" if local else "all"

        def crown_rows(n):
            p = plan.get(n.name)
            return rows if p is not None and p.method == "crown" else ""

        zone = dict(zone=z, channels=C, local_rows=local, reduction=reduce,
                    nproc=options.nproc)
        notes[col.name] = Placement("column", crown_rows=crown_rows(col), split=split, **zone)
        for n in chain:
            bias = bool(op_class(n).summation_note(facts[n.name], lambda k: str(k)))
            notes[n.name] = Placement("elementwise", crown_rows=crown_rows(n),
                                      bias_partial=bias, **zone)
        notes[row.name] = Placement("row", split=split, **zone)
    summary = (f"{len(zones)} zone(s), intermediate bounds in zones by {tp_intermediate}"
               if zones else "no tp zones found: every node Replicate (every rank runs the "
               "whole network, like single mode)")
    for n in graph.nodes:
        if n.name not in notes:
            notes[n.name] = Placement(summary=summary if n is graph.input else "",
                                      nproc=options.nproc)
    return graph.annotate("bounds", plan).annotate("tp", notes)
