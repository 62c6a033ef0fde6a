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

import bisect
import dataclasses

import numpy as np

from shardbound.compiler.ir import Graph, Node
from shardbound.passes.traits import node_facts, op_class

F64 = np.float64


class _Scratch:
    """The graph being rewritten (local to one run of the pass), with the indexes that keep a
    rewrite local: consumers and shapes by name, and each node's list position found by
    bisection on order keys (a removal leaves the other keys alone, an insertion takes a key
    between its neighbours'). `touched` collects the nodes whose rewrite may have become
    possible (changed nodes, and the nodes they read). Without these, every rewrite rescanned
    from the top and rebuilt the node list: cubic in depth (2,000 Relu/Mul/Add nodes: 45 s)."""

    def __init__(self, graph: Graph):
        self.nodes = list(graph.nodes)
        self.keys = [float(i) for i in range(len(self.nodes))]
        self.key = {n.name: float(i) for i, n in enumerate(self.nodes)}
        self.tensors = {k: np.asarray(v) for k, v in graph.tensors.items()}
        self.output = graph.output
        self.shapes = {n.name: n.shape for n in self.nodes}
        self.users: dict[str, dict[str, None]] = {n.name: {} for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                self.users[i][n.name] = None
        self.touched: set[str] = set()

    # -- positions and indexes ---------------------------------------------------------------
    def position(self, name: str) -> int:
        return bisect.bisect_left(self.keys, self.key[name])

    def node(self, name: str) -> Node:
        return self.nodes[self.position(name)]

    def _unlink(self, node: Node) -> None:
        for x in node.inputs:
            self.users[x].pop(node.name, None)
            self.touched.add(x)

    def _link(self, node: Node) -> None:
        for x in node.inputs:
            self.users[x][node.name] = None
            self.touched.add(x)
        self.shapes[node.name] = node.shape
        self.touched.add(node.name)

    def _put(self, new: Node) -> None:
        """`new` in the slot of the node of the same name."""
        i = self.position(new.name)
        self._unlink(self.nodes[i])
        self.nodes[i] = new
        self._link(new)

    def _take_slot(self, old: Node, new: Node) -> None:
        """`new` (another name) in the slot of `old`, which no node reads any more."""
        i = self.position(old.name)
        self._unlink(old)
        key = self.keys[i]
        del self.key[old.name], self.users[old.name], self.shapes[old.name]
        self.nodes[i] = new
        self.key[new.name] = key
        self.users.setdefault(new.name, {})
        self._link(new)

    def _drop(self, node: Node) -> None:
        i = self.position(node.name)
        self._unlink(node)
        del self.nodes[i], self.keys[i]
        del self.key[node.name], self.users[node.name], self.shapes[node.name]

    def _insert_after(self, before: str, new: Node) -> None:
        i = self.position(before) + 1
        lo = self.keys[i - 1]
        hi = self.keys[i] if i < len(self.keys) else lo + 2.0
        key = (lo + hi) / 2
        if not lo < key < hi:               # no float left between them: renumber all
            self.keys = [float(k) for k in range(len(self.nodes))]
            self.key = {n.name: float(k) for k, n in enumerate(self.nodes)}
            key = self.keys[i - 1] + 0.5
        self.nodes.insert(i, new)
        self.keys.insert(i, key)
        self.key[new.name] = key
        self.users[new.name] = {}
        self._link(new)

    def _rewire(self, readers, old: str, new: str) -> None:
        """The nodes named in `readers` read `new` where they read `old`."""
        for c in readers:
            n = self.node(c)
            self._put(dataclasses.replace(n, inputs=tuple(new if i == old else i
                                                          for i in n.inputs)))

    def restart(self, fallback: int) -> int:
        """Where the next scan must start: no node before it can have changed."""
        live = [self.position(t) for t in self.touched if t in self.key]
        self.touched.clear()
        return min([fallback, *live])

    # -- what the rewrites use ---------------------------------------------------------------
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
        self._put(new)
        return new

    def remove(self, node: Node) -> None:
        """Delete `node`, which no node reads any more."""
        self._drop(node)

    def remove_passthrough(self, node: Node) -> None:
        """Delete `node`, whose consumers now read its input instead."""
        src = node.inputs[0]
        self._rewire(list(self.users[node.name]), node.name, src)
        self._drop(node)
        if self.output == node.name:
            self.output = src
            self.touched.add(src)

    def only_consumer(self, node: Node):
        users = self.users[node.name]
        if len(users) == 1 and node.name != self.output:
            return self.node(next(iter(users)))
        return None

    def facts(self, node: Node):
        return node_facts(self, node, self.shapes)


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
    s.remove(first)
    return True


def _fold_affine_after(s, layer, affine):
    scale, shift = _affine_full(s, affine)
    folded = op_class(layer).absorb_affine_after(s.facts(layer), s.get(layer, "weight"),
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
    readers = list(s.users[reshape.name])
    # The reshape takes the affine's slot, the affine goes right after it, and consumers of
    # the reshape now read the affine.
    s.remove(reshape)
    s._take_slot(affine, moved_reshape)
    s._insert_after(reshape.name, moved_affine)
    s._rewire(readers, reshape.name, affine.name)
    if s.output == reshape.name:
        s.output = affine.name
    s.replace(moved_affine, moved_affine, {"scale": scale.reshape(target),
                                           "shift": shift.reshape(target)})
    # Names: the affine keeps its name, so rename nothing else; the reshape keeps its own.
    return True


def _fold_affine_before(s, affine, layer):
    scale, shift = _affine_full(s, affine)
    folded = op_class(layer).absorb_affine_before(s.facts(layer), s.get(layer, "weight"),
                                                  s.get(layer, "bias"), scale, shift)
    if folded is None:
        return False
    fused = dataclasses.replace(layer, inputs=affine.inputs, origin=f"{affine.origin} + {layer.origin}")
    s.replace(layer, fused, {"weight": folded[0], "bias": np.asarray(folded[1], dtype=F64)})
    s.remove(affine)
    return True


def _rewrite_at(s: _Scratch, start: int) -> int | None:
    """Apply the first rewrite that fires at or after position `start`; the position the
    next scan starts from, or None when none fires (the nodes before `start` are known not
    to fire, so this is the first rewrite of a scan from the top)."""
    for i in range(start, len(s.nodes)):
        n = s.nodes[i]
        user = s.only_consumer(n)
        if user is None:
            continue
        first, second = op_class(n), op_class(user)
        s.touched.clear()
        if first.pointwise_affine and second.pointwise_affine:
            _merge_affines(s, n, user)
        elif not ((second.pointwise_affine and _fold_affine_after(s, n, user))
                  or (first.pointwise_affine and second.is_view
                      and _move_affine_behind_view(s, n, user))
                  or (first.pointwise_affine and _fold_affine_before(s, n, user))):
            continue
        return s.restart(i)
    return None


def canonicalize(graph: Graph, options) -> Graph:
    s = _Scratch(graph)
    start = 0
    for _ in range(10 * len(s.nodes) + 10):
        start = _rewrite_at(s, start)
        if start is None:
            break
    used = {key for n in s.nodes for _, key in n.params}
    return graph.with_nodes(s.nodes, {k: v for k, v in s.tensors.items() if k in used}, s.output)
