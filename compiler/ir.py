"""The bound IR: frozen nodes in topological order, a networkx view, and pass annotations.

Nodes describe *what* to bound (op kind, inputs, per-sample shape, parameters by name); passes
add annotations (a new Graph each time, never mutated in place); codegen renders the result.
Shapes exclude the batch axis: every runtime tensor is (B, *shape).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class Node:
    name: str                      # a legal, unique Python identifier (see naming.py)
    op: str                        # a runtime op kind (shardbound.runtime.ops.OP_TYPES)
    inputs: tuple[str, ...]
    shape: tuple[int, ...]
    params: tuple[tuple[str, str], ...] = ()   # (role, tensor key)
    attrs: tuple[tuple[str, Any], ...] = ()    # literal values only: ints, floats, tuples
    origin: str = ""               # the ONNX node this came from, e.g. 'Gemm "fc1"' (untrusted)

    def param(self, role: str) -> str | None:
        return dict(self.params).get(role)

    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    tensors: Mapping[str, np.ndarray]
    output: str
    source: str = "model.onnx"     # file name only: no absolute paths in generated files
    input_name: str = "input"      # the ONNX input name (untrusted; for messages and plan.json)
    annotations: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # input elements folded in as constants (compiler/fixed_inputs.py): the program is valid
    # only for boxes that fix them to these values (plan.json "fixed_inputs")
    fixed_inputs: Any = None

    @property
    def input(self) -> Node:
        return self.nodes[0]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def consumers(self, name: str) -> list[Node]:
        return [n for n in self.nodes if name in n.inputs]

    def to_networkx(self):
        """The graph as a networkx.DiGraph (imported here: importing networkx took 0.2-0.4 s
        of every `verify` run, which never needs it)."""
        import networkx as nx

        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, op=n.op)
            for i in n.inputs:
                g.add_edge(i, n.name)
        return g

    def with_nodes(self, nodes, tensors=None, output=None) -> "Graph":
        """A new graph with other nodes (annotations are dropped: they refer to old nodes)."""
        return dataclasses.replace(self, nodes=tuple(nodes),
                                   tensors=MappingProxyType(dict(tensors if tensors is not None
                                                                 else self.tensors)),
                                   output=output or self.output, annotations={})

    def annotate(self, key: str, values: Mapping[str, Any]) -> "Graph":
        merged = dict(self.annotations)
        merged[key] = MappingProxyType(dict(values))
        return dataclasses.replace(self, annotations=MappingProxyType(merged))

    def annotation(self, key: str, node: str, default=None):
        return self.annotations.get(key, {}).get(node, default)


def format_shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def dump(graph: Graph) -> str:
    """The canonical text form: one line per node, jaxpr-like, stable across runs. The
    annotations come from the printer program.py's comments use too (passes/annotations)."""
    from shardbound.passes.annotations import notes as annotation_notes

    origin = graph.input.origin      # named when more than one float32 input: several, a cast
    source = f" = {origin}" if origin and origin != f"input {graph.input_name!r}" else ""
    lines = [f"graph {graph.source}: input {graph.input.name}{format_shape(graph.input.shape)}"
             f"{source} -> output {graph.output}"]
    for n in graph.nodes:
        args = ", ".join(n.inputs)
        params = " ".join(f"{role}={key}{format_shape(graph.tensors[key].shape)}"
                          for role, key in n.params)
        attrs = " ".join(f"{k}={_attr_text(v)}" for k, v in n.attrs)
        notes = " ".join(f"{k}={text}" for k, text in annotation_notes(graph, n.name))
        parts = [f"{n.name}{format_shape(n.shape)} = {n.op}({args})", params, attrs]
        if notes:
            parts.append("| " + notes)
        lines.append("  " + "  ".join(p for p in parts if p))
    return "\n".join(lines) + "\n"


def _attr_text(v) -> str:
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(_attr_text(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)
