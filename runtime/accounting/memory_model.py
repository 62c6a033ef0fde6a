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


def chunk_for(chunks, name: str) -> int:
    """A node's stream chunk in bytes: `chunks` is one size for every layer (an int; None: 0)
    or a mapping node name -> bytes (plan.json's `stream_chunks` for one rank count:
    runtime/accounting/chunk_choice.py); a node it does not name never streams."""
    if isinstance(chunks, dict):
        return int(chunks.get(name, 0))
    return int(chunks or 0)


def _gathered_bytes(node: NodeShape, gathers: bool, streamed: bool, chunk) -> int:
    """What a rank holds of a node's gathered parameters while visiting it: all of them, or
    for a streamed linear layer (runtime/numerics/streaming.py) one weight block, and the other
    parameters (the bias) only after the blocks are done. `chunk`: see `chunk_for`."""
    if not gathers:
        return 0
    chunk = chunk_for(chunk, node.name)
    total = sum(node.param_numels) * F32
    weight = math.prod(node.weight_shape) * F32 if node.weight_shape else 0
    if (not streamed or not node.traits.streams_weight or len(node.weight_shape) != 2
            or weight <= chunk):
        return total
    rows, cols = node.weight_shape
    block = max(min(max(1, chunk // F32 // cols), rows) * cols,   # forward / IBP: row blocks
                min(max(1, chunk // F32 // rows), cols) * rows) * F32  # backward: column blocks
    return max(block, total - weight)


def _starts_at_inputs(node: NodeShape, world: int, streamed: bool, chunk) -> bool:
    """Whether a backward pass from `node` starts from its own rows at its inputs (the op's
    closed-form `unit_backward`: runtime/engine/network.py) rather than from unit rows at the
    node; a streamed linear weight has no closed form (it is never gathered whole)."""
    from shardbound.runtime.ops.base import Op

    cls = node.traits
    if cls.relaxed or cls.unit_backward is Op.unit_backward:
        return False
    chunk = chunk_for(chunk, node.name)
    weight = math.prod(node.weight_shape) * F32 if node.weight_shape else 0
    return not (streamed and world > 1 and cls.streams_weight and len(node.weight_shape) == 2
                and weight > chunk)


def predict_peak(nodes: list[NodeShape], output: str, world: int, batch: int = 1,
                 spec_rows: int | None = None, shard_rows: bool | None = None,
                 method: str = "crown", stream_chunk_bytes: int | dict | None = None,
                 crown_rows: dict | None = None, row_tile: int | None = None,
                 alpha_rows: dict | None = None, alpha_neurons: dict | None = None,
                 order: str = "blocked") -> dict:
    """Predicted per-rank bytes: resident parameters, and the tracked peak of a run of
    `method` ("ibp" or "crown"). `shard_rows` None means single mode (whole parameters);
    False or True means fsdp without or with work sharding of the CROWN rows (the orders that
    shard rows also stream large linear weights in blocks of `stream_chunk_bytes`: one size,
    or a mapping node name -> bytes, plan.json's `stream_chunks` of this P).
    `crown_rows` (a run's `Network.bounded_rows`): how many neurons of each planned node CROWN
    bounded; without it every neuron is assumed to be (the most a run can take: the compiler's
    memory_plan pass predicts before any box is known). `row_tile`: the most rows one backward
    pass propagates at once (`Network.row_tile`; None: all of a rank's rows).

    Besides the bytes, the result names where the peak is (`peak_phase`: "ibp", "crown<-NODE"
    or a method's own phase; `peak_node`: the node being visited), for the planner's and the
    run-time guard's messages. Methods other than IBP and CROWN are predicted by the figures
    registered in `METHOD_MODELS` (alpha-CROWN: runtime/accounting/alpha_model.py).
    For "full-alpha-crown" (full alpha-CROWN: runtime/engine/full_alpha.py) `alpha_rows` (a
    run's `Network.alpha_rows`) gives each intermediate start node's neurons with alphas; the
    peak is CROWN's or the optimisation's (`_alpha_phase_peak`), whichever is larger. Without
    `alpha_rows` (before any box is known: the planner) every neuron of every intermediate
    pass is assumed to get alphas, the most a run can take. `alpha_neurons` (a run's
    `Network.alpha_neurons`): the ops whose alphas were kept for some input neurons alone
    (`SparseAlpha`), and how many. `order` (the summation order) decides which weights a
    differentiated step keeps (`weight_keeper`).

    Replaying every backward pass costs the sum of their lengths: quadratic in depth (a chain
    of 20,000 ReLUs took minutes to compile). Only the largest peak is wanted, so each pass
    first gets a cheap upper bound (`_PassBounds`), passes are replayed from the largest bound
    down, and the rest are skipped once a bound falls to the peak already found: the result is
    exactly the full replay's, for linear work on graphs whose passes peak alike."""
    fsdp = shard_rows is not None
    streamed = bool(shard_rows) and stream_chunk_bytes is not None
    shard_rows = bool(shard_rows) and world > 1
    if fsdp:
        resident = sum(-(-n // world) * F32 for node in nodes for n in node.param_numels)
    else:
        resident = sum(n * F32 for node in nodes for n in node.param_numels)
    gathered = [_gathered_bytes(node, fsdp and world > 1, streamed, stream_chunk_bytes)
                for node in nodes]
    index = {node.name: i for i, node in enumerate(nodes)}

    def rows(total):
        local = -(-total // world) if shard_rows else total
        return min(local, row_tile) if row_tile else local

    # IBP: every node's (lower, upper) -- the input's are the box itself; views add nothing.
    ibp_bytes = 0
    peak, where = resident, ("ibp", nodes[0].name)
    for i, node in enumerate(nodes):
        if not node.traits.is_view:
            ibp_bytes += 2 * batch * math.prod(node.shape) * F32
        if resident + gathered[i] + ibp_bytes > peak:
            peak, where = resident + gathered[i] + ibp_bytes, ("ibp", node.name)
    if method == "ibp":
        return _result(resident, peak, where)
    if method not in ("crown", "full-alpha-crown") and method not in METHOD_MODELS:
        raise ValueError(f"no memory model for method {method!r}; register one in "
                         "METHOD_MODELS (runtime/accounting/memory_model.py)")

    passes = _passes(nodes, index, batch, rows, ibp_bytes, output, spec_rows, crown_rows)
    limits = _PassBounds(nodes, index, gathered)
    ranked = sorted(passes, key=lambda p: -(resident + p[3] + limits.upper(p[0], p[1], batch)))
    for target, S, eye, held in ranked:
        if resident + held + limits.upper(target, S, batch) <= peak:
            break                       # this pass and every later one cannot beat the peak
        starts = (world, streamed, stream_chunk_bytes)
        got, at = _backward_peak(nodes, index, gathered, target, S, eye, batch, starts)
        if resident + held + got > peak:
            peak, where = resident + held + got, (f"crown<-{nodes[target].name}", nodes[at].name)
    if method == "full-alpha-crown":
        # Differentiated backward products stream every sharded matrix, P = 1 included
        # (runtime/ops/linear.py): blocks of it are gathered.
        alpha_gathered = [_gathered_bytes(node, True, True, stream_chunk_bytes) if fsdp
                          else 0 for node in nodes]
        final_rows = rows(spec_rows or math.prod(nodes[index[output]].shape))
        if alpha_rows is None:
            alpha_rows = {nodes[t].name: math.prod(nodes[t].shape) for t, *_ in passes[:-1]}
        got = resident + passes[-1][3] + _alpha_phase_peak(
            nodes, index, output, batch, rows, final_rows, alpha_rows, alpha_gathered,
            alpha_neurons or {}, keeps_weights=weight_keeper(order))
        if got > peak:
            peak, where = got, ("full-alpha-crown", output)
    result = _result(resident, peak, where)
    if method not in ("crown", "full-alpha-crown"):
        final = passes[-1]
        spec_total = spec_rows or math.prod(nodes[index[output]].shape)
        context = MethodContext(nodes, index, gathered, resident, batch, output,
                                -(-spec_total // world) if shard_rows else spec_total,
                                final[3], world, result)
        result = METHOD_MODELS[method](context)
    return result


def _result(resident: int, peak: int, where: tuple[str, str]) -> dict:
    return {"resident_param_bytes": resident, "peak_tracked_bytes": peak,
            "peak_phase": where[0], "peak_node": where[1]}


@dataclass(frozen=True)
class MethodContext:
    """What a method's memory figure gets from `predict_peak`: the node shapes, each node's
    gathered parameter bytes per rank, the resident bytes, boxes, the output node, the final
    pass's spec rows per rank (after row sharding, before any row tile) and the bounds held
    during it, the world size and CROWN's own prediction (`crown`: the dict `predict_peak`
    returns for method "crown")."""

    nodes: list
    index: dict
    gathered: list
    resident: int
    batch: int
    output: str
    local_rows: int
    held: int
    world: int
    crown: dict


# method name -> figure(MethodContext) -> predict_peak's dict. A bound method that is not IBP
# or CROWN registers its figure here (see register_method_model); the planner covers every
# method registered.
METHOD_MODELS: dict = {}


def register_method_model(name: str):
    """Decorator: `figure(context: MethodContext) -> dict` predicts method `name`'s per-rank
    peak (the keys of `_result`). A second registration of a name is a bug."""
    def put(fn):
        if name in METHOD_MODELS:
            raise TypeError(f"memory model for method {name!r} registered twice")
        METHOD_MODELS[name] = fn
        return fn
    return put


# What the autograd graph of one alpha pass saves, in tensors of (batch, rows, op input) per
# optimisable op, measured on the ReLU kernels (runtime/ops/activation.py): the first such op
# of the pass (its incoming A-matrix is a constant) keeps two, every later one four (its
# A-matrix depends on earlier alphas); the input A-matrix is kept for the box terms.
SAVED_FIRST, SAVED_LATER = 2, 4
# The same for a ReLU whose alphas are kept for k inexact neurons alone (`SparseAlpha`,
# relaxation.py `_crown_sparse_alpha`): every such op keeps SPARSE_FIRST tensors of (batch,
# rows, k) -- the alphas (their clamp's input: the counter sees the parameter's storage
# too), the selected columns and their alpha slopes (`_LinesStep`), and the index_copy's
# source -- and the k indices (int64); a later one also SPARSE_LATER of (batch, rows, op
# input) (the clamp's input, its whole A-matrix) and the dense side's two CROWN lines
# (batch, op input). Measured with SavedTensorCounter per step on the bench MLPs
# (256-2048-256-10, 784-512-512-512-10); 2 and 2 (session 7) left a first sparse ReLU's
# pass 18% under on a 2048-wide layer.
SPARSE_FIRST, SPARSE_LATER = 4, 1


def weight_keeper(order: str):
    """node -> whether a differentiated backward step of it keeps its weight where the ledger
    counts it (autograd's saves): the conv kernels save theirs in every order
    (`alpha_saves_weight`: `_OrderedTransposedConv`, conv_transpose2d); a linear layer's
    ordered product holds the prepared operand outside the saves (`contract._OrderedMatmul`),
    while `fast`'s torch.matmul saves the weight's storage (or fsdp's streamed blocks).
    Measured per step with SavedTensorCounter: counting every resident linear weight under
    `blocked` (session 7) over-predicted the 784-512-512-512-10 MLP by 7.5%."""
    def keeps(node) -> bool:
        return order == "fast" or bool(getattr(node.traits, "alpha_saves_weight", False))
    return keeps


def _alpha_phase_peak(nodes, index, output: str, batch: int, rows, final_rows: int,
                      alpha_rows: dict, gathered: list, alpha_neurons: dict,
                      pass_extra=None, keeps_weights=False) -> int:
    """Bytes on top of resident parameters and held bounds while full alpha-CROWN optimises:
    every start node's alphas with Adam's two moments, plus the largest of one pass's
    steps: what its autograd graph saved so far, the step's A-matrices in and out and its
    gathered parameters; then the box terms (the input A-matrix, saved too). Each pass's
    graph is freed by its own backward. `rows(n)` is this rank's share of n rows.
    `pass_extra(R, start, path)` (tp: tp_model.py), if given, tells what a pass of R rows from
    node `start` through the nodes `path` (names, backward order) keeps besides: (bytes saved
    at each differentiated step of those nodes {name: bytes}, the buffers of its backward's
    largest reduction), each counted where it happens (added to the pass's whole peak
    before branch tpfix: 6-9% over in tp on the bench MLPs). `keeps_weights`
    (a bool, or a function node -> bool: `weight_keeper`; tp: of replicated layers only):
    whether a differentiated step keeps its weight where the ledger counts it as saved."""
    ancestors: dict[str, set] = {}
    for node in nodes:
        seen = set()
        for i in node.inputs:
            seen |= ancestors[i] | {i}
        ancestors[node.name] = seen

    def numel(name):
        return math.prod(nodes[index[name]].shape)

    input_numel = math.prod(nodes[0].shape)
    starts = [(2 * rows(k), name) for name, k in alpha_rows.items() if k]
    starts.append((final_rows, output))
    alpha, worst = 0, 0
    for R, name in starts:
        path = [j for j in range(index[name], 0, -1)
                if nodes[j].name in ancestors[name] | {name}]      # backward order
        ops = [j for j in path if nodes[j].traits.relaxed and nodes[j].traits.has_alpha]
        if not ops:
            continue
        alpha += 3 * batch * R * sum(alpha_neurons.get(nodes[j].name, numel(nodes[j].inputs[0]))
                                     for j in ops) * F32
        kept, back = ({}, 0) if pass_extra is None else pass_extra(
            R, name, [nodes[j].name for j in path])
        saved, later, peak = 0, False, 0
        for j in path:
            node = nodes[j]
            ins = sum(numel(i) for i in node.inputs)
            if j in ops and node.name in alpha_neurons:
                k = alpha_neurons[node.name]
                saved += (batch * R * (k * SPARSE_FIRST + (ins * SPARSE_LATER if later else 0))
                          * F32 + 8 * k + (2 * batch * ins * F32 if later else 0))
            elif j in ops:
                # masks (a byte each) and, past the first op, two lines of floats
                saved += (batch * R * ins * (SAVED_LATER if later else SAVED_FIRST) * F32
                          + batch * ins * (1 + (2 * F32 if later else 0)))
            if j in ops:
                # the step's A-matrices in and out, beside what it saved (measured: the peak
                # of a sparse ReLU's pass, tests/test_tp.py's tp_mlp2)
                later = True
                peak = max(peak, saved + batch * R * (numel(node.name) + ins) * F32)
                continue
            if not node.traits.relaxed:     # the bias terms keep the non-weight parameters
                saved += (sum(node.param_numels) - math.prod(node.weight_shape or (0,))) * F32
                keeps = keeps_weights(node) if callable(keeps_weights) else keeps_weights
                if later and keeps and node.weight_shape:
                    saved += math.prod(node.weight_shape) * F32
                if later:
                    saved += kept.get(node.name, 0)
            peak = max(peak, saved + batch * R * (numel(node.name) + ins) * F32 + gathered[j])
        # the box terms: the input A-matrix (and its saved copy), the box's center and radius
        peak = max(peak, saved + batch * (R * 2 * input_numel * F32 + 2 * F32 * input_numel + R))
        # the backward: the whole graph saved (the input A-matrix's copy too) and a gradient
        # reduction's buffers (tp)
        peak = max(peak, saved + batch * R * input_numel * F32 + back)
        worst = max(worst, peak)
    return alpha + worst if alpha else 0


def _passes(nodes, index, batch: int, rows, ibp_bytes: int, output: str, spec_rows,
            crown_rows) -> list[tuple]:
    """The backward passes in run order: (target index, rows, identity start?, bounds held).
    The engine recomputes IBP from CROWN-tightened bounds (to choose the sparse rows): a
    node whose inputs' bounds were tightened gets new bounds of its own ("differs"), kept
    with the others and counted at the next planned node."""
    passes = []
    bounds = ibp_bytes
    differs, pending = set(), 0
    for i, node in enumerate(nodes):
        planned = node.crown_bounds and not node.traits.is_input
        if not planned:
            if any(n in differs for n in node.inputs):
                differs.add(node.name)
                if not node.traits.is_view:
                    pending += 2 * batch * math.prod(node.shape) * F32
            continue
        total = math.prod(node.shape)
        if crown_rows is not None:
            total = crown_rows.get(node.name, 0)
        if total:
            passes.append((i, rows(total), True, bounds))
        if total or any(n in differs for n in node.inputs):
            bounds += 2 * batch * math.prod(node.shape) * F32      # new bounds of its own
            differs.add(node.name)
        bounds += pending
        pending = 0
    passes.append((index[output], rows(spec_rows or math.prod(nodes[index[output]].shape)),
                   False, bounds))
    return passes


def _backward_peak(nodes, index, gathered, t: int, S: int, eye: bool, batch: int,
                   starts: tuple = (1, False, 0)) -> int:
    """The peak of live A-matrix bytes plus gathered parameters in one backward pass from
    node `t` with S rows (what the ledger sees on top of resident parameters and bounds).
    `starts`: (world, streamed, chunk) for `_starts_at_inputs`. Returns (peak, index of the
    node visited at the peak)."""
    while (eye and nodes[t].traits.is_view and len(nodes[t].inputs) == 1
           and not nodes[index[nodes[t].inputs[0]]].traits.is_input):
        t = index[nodes[t].inputs[0]]          # unit rows of a view are its input's
    target = nodes[t]
    peak = 0
    # live: name -> (lower bytes, upper bytes, shared storage?)
    if eye and _starts_at_inputs(target, *starts):
        # the target's own rows at its inputs (shared by both sides, broadcast over B)
        live = {name: (S * math.prod(nodes[index[name]].shape) * F32,) * 2 + (True,)
                for name in target.inputs}
        a_prev = sum(l for l, _, _ in live.values())
        # the target's parameters are released before its rows enter the ledger
        peak, at = max(a_prev, gathered[t]), t
        t -= 1
    else:
        first = (S * math.prod(target.shape) if eye
                 else batch * S * math.prod(target.shape)) * F32
        live = {target.name: (first, first, True)}
        a_prev = first
        at = t
    for j in range(t, -1, -1):
        node = nodes[j]
        if node.name not in live or node.traits.is_input:
            continue
        new_bytes = backward_step(nodes, index, node, live, batch, S)
        if a_prev + new_bytes + gathered[j] > peak:
            peak, at = a_prev + new_bytes + gathered[j], j
        a_now = sum(l + (0 if sh else u) for l, u, sh in live.values())
        if a_now > peak:
            peak, at = a_now, j
        a_prev = a_now
    return peak, at


def backward_step(nodes, index, node, live: dict, batch: int, S: int) -> int:
    """One step of a modelled backward pass: node's A-matrices (popped from `live`: name ->
    (lower bytes, upper bytes, shared storage?)) become its inputs' (batch x S x each input's
    elements; a view passes its own on). Returns the bytes of the tensors the step makes,
    alive with its inputs. An input that already has A-matrices is summed into new tensors,
    one per side, as Network._propagate makes them (single, fsdp and tp alike; the
    single/fsdp model counted one shared tensor before: on the zoo that under-predicted
    slice_gather_mlp's CROWN peak by 5.0%, now 4.2%, and changed no other prediction)."""
    l_bytes, u_bytes, shared = live.pop(node.name)
    new_bytes = 0
    for name in node.inputs:
        size = batch * S * math.prod(nodes[index[name]].shape) * F32
        kept = node.traits.backward_memory
        if kept == "view":
            produced = (l_bytes, u_bytes, shared)
        else:
            produced = (size, size, shared and kept == "shared")
            new_bytes += size * (1 if produced[2] else 2)
        if name in live:
            produced = (size, size, False)
        live[name] = produced
    return new_bytes


class _PassBounds:
    """Upper bounds on `_backward_peak`, O(1) per pass after one linear sweep.

    While a pass visits node j, every live A-matrix belongs to j or to an earlier node with a
    consumer after j (the "cut" at j, taken over the whole graph: a pass sees a subset), and
    the step adds one tensor per input of j. Each such tensor is at most batch x S x its
    node's elements (a view's: the elements of the tensor it views), counted once when every
    op after its node keeps lower and upper shared, else twice. So the peak of a pass from
    node t is at most batch x S x 4 bytes x max over j <= t of (cut weight + step weight),
    plus the largest gathered parameter set up to t."""

    def __init__(self, nodes, index, gathered):
        n = len(nodes)
        numel = [math.prod(node.shape) for node in nodes]
        consumers = [[] for _ in range(n)]
        reads = [0] * n
        for j, node in enumerate(nodes):
            for name in dict.fromkeys(node.inputs):
                consumers[index[name]].append(j)
            for name in node.inputs:
                reads[index[name]] += 1
        factor, elements = [2] * n, list(numel)
        for j in range(n - 1, -1, -1):      # consumers come later: a reverse sweep sees them
            cs = consumers[j]
            # read twice or more: summed A-matrices, one tensor per side (backward_step)
            kept_ok = (reads[j] <= 1
                       and all(nodes[c].traits.backward_memory in ("shared", "view")
                               and factor[c] == 1 for c in cs))
            factor[j] = 1 if kept_ok else 2
            for c in cs:
                if nodes[c].traits.backward_memory == "view":
                    elements[j] = max(elements[j], elements[c])
        weight = [factor[j] * elements[j] for j in range(n)]
        # cut[j]: weight of j and of the earlier nodes read after j (difference array).
        delta = [0] * (n + 1)
        for j in range(n):
            if consumers[j]:
                last = max(consumers[j])
                if last > j + 1:
                    delta[j + 1] += weight[j]
                    delta[last] -= weight[j]
        self.step = []          # prefix maxima of (cut + step) weight, and of gathered bytes
        self.gathered = []
        running, best, best_g = 0, 0, 0
        for j, node in enumerate(nodes):
            running += delta[j]
            if not node.traits.is_input:
                step = running + weight[j] + sum(weight[index[i]] for i in node.inputs)
                best, best_g = max(best, step), max(best_g, gathered[j])
            self.step.append(best)
            self.gathered.append(best_g)

    def upper(self, t: int, S: int, batch: int) -> int:
        return batch * S * F32 * self.step[t] + self.gathered[t]


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


# registers alpha-crown and beta-crown
from shardbound.runtime.accounting import alpha_model, beta_model  # noqa: E402,F401
