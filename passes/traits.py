"""What passes know of an IR node's kernel: its class (whose declared traits they read, never
its op name) and its facts (per-sample shapes, parameter shapes, attributes)."""

from __future__ import annotations

from shardbound.compiler.ir import Graph, Node
from shardbound.runtime.ops import OP_TYPES, NodeFacts


def op_class(node: Node):
    return OP_TYPES[node.op]


def all_facts(graph: Graph) -> dict[str, NodeFacts]:
    """Every node's facts, by name (one pass over the graph)."""
    shapes = {n.name: n.shape for n in graph.nodes}
    return {n.name: node_facts(graph, n, shapes) for n in graph.nodes}


def node_facts(graph: Graph, node: Node, shapes: dict | None = None) -> NodeFacts:
    if shapes is None:
        shapes = {n.name: n.shape for n in graph.nodes}
    return NodeFacts(shape=tuple(node.shape),
                     in_shapes=tuple(shapes[i] for i in node.inputs) or (tuple(node.shape),),
                     param_shapes={role: tuple(graph.tensors[key].shape) for role, key in node.params},
                     attrs=node.attr_dict(), has_params=frozenset(role for role, _ in node.params))
