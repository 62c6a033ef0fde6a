"""canonicalize: fewer, larger linear nodes before any bound is planned.

Rewrites, applied until none fires (each keeps the function the graph computes, up to float32
rounding of the folded parameters, which are computed in float64):
- affine -> affine           merge into one affine
- linear/conv -> affine      fold a per-feature / per-channel affine (MatMul+Add, BatchNorm)
- affine -> reshape          move the affine behind the reshape (so it can meet a linear)
- affine -> linear/conv      fold input normalisation (Sub/Div) into the layer after it (a conv
                             only takes a shift when it has no zero padding, since padding
                             happens after the affine)
Each rewrite needs the first node to have a single consumer. IBP and CROWN are exact on affine
maps of a box, so folding changes speed, not tightness.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardbound.compiler.ir import Graph, Node

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


def _affine_full(s: _Scratch, n: Node):
    """(scale, shift) of an affine node as arrays of the node's full per-sample shape."""
    scale, shift = s.get(n, "scale"), s.get(n, "shift")
    ones = np.ones(n.shape, dtype=F64)
    return (ones if scale is None else ones * scale), (ones * 0 if shift is None else ones * shift)


def _along(full: np.ndarray, axis: int):
    """The vector `v` with full == v broadcast along `axis`, or None when it varies elsewhere."""
    moved = np.moveaxis(full, axis, 0).reshape(full.shape[axis], -1)
    if moved.size and not np.all(moved == moved[:, :1]):
        return None
    return moved[:, 0]


def _merge_affines(s, first, second):
    s1, t1 = _affine_full(s, first)
    s2, t2 = _affine_full(s, second)
    merged = dataclasses.replace(second, inputs=first.inputs, origin=f"{first.origin} + {second.origin}")
    s.replace(second, merged, {"scale": s1 * s2, "shift": t1 * s2 + t2})
    s.nodes.remove(first)
    return True


def _fold_affine_after(s, layer, affine):
    scale, shift = _affine_full(s, affine)
    axis = 0 if layer.op == "conv2d" else len(layer.shape) - 1
    sv, tv = _along(scale, axis), _along(shift, axis)
    if sv is None or tv is None:
        return False
    w = s.get(layer, "weight")
    b = s.get(layer, "bias")
    w_new = w * sv.reshape((-1,) + (1,) * (w.ndim - 1))
    b_new = (np.zeros_like(sv) if b is None else b) * sv + tv
    fused = dataclasses.replace(layer, name=layer.name, origin=f"{layer.origin} + {affine.origin}")
    s.replace(layer, fused, {"weight": w_new, "bias": b_new})
    s.remove_passthrough(affine)
    return True


def _move_affine_behind_reshape(s, affine, reshape):
    scale, shift = _affine_full(s, affine)
    target = reshape.attr_dict()["target"]
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
    w, b = s.get(layer, "weight"), s.get(layer, "bias")
    if layer.op == "linear":
        if len(layer.shape) != 1:
            return False
        w_new = w * scale[None, :]
        b_new = (0 if b is None else b) + w @ shift
    else:
        attrs = layer.attr_dict()
        sv, tv = _along(scale, 0), _along(shift, 0)
        if sv is None or tv is None or attrs.get("groups", 1) != 1:
            return False
        if any(attrs["pads"]) and np.any(tv != 0):
            return False
        w_new = w * sv[None, :, None, None]
        b_new = (0 if b is None else b) + np.einsum("ochw,c->o", w, tv)
    if b is None:
        b_new = np.broadcast_to(b_new, (w.shape[0],)).astype(F64)
    fused = dataclasses.replace(layer, inputs=affine.inputs, origin=f"{affine.origin} + {layer.origin}")
    s.replace(layer, fused, {"weight": w_new, "bias": b_new})
    s.nodes.remove(affine)
    return True


def _rewrite_once(s: _Scratch) -> bool:
    for n in s.nodes:
        user = s.only_consumer(n)
        if user is None:
            continue
        pair = (n.op, user.op)
        if pair == ("affine", "affine"):
            return _merge_affines(s, n, user)
        if n.op in ("linear", "conv2d") and user.op == "affine" and _fold_affine_after(s, n, user):
            return True
        if pair == ("affine", "reshape"):
            return _move_affine_behind_reshape(s, n, user)
        if n.op == "affine" and user.op in ("linear", "conv2d") and _fold_affine_before(s, n, user):
            return True
    return False


def canonicalize(graph: Graph, options) -> Graph:
    s = _Scratch(graph)
    for _ in range(10 * len(s.nodes) + 10):
        if not _rewrite_once(s):
            break
    used = {key for n in s.nodes for _, key in n.params}
    return graph.with_nodes(s.nodes, {k: v for k, v in s.tensors.items() if k in used}, s.output)
