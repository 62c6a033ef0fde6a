"""Where relu_split's branch and bound splits a domain: which ops take part, which neuron of
an open domain is split, and the two children's bounds of an interval split.

Every op that declares itself `splittable` (ReLU and the other kinks at 0) is split by the
sign of its input (`split_ops`); every op that declares itself `interval_splittable` (the
smooth functions) by its input interval at the op's `split_point` (`interval_split_ops`,
`interval_children`).

Branching: filtered smart branching. BaBSR's score (`slack_scores`: the unstable neuron's
|A|, summed over the spec rows still open, times its op's `branch_slack`: for a ReLU the
intercept of its upper line, -l u / (u - l), the most slack its relaxation adds to the lower
bound; for an interval split of a smooth function, |A| times the op's `interval_slack`, the
gap between its upper and lower line at the split point, the two kinds ranked together)
proposes FSB_CANDIDATES neurons; a one-step bound of both children (`fsb_choice`) picks one.
Kept apart from the loop in relu_split.py so that the choice of neuron, which never affects
soundness (both children always cover their parent), reads on its own.
"""

from __future__ import annotations

import torch

from shardbound.runtime.verification.input_split import closeness
from shardbound.runtime.verification.row_pairs import crown_pairs


def slack_scores(network, ops, split_A, known, open_rows, n_sign: int) -> torch.Tensor:
    """(b, total neurons) branching score; -1 for neurons that are not unstable (sign splits:
    the first `n_sign` ops) or whose interval cannot be split (the others). A tp rank scores
    the neurons it holds; the scores are gathered so every rank branches alike."""
    parts = []
    for i, op in enumerate(ops):
        lo, hi = known[op.inputs[0]]
        b = lo.shape[0]
        if i < n_sign:
            slack = op.branch_slack(lo, hi).reshape(b, -1)
            unstable = ((lo < 0) & (hi > 0)).reshape(b, -1)
        else:
            slack = op.interval_slack(lo, hi).reshape(b, -1)
            unstable = slack > 0
        A = split_A.get(op.name)            # absent: no A reached the op (a discrete op)
        if A is None:
            weight = torch.zeros_like(slack)
        else:
            A = A.reshape(b, open_rows.shape[1], -1)
            weight = (A.abs() * open_rows.unsqueeze(-1)).sum(dim=1)
        # A tiny share of the slack alone breaks ties among neurons the spec rows ignore.
        score = (weight + 1e-6) * slack
        score = torch.where(unstable, score, torch.full_like(score, -1.0))
        parts.append(network.gather_neurons(op, score))
    return torch.cat(parts, dim=1)


def fsb_choice(network, relus, names, offsets, known, ibp, lo_flat, hi_flat, C, d, owner,
                scores, which, k: int, n_sign: int, parent_lb=None) -> torch.Tensor:
    """Filtered smart branching: per domain in `which` (indices into the batch), BaBSR's top
    k neurons (`scores`, (len(which), total)), each judged by a one-step bound: the final
    CROWN pass on both children with the parent's intermediate bounds and the neuron's
    bounds clamped at 0 (no intermediate pass). The neuron whose children's margins still
    short of proved sum highest wins (a proved child counts 0: splits that close one side
    are preferred, which also isolates a spike's support, see falsify.py; ties: BaBSR's
    order). `parent_lb` ((len(which), S) or None): the parents' bounds, which hold on the
    children too. Returns (len(which),) global neuron indices."""
    order = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]   # (b, k)
    b = len(which)
    valid = torch.gather(scores, 1, order) >= 0
    cand = order.reshape(-1)
    m = 2 * len(cand)
    parent = which.repeat_interleave(2 * k).to(network.device)
    child_known = {nm: (v[0].index_select(0, parent).clone(), v[1].index_select(0, parent).clone())
                   for nm, v in known.items()}
    rows = torch.arange(m, device=network.device)
    glob = cand.repeat_interleave(2).to(network.device)
    active = (torch.arange(m) % 2 == 0).to(network.device)
    for i, nm in enumerate(names):
        lo_t, hi_t = child_known[nm]
        flat_lo, flat_hi = lo_t.reshape(m, -1), hi_t.reshape(m, -1)
        mine = (glob >= int(offsets[i])) & (glob < int(offsets[i + 1]))
        if not bool(mine.any()):
            continue
        r, j = rows[mine], glob[mine] - int(offsets[i])
        act = active[mine]
        l_rj, h_rj = flat_lo[r, j], flat_hi[r, j]
        # A sign split clamps at 0; an interval split (ops after the first n_sign) at the
        # op's split point: [p, u] for the first child, [l, p] for the second.
        p = torch.zeros_like(l_rj) if i < n_sign else relus[i].split_point(l_rj, h_rj)
        flat_lo[r, j] = torch.where(act, torch.maximum(l_rj, p), l_rj)
        flat_hi[r, j] = torch.where(act, h_rj, torch.minimum(h_rj, p))
    out = network.output.name
    child_ibp = {out: (ibp[out][0].index_select(0, parent), ibp[out][1].index_select(0, parent))}
    shape = (m, *network.input_shape)
    clo = lo_flat.expand(m, -1).reshape(shape).to(network.device)
    chi = hi_flat.expand(m, -1).reshape(shape).to(network.device)
    with torch.no_grad():
        lb = crown_pairs(network, child_ibp, child_known, clo, chi, C)
    if parent_lb is not None:
        lb = torch.maximum(lb.cpu(), parent_lb.repeat_interleave(2 * k, dim=0))
    n_conj = int(owner.max()) + 1
    close = closeness(lb.cpu(), d, owner, n_conj).reshape(b, k, 2).clamp(max=0).sum(dim=2)
    close = torch.where(valid & ~close.isnan(), close, torch.full_like(close, -float("inf")))
    pick = close.argmax(dim=1)
    return order[torch.arange(b), pick]


def split_ops(network) -> list:
    """The splittable ops, one per input node (two ops reading one node share its splits)."""
    seen, ops = set(), []
    for op in network.splittable_nodes():
        if op.inputs[0] not in seen:
            seen.add(op.inputs[0])
            ops.append(op)
    return ops


def interval_split_ops(network, taken=()) -> list:
    """The interval-splittable ops, one per input node that no sign split covers."""
    seen, ops = set(taken), []
    for op in network.interval_splittable_nodes():
        if op.inputs[0] not in seen:
            seen.add(op.inputs[0])
            ops.append(op)
    return ops


def can_split(network) -> bool:
    """Whether this branch and bound has any neuron to split."""
    return bool(network.splittable_nodes() or network.interval_splittable_nodes())


def interval_children(ops, n_sign, offsets, local, ranges, kb, best, chosen, cuts=None):
    """The two children's bounds (n, 2, local neurons) of domains whose bounds are `kb`: a
    copy of kb where a domain is split by sign, and where it is split on an interval (`chosen`:
    global neuron `best` of an interval-split op) [l, p] in the first child and [p, u] in the
    second, p the op's split point. A tp rank changes only the neurons it holds. With `cuts`
    (the parents' interval assumptions, same layout; -inf / inf where none), also the
    children's: the first assumes z <= p, the second z >= p (the certificate's constraints,
    apart from the computed bounds)."""
    below, above = kb.clone(), kb.clone()
    cut_below = cut_above = None
    if cuts is not None:
        cut_below, cut_above = cuts.clone(), cuts.clone()
    for i in range(n_sign, len(ops)):
        start, stop, _ = ranges[i]
        g = best - int(offsets[i])
        mine = chosen & (g >= start) & (g < stop)
        if not bool(mine.any()):
            continue
        rows = torch.nonzero(mine).reshape(-1)
        at = int(local[i]) + (g[rows] - start)
        lo, hi = kb[rows, 0, at], kb[rows, 1, at]
        p = ops[i].split_point(lo, hi)
        below[rows, 1, at] = p
        above[rows, 0, at] = p
        if cuts is not None:
            cut_below[rows, 1, at] = torch.minimum(cut_below[rows, 1, at], p)
            cut_above[rows, 0, at] = torch.maximum(cut_above[rows, 0, at], p)
    if cuts is not None:
        return below, above, cut_below, cut_above
    return below, above
