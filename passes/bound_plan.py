"""bound_plan: which nodes need intermediate bounds, and by which method.

A relaxed op (any kernel whose `relaxed` trait is set: ReLU, and every other nonlinear op)
needs bounds on its inputs, so every node that feeds one is marked with the method that
bounds it when the final method is CROWN (a `BoundPlan`: the method and the relaxed ops it
feeds): `crown` (a backward pass from that node, tighter)
or `ibp` (one forward interval pass, cheaper). IBP as the final method needs no plan: it
bounds everything on the way.
"""

from __future__ import annotations

from shardbound.compiler.ir import Graph
from shardbound.passes.annotations import BoundPlan
from shardbound.passes.traits import op_class

INTERMEDIATE_METHODS = ("crown", "ibp")


def bound_plan(graph: Graph, options) -> Graph:
    if options.intermediate not in INTERMEDIATE_METHODS:
        raise ValueError(f"unknown intermediate method {options.intermediate!r}")
    feeds: dict[str, list[str]] = {}
    for n in graph.nodes:
        if op_class(n).relaxed:
            for i in n.inputs:
                feeds.setdefault(i, []).append(n.name)
    needs = {i: BoundPlan(options.intermediate, tuple(dict.fromkeys(f)))
             for i, f in feeds.items()}
    return graph.annotate("bounds", needs)
