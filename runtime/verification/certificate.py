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


def certified(certify, done, blo, bhi, splits, lagrangian, rows: int, cuts=None
               ) -> torch.Tensor:
    """(B,) bool: the `done` domains the rigorous bounds prove (--soundness real/float32).
    Those beta-CROWN bounded are certified with its alphas and betas (its Lagrangian, which
    holds for any of them), the others by rigorous CROWN with the splits as clamps; `cuts`
    (node -> (a, b) (B, *shape)): the interval splits each domain assumes, a <= z <= b."""
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
        ok[group] = certify(blo[g].reshape(n, -1).cpu(), bhi[g].reshape(n, -1).cpu(), sub,
                            extra, sub_cuts)
    return ok
