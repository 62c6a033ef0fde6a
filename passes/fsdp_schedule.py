"""fsdp_schedule: where each parameter is all-gathered and freed, per phase.

Every parameter belongs to exactly one node, and a node's kernel uses all its parameters in one
call, so in every phase (the IBP forward pass, and each CROWN backward pass: one per node with
planned CROWN bounds, plus the final one from the output) a parameter is gathered right before
its node runs and freed right after. The annotation records, per node: the parameters gathered,
and the phases in which that happens, so `inspect` and the program's comments show it.
"""

from __future__ import annotations

from shardbound.compiler.ir import Graph


LISTED_PHASES = 12      # phases named per node; a longer list ends with "(N more)"


def _phases_of(graph: Graph) -> dict[str, tuple[int, list[str]]]:
    """Per node: (how many phases visit it, the first LISTED_PHASES of them in run order).

    The phases are the IBP pass (every node) and the CROWN backward passes, one per node with
    planned CROWN bounds in topological order, then the final one from the output; a backward
    pass from t visits t's ancestors. Each node's set of visiting passes is kept as a bit mask
    over the passes, OR-ed over its consumers in one reverse sweep (sets of ancestors per node
    and full phase lists were quadratic in depth)."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    plan = graph.annotations.get("bounds", {})
    targets = sorted((k for k, v in plan.items() if v == "crown"), key=index.get)
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
            listed, rest = [], m
            while rest and len(listed) < LISTED_PHASES:
                low = rest & -rest
                listed.append(names[low.bit_length() - 1])
                rest ^= low
            out[n.name] = (m.bit_count(), listed)
    return out


def fsdp_schedule(graph: Graph, options) -> Graph:
    phases = _phases_of(graph)
    notes = {}
    for n in graph.nodes:
        if not n.params:
            continue
        count, listed = phases[n.name]
        roles = ",".join(role for role, _ in n.params)
        more = f" ({count - len(listed)} more)" if count > len(listed) else ""
        notes[n.name] = (f"gather {roles} before, free after; in {count} phases: "
                         + " ".join(listed) + more)
    return graph.annotate("fsdp", notes)
