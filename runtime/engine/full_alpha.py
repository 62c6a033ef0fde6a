"""Full alpha-CROWN: relaxation parameters per (relaxed op, start node), optimised jointly.

alpha-CROWN of the final pass alone (runtime/engine/alpha.py) keeps CROWN's intermediate
bounds, yet those decide which neurons are unstable and how loose every later relaxation is.
Here every pass that bounds neurons gets its own parameters, as in Xu et al. 2021: the start
nodes are the final spec and every planned-CROWN node with neurons whose relaxation is
inexact under CROWN's bounds (sparse rows: only those neurons, two rows each, z_i and -z_i, the
lower bound of -z_i being minus its upper bound). Start node N's parameters are one alpha
tensor (B, rows of N, *op shape) per optimisable op before N, initialised from CROWN's slopes.

One iteration runs the passes in topological order, each from the best-so-far bounds of the
earlier start nodes (every such bound holds on the box, so each pass is sound whatever the
optimiser did), then one projected Adam step (runtime/engine/optimise.py) on all parameters:
the loss is the sum of the final spec rows' lower bounds and of the start nodes' row bounds,
with intermediate bounds entering later relaxations as constants (a stop-gradient; auto_LiRPA
instead differentiates the final loss through them). The reason is sharding: with it, the
gradient of a row's parameters depends on that row alone, so in fsdp each rank owns the rows of
every start node that row sharding (runtime/parallel/rows.py) gives it -- its 1/P of every
alpha tensor and of Adam's moments, never the full set -- and the bits are single mode's for
any P under a row-invariant order; and each pass's autograd graph is freed right after its
backward, so the autograd peak is one pass's, not the sum over passes. Each row keeps its best
value over the iterations (never looser than CROWN: CROWN's bound is the floor).

Deterministic: a fixed iteration count, passes in a fixed order, no randomness. In tp a zone
node (each rank holds a slice of its neurons) is a start node with its rows laid out as tp's
CROWN bounds it (runtime/parallel/tp.py `ZoneStartRows`): with no zone upstream each rank
carries the rows of its own neurons alone (their alphas and moments are that rank's only);
else every rank carries every row with its own channels' columns and alphas. Every op's
alphas are held as its A-matrices are: a zone op's at this rank's channels, a replicated op's
on every rank. The gradient of a row still depends on that row alone, so the bits are single
mode's under `blocked` for any P. A start node whose alpha tensors would exceed
`max_alpha_elements` (counted over all rows and ranks, so every rank decides alike) keeps
CROWN's bounds.

Rows in patches form (single mode; runtime/ops/patches.py): the rows of a start node
over a (C, H, W) node start as 1x1 windows and keep their windows through the elementwise
relaxations before it, whose alphas are laid out at the windows (B, rows, C, ph, pw) instead
of over the whole grid (`WindowAlpha`; one pass without alphas finds the windows); a
parameter outside a row's window changes nothing, so the optimisation is the dense one's up to
the rounding of `fast`'s window sums. Bench cnn: the conv start node's 572 rows carry 0.17M
alphas instead of 4.7M, and its pass no longer goes dense at the first ReLU. Under the ordered
summations (`blocked`, `exact`) only ops with `alpha_slope_only` get window alphas, and every
sum over a node (bias terms, the concretisation) is the dense rows' (`_side_patches`,
`Network._box_terms`); each value in a window is the dense rows' value there, its gradient
too (the ordered transposed conv's and `to_dense`'s gradients in closed form:
`conv._OrderedTransposedConv`, `patches._DenseRows`), so the bits are those of dense rows,
which fsdp (no patches) computes for any P (tests/test_full_alpha.py checks them bitwise).

Elsewhere a ReLU's alphas (`alpha_slope_only`) are kept for the neurons inexact in some box
only, (B, rows, k) (`SparseAlpha`), in every mode and order: per element the arithmetic of the
dense layout, so the same bits (bench cnn: 521 of 12,288 neurons before the fc start node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardbound.runtime.accounting.ledger import SavedTensorCounter
from shardbound.runtime.engine.interval_helpers import expand_rows
from shardbound.runtime.engine.optimise import alpha_bytes, alpha_group, initial_alphas, maximise
from shardbound.runtime.ops.patches import Patches
from shardbound.runtime.ops.relaxation import ElementwiseRelaxation
from shardbound.runtime.parallel.rows import unit_rows

DEFAULT_ITERATIONS = 20
DEFAULT_LR = 0.5
DEFAULT_DECAY = 0.95                # per step: lr 0.5 -> 0.18 over 20 steps. auto_LiRPA's
# 0.98 (-> 0.33) left Adam still jumping at the end; each row keeps its best value, so a
# faster decay spends the last steps refining near it (bench/vs_autolirpa.py: tighter on
# every spec row of every model than auto_LiRPA's 0.98, which it was not; README, issue 18)
MAX_ALPHA_ELEMENTS = 1 << 25        # per start node, all ranks: 128 MiB of slopes


@dataclass
class StartNode:
    """An intermediate pass: `index` (all ranks' neurons of `node` it bounds), this rank's
    slice `mine` of them, its start rows A (B, 2 len(mine), *shape) and its alphas."""

    node: object
    index: torch.Tensor
    mine: torch.Tensor
    A: torch.Tensor | None      # None when `starts` holds the rows after the node's own step
    alphas: dict
    best: torch.Tensor          # (B, 2 len(mine)): best lower bounds of z_mine, -z_mine
    layout: dict                # op -> how its alphas lie (`Network._propagate`'s alpha_layout)
    starts: dict | None = None  # the rows after the node's own step (input -> A), if closed form
    bias: torch.Tensor | None = None    # (B, rows): that step's bias term
    zone: object = None         # tp zone node: its rows (runtime/parallel/tp.py ZoneStartRows)


def full_alpha_crown(network, lower: torch.Tensor, upper: torch.Tensor, C=None,
                     iterations: int = DEFAULT_ITERATIONS, lr: float = DEFAULT_LR, cache=None,
                     stop=None, max_alpha_elements: int = MAX_ALPHA_ELEMENTS,
                     decay: float = DEFAULT_DECAY, replay: dict | None = None):
    """(lower (B, S), upper (B, S), known): bounds of C f(x) by full alpha-CROWN and the
    intermediate bounds it tightened (a copy of the planned ones, each at least as tight).
    `cache` may hold (ibp, known) from an earlier intermediate pass on the same boxes;
    `stop()` ends the optimisation early (a time budget: see `optimise.maximise`).

    A dict as `replay` (--soundness real/float32) receives the parameters behind the bounds,
    per row those of the iteration that gave its best value: "nodes" (start node name ->
    (its neuron indices (k,), {op name: alphas (B, 2k, ...)}, rows z_i then -z_i), in
    topological order) and "final" ({op name: (B, S, ...)}), for the rigorous engine to
    re-evaluate (`RigorousBounds.root_certificate`). Left empty under row sharding (a rank
    holds only its rows' alphas) and when nothing was optimised. Bookkeeping only: the
    bounds are the same bits with or without it."""
    network.alpha_rows = None               # set below when the optimisation runs
    network.alpha_neurons = {}
    with torch.no_grad():
        ibp, known = cache if cache is not None else network.intermediate_bounds(lower, upper)
        lb_all, ub_all = network.final_crown(ibp, known, lower, upper, C)
    if iterations <= 0:
        return lb_all, ub_all, dict(known)
    if not network.optimisable_nodes() or not _any_inexact(network, known):
        return lb_all, ub_all, dict(known)
    B = lower.shape[0]
    starts = start_nodes(network, known, B, max_alpha_elements, lower, upper)
    network.alpha_rows = {s.node.name: len(s.index) for s in starts}
    S_all = lb_all.shape[1]
    a, b = network.rows.my_range(S_all)
    final_layout = {}
    final_alphas = _alphas(network, known, B, b - a, network.optimisable_nodes(), final_layout)
    network.alpha_neurons = {k: len(v) for k, v in final_layout.items()
                             if isinstance(v, torch.Tensor)}
    every = [final_alphas] + [s.alphas for s in starts]
    ledger = network.ledger
    saved = SavedTensorCounter(ledger)
    current = {"known": dict(known)}
    sharded = ((a, b) != (0, S_all) or any(len(s.mine) != len(s.index) for s in starts)
               or network.tp is not None)      # tp: a rank holds its channels' alphas
    keep_final = {} if replay is not None and not sharded else None
    kept = None
    if keep_final is not None:
        keep_final.update(final_alphas)
        kept = {s.node.name: {k: t.detach().clone() for k, t in s.alphas.items()}
                for s in starts}
    # the kept copies (each row's best parameters, one more copy of every alpha) are held
    # beside the optimised ones and their moments
    kept_bytes = 0 if keep_final is None else sum(alpha_bytes(al) // 3 for al in every)
    ledger.set("alpha", sum(alpha_bytes(al) for al in every) + kept_bytes)

    def objective(last):
        cur = dict(known)
        for s in starts:
            if s.zone is not None:
                if not s.zone.runs:         # local rows, none of them on this rank
                    continue
                value = s.zone.backward(network, s.node, lower, upper, cur, s.alphas, s.layout)
            elif s.starts is None:
                value = network.backward(s.node, s.A, lower, upper, cur, s.alphas,
                                         lower_only=True, alpha_layout=s.layout)[0]
            else:               # from the node's inputs: its own step is the same each time
                value = network._propagate(s.node, dict(s.starts), dict.fromkeys(s.starts),
                                           s.bias, s.bias, lower, upper, cur, s.alphas,
                                           alpha_layout=s.layout)[0]
            if not last and value.requires_grad:
                (-value.sum()).backward()
                saved.clear()           # this pass's graph is gone
            if kept is not None:        # each row's parameters at its best value
                better = value.detach() > s.best
                mine = kept[s.node.name]
                for k, t in s.alphas.items():
                    w = better.reshape(*better.shape, *([1] * (t.dim() - 2)))
                    mine[k] = torch.where(w, t.detach(), mine[k])
            s.best = torch.maximum(s.best, value.detach())
            cur[s.node.name] = _merged(network, s, known[s.node.name])
        current["known"] = cur
        return network.final_crown(ibp, cur, lower, upper, C, final_alphas, lower_only=True,
                                   gather=False, alpha_layout=final_layout)[0]

    groups = [alpha_group(network, al, lr, decay) for al in every if al]
    try:
        best = maximise(objective, groups, iterations, start=lb_all[:, a:b], saved=saved,
                        stop=stop, keep=keep_final)
    finally:
        saved.clear()
        ledger.set("alpha", 0)
    if keep_final is not None:
        replay["final"] = _dense_alphas(network, final_layout, keep_final, known)
        replay["nodes"] = {s.node.name: (s.index, _dense_alphas(network, s.layout,
                                                                 kept[s.node.name], known))
                           for s in starts}
        kept_bytes = sum(t.numel() * t.element_size() for al in
                         (replay["final"], *(k for _, k in replay["nodes"].values()))
                         for t in al.values())
        ledger.set("kept_alpha", kept_bytes)    # until the root certificate has used them
    tightened = current["known"]
    lb = torch.maximum(network.rows.gather(best, S_all), lb_all)
    if starts:      # CROWN's upper side on the tightened intermediate bounds
        with torch.no_grad():
            lb2, ub2 = network.final_crown(ibp, tightened, lower, upper, C)
        lb, ub_all = torch.maximum(lb, lb2), torch.minimum(ub_all, ub2)
    return lb, ub_all, tightened


def start_nodes(network, known, B: int, max_alpha_elements: int = MAX_ALPHA_ELEMENTS,
                lower=None, upper=None) -> list[StartNode]:
    """The intermediate passes of full alpha-CROWN, in topological order (see the module
    docstring), each with this rank's rows and CROWN-initialised alphas (at the rows' windows
    where they travel in patches form: `_patch_rows`, given the box)."""
    position = {n.name: i for i, n in enumerate(network.nodes)}
    optimisable = network.optimisable_nodes()
    per_row = _per_row(network, optimisable, known)
    whole = _per_row(network, optimisable, known, held=False)
    out = []
    for node in network.nodes:
        if (network.intermediate.get(node.name) != "crown" or node is network.input
                or node.name not in known):
            continue
        before = [r for r in optimisable if position[r.name] < position[node.name]
                  and all(i in known for i in r.inputs)]
        if hasattr(node, "crown_bounds"):       # a tp zone node: a slice of its neurons here
            zone = _zone_start(network, node, known, B, before, _counted(node, per_row, whole),
                               max_alpha_elements)
            if zone is not None:
                out.append(zone)
            continue
        lo, hi = known[node.name]
        index = torch.nonzero(network.inexact_mask(node, known[node.name]).reshape(B, -1)
                              .any(dim=0)).reshape(-1)
        k = len(index)
        counted = _counted(node, per_row, whole)
        if not before or k == 0 or B * 2 * k * sum(counted[r.name] for r in before) > \
                max_alpha_elements:
            continue
        a, b = network.rows.my_range(k)
        mine = index[a:b]
        n = math.prod(node.shape)
        layout = {}
        if lower is not None and len(node.shape) == 3 \
                and network._patches_ok():
            A, layout = _patch_rows(network, node, mine, lower, upper, known, before)
        else:
            eye = unit_rows(mine, n, lo.dtype, lo.device)
            A = torch.cat([eye, -eye]).reshape(1, 2 * len(mine), *node.shape)
            A = A.expand(B, *A.shape[1:])
        flat_lo, flat_hi = lo.reshape(B, n), hi.reshape(B, n)
        idx = mine.to(lo.device)
        best = torch.cat([flat_lo[:, idx], -flat_hi[:, idx]], dim=1)
        alphas = _alphas(network, known, B, 2 * len(mine), before, layout)
        own = (None, None) if isinstance(A, Patches) else _own_step(network, node, mine, B, lo)
        if own[0] is not None:
            A = None                    # the pass starts from `own` instead
        out.append(StartNode(node, index, mine, A, alphas, best, layout, *own))
    return out


def _zone_start(network, node, known, B, before, per_row, max_alpha_elements):
    """The StartNode of a tp zone node (rows as runtime/parallel/tp.py ZoneStartRows lays
    them out), or None where single mode would have none: the same decision on every rank
    (neurons and alpha elements counted over all ranks)."""
    from shardbound.runtime.parallel.tp import ZoneStartRows

    if not before:
        return None
    rows = ZoneStartRows(network, node, known, B)
    if rows.total == 0 or B * 2 * rows.total * sum(per_row[r.name] for r in before) > \
            max_alpha_elements:
        return None
    layout = {}
    alphas = _alphas(network, known, B, 2 * len(rows.index), before, layout)
    return StartNode(node, rows.index, rows.index, None, alphas, rows.best, layout, zone=rows)


def _counted(node, held: dict, whole: dict) -> dict:
    """The per-row alpha counts the cap is checked against for start node `node`: as held
    (`_per_row`) for a flat node, whose rows carry `SparseAlpha` or whole-op alphas in every
    mode; whole op shapes for a (C, H, W) node, whose rows may travel in patches form with
    alphas at their windows (single mode), up to a whole op's per row: the same decision in
    every mode and for any P, so fsdp and tp keep single mode's bits."""
    return whole if len(node.shape) == 3 else held


def _per_row(network, ops, known, held: bool = True) -> dict:
    """Alpha elements per row of each op of `ops`, over all ranks: with `held`, as `_alphas`
    holds them on rows in dense form (an op with `SparseAlpha` holds its inexact input
    neurons' alone: counting its whole shape had kept CROWN's bounds at bench mlp4096's
    third start node, 3,733 rows over 8,192 ReLU neurons of which 2,015 are inexact, looser
    than auto_LiRPA's alpha-CROWN on every spec row), else the whole op's; a tp zone op holds
    its channels' (their sum over ranks is the whole op's, what single mode counts). Known
    bounds are the same on every rank, so every rank decides alike."""
    per_row = {}
    for r in ops:
        init = r.alpha_init([known.get(i) for i in r.inputs])
        if held and _sparse_ok(r, init, known):
            lo, hi = known[r.inputs[0]]
            per_row[r.name] = int(r.inexact(lo, hi).reshape(lo.shape[0], -1).any(dim=0).sum())
        else:
            per_row[r.name] = math.prod(init.shape[1:])
    zone = [r for r in ops if hasattr(r, "gather_neurons")]
    if network.tp is not None and zone:
        comm = network.tp.comm
        counts = torch.tensor([float(per_row[r.name]) for r in zone], dtype=torch.float64)
        every = comm.all_gather_flat(counts).reshape(comm.world, -1).sum(dim=0)
        per_row.update({r.name: int(v) for r, v in zip(zone, every.tolist())})
    return per_row


def _any_inexact(network, known) -> bool:
    """`Network.any_inexact`, agreed over tp ranks (each holds some neurons of a zone)."""
    inexact = network.any_inexact(known)
    if network.tp is not None:
        inexact = bool(network.any_over_ranks(torch.tensor([inexact])).item())
    return inexact


def _own_step(network, node, mine, B: int, like):
    """(A per input, bias) of rows z_mine then -z_mine after the node's own backward step, in
    closed form (`Op.unit_backward`: rows of a weight matrix), or (None, None): the step
    is the same in every iteration (no alphas in it), and from the identity rows it cost an
    identity-times-weight product per pass (bench cnn: 344 x 512 @ 512 x 4096, a fifth of the
    time). The rows are what the step gives the identity rows: bitwise, up to the sign of a
    zero."""
    if node.relaxed or node.is_view:
        return None, None
    start = node.unit_backward(mine.to(like.device), patches=False)
    if start is None:
        return None, None
    A_ins, bias = start
    starts = {}
    for name, A in zip(node.inputs, A_ins):
        if A is None:
            continue
        A = torch.cat([A, -A], dim=1)
        A = A.expand(B, *A.shape[1:])
        starts[name] = A if name not in starts else starts[name] + A
    if not starts:
        return None, None
    k = len(mine)
    l_bias = torch.zeros(B, 2 * k, dtype=like.dtype, device=like.device)
    if bias is not None:
        l_bias = l_bias + torch.cat([bias, -bias], dim=1)
    node.release()
    return starts, l_bias


def _alphas(network, known, B: int, S: int, ops, layout: dict) -> dict:
    """CROWN-initialised alphas of `ops` for S rows, in topological order: at the windows of
    the ops `layout` holds a frame for, of the inexact input neurons alone for ops with
    `alpha_slope_only` (their indices added to `layout`), else (B, S, *alpha_shape)."""
    alphas = {}
    for r in ops:
        init = r.alpha_init([known.get(i) for i in r.inputs])
        if r.name in layout:
            alphas[r.name] = layout[r.name].gather(init.unsqueeze(1)).clone().requires_grad_(True)
        elif _sparse_ok(r, init, known):
            lo, hi = known[r.inputs[0]]
            index = torch.nonzero(r.inexact(lo, hi).reshape(B, -1).any(dim=0)).reshape(-1)
            layout[r.name] = index
            alphas[r.name] = init.reshape(B, 1, -1).index_select(-1, index).expand(
                B, S, len(index)).clone().requires_grad_(True)
        else:
            alphas.update(initial_alphas(network, known, B, S, [r]))
    return alphas


def _sparse_ok(r, init, known) -> bool:
    """Whether `r`'s alphas can be kept for its inexact input neurons alone (`SparseAlpha`):
    its alpha moves only the lower line's slope, one per input element, and the generic
    step runs it."""
    return (getattr(r, "alpha_slope_only", False) and len(r.inputs) == 1
            and type(r).crown_backward is ElementwiseRelaxation.crown_backward
            and known.get(r.inputs[0]) is not None
            and tuple(init.shape) == tuple(known[r.inputs[0]][0].shape))


def _patch_rows(network, node, mine, lower, upper, known, before):
    """(rows z_mine then -z_mine in patches form (1x1 windows), {op: frame}): the ops of
    `before` whose alphas can lie at the windows that reach them (an elementwise relaxation's
    generic step, one parameter per input element), found by one pass without alphas."""
    B = lower.shape[0]
    unit = Patches.unit(mine, node.shape, lower.dtype, lower.device)
    A = expand_rows(unit.with_values(torch.cat([unit.values, -unit.values], dim=1),
                                     torch.cat([unit.origin, unit.origin])), B)
    reached = {}
    with torch.no_grad():
        network.backward(node, A, lower, upper, known, lower_only=True, alpha_layout=reached)
    windows = {}
    for r in before:
        if (r.name in reached and isinstance(r, ElementwiseRelaxation)
                and type(r).crown_backward is ElementwiseRelaxation.crown_backward
                and (network.order == "fast" or getattr(r, "alpha_slope_only", False))):
            init = r.alpha_init([known.get(i) for i in r.inputs])
            if tuple(init.shape[1:]) == tuple(reached[r.name].node_shape):
                windows[r.name] = reached[r.name]
    return A, windows


def _dense_alphas(network, layout: dict, alphas: dict, known) -> dict:
    """`alphas` laid out at windows or kept for some neurons put back over the whole op
    (B, rows, *op shape, what the rigorous engine reads): CROWN's slopes elsewhere, where the
    row is zero or the relaxation exact and no parameter changes anything."""
    out = {}
    for name, t in alphas.items():
        if name not in layout:
            out[name] = t
            continue
        op, f = network.by_name[name], layout[name]
        init = op.alpha_init([known.get(i) for i in op.inputs]).unsqueeze(1)
        if isinstance(f, torch.Tensor):         # SparseAlpha: neurons f
            B, S = t.shape[:2]
            full = init.reshape(B, 1, -1).expand(B, S, -1).clone()
            out[name] = full.index_copy(-1, f, t.detach()).reshape(B, S, *init.shape[2:])
            continue
        inside = f.with_values(torch.ones_like(t)).to_dense() > 0
        out[name] = torch.where(inside, f.with_values(t).to_dense(),
                                init.expand(*inside.shape))
    return out


def _merged(network, s: StartNode, base):
    """`base` (the node's planned bounds) with its start rows' best bounds, all ranks' rows
    gathered (every rank then holds the same bounds, as after a CROWN pass)."""
    if s.zone is not None:
        return s.zone.merged(s.best, base)
    lo, hi = base
    B, k, m = lo.shape[0], len(s.index), len(s.mine)
    both = network.rows.gather(torch.stack([s.best[:, :m], -s.best[:, m:]], dim=-1), k)
    n = math.prod(s.node.shape)
    new_lo, new_hi = lo.reshape(B, n).clone(), hi.reshape(B, n).clone()
    idx = s.index.to(lo.device)
    new_lo[:, idx] = torch.maximum(new_lo[:, idx], both[..., 0])
    new_hi[:, idx] = torch.minimum(new_hi[:, idx], both[..., 1])
    return new_lo.reshape(lo.shape), new_hi.reshape(hi.shape)


def root_bounds(network, lower, upper, C, cache, stop=None, replay=None):
    """What `verify` runs once per input box after CROWN: (lower bounds (B, S) by full
    alpha-CROWN, the tightened intermediate bounds: branch and bound's root prior), in every
    mode (tp: zone nodes' start rows as runtime/parallel/tp.py lays them out)."""
    lb, _, known = full_alpha_crown(network, lower, upper, C, cache=cache, stop=stop,
                                    replay=replay)
    return lb, known
