"""beta-CROWN on the open (domain, spec row) pairs of a batch only.

A row that a domain's parent proved stays proved on the domain (the domain is a subset of
its parent, so the parent's bound of the row holds there; `relu_split` carries the parents'
bounds). Measured on mnistfc prop_3_0.03 (9 rows): CROWN at the children leaves 90% of the
(domain, row) pairs open, beta-CROWN only 24%, and a batch's union of open rows was every
row, so optimising whole domains spent ~3/4 of beta-CROWN on rows already proved.

So each open pair becomes a box of its own with one spec row (`final_crown` takes a C per
box): its domain's bounds, splits and input box, the row's warm-start alphas and betas
(kept per row, (domain, S, ...), as whole domains keep them), and its bound as the floor.
The results go back into the (domain, row) layout; the rows not optimised keep their warm
start (zeros where none: any alpha is projected before use, any beta >= 0 is sound, and a
proved row is never optimised again). Single process or tp: under row sharding the rows
are the ranks' work split, so whole domains are optimised there.
"""

from __future__ import annotations

import torch

from shardbound.runtime.engine.beta import beta_crown


def optimise_pairs(network, ibp, known, lo, hi, C, splits, lb, pairs, iterations, stop,
                   warm, beta_key: str):
    """(lb (B, S) with the `pairs` ((B, S) bool) raised by beta-CROWN, the pairs' input
    A-matrices (P, n) or None, the domains that had a pair (indices), and their alphas and
    betas in the (domains, S, ...) layout, betas under beta_key + split node)."""
    dom, row = torch.nonzero(pairs, as_tuple=True)
    B, S = lb.shape
    idx = torch.unique(dom)                     # sorted: the domains with an open pair
    where = torch.full((B,), -1, dtype=torch.long)
    where[idx] = torch.arange(len(idx))
    dev = lo.device
    d_dev, r_dev = dom.to(dev), row.to(dev)
    pick = lambda t: t.index_select(0, d_dev)                                 # noqa: E731
    sub = lambda m: {k: (pick(v[0]), pick(v[1])) for k, v in m.items()}      # noqa: E731
    Cp = C.to(dev)[r_dev].unsqueeze(1)                                       # (P, 1, out)
    alpha_start = beta_start = None
    if warm is not None and bool(warm[1][dom].any()):
        has = warm[1][dom]
        per_row = {k: v.to(dev)[d_dev, r_dev].unsqueeze(1) for k, v in warm[0].items()}
        alpha_start = ({k: v for k, v in per_row.items() if not k.startswith(beta_key)}, has)
        beta_start = ({k[len(beta_key):]: v for k, v in per_row.items()
                       if k.startswith(beta_key)}, has)
    alphas, betas = {}, {}
    with torch.no_grad():
        better, lA = beta_crown(network, sub(ibp), sub(known), pick(lo), pick(hi), Cp,
                                {k: pick(v) for k, v in splits.items()},
                                lb[dom, row].reshape(-1, 1).to(dev), iterations, stop=stop,
                                alpha_start=alpha_start, alpha_out=alphas, beta_out=betas,
                                beta_start=beta_start)
    out = lb.clone()
    out[dom, row] = torch.maximum(out[dom, row], better.reshape(-1).cpu())
    # Back into the (domain, row) layout, from the warm start where there was one.
    n = len(idx)
    full = {}
    if alphas:
        for k, a in alphas.items():
            full[k] = torch.zeros(n, S, *a.shape[2:], dtype=a.dtype, device=a.device)
        for k, b in betas.items():
            full[beta_key + k] = torch.zeros(n, S, *b.shape[2:], dtype=b.dtype, device=b.device)
        if warm is not None:
            has_d = warm[1][idx]
            if bool(has_d.any()):
                at = idx[has_d].to(dev)
                for k, t in full.items():
                    if k in warm[0] and warm[0][k].shape[1:] == t.shape[1:]:
                        t[has_d.to(t.device)] = warm[0][k].to(t.device)[at]
        pos = where[dom].to(dev)
        for k, a in alphas.items():
            full[k][pos, r_dev] = a[:, 0]
        for k, b in betas.items():
            full[beta_key + k][pos, r_dev] = b[:, 0]
    return out, (None if lA is None else lA[:, 0].cpu()), idx, full
