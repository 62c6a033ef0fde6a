"""Predict the memory ledger's per-rank peak of a tp run (runtime/parallel/tp.py), from shapes.

tp holds a slice of each zone's hidden channels on every rank, so the figures of the memory
model (memory_model.py) change in four ways, all replayed here rank by rank (every rank's own
channel count: `blocked` splits on 256-block boundaries, so ranks differ and some hold none),
and the prediction is the largest over ranks, as the ledger's report is:

- shapes: a zone's column and elementwise nodes hold `local` of their C channels, and their
  A-matrices (and bounds, and alpha slopes) only those columns; the row layer reads them;
  parameters sliced on the channel dimension hold local / C of their elements; nodes outside
  zones are whole on every rank (nothing is sharded or gathered as in fsdp);
- collectives: a reduction of Partial sums (the row layer's forward and IBP products, the
  column layer's backward product, zone bias terms) holds send and receive buffers on the
  ledger while it runs (`tp_reduce.Reduction._gathered`: `count` subtotals of the M output
  elements sent, P x count x one column chunk received);
- passes: a planned zone node is bounded by CROWN either on this rank's own neurons ("local
  rows": no zone upstream, no collective in the pass) or on all its neurons in P row tiles
  (each rank carries every tile with its own columns); other planned nodes and the final pass
  carry all their rows on every rank (tp does not shard rows);
- bounds: tp recomputes IBP from the tightest bounds known so far (`refine_ibp`) when some
  planned node takes IBP bounds; each node's new bounds are then kept as the run goes.

alpha-CROWN is alpha_model.py's figure on this rank's shapes, plus what tp's autograd
functions keep (tp_reduce.py): the column and row layers' (transposed) weight slices, and the
reduction buffers of the backward pass. Full alpha-CROWN is memory_model's alpha phase on this rank's
shapes (`_alpha_phase_peak`: every start node's alphas x3 and the largest pass), with each
start node's rows as the rank carries them (`Network.alpha_rows` of that rank: a zone node on
local rows its own neurons, else every rank's; without a run, every neuron), and per pass
tp's autograd keepers and the gradient's reduction buffer as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardbound.runtime.accounting.memory_model import (F32, MethodContext, NodeShape,
                                                        _alpha_phase_peak, _result,
                                                        backward_step, weight_keeper)
from shardbound.runtime.numerics.blocktree import tree_nodes

GATHER_WHOLE_ELEMENTS = 1 << 16     # tp_reduce: outputs up to this size go in one all-gather
TP_METHODS = ("ibp", "crown", "alpha-crown", "full-alpha-crown")


@dataclass(frozen=True)
class TpPlace:
    """A zone node's place: role ("column", "elementwise", "row"), zone, channel count C,
    whether CROWN bounds it on local rows, and per parameter (in `param_numels` order)
    whether it is sliced on the channel dimension (it then holds local / C of its elements)."""

    role: str
    zone: int
    channels: int
    local_rows: bool
    sliced: tuple[bool, ...]


def spatial(shape) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def sliced_params(role: str, node_shape, channels: int, params) -> tuple[bool, ...]:
    """Which parameters (role, shape) of a zone node are sliced on its channels, as
    runtime/parallel/tp.py's `_slice` reads them: every one of a column layer's, the row
    layer's weight, and an elementwise op's constants of the sample's rank with C channels."""
    out = []
    for name, shape in params:
        if role == "column":
            out.append(True)
        elif role == "row":
            out.append(name == "weight")
        else:
            out.append(len(shape) == len(node_shape) and bool(shape)
                       and shape[0] == channels > 1)
    return tuple(out)


@dataclass(frozen=True)
class _Split:
    """One zone's split on one rank: every rank's channel range, and the reduction order."""

    ranges: tuple
    rank: int
    order: str

    @property
    def local(self) -> int:
        c0, c1 = self.ranges[self.rank]
        return c1 - c0

    def collective(self, M: int, X: int = 1) -> int:
        """Ledger bytes of one reduction of M output elements over this split (tp_reduce)."""
        P = len(self.ranges)
        if self.order == "blocked":
            owners = [r for r, (c0, c1) in enumerate(self.ranges) if c1 > c0]
            if len(owners) == 1:            # one owner computes it and broadcasts
                return M * F32 if P > 1 else 0
            C = self.ranges[-1][1]
            count = max(len(tree_nodes(c0 * X, c1 * X, C * X)) for c0, c1 in self.ranges)
        else:
            count = 1
        step = M if M <= GATHER_WHOLE_ELEMENTS else -(-M // P)
        return (count * M + P * count * step) * F32


def localize(nodes: list[NodeShape], places: dict, world: int, rank: int, ranges, order: str
             ) -> tuple[list[NodeShape], dict]:
    """This rank's node shapes (zone column/elementwise outputs hold `local` channels,
    sliced parameters local / C of their elements) and each zone node's _Split."""
    out, splits = [], {}
    for node in nodes:
        place = places.get(node.name)
        if place is None:
            out.append(node)
            continue
        split = _Split(tuple(ranges(place.channels, world)), rank, order)
        splits[node.name] = split
        C, local = place.channels, split.local
        numels = tuple(n // C * local if s else n
                       for n, s in zip(node.param_numels, place.sliced))
        shape = node.shape if place.role == "row" else (local, *node.shape[1:])
        weight = node.weight_shape
        if weight and place.role in ("column", "row"):
            dim = 0 if place.role == "column" else 1
            weight = tuple(local if d == dim else w for d, w in enumerate(weight))
        out.append(replace(node, shape=shape, param_numels=numels, weight_shape=weight))
    return out, splits


def predict_tp_peak(nodes: list[NodeShape], places: dict, output: str, world: int, ranges,
                    order: str = "blocked", batch: int = 1, spec_rows: int | None = None,
                    method: str = "crown", crown_rows=None, row_tile: int | None = None,
                    refine: bool = False, ibp_planned=(), alpha_rows=None,
                    alpha_neurons=None) -> dict:
    """The largest per-rank prediction over the ranks of a tp job (predict_peak's dict, plus
    `rank`). `places`: node name -> TpPlace for zone nodes; `ranges(channels, P)`: the
    split (tp_reduce.channel_ranges of the order); `crown_rows`: a run's
    `Network.bounded_rows`, one dict per rank (a list), or None (every neuron: the most a run
    can take); `refine`: tp recomputes IBP from the tightest bounds (some planned node takes
    IBP bounds: `Network.refine_ibp`); `ibp_planned`: the nodes whose planned bounds are
    IBP's (the engine counts its bounds at every planned node). Full alpha-CROWN:
    `alpha_rows` / `alpha_neurons`, one dict per rank (a run's `Network.alpha_rows` /
    `alpha_neurons`) or None (every neuron of every start node, dense alphas)."""
    if method not in TP_METHODS:
        raise ValueError(f"tp has no memory model for method {method!r} (tp runs "
                         f"{', '.join(TP_METHODS)})")
    best, seen = None, {}
    for rank in range(world):
        local, splits = localize(nodes, places, world, rank, ranges, order)
        rows = None if crown_rows is None else crown_rows[rank]
        key = tuple(s.ranges[rank] for s in splits.values())
        if rows is None and alpha_rows is None and key in seen:   # the same channels: alike
            continue
        seen[key] = True
        alpha = (None if alpha_rows is None else alpha_rows[rank],
                 None if alpha_neurons is None else alpha_neurons[rank])
        got = _rank_peak(local, places, splits, output, world, batch, spec_rows, method,
                         rows, row_tile, refine, set(ibp_planned), alpha, order)
        if best is None or got["peak_tracked_bytes"] > best["peak_tracked_bytes"]:
            best = dict(got, rank=rank)
    return best


def _numel(nodes, index, name) -> int:
    return math.prod(nodes[index[name]].shape)


def _rank_peak(nodes, places, splits, output, world, batch, spec_rows, method, crown_rows,
               row_tile, refine, ibp_planned, alpha=(None, None), order="blocked") -> dict:
    index = {node.name: i for i, node in enumerate(nodes)}
    resident = sum(n * F32 for node in nodes for n in node.param_numels)
    # IBP: every node's bounds; a row layer's two products (centre, radius) are reductions.
    ibp_bytes, peak, where = 0, resident, ("ibp", nodes[0].name)
    for node in nodes:
        place = places.get(node.name)
        if place is not None and place.role == "row" and node.inputs:
            X = math.prod(node.weight_shape[2:]) if len(node.weight_shape) > 2 else 1
            coll = splits[node.name].collective(batch * math.prod(node.shape), X)
            if resident + ibp_bytes + coll > peak:
                peak, where = resident + ibp_bytes + coll, ("ibp", node.name)
        if not node.traits.is_view:     # the input's: the box itself
            ibp_bytes += 2 * batch * math.prod(node.shape) * F32
        if resident + ibp_bytes > peak:
            peak, where = resident + ibp_bytes, ("ibp", node.name)
    if method == "ibp":
        return _result(resident, peak, where)

    def tiled(n):
        return min(n, row_tile) if row_tile else n

    # The passes in run order: (target, rows, start, local rows?, bounds on the ledger).
    # The engine puts its bounds on the ledger at each planned node (Network.
    # intermediate_bounds): what it keeps of the nodes after the last one is not counted.
    passes, kept, counted = [], ibp_bytes, ibp_bytes
    for i, node in enumerate(nodes):
        if node.traits.is_input:
            continue
        own = 2 * batch * math.prod(node.shape) * F32
        place = places.get(node.name)
        planned = node.crown_bounds or node.name in ibp_planned
        if node.crown_bounds:
            if place is not None and place.role != "row":
                total = math.prod(node.shape) if place.local_rows else \
                    math.prod(node.shape[1:] or (1,)) * place.channels
                if crown_rows is not None:
                    total = crown_rows.get(node.name, 0)
                elif not place.local_rows:
                    total = -(-total // world)          # one of P row tiles
                passes.append((i, total, "node", place.local_rows, counted))
                kept += own
            else:
                total = math.prod(node.shape)
                if crown_rows is not None:
                    total = crown_rows.get(node.name, 0)
                if total:
                    starts = "inputs" if _starts_at_inputs(node, place) else "node"
                    passes.append((i, tiled(total), starts, False, counted))
                    kept += own
        elif refine and not node.traits.is_view:
            kept += own                 # IBP recomputed from the tightest bounds, kept
        if planned:
            counted = kept
    S = spec_rows or math.prod(nodes[index[output]].shape)
    passes.append((index[output], tiled(S), "final", False, counted))
    for t, S, start, local, held in passes:
        if not S:
            continue
        got, at = _backward_peak(nodes, index, places, splits, t, S, start, local, batch)
        if resident + held + got > peak:
            peak, where = resident + held + got, (f"crown<-{nodes[t].name}", nodes[at].name)
    if method == "crown":
        return _result(resident, peak, where)
    crown = _result(resident, peak, where)
    if method == "full-alpha-crown":
        return _full_alpha_peak(nodes, index, places, splits, output, batch, S, passes,
                                resident, crown, *alpha, order)
    return _alpha_peak(nodes, index, places, splits, output, batch, S, passes[-1][4],
                       resident, world, crown)


def _starts_at_inputs(node, place) -> bool:
    """A non-zone planned node (or a row linear layer) starts from its own rows at its
    inputs where its kernel has the closed form; a row conv (no patches) starts at itself."""
    from shardbound.runtime.ops.base import Op

    cls = node.traits
    if cls.relaxed or cls.unit_backward is Op.unit_backward:
        return False
    return not (place is not None and place.role == "row" and len(node.weight_shape) > 2)


def _step_collective(node, place, split, batch, S, local) -> int:
    """Ledger bytes of the reductions inside one backward step of a zone node (none on
    local rows): the column layer's product over its channels (one im2col product for a
    conv: M = rows x output positions x C_in k k) and the bias terms (M = rows)."""
    if place is None or local or place.role == "row":
        return 0
    dot = split.collective(batch * S, spatial(node.shape) if place.role != "column" else 1)
    if place.role != "column":
        return dot
    cols = math.prod(node.weight_shape[1:]) * spatial(node.shape)
    return max(dot, split.collective(batch * S * cols))


def _backward_peak(nodes, index, places, splits, t, S, start, local, batch):
    """memory_model._backward_peak on this rank's shapes, with the step's reduction buffers
    alive with the A-matrices before it."""
    target = nodes[t]
    if start == "inputs":
        while (target.traits.is_view and len(target.inputs) == 1
               and not nodes[index[target.inputs[0]]].traits.is_input):
            t = index[target.inputs[0]]
            target = nodes[t]
        live = {name: (S * _numel(nodes, index, name) * F32,) * 2 + (True,)
                for name in target.inputs}
        a_prev = sum(l for l, _, _ in live.values())
        peak, at = a_prev, t
        t -= 1
    else:
        first = (batch if start == "final" else 1) * S * math.prod(target.shape) * F32
        live = {target.name: (first, first, True)}
        a_prev, peak, at = first, first, t
    for j in range(t, -1, -1):
        node = nodes[j]
        if node.name not in live or node.traits.is_input:
            continue
        new_bytes = backward_step(nodes, index, node, live, batch, S)
        place = places.get(node.name)
        # While a reduction runs the ledger holds the A-matrices before the step and its
        # buffers (a first side's finished product is on it only once the step returns).
        coll = _step_collective(node, place, splits.get(node.name), batch, S, local)
        if a_prev + coll > peak:
            peak, at = a_prev + coll, j
        if a_prev + new_bytes > peak:
            peak, at = a_prev + new_bytes, j
        a_now = sum(l + (0 if sh else u) for l, u, sh in live.values())
        if a_now > peak:
            peak, at = a_now, j
        a_prev = a_now
    return peak, at


def _alpha_peak(nodes, index, places, splits, output, batch, S, held, resident, world,
                crown) -> dict:
    """alpha_model's figure on this rank's shapes, plus what tp's autograd functions keep."""
    from shardbound.runtime.accounting.alpha_model import alpha_crown_peak

    extra = 0
    for node in nodes:
        place = places.get(node.name)
        if place is None:
            continue
        if place.role in ("column", "row"):  # _ReducedMatmul / _ColumnMatmul keep the
            extra += math.prod(node.weight_shape) * F32     # (transposed) weight slice
    context = MethodContext(nodes, index, [0] * len(nodes), resident, batch, output, S,
                            held + extra, world, crown)
    got = alpha_crown_peak(context)
    if got["peak_phase"] == "alpha-crown":
        # The gradient w.r.t. a row layer's replicated A-matrix is reduced over the zone's
        # channels (_ColumnMatmul) while the whole graph is still saved.
        back = max([s.collective(batch * S * math.prod(nodes[index[name]].shape))
                    for name, s in splits.items() if places[name].role == "row"] + [0])
        got = dict(got, peak_tracked_bytes=got["peak_tracked_bytes"] + back)
    return got


def _full_alpha_peak(nodes, index, places, splits, output, batch, S, passes, resident, crown,
                     alpha_rows, alpha_neurons, order: str = "blocked") -> dict:
    """CROWN's figure or full alpha-CROWN's optimisation on this rank's shapes, the larger
    (memory_model._alpha_phase_peak, with tp's per-pass keepers: `_pass_extra`)."""
    keeper = weight_keeper(order)
    if alpha_rows is None:          # every neuron of every start node, as this rank holds it
        alpha_rows = {}
        for t, _, start, local, _ in passes[:-1]:
            node, place = nodes[t], places.get(nodes[t].name)
            whole = place is not None and place.role != "row" and not local
            alpha_rows[node.name] = (spatial(node.shape) * place.channels if whole
                                     else math.prod(node.shape))

    def extra(R, start, path):
        return _pass_extra(nodes, index, places, splits, batch, R, start, path)

    got = resident + passes[-1][4] + _alpha_phase_peak(
        nodes, index, output, batch, lambda n: n, S, alpha_rows, [0] * len(nodes),
        alpha_neurons or {}, pass_extra=extra,
        keeps_weights=lambda node: node.name not in places and keeper(node))  # zone: _pass_extra
    if got <= crown["peak_tracked_bytes"]:
        return crown
    return _result(resident, got, ("full-alpha-crown", output))


def _pass_extra(nodes, index, places, splits, batch, R, start, path) -> tuple[dict, int]:
    """What tp's autograd functions keep in one differentiated pass of R rows (see
    `_alpha_peak`): ({zone layer past the start node: its (transposed) weight slice, saved at
    its step}, the largest reduction of a row layer's replicated A-matrix gradient, at the
    pass's backward)."""
    kept, back = {}, 0
    for name in path:
        place = places.get(name)
        if place is None or name == start:
            continue
        node = nodes[index[name]]
        if place.role in ("column", "row"):
            kept[name] = math.prod(node.weight_shape) * F32
        if place.role == "row":
            back = max(back, splits[name].collective(batch * R * math.prod(node.shape)))
    return kept, back


def network_places(network) -> tuple[list[NodeShape], dict]:
    """A tp rank's network as the model sees it: whole shapes and parameter sizes (zone ops
    keep them from binding: runtime/parallel/tp.py) and each zone node's TpPlace."""
    nodes, places = [], {}
    for n in network.nodes:
        weight = n.params.get("weight")
        role = getattr(n, "tp_role", None)
        if role in ("column", "elementwise", "row") and hasattr(n, "tp_param_numels"):
            numels = tuple(n.tp_param_numels.get(r, int(p.numel())) for r, p in n.params.items())
            sliced = tuple(n.tp_sliced.get(r, False) for r in n.params)
            places[n.name] = TpPlace(role, n.tp_zone, n.tp_channels, n.tp_local_rows, sliced)
            shape = n.full_shape
            wshape = ()
            if weight is not None:
                wshape = list(weight.shape)
                if role != "elementwise":
                    wshape[0 if role == "column" else 1] = n.tp_channels
                wshape = tuple(wshape)
        else:
            numels = tuple(int(p.numel()) for p in n.params.values())
            shape = n.shape
            wshape = tuple(weight.shape) if weight is not None else ()
        nodes.append(NodeShape(n.name, n.kind, n.inputs, shape, numels,
                               network.intermediate.get(n.name) == "crown", wshape))
    return nodes, places


def refines(network) -> bool:
    """Whether a tp run recomputes IBP from the tightest bounds (Network.intermediate_bounds)."""
    return bool(network.refine_ibp and "ibp" in network.intermediate.values())


def ibp_planned(network) -> set:
    """The nodes whose planned intermediate bounds are IBP's."""
    return {name for name, how in network.intermediate.items() if how == "ibp"}
