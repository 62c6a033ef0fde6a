"""summation_order: how every contraction of the program is summed, recorded per node.

The order itself is one program-wide choice (fast, blocked or exact; see
shardbound.runtime.contract); this pass writes down, for each node, which contractions it
performs in the forward/IBP pass and in the CROWN backward pass, over which length, and how
that length is cut into the fixed 256-blocks that `blocked` sums along a pairwise tree. It shows
in `inspect` and in the program's comments, so a reader can see every place bits are decided.
"""

from __future__ import annotations

import math

from shardbound.compiler.ir import Graph

BLOCK = 256
ORDERS = ("fast", "blocked", "exact")


def _sum(length: int, order: str) -> str:
    if order == "blocked":
        blocks = max(1, math.ceil(length / BLOCK))
        return f"{length} ({blocks} block{'s' if blocks != 1 else ''}, pair tree)"
    if order == "exact":
        return f"{length} (exact, rounded once)"
    return f"{length} (BLAS order)"


def _describe(graph: Graph, node, order: str) -> str | None:
    shape = {n.name: n.shape for n in graph.nodes}
    numel = math.prod(node.shape) if node.shape else 1
    if node.op == "linear":
        n_out, k = graph.tensors[node.param("weight")].shape
        text = f"fwd x.W^T over {_sum(k, order)}; bwd A.W over {_sum(n_out, order)}"
        if node.param("bias"):
            text += f"; bias A.b over {_sum(n_out, order)}"
        return text
    if node.op == "conv2d":
        w = graph.tensors[node.param("weight")].shape
        groups = dict(node.attrs).get("groups", 1)
        k = w[1] * w[2] * w[3]
        how = "conv library" if order == "fast" else f"im2col, {groups} group(s)"
        return f"fwd {how} over {_sum(k, order)}; bwd over {_sum(w[0] // groups, order)}"
    if node.op == "affine" and node.param("shift"):
        return f"bias A.shift over {_sum(numel, order)}"
    if node.op == "relu":
        return f"bias A.intercept over {_sum(numel, order)}"
    if node.op == "input":
        n = math.prod(shape[node.name])
        return f"concretize A.center and |A|.radius over {_sum(n, order)}"
    return None


def summation_order(graph: Graph, options) -> Graph:
    if options.summation not in ORDERS:
        raise ValueError(f"unknown summation order {options.summation!r}")
    notes = {}
    for n in graph.nodes:
        text = _describe(graph, n, options.summation)
        if text:
            notes[n.name] = text
    return graph.annotate("summation", notes)
