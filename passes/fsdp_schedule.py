"""fsdp_schedule: where each parameter is all-gathered and freed, per phase.

Every parameter belongs to exactly one node, and a node's kernel uses all its parameters in one
call, so in every phase (the IBP forward pass, and each CROWN backward pass: one per node with
planned CROWN bounds, plus the final one from the output) a parameter is gathered right before
its node runs and freed right after. The annotation records, per node: the parameters gathered,
and the phases in which that happens, so `inspect` and the program's comments show it.
"""

from __future__ import annotations

import numpy as np

from shardbound.compiler.ir import Graph
from shardbound.passes.traits import op_class
from shardbound.passes.annotations import FsdpUse, PhaseRun
from shardbound.runtime.accounting.chunk_choice import MIN_CHUNK


def _runs(mask: int, names: list[str]) -> tuple[PhaseRun, ...]:
    """The set bits of `mask` as runs of consecutive phases. Only run starts and ends are
    visited (bit tricks), so a chain's node -- every later phase, one run -- costs O(1)
    big-int operations, not one per phase."""
    starts = mask & ~(mask << 1)
    ends = mask & ~(mask >> 1)
    runs = []
    while starts:
        s_low, e_low = starts & -starts, ends & -ends
        a, b = s_low.bit_length() - 1, e_low.bit_length() - 1
        runs.append(PhaseRun(names[a], names[b], b - a + 1))
        starts ^= s_low
        ends ^= e_low
    return tuple(runs)


def _phases_of(graph: Graph) -> dict[str, tuple[int, tuple[PhaseRun, ...]]]:
    """Per node: (how many phases visit it, all of them as runs of consecutive phases).

    The phases are the IBP pass (every node) and the CROWN backward passes, one per node with
    planned CROWN bounds in topological order, then the final one from the output; a backward
    pass from t visits t's ancestors. Each node's set of visiting passes is kept as a bit mask
    over the passes, OR-ed over its consumers in one reverse sweep (sets of ancestors per node
    and full phase lists were quadratic in depth)."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    plan = graph.annotations.get("bounds", {})
    targets = sorted((k for k, v in plan.items() if v.method == "crown"), key=index.get)
    names = ["ibp"] + [f"crown<-{t}" for t in targets] + [f"crown<-{graph.output}"]
    own = {t: 1 << (k + 1) for k, t in enumerate(targets)}
    own[graph.output] = own.get(graph.output, 0) | (1 << (len(targets) + 1))
    consumers: dict[str, list[str]] = {n.name: [] for n in graph.nodes}
    for n in graph.nodes:
        for i in dict.fromkeys(n.inputs):
            consumers[i].append(n.name)
    mask: dict[str, int] = {}
    pending = {n.name: len(dict.fromkeys(n.inputs)) for n in graph.nodes}
    out: dict[str, tuple[int, list[str]]] = {}
    for n in reversed(graph.nodes):
        m = own.get(n.name, 0) | 1
        for c in consumers[n.name]:
            m |= mask[c]
            pending[c] -= 1
            if pending[c] == 0 and c in mask:       # c's producers are all done with it
                del mask[c]
        mask[n.name] = m
        if n.params:
            out[n.name] = (m.bit_count(), ((PhaseRun("ibp", "ibp", 1),) if m & 1 else ())
                           + _runs(m >> 1, names[1:]))
    return out


def fsdp_schedule(graph: Graph, options) -> Graph:
    phases = _phases_of(graph)
    notes = {}
    for n in graph.nodes:
        if not n.params:
            continue
        count, runs = phases[n.name]
        streamed = ()
        # a fixed chunk: the weights larger than it; chosen per layer (None): any weight
        # larger than the smallest chunk may stream (plan.json's stream_chunks says where)
        limit = options.stream_chunk_bytes or MIN_CHUNK
        if op_class(n).streams_weight and options.summation != "fast":
            streamed = tuple(role for role, key in n.params
                             if np.ndim(graph.tensors[key]) == 2
                             and np.size(graph.tensors[key]) * 4 > limit)
        notes[n.name] = FsdpUse(tuple(role for role, _ in n.params), count, runs, streamed,
                                (options.stream_chunk_bytes or 0) // 1024)
    return graph.annotate("fsdp", notes)
