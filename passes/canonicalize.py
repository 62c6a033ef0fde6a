"""canonicalize: fewer, larger linear nodes before any bound is planned.

Rewrites, applied until none fires (each keeps the function the graph computes, up to float32
rounding of the folded parameters, which are computed in float64). Which ops take part is
what the kernels declare (runtime/ops/base.py), never their names:
- affine -> affine           merge two `pointwise_affine` ops into one
- layer -> affine            fold a per-feature / per-channel affine into the layer before it
                             (MatMul+Add, BatchNorm): the layer's `absorb_affine_after`
- affine -> view             move the affine behind a view (`is_view`: a reshape), so it can
                             meet a layer
- affine -> layer            fold input normalisation (Sub/Div) into the layer after it: the
                             layer's `absorb_affine_before` (a conv only takes a shift when it
                             has no zero padding, since padding happens after the affine)
Each rewrite needs the first node to have a single consumer. IBP and CROWN are exact on affine
maps of a box, so folding changes speed, not tightness.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardbound.compiler.ir import Graph, Node
from shardbound.passes.traits import node_facts, op_class

F64 = np.float64


class _Scratch:
    """The graph being rewritten (local to one run of the pass)."""

    def __init__(self, graph: Graph):
        self.nodes = list(graph.nodes)
        self.tensors = {k: np.asarray(v) for k, v in graph.tensors.items()}
        self.output = graph.output

    def consumers(self, name):
        return [n for n in self.nodes if name in n.inputs]

    def get(self, node: Node, role: str):
        key = node.param(role)
        return None if key is None else self.tensors[key].astype(F64)

    def replace(self, old: Node, new: Node, params: dict):
        keys = []
        for role, value in sorted(params.items()):
            if value is None:
                continue
            key = f"{new.name}.{role}"
            self.tensors[key] = np.ascontiguousarray(value, dtype=np.float32)
            keys.append((role, key))
        new = dataclasses.replace(new, params=tuple(keys))
        self.nodes[self.nodes.index(old)] = new
        return new

    def remove_passthrough(self, node: Node):
        """Delete `node`, whose consumers now read its input instead."""
        src = node.inputs[0]
        self.nodes = [dataclasses.replace(n, inputs=tuple(src if i == node.name else i
                                                         for i in n.inputs))
                      for n in self.nodes if n is not node]
        if self.output == node.name:
            self.output = src

    def only_consumer(self, node: Node):
        users = self.consumers(node.name)
        if len(users) == 1 and node.name != self.output:
            return users[0]
        return None


def _facts(s: _Scratch, n: Node):
    return node_facts(_AsGraph(s), n)


class _AsGraph:
    """The scratch graph seen as a Graph by node_facts (nodes and tensors)."""

    def __init__(self, s: _Scratch):
        self.nodes, self.tensors = s.nodes, s.tensors


def _affine_full(s: _Scratch, n: Node):
    """(scale, shift) of an affine node as arrays of the node's full per-sample shape."""
    scale, shift = s.get(n, "scale"), s.get(n, "shift")
    ones = np.ones(n.shape, dtype=F64)
    return (ones if scale is None else ones * scale), (ones * 0 if shift is None else ones * shift)


def _merge_affines(s, first, second):
    s1, t1 = _affine_full(s, first)
    s2, t2 = _affine_full(s, second)
    merged = dataclasses.replace(second, inputs=first.inputs, origin=f"{first.origin} + {second.origin}")
    s.replace(second, merged, {"scale": s1 * s2, "shift": t1 * s2 + t2})
    s.nodes.remove(first)
    return True


def _fold_affine_after(s, layer, affine):
    scale, shift = _affine_full(s, affine)
    folded = op_class(layer).absorb_affine_after(_facts(s, layer), s.get(layer, "weight"),
                                                 s.get(layer, "bias"), scale, shift)
    if folded is None:
        return False
    fused = dataclasses.replace(layer, name=layer.name, origin=f"{layer.origin} + {affine.origin}")
    s.replace(layer, fused, {"weight": folded[0], "bias": folded[1]})
    s.remove_passthrough(affine)
    return True


def _move_affine_behind_view(s, affine, reshape):
    scale, shift = _affine_full(s, affine)
    target = reshape.shape          # a view keeps the element order: only the shape changes
    moved_reshape = dataclasses.replace(reshape, inputs=affine.inputs)
    moved_affine = dataclasses.replace(affine, inputs=(reshape.name,), shape=reshape.shape)
    i = s.nodes.index(affine)
    s.nodes.remove(reshape)
    s.nodes[i] = moved_reshape
    s.nodes.insert(i + 1, moved_affine)
    # Consumers of the reshape now read the affine (which took over the affine's name).
    s.nodes = [n if n is moved_affine else dataclasses.replace(
        n, inputs=tuple(affine.name if x == reshape.name else x for x in n.inputs)) for n in s.nodes]
    if s.output == reshape.name:
        s.output = affine.name
    s.replace(moved_affine, moved_affine, {"scale": scale.reshape(target),
                                           "shift": shift.reshape(target)})
    # Names: the affine keeps its name, so rename nothing else; the reshape keeps its own.
    return True


def _fold_affine_before(s, affine, layer):
    scale, shift = _affine_full(s, affine)
    folded = op_class(layer).absorb_affine_before(_facts(s, layer), s.get(layer, "weight"),
                                                  s.get(layer, "bias"), scale, shift)
    if folded is None:
        return False
    fused = dataclasses.replace(layer, inputs=affine.inputs, origin=f"{affine.origin} + {layer.origin}")
    s.replace(layer, fused, {"weight": folded[0], "bias": np.asarray(folded[1], dtype=F64)})
    s.nodes.remove(affine)
    return True


def _rewrite_once(s: _Scratch) -> bool:
    for n in s.nodes:
        user = s.only_consumer(n)
        if user is None:
            continue
        first, second = op_class(n), op_class(user)
        if first.pointwise_affine and second.pointwise_affine:
            return _merge_affines(s, n, user)
        if second.pointwise_affine and _fold_affine_after(s, n, user):
            return True
        if first.pointwise_affine and second.is_view:
            return _move_affine_behind_view(s, n, user)
        if first.pointwise_affine and _fold_affine_before(s, n, user):
            return True
    return False


def canonicalize(graph: Graph, options) -> Graph:
    s = _Scratch(graph)
    for _ in range(10 * len(s.nodes) + 10):
        if not _rewrite_once(s):
            break
    used = {key for n in s.nodes for _, key in n.params}
    return graph.with_nodes(s.nodes, {k: v for k, v in s.tensors.items() if k in used}, s.output)
