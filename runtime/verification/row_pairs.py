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
proved row is never optimised again).

fsdp with row sharding (`blocked`/`exact`): the batch's domains are split over ranks as rows
are. The (domain, row) work of a round is one list, and each rank bounds a contiguous share
of it (`RowSplit.my_range` over the list): beta-CROWN on the open pairs (each rank holds the
alphas, betas, Adam moments and autograd graph of its pairs only), and the round's CROWN pass
and filtered smart branching's one-step bounds on every (domain, row) pair (`crown_pairs`).
The results (bounds, input and split A-matrices, last alphas and betas) are all-gathered in
one collective per call, so every rank branches alike. A pair's bits do not depend on which
other boxes or rows share its kernels under these orders, so every bound is single mode's.
Before, every rank took every domain and a slice of each one's spec rows: with fewer spec
rows than ranks (one row: most properties) every rank bounded the same row, and beta-CROWN's
work and memory did not fall with P.
"""

from __future__ import annotations

import torch

from shardbound.runtime.engine.beta import beta_crown


def sub_part(bounds: dict, part) -> dict:
    """{node: (lower, upper)} with `part` applied to both sides."""
    return {k: (part(v[0]), part(v[1])) for k, v in bounds.items()}


def crown_pairs(network, ibp, known, lo, hi, C, input_A=None, split_A=None) -> torch.Tensor:
    """final_crown(lower_only=True)'s lower bounds (B, S) of B domains (boxes) and C (S,
    out); `input_A` / `split_A` dicts receive what final_crown gives them, (B, S, ...). Under
    row sharding each rank bounds its share of the B * S (domain, row) pairs, each a box with
    one spec row, and the results are all-gathered in one collective; elsewhere this is
    final_crown itself."""
    if not network.rows.enabled:
        return network.final_crown(ibp, known, lo, hi, C, input_A=input_A, lower_only=True,
                                   split_A=split_A)[0]
    B, S = lo.shape[0], C.shape[-2]
    a, b = network.rows.my_range(B * S)
    dev = lo.device
    at = torch.arange(a, b, device=dev)
    dom, row = at // S, at % S
    part = lambda t: t.index_select(0, dom)                                  # noqa: E731
    Cp = (C[dom, row] if C.dim() == 3 else C[row]).unsqueeze(1)              # (k, 1, out)
    out = network.output.name
    grab = {} if input_A is not None else None
    got_A = {} if split_A is not None else None
    with network.rows.local():
        lb, _ = network.final_crown(sub_part({out: ibp[out]}, part),
                                    sub_part(known, part), part(lo), part(hi), Cp,
                                    input_A=grab, lower_only=True, split_A=got_A)
    names = sorted(got_A or {})
    parts = [lb] + ([grab["lA"]] if grab is not None else []) + [got_A[k] for k in names]
    every = network.rows.gather_parts(parts, B * S)
    if grab is not None:
        input_A["lA"] = every[1].reshape(B, S, *every[1].shape[2:])
    for k, t in zip(names, every[1 + (grab is not None):]):
        split_A[k] = t.reshape(B, S, *t.shape[2:])
    return every[0].reshape(B, S)


def optimise_pairs(network, ibp, known, lo, hi, C, splits, lb, pairs, iterations, stop,
                   warm, beta_key: str, best_out=None):
    """(lb (B, S) with the `pairs` ((B, S) bool) raised by beta-CROWN, the pairs' input
    A-matrices (P, n) or None, the domains that had a pair (indices), and their alphas and
    betas in the (domains, S, ...) layout, betas under beta_key + split node).
    `best_out` (a dict; not under row sharding): receives beta_crown's best parameters per
    pair, in the pair layout (P, 1, ...), the pairs in `torch.nonzero(pairs)`'s order: the
    Lagrangian --soundness real/float32 re-evaluates (certificate.py)."""
    if best_out is not None and network.rows.enabled:
        raise ValueError("optimise_pairs: best_out is not gathered under row sharding")
    dom, row = torch.nonzero(pairs, as_tuple=True)
    B, S = lb.shape
    idx = torch.unique(dom)                     # sorted: the domains with an open pair
    where = torch.full((B,), -1, dtype=torch.long)
    where[idx] = torch.arange(len(idx))
    dev = lo.device
    d_dev, r_dev = dom.to(dev), row.to(dev)
    Cp = C.to(dev)[r_dev].unsqueeze(1)                                       # (P, 1, out)
    alpha_start = beta_start = None
    if warm is not None and bool(warm[1][dom].any()):
        has = warm[1][dom]
        per_row = {k: v.to(dev)[d_dev, r_dev].unsqueeze(1) for k, v in warm[0].items()}
        alpha_start = ({k: v for k, v in per_row.items() if not k.startswith(beta_key)}, has)
        beta_start = ({k[len(beta_key):]: v for k, v in per_row.items()
                       if k.startswith(beta_key)}, has)
    floor = lb[dom, row].reshape(-1, 1).to(dev)
    n_pairs = len(dom)
    a, b = network.rows.my_range(n_pairs)       # all of them without row sharding
    share = torch.arange(a, b, device=dev)
    part = lambda t: t.index_select(0, share)       # a tensor in pair layout  # noqa: E731
    mine = d_dev.index_select(0, share)             # the domain of each of this rank's pairs
    pick = lambda t: t.index_select(0, mine)        # a tensor in domain layout  # noqa: E731
    if alpha_start is not None:
        alpha_start = ({k: part(v) for k, v in alpha_start[0].items()}, alpha_start[1][a:b])
        beta_start = ({k: part(v) for k, v in beta_start[0].items()}, beta_start[1][a:b])
    alphas, betas = {}, {}
    with torch.no_grad(), network.rows.local():
        better, lA = beta_crown(network, sub_part(ibp, pick), sub_part(known, pick),
                                pick(lo), pick(hi), part(Cp),
                                {k: pick(v) for k, v in splits.items()},
                                part(floor), iterations, stop=stop,
                                alpha_start=alpha_start, alpha_out=alphas, beta_out=betas,
                                beta_start=beta_start, best_out=best_out)
    if network.rows.enabled:                    # every rank gets every pair's results
        keys = sorted(alphas), sorted(betas)
        parts = [better] + ([] if lA is None else [lA]) + [alphas[k] for k in keys[0]] + \
            [betas[k] for k in keys[1]]
        got = network.rows.gather_parts(parts, n_pairs)
        better, got = got[0], got[1:]
        if lA is not None:
            lA, got = got[0], got[1:]
        alphas = dict(zip(keys[0], got[:len(keys[0])]))
        betas = dict(zip(keys[1], got[len(keys[0]):]))
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
