"""summation_order: how every contraction of the program is summed, recorded per node.

The order itself is one program-wide choice (fast, blocked or exact; see
shardbound.runtime.numerics.contract); this pass writes down, for each node, which contractions it
performs in the forward/IBP pass and in the CROWN backward pass, over which length, and how
that length is cut into the fixed 256-blocks that `blocked` sums along a pairwise tree. It shows
in `inspect` and in the program's comments, so a reader can see every place bits are decided.
"""

from __future__ import annotations

import math

from shardbound.compiler.ir import Graph
from shardbound.passes.annotations import SummationNote
from shardbound.passes.traits import all_facts, op_class

BLOCK = 256
ORDERS = ("fast", "blocked", "exact")


class SumText:
    """How a contraction of a given length is summed under one order, as text (the callable
    each kernel's `summation_note` receives). It records the lengths asked for, which the
    typed note keeps next to the kernel's text."""

    def __init__(self, order: str):
        self.order = order
        self.lengths: list[int] = []

    def __call__(self, length: int) -> str:
        self.lengths.append(int(length))
        if self.order == "blocked":
            blocks = max(1, math.ceil(length / BLOCK))
            return f"{length} ({blocks} block{'s' if blocks != 1 else ''}, pair tree)"
        if self.order == "exact":
            return f"{length} (exact, rounded once)"
        return f"{length} (BLAS order)"


def summation_order(graph: Graph, options) -> Graph:
    if options.summation not in ORDERS:
        raise ValueError(f"unknown summation order {options.summation!r}")
    notes = {}
    facts = all_facts(graph)
    for n in graph.nodes:
        sums = SumText(options.summation)
        text = op_class(n).summation_note(facts[n.name], sums)
        if text:
            blocks = (tuple(max(1, math.ceil(k / BLOCK)) for k in sums.lengths)
                      if options.summation == "blocked" else ())
            notes[n.name] = SummationNote(options.summation, text, tuple(sums.lengths), blocks)
    return graph.annotate("summation", notes)
