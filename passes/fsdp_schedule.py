"""fsdp_schedule: where each parameter is all-gathered and freed, per phase.

Every parameter belongs to exactly one node, and a node's kernel uses all its parameters in one
call, so in every phase (the IBP forward pass, and each CROWN backward pass: one per node with
planned CROWN bounds, plus the final one from the output) a parameter is gathered right before
its node runs and freed right after. The annotation records, per node: the parameters gathered,
and the phases in which that happens, so `inspect` and the program's comments show it.
"""

from __future__ import annotations

from shardbound.compiler.ir import Graph


def _phases(graph: Graph) -> list[tuple[str, set[str]]]:
    """(phase name, nodes visited) for the IBP pass and every CROWN backward pass."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    ancestors: dict[str, set[str]] = {}
    for n in graph.nodes:
        acc = {n.name}
        for i in n.inputs:
            acc |= ancestors[i]
        ancestors[n.name] = acc
    phases = [("ibp", {n.name for n in graph.nodes})]
    plan = graph.annotations.get("bounds", {})
    for name in sorted((k for k, v in plan.items() if v == "crown"), key=index.get):
        phases.append((f"crown<-{name}", ancestors[name]))
    phases.append((f"crown<-{graph.output}", ancestors[graph.output]))
    return phases


def fsdp_schedule(graph: Graph, options) -> Graph:
    phases = _phases(graph)
    notes = {}
    for n in graph.nodes:
        if not n.params:
            continue
        used = [name for name, visited in phases if n.name in visited]
        roles = ",".join(role for role, _ in n.params)
        notes[n.name] = (f"gather {roles} before, free after; in {len(used)} phases: "
                         + " ".join(used))
    return graph.annotate("fsdp", notes)
