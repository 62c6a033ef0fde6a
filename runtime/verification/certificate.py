"""The certificates of branch-and-bound leaves under --soundness real/float32 (issue 17): what
relu_split hands the rigorous engine (runtime/rigorous/) about each domain the float32 engine
proved, and the interval assumptions each domain carries for it.

A leaf is certified with beta-CROWN's Lagrangian when beta-CROWN bounded it (its alphas and
betas, per row those of the best iterate: any alpha in range and beta >= 0 gives a bound),
else by rigorous CROWN with the sign splits as clamps; in both cases with the interval splits
it assumes (`cuts`) and the verifier's rigorous root bounds as prior (verdict.py).

`cuts`: per domain, (2, neurons) in branch and bound's layout of the split neurons, -inf /
inf where nothing is assumed; an interval split at p narrows the first child's upper end to
p and the second's lower end. They are not the domain's computed bounds (float32, from the
engine): only what the domain assumes, so the two children cover their parent and the leaves
cover the box.

Each domain also carries rigorous bounds of the split nodes down the tree (`LeafCertifier.
domain_bounds`, every domain of every round): the float32 engine's children keep their
parent's intermediate bounds as a prior and intersect them with their own CROWN, and CROWN
under more split clamps is not always tighter (a clamp z >= 0 makes the ReLU the identity,
but the input box is concretised whole, points with z < 0 included), so the inherited
bounds of a deep domain are much tighter than one fresh CROWN under its clamps. Measured on
mnistfc prop_3_0.03 (bench/leaf_certificates.py): the engine's second-layer lower bounds up
to 1.5 above a fresh rigorous pass's, 4 more unstable neurons, and past ~2,500 leaves whole
batches the engine proved by CROWN alone refused at rigorous margins near -2.6. Carrying the
rigorous bounds the same way makes the certificate's intermediate bounds the engine's up to
rounding; they are rigorous because each domain's were computed rigorously on a superset of
it (an ancestor) or on it.
"""

from __future__ import annotations

import math

import torch


def no_cuts(width: int) -> torch.Tensor:
    """(1, 2, width): the root assumes nothing."""
    return torch.stack([torch.full((1, width), -math.inf), torch.full((1, width), math.inf)],
                       dim=1)


def cut_dict(cuts, ops, names, local, n_sign: int) -> dict:
    """The interval-split nodes' assumptions of a batch (cuts (b, 2, neurons)) as node ->
    (a, b) (b, *shape), for the certificate."""
    take = len(cuts)
    return {names[i]: (cuts[:, 0, local[i]:local[i + 1]].reshape(take, *ops[i].shape),
                       cuts[:, 1, local[i]:local[i + 1]].reshape(take, *ops[i].shape))
            for i in range(n_sign, len(ops))}


def down32(x: torch.Tensor) -> torch.Tensor:
    """float64 lower bounds as the float32 ones at or below them (a carried rigorous row
    bound as the engine's floor)."""
    from shardbound.runtime.rigorous import to_float32_outward

    return to_float32_outward(x, x)[0]


def carried_dict(carried, names, shapes) -> dict:
    """Carried rigorous bounds (b, 2, neurons) float64, `names` flattened in order (shapes:
    each node's, without the batch), as node -> (lower, upper) (b, *shape)."""
    out, at, b = {}, 0, len(carried)
    for name, shape in zip(names, shapes):
        size = math.prod(shape)
        out[name] = (carried[:, 0, at:at + size].reshape(b, *shape),
                     carried[:, 1, at:at + size].reshape(b, *shape))
        at += size
    return out


def _intersect(a: dict | None, b: dict | None) -> dict | None:
    """Two node -> (lower, upper) dicts that both hold on each domain, intersected."""
    if a is None or b is None:
        return a if b is None else b
    out = dict(b)
    for name, (l, h) in a.items():
        if name in out:
            bl, bh = out[name]
            l, h = torch.maximum(l, bl.to(l.dtype)), torch.minimum(h, bh.to(h.dtype))
        out[name] = (l, h)
    return out


class LeafCertifier:
    """What branch and bound asks the rigorous engine under --soundness real/float32 (see the
    module docstring): `domain_bounds` for every domain bounded, and the certificate of the
    leaves the float32 engine proved (the call). `refuted(los, his, splits, lagrangian,
    prior, cuts, both, bounds)` is RigorousBounds.refuted with the spec bound in; `agree(ok)`
    makes the ranks close the same domains; `prior`: rigorous bounds over the whole box."""

    def __init__(self, rig, refuted, agree, prior=None, check=None, lower=None, C=None):
        self.rig, self.refuted, self.agree = rig, refuted, agree
        self.prior, self.check = prior, check
        self.lower, self.C = lower, C       # `row_bounds`' spec_lower and spec rows (S, out)

    def domain_bounds(self, los, his, splits, cuts=None, carried=None, since=None) -> dict:
        """Rigorous bounds of every node on each domain (los, his (B, ...) its box, splits its
        sign assumptions, cuts its interval ones, carried: node -> (lower, upper) (B, *shape),
        the rigorous bounds of its parent, which hold on it, the split nodes in branch and
        bound's order). `since` (B,) int: per domain, the split node (an index into that
        order) of its last split, -1 for none known: a node no later than it is bounded by
        the same relaxations as on the parent, so its CROWN is not redone there (the carried
        bounds are the parent's CROWN under the same lines)."""
        B = len(los)
        lo = los.reshape(B, -1).to("cpu", torch.float64)
        hi = his.reshape(B, -1).to("cpu", torch.float64)
        fresh = None
        if since is not None and carried:
            pos = {n.name: i for i, n in enumerate(self.rig.nodes)}
            at = torch.tensor([pos[name] for name in carried])
            first = torch.where(since >= 0, at[since.clamp(min=0)], -1)
            fresh = {name: pos[name] > first for name in self.rig.crown_nodes}
        with torch.no_grad():
            return self.rig.all_bounds(lo, hi, splits, self.prior, _intersect(carried, cuts),
                                       check=self.check, fresh=fresh)

    def row_bounds(self, los, his, splits, bounds, pairs=None) -> torch.Tensor:
        """(B, S) float64: a rigorous lower bound of every spec row on each domain, from its
        rigorous node bounds `bounds` (`domain_bounds`): plain rigorous CROWN under the sign
        splits, and for the (domain, row) pairs beta-CROWN optimised, `pairs` = (dom, row,
        alphas, betas) (P,) (P,) and {name: (P, 1, ...)}, the best iterate's Lagrangian
        re-evaluated on that pair alone (each pair a box with its one row; any alpha in range
        and beta >= 0 gives a bound); each row keeps the larger. Branch and bound carries
        these down the tree: a row proved on a domain stays proved on its children (subsets),
        so beta-CROWN optimises only the pairs still open, as in the default mode."""
        B = len(los)
        lo = los.reshape(B, -1).to("cpu", torch.float64)
        hi = his.reshape(B, -1).to("cpu", torch.float64)
        splits = {k: v.cpu() for k, v in splits.items()}
        with torch.no_grad():
            lb = self.lower(lo, hi, self.C, splits, None, bounds=bounds)
            if pairs is not None and len(pairs[0]):
                dom, row, alphas, betas = pairs
                sub = {k: (a.index_select(0, dom), b.index_select(0, dom))
                       for k, (a, b) in bounds.items()}
                lp = self.lower(lo.index_select(0, dom), hi.index_select(0, dom),
                                self.C[row].unsqueeze(1),
                                {k: v.index_select(0, dom) for k, v in splits.items()},
                                (alphas, betas), bounds=sub)
                lb[dom, row] = torch.maximum(lb[dom, row], lp[:, 0])
        return lb

    def __call__(self, los, his, splits=None, lagrangian=None, cuts=None, bounds=None):
        # with beta-CROWN's parameters, plain CROWN too: where no iterate beat the float32
        # CROWN floor, the kept ones are the warm start, not what proved the row
        ok = self.refuted(los, his, splits, lagrangian, prior=self.prior, cuts=cuts,
                          both=lagrangian is not None, bounds=bounds)
        return self.agree(ok)


def certified(certify, done, blo, bhi, splits, lagrangian, rows: int, cuts=None,
              bounds=None) -> torch.Tensor:
    """(B,) bool: the `done` domains the rigorous bounds prove (--soundness real/float32).
    Those beta-CROWN bounded are certified with its alphas and betas (its Lagrangian, which
    holds for any of them), the others by rigorous CROWN with the splits as clamps; `cuts`
    (node -> (a, b) (B, *shape)): the interval splits each domain assumes, a <= z <= b;
    `bounds` (node -> (lower, upper) (B, *shape)): the batch's rigorous node bounds
    (`LeafCertifier.domain_bounds`, with those cuts), reused."""
    take = len(done)
    ok = torch.zeros(take, dtype=torch.bool)
    by_beta = torch.zeros(take, dtype=torch.bool)
    pos = torch.full((take,), -1, dtype=torch.long)
    if lagrangian is not None:
        idx, alphas, betas = lagrangian
        params = list(alphas.values()) + list(betas.values())
        if all(p.shape[1] == rows for p in params):    # not row-sharded: every row's own
            by_beta[idx] = True
            pos[idx] = torch.arange(len(idx))
    for group in (done & ~by_beta, done & by_beta):
        if not bool(group.any()):
            continue
        g = group.to(blo.device)
        sub = {k: v[group.to(v.device)] for k, v in splits.items()}
        extra = None
        if bool(by_beta[group].all()):
            at = pos[group]
            extra = ({k: v[at.to(v.device)] for k, v in alphas.items()},
                     {k: v[at.to(v.device)] for k, v in betas.items()})
        n = int(group.sum())
        sub_cuts = None if cuts is None else {k: (a[group], b[group]) for k, (a, b) in
                                              cuts.items()}
        more = {}
        if bounds is not None:
            more["bounds"] = {k: (a[group], b[group]) for k, (a, b) in bounds.items()}
        ok[group] = certify(blo[g].reshape(n, -1).cpu(), bhi[g].reshape(n, -1).cpu(), sub,
                            extra, sub_cuts, **more)
    return ok
