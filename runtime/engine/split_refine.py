"""Intermediate bounds tightened by branch and bound over earlier ReLU splits.

CROWN, alpha-CROWN and the LP over the triangle relaxation (which optimised alphas reach:
measured on mnistfc 256x2 prop_3_0.03, the LP gave the same 66 unstable second-layer neurons
and a final margin of -1.517 against full alpha-CROWN's -1.518) all relax every unstable
neuron before a node on its own. The exact bound of a second-layer neuron (a MILP over the
first layer's 18 unstable neurons) left 49 unstable instead of 66, and with those bounds the
final LP margin was -0.68 instead of -1.52: the slack is the correlation between relaxed
neurons, which only splitting them recovers.

So each unstable neuron z_j of a target node (a planned-CROWN node that feeds a splittable
op, with splittable ops before it) gets its own small branch and bound, for each of its two
bounds (objectives z_j and -z_j): a leaf is a sign assignment to unstable neurons of the
splittable ops before the target, bounded by one backward pass from the target with those
neurons' bounds clamped at 0 and beta-CROWN's multipliers for the assumptions
(-beta s z at each split node, sound for any beta >= 0, as in runtime/engine/beta.py),
alphas and betas optimised by the shared projected-Adam loop. Each round splits every
objective's worst leaf (BaBSR's neuron: |A| at the split node times the ReLU's upper-line
intercept). The two children of a leaf cover it (a point with z = 0 lies in both), so an
objective's leaves cover the box and the lowest leaf bound is a bound of the objective on
the box: sound whatever the optimiser did, and intersected with the bound it started from.
Nodes between a split node and the target keep the bounds they had (they hold on every
leaf). No solver and no certificate: every number is a CROWN bound.

Deterministic: a fixed number of rounds and iterations, ties towards the lowest index.
Single process only (tp zones and row sharding would need their collectives): elsewhere
the bounds are returned unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardbound.runtime.engine.optimise import ParamGroup, alpha_group, initial_alphas, maximise

ROUNDS = 300             # per target node: each round splits every open objective's worst leaf
ITERATIONS = 5           # Adam steps per leaf (alphas and betas, from its parent's)
ROOT_ITERATIONS = 20     # for the one leaf per objective that starts from CROWN's slopes
ALPHA_KEY, BETA_KEY = "alpha:", "beta:"
LR_ALPHA, LR_BETA = 0.25, 0.1
MAX_OBJECTIVES = 1024    # per target node (2 per unstable neuron): larger nodes are skipped


def refine_by_splits(network, lower, upper, known: dict, rounds: int | None = None,
                     iterations: int | None = None, stop=None, leaves: list | None = None
                     ) -> dict:
    """A copy of `known` (planned bounds on the single box lower/upper, batch 1) with the
    unstable neurons of every target node tightened (see the module docstring); `rounds`
    and `iterations` default to ROUNDS and ITERATIONS. `leaves`: a list that receives, per
    target node in order, its final leaves (`RefineLeaves`: what --soundness real/float32
    re-evaluates rigorously, runtime/rigorous/refine.py)."""
    rounds = ROUNDS if rounds is None else rounds
    iterations = ITERATIONS if iterations is None else iterations
    out = dict(known)
    if rounds <= 0:
        return out
    for node, before in _targets(network, lower.shape[0], out):
        if stop is not None and stop():
            break
        out[node.name] = _refine_node(network, node, before, lower, upper, out, rounds,
                                      iterations, stop, leaves)
    return out


def needs_refinement(network, known: dict, batch: int = 1) -> bool:
    """Whether `refine_by_splits` has anything to tighten on these bounds."""
    return any(True for _ in _targets(network, batch, known))


def _targets(network, batch: int, known: dict):
    """(target node, the split ops before it) in topological order: the nodes feeding a
    splittable op, planned by CROWN, with an unstable neuron, at most MAX_OBJECTIVES / 2 of
    them, and an unstable neuron in an earlier split node. Nothing for a batch of several
    boxes, in tp mode or under row sharding."""
    if batch != 1 or getattr(network, "tp", None) is not None or network.rows.enabled:
        return
    position = {n.name: i for i, n in enumerate(network.nodes)}
    seen, split_ops = set(), []
    for op in network.splittable_nodes():
        if op.inputs[0] not in seen:
            seen.add(op.inputs[0])
            split_ops.append(op)
    targets = {op.inputs[0] for op in split_ops}
    for node in network.nodes:
        if (node.name not in targets or node.name not in known or node is network.input
                or network.intermediate.get(node.name) != "crown"):
            continue
        k = len(_unstable(known[node.name]))
        if k == 0 or 2 * k > MAX_OBJECTIVES:
            continue
        before = [op for op in split_ops if position[op.inputs[0]] < position[node.name]
                  and op.inputs[0] in known and len(_unstable(known[op.inputs[0]]))]
        if before:
            yield node, before


def _unstable(bounds) -> torch.Tensor:
    lo, hi = bounds
    return torch.nonzero(((lo < 0) & (hi > 0)).reshape(-1)).reshape(-1)


@dataclass
class RefineLeaves:
    """One target node's final leaves: leaf i bounds sign[obj[i]] * z_{j[obj[i]]} of `node`
    on the sign assignment `assign[i]` (over `cand`, the unstable neurons of the split nodes
    `names`, flattened at `offsets`), with the relaxation parameters and split multipliers
    `params` (ALPHA_KEY + op / BETA_KEY + split node -> (L, 1, ...): those behind the leaf's
    bound, its own best iterate's or, where none beat its parent's bound, the parent's).
    Objectives 0..k-1 are the lower bounds of z_j, k..2k-1 the negated upper bounds. The
    leaves of an objective cover the box, so the lowest of their bounds, by any sound
    evaluation of these parameters, bounds the objective."""
    node: str
    j: torch.Tensor
    obj: torch.Tensor
    assign: torch.Tensor
    names: list
    cand: list
    offsets: list
    params: dict


def _refine_node(network, node, before, lower, upper, known, rounds, iterations, stop,
                 leaves=None):
    lo, hi = known[node.name]
    j = _unstable((lo, hi))
    # Candidates: the unstable neurons of the split nodes before `node`, flattened in order.
    names = [op.inputs[0] for op in before]
    cand = [_unstable(known[nm]) for nm in names]
    offsets = [0]
    for c in cand:
        offsets.append(offsets[-1] + len(c))
    k = len(j)
    # Objectives r: sign[r] * z_{j[r]}; their best bound so far is the current one.
    obj_j = torch.cat([j, j])
    obj_sign = torch.cat([torch.ones(k), -torch.ones(k)]).to(lo.dtype)
    flat_lo, flat_hi = lo.reshape(-1), hi.reshape(-1)
    start = torch.cat([flat_lo[j], -flat_hi[j]]).cpu().double()
    # Leaves: objective, assignment over the K candidates, bound, next candidate to split.
    leaf_obj = torch.arange(2 * k)
    leaf_assign = torch.zeros(2 * k, offsets[-1], dtype=torch.int8)
    best_of = None if leaves is None else {}       # per leaf, the parameters behind its bound
    bound, nxt, params = _bound_leaves(network, node, before, names, cand, offsets, lower,
                                       upper, known, obj_j[leaf_obj], obj_sign[leaf_obj],
                                       leaf_assign, start[leaf_obj], ROOT_ITERATIONS,
                                       best_out=best_of)
    for _ in range(rounds):
        if stop is not None and stop():
            break
        # Every objective's worst leaf, unless it proves the neuron stable already or has
        # nothing left to split (then no split elsewhere can raise the objective's bound).
        worst = _worst_leaves(leaf_obj, bound, 2 * k)
        worst = worst[worst >= 0]
        sel = worst[(nxt[worst] >= 0) & (bound[worst] < 0)]
        if len(sel) == 0:
            break
        pick = nxt[sel]
        plus, minus = leaf_assign[sel].clone(), leaf_assign[sel].clone()
        rows = torch.arange(len(sel))
        plus[rows, pick] = 1
        minus[rows, pick] = -1
        c_obj = torch.cat([leaf_obj[sel], leaf_obj[sel]])
        c_assign = torch.cat([plus, minus])
        warm = {nm: torch.cat([t[sel], t[sel]]) for nm, t in params.items()}
        c_best = None
        if best_of is not None:
            c_best = {nm: torch.cat([t[sel], t[sel]]) for nm, t in best_of.items()}
        c_bound, c_nxt, c_params = _bound_leaves(network, node, before, names, cand, offsets,
                                                 lower, upper, known, obj_j[c_obj],
                                                 obj_sign[c_obj], c_assign,
                                                 torch.cat([bound[sel], bound[sel]]),
                                                 iterations, warm, best_out=c_best)
        keep = torch.ones(len(leaf_obj), dtype=torch.bool)
        keep[sel] = False
        params = {nm: torch.cat([t[keep], c_params[nm]]) for nm, t in params.items()}
        if best_of is not None:
            best_of = {nm: torch.cat([t[keep], c_best[nm]]) for nm, t in best_of.items()}
        leaf_obj = torch.cat([leaf_obj[keep], c_obj])
        leaf_assign = torch.cat([leaf_assign[keep], c_assign])
        bound = torch.cat([bound[keep], c_bound])
        nxt = torch.cat([nxt[keep], c_nxt])
    if leaves is not None:
        leaves.append(RefineLeaves(node.name, j.cpu(), leaf_obj, leaf_assign, names,
                                   [c.cpu() for c in cand], offsets,
                                   best_of))
    # Each objective's bound: its lowest leaf (the leaves cover the box).
    best = torch.full((2 * k,), math.inf, dtype=torch.float64)
    best = best.scatter_reduce(0, leaf_obj, bound, reduce="amin")
    best = torch.maximum(best, start)
    new_lo, new_hi = flat_lo.clone(), flat_hi.clone()
    dev = lo.device
    new_lo[j] = torch.maximum(flat_lo[j], best[:k].to(lo.dtype).to(dev))
    new_hi[j] = torch.minimum(flat_hi[j], (-best[k:]).to(hi.dtype).to(dev))
    return new_lo.reshape(lo.shape), new_hi.reshape(hi.shape)


def _worst_leaves(leaf_obj, bound, n_obj) -> torch.Tensor:
    """Per objective, the index of its lowest-bound leaf (ties: the earliest), -1 if none."""
    order = torch.argsort(bound, stable=True)
    order = order[torch.argsort(leaf_obj[order], stable=True)]
    o = leaf_obj[order]
    first = torch.ones(len(o), dtype=torch.bool)
    first[1:] = o[1:] != o[:-1]
    out = torch.full((n_obj,), -1, dtype=torch.long)
    out[o[first]] = order[first]
    return out


def _bound_leaves(network, node, before, names, cand, offsets, lower, upper, known, jj, sign,
                  assign, floor, iterations, warm=None, best_out=None):
    """(bounds (L,) float64 of sign * z_jj on each leaf, at least `floor` (a bound that holds
    on it: its parent's); the next candidate to split per leaf, -1 when all are assigned;
    the leaves' alphas and betas after the optimisation, {name: (L, 1, *shape)}, which
    `warm` (the parents', in that layout) starts from: alphas projected onto their set,
    betas clamped to >= 0 and zeroed where a leaf does not split, so any start is sound)."""
    L = len(jj)
    dev = lower.device
    n = math.prod(node.shape)
    known_l = {nm: (v[0].expand(L, *v[0].shape[1:]), v[1].expand(L, *v[1].shape[1:]))
               for nm, v in known.items()}
    signs = {}
    for i, nm in enumerate(names):
        s = torch.zeros(L, math.prod(known[nm][0].shape[1:]), dtype=torch.int8)
        s[:, cand[i]] = assign[:, offsets[i]:offsets[i + 1]]
        s = s.to(dev).reshape(L, *known[nm][0].shape[1:])
        l, h = known_l[nm]
        known_l[nm] = (torch.where(s > 0, l.clamp(min=0), l), torch.where(s < 0, h.clamp(max=0), h))
        signs[nm] = s
    A = torch.zeros(L, 1, n, dtype=lower.dtype, device=dev)
    A[torch.arange(L), 0, jj.to(dev)] = sign.to(dev)
    A = A.reshape(L, 1, *node.shape)
    lo_b = lower.expand(L, *lower.shape[1:])
    hi_b = upper.expand(L, *upper.shape[1:])
    position = {m.name: i for i, m in enumerate(network.nodes)}
    ops = [r for r in network.optimisable_nodes() if position[r.name] < position[node.name]
           and all(i in known_l for i in r.inputs)]
    alphas = initial_alphas(network, known_l, L, 1, ops)
    betas, sg = {}, {}
    for nm, s in signs.items():
        sg[nm] = s.to(lower.dtype).unsqueeze(1)
        betas[nm] = torch.zeros(L, 1, *s.shape[1:], dtype=lower.dtype, device=dev)
    if warm is not None:
        with torch.no_grad():
            for name, a in alphas.items():
                a.copy_(warm[ALPHA_KEY + name].to(dev))
                network.by_name[name].alpha_project_(a)
            for nm in betas:
                betas[nm] = warm[BETA_KEY + nm].to(dev).clamp(min=0).masked_fill(sg[nm] == 0, 0)
    for t in betas.values():
        t.requires_grad_(True)
    grab = {}

    def objective(last):
        extra = {nm: -betas[nm] * sg[nm] for nm in betas}
        split_A = {} if last else None
        value = network.backward(node, A, lo_b, hi_b, known_l, alphas, lower_only=True,
                                 split_A=split_A, extra_A=extra)[0]
        if last:
            grab.update(split_A)
        return value

    def project():
        for t in betas.values():
            t.clamp_(min=0)

    groups = [alpha_group(network, alphas, LR_ALPHA),
              ParamGroup(list(betas.values()), LR_BETA, project)]
    keep = None
    if best_out is not None:
        keep = {**{ALPHA_KEY + k: a for k, a in alphas.items()},
                **{BETA_KEY + k: b for k, b in betas.items()}}
    floor32 = floor.to(lower.dtype).to(dev).reshape(L, 1)
    with torch.no_grad():
        value = maximise(objective, groups, iterations, start=floor32, keep=keep)
    bound = torch.maximum(value.reshape(L).cpu().double(), floor)
    if best_out is not None:
        # Per leaf, the parameters behind its bound: the best iterate's, or where none beat
        # the floor, those behind the floor (`best_out` as given: the parent's; at the root,
        # the starting ones). Only bookkeeping: the bounds are the same bits without it.
        from_floor = (value.reshape(L) <= floor32.reshape(L)).cpu()
        got = {}
        for k, t in keep.items():
            t = t.detach()
            if k in best_out:
                w = from_floor.to(t.device).reshape(L, *([1] * (t.dim() - 1)))
                t = torch.where(w, best_out[k].to(t.device), t)
            got[k] = t
        best_out.clear()
        best_out.update(got)
    # BaBSR's next split per leaf: |A| at the split node times the upper-line intercept, over
    # the candidates not yet assigned (the op's branch_slack is 0 where the clamp made the
    # neuron stable).
    scores = []
    for i, (op, nm) in enumerate(zip(before, names)):
        lA = grab.get(op.name)
        l, h = known_l[nm]
        slack = op.branch_slack(l, h).reshape(L, -1)[:, cand[i].to(dev)]
        w = (lA.reshape(L, -1)[:, cand[i].to(dev)].abs() if lA is not None
             else torch.zeros_like(slack))
        sc = (w + 1e-6) * slack
        sc = torch.where(assign[:, offsets[i]:offsets[i + 1]].to(dev) == 0, sc,
                         torch.full_like(sc, -1.0))
        scores.append(sc.cpu())
    scores = torch.cat(scores, dim=1)
    best = scores.argmax(dim=1)
    nxt = torch.where(scores.max(dim=1).values >= 0, best, torch.full_like(best, -1))
    params = {ALPHA_KEY + name: a.detach() for name, a in alphas.items()}
    params.update({BETA_KEY + nm: b.detach() for nm, b in betas.items()})
    return bound, nxt, params
