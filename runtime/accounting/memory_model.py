"""Predict the memory ledger's per-rank peak for a CROWN run, from shapes alone.

The prediction replays what `Network.crown` does -- the IBP pass, one backward pass per node
with planned CROWN bounds, the final pass -- with byte counts instead of tensors, following the
ledger's own accounting (MemoryLedger): resident parameter shards, the one gathered parameter
set of the node being visited, the live A-matrices after each backward step (a tensor shared by
the lower and upper side, or a view, counts once) and the IBP and intermediate bounds kept so
far. The compiler's memory_plan pass and `run --json` use this same function, so the predicted
and measured numbers are defined the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardbound.runtime.ops import OP_TYPES

F32 = 4


@dataclass(frozen=True)
class NodeShape:
    name: str
    op: str
    inputs: tuple[str, ...]
    shape: tuple[int, ...]
    param_numels: tuple[int, ...]
    crown_bounds: bool                 # the bound plan asks CROWN for this node's bounds
    weight_shape: tuple[int, ...] = ()  # shape of the "weight" parameter, if any

    @property
    def traits(self):
        """The kernel class: what the op declares about its memory (runtime/ops/base.py)."""
        return OP_TYPES[self.op]


def _gathered_bytes(node: NodeShape, gathers: bool, streamed: bool, chunk: int) -> int:
    """What a rank holds of a node's gathered parameters while visiting it: all of them, or
    for a streamed linear layer (runtime/numerics/streaming.py) one weight block, and the other
    parameters (the bias) only after the blocks are done."""
    if not gathers:
        return 0
    total = sum(node.param_numels) * F32
    weight = math.prod(node.weight_shape) * F32 if node.weight_shape else 0
    if (not streamed or not node.traits.streams_weight or len(node.weight_shape) != 2
            or weight <= chunk):
        return total
    rows, cols = node.weight_shape
    block = max(min(max(1, chunk // F32 // cols), rows) * cols,   # forward / IBP: row blocks
                min(max(1, chunk // F32 // rows), cols) * rows) * F32  # backward: column blocks
    return max(block, total - weight)


def _starts_at_inputs(node: NodeShape, world: int, streamed: bool, chunk: int) -> bool:
    """Whether a backward pass from `node` starts from its own rows at its inputs (the op's
    closed-form `unit_backward`: runtime/engine/network.py) rather than from unit rows at the
    node; a streamed linear weight has no closed form (it is never gathered whole)."""
    from shardbound.runtime.ops.base import Op

    cls = node.traits
    if cls.relaxed or cls.unit_backward is Op.unit_backward:
        return False
    weight = math.prod(node.weight_shape) * F32 if node.weight_shape else 0
    return not (streamed and world > 1 and cls.streams_weight and len(node.weight_shape) == 2
                and weight > chunk)


def predict_peak(nodes: list[NodeShape], output: str, world: int, batch: int = 1,
                 spec_rows: int | None = None, shard_rows: bool | None = None,
                 method: str = "crown", stream_chunk_bytes: int | None = None,
                 crown_rows: dict | None = None) -> dict:
    """Predicted per-rank bytes: resident parameters, and the tracked peak of a run of
    `method` ("ibp" or "crown"). `shard_rows` None means single mode (whole parameters);
    False or True means fsdp without or with work sharding of the CROWN rows (the orders that
    shard rows also stream large linear weights in blocks of `stream_chunk_bytes`).
    `crown_rows` (a run's `Network.bounded_rows`): how many neurons of each planned node CROWN
    bounded; without it every neuron is assumed to be (the most a run can take: the compiler's
    memory_plan pass predicts before any box is known)."""
    fsdp = shard_rows is not None
    streamed = bool(shard_rows) and stream_chunk_bytes is not None
    shard_rows = bool(shard_rows) and world > 1
    if fsdp:
        resident = sum(-(-n // world) * F32 for node in nodes for n in node.param_numels)
    else:
        resident = sum(n * F32 for node in nodes for n in node.param_numels)
    gathered = {node.name: _gathered_bytes(node, fsdp and world > 1, streamed,
                                           stream_chunk_bytes or 0)
                for node in nodes}
    index = {node.name: i for i, node in enumerate(nodes)}
    by_name = {node.name: node for node in nodes}

    def rows(total):
        return -(-total // world) if shard_rows else total

    # IBP: every node's (lower, upper) -- the input's are the box itself; views add nothing.
    ibp_bytes = 0
    peak = resident
    for node in nodes:
        if not node.traits.is_view:
            ibp_bytes += 2 * batch * math.prod(node.shape) * F32
        peak = max(peak, resident + gathered[node.name] + ibp_bytes)
    bounds = ibp_bytes
    if method == "ibp":
        return {"resident_param_bytes": resident, "peak_tracked_bytes": peak}

    def backward(target: NodeShape, S: int, eye: bool):
        """Peak of one backward pass from `target` with S rows."""
        nonlocal peak
        # live: name -> (lower bytes, upper bytes, shared storage?)
        while (eye and target.traits.is_view and len(target.inputs) == 1
               and not by_name[target.inputs[0]].traits.is_input):
            target = by_name[target.inputs[0]]      # unit rows of a view are its input's
        stop = index[target.name] + 1
        if eye and _starts_at_inputs(target, world, streamed, stream_chunk_bytes or 0):
            # the target's own rows at its inputs (shared by both sides, broadcast over B)
            live = {name: (S * math.prod(by_name[name].shape) * F32,) * 2 + (True,)
                    for name in target.inputs}
            a_prev = sum(l for l, _, _ in live.values())
            # the target's parameters are released before its rows enter the ledger
            peak = max(peak, resident + bounds + max(a_prev, gathered[target.name]))
            stop -= 1
        else:
            first = (S * math.prod(target.shape) if eye
                     else batch * S * math.prod(target.shape)) * F32
            live = {target.name: (first, first, True)}
            a_prev = first
        for node in reversed(nodes[:stop]):
            if node.name not in live or node.traits.is_input:
                continue
            l_bytes, u_bytes, shared = live.pop(node.name)
            new_bytes = 0        # this step's outputs, alive with its inputs and parameters
            for name in node.inputs:
                size = batch * S * math.prod(by_name[name].shape) * F32
                kept = node.traits.backward_memory
                if kept == "view":
                    produced = (l_bytes, u_bytes, shared)
                else:
                    produced = (size, size, shared and kept == "shared")
                    new_bytes += size * (1 if produced[2] else 2)
                if name in live:     # summed into a new tensor
                    old = live[name]
                    produced = (size, size, old[2] and produced[2])
                live[name] = produced
            peak = max(peak, resident + bounds + a_prev + new_bytes + gathered[node.name])
            a_now = sum(l + (0 if sh else u) for l, u, sh in live.values())
            peak = max(peak, resident + bounds + a_now)
            a_prev = a_now

    # The engine recomputes IBP from CROWN-tightened bounds (to choose the sparse rows): a
    # node whose inputs' bounds were tightened gets new bounds of its own ("differs"), kept
    # with the others and counted at the next planned node.
    differs, pending = set(), 0
    for node in nodes:
        planned = node.crown_bounds and not node.traits.is_input
        if not planned:
            if any(i in differs for i in node.inputs):
                differs.add(node.name)
                if not node.traits.is_view:
                    pending += 2 * batch * math.prod(node.shape) * F32
            continue
        total = math.prod(node.shape)
        if crown_rows is not None:
            total = crown_rows.get(node.name, 0)
        if total:
            backward(node, rows(total), eye=True)
        if total or any(i in differs for i in node.inputs):
            bounds += 2 * batch * math.prod(node.shape) * F32      # new bounds of its own
            differs.add(node.name)
        bounds += pending
        pending = 0
    out = by_name[output]
    backward(out, rows(spec_rows or math.prod(out.shape)), eye=False)
    return {"resident_param_bytes": resident, "peak_tracked_bytes": peak}


def network_shapes(network) -> list[NodeShape]:
    """The description of a runtime Network (what `run --json` predicts from)."""
    out = []
    for n in network.nodes:
        numels = tuple(int(p.numel() if callable(p.numel) else p.numel)   # Tensor or shard
                       for p in n.params.values())
        weight = n.params.get("weight")
        out.append(NodeShape(n.name, n.kind, n.inputs, n.shape, numels,
                             network.intermediate.get(n.name) == "crown",
                             tuple(weight.shape) if weight is not None else ()))
    return out
