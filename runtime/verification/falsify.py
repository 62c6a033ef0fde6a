"""Counterexample search inside ReLU-split domains: a gradient attack that respects the split.

A domain of ReLU branch and bound assumes signs of some pre-activations (z_j >= 0 or <= 0).
A violation planted inside a narrow ReLU spike is invisible to attacks on the whole box (the
spike has no gradient outside its support), but the domain that assumes the spike's ReLUs
active describes exactly where it lives. The attack here starts from the domain's
bound-minimising vertex and, while the point breaks some of the domain's sign assumptions,
steps along the gradient of the broken assumptions' total violation (sum relu(-s_j z_j)),
else along the gradient of the property's worst row margin. Every iterate is a candidate:
any point of the box that violates the property is a counterexample, inside the domain or
not; the caller confirms it with a plain forward pass.

Signed-gradient steps with momentum as in `attack.pgd`, a step shrinking from a fifth of the
box to a five-hundredth (geometrically: a spike's support can be far narrower than the
box); seeded restarts, so the search is deterministic. In tp a rank holds only
its channels of a zone's values, so the assumptions are not penalised there (the attack is
then a plain PGD from the vertex, the same on every rank).
"""

from __future__ import annotations

import torch

ATTACK_STEPS = 30          # split_pgd steps per domain attacked by branch and bound


def node_values(network, x: torch.Tensor, names) -> tuple[torch.Tensor, dict]:
    """(output, {name: value}) for a batch x (B, *input_shape): `Network.forward` that also
    hands back the values of `names`."""
    values: dict[str, torch.Tensor] = {}
    keep = {}
    for n in network.nodes:
        values[n.name] = n.forward(*(values[i] for i in n.inputs)) if n.inputs else x
        n.release()
        if n.name in names:
            keep[n.name] = values[n.name]
    return values[network.output.name], keep


def split_pgd(network, lo: torch.Tensor, hi: torch.Tensor, starts: torch.Tensor,
              C: torch.Tensor, d: torch.Tensor, rows: torch.Tensor, splits: dict,
              steps: int = 30, stop=None) -> torch.Tensor | None:
    """A point of [lo, hi] (flattened, CPU) where every row in `rows` of some start holds
    (C f(x) <= d), or None.

    starts (k, n): start points on the CPU; rows (k, R) bool: the rows of the conjunction each
    start attacks; splits: {node name: int8 (k, *node shape)} sign assumptions per start (the
    domain of the start), or {} for none. d (R,) float32."""
    dev = network.device
    lo, hi = lo.reshape(1, -1).to(dev), hi.reshape(1, -1).to(dev)
    Cd, dd, rows = C.to(dev), d.to(dev), rows.to(dev)
    signs = {k: v.reshape(len(starts), -1).to(dev).float() for k, v in splits.items()}
    if network.tp is not None:
        signs = {}
    x = starts.to(dev).clone()
    momentum = torch.zeros_like(x)
    shape = (len(x), *network.input_shape)
    for it in range(steps + 1):
        x = x.detach().requires_grad_(True)
        out, vals = node_values(network, x.reshape(shape), signs.keys())
        margins = out.reshape(len(x), -1) @ Cd.T - dd
        worst = torch.where(rows, margins, torch.full_like(margins, -torch.inf)).max(dim=1).values
        hit = torch.nonzero(worst <= 0).reshape(-1)
        if len(hit):
            return x[int(hit[0])].detach().cpu()
        if it == steps or (stop is not None and stop()):
            return None
        broken = torch.zeros(len(x), device=dev)
        for name, s in signs.items():
            broken = broken + torch.relu(-vals[name].reshape(len(x), -1) * s).sum(dim=1)
        feasible = broken <= 0
        (g_margin,) = torch.autograd.grad(worst.sum(), x, retain_graph=bool(signs))
        g = g_margin
        if signs and not bool(feasible.all()):
            (g_split,) = torch.autograd.grad(broken.sum(), x)
            g = torch.where(feasible.unsqueeze(1), g_margin, g_split)
        with torch.no_grad():
            g = g / g.abs().sum(dim=1, keepdim=True).clamp(min=1e-30)
            momentum = 0.75 * momentum + g
            step = (hi - lo) * (0.2 * 0.01 ** (it / steps))
            x = torch.maximum(torch.minimum(x - step * momentum.sign(), hi), lo)
    return None


def attack_domains(network, lo_flat, hi_flat, C, d, owner_t, lA, lb, order, splits, dom_open,
                    is_violation, stop, seed):
    """split_pgd in the given open domains of a ReLU branch-and-bound batch (`order`: indices
    into it; lA, lb: their rows' input A-matrices and lower bounds, dom_open: the rows still
    open), each from its most violated row's bound-minimising vertex and one seeded random
    point, on that row's conjunction. A confirmed counterexample (flattened, CPU) or None."""
    if not len(order):
        return None
    n = lo_flat.shape[1]
    margin = lb[order].double() - torch.from_numpy(d)                         # (k, R)
    margin = torch.where(dom_open[order], margin, torch.full_like(margin, float("inf")))
    row = margin.argmin(dim=1)
    rows = owner_t.unsqueeze(0) == owner_t[row].unsqueeze(1)                  # (k, R)
    vert = torch.where(lA[order, row] > 0, lo_flat, hi_flat)                  # (k, n)
    gen = torch.Generator().manual_seed(seed)
    rand = lo_flat + torch.rand(len(order), n, generator=gen) * (hi_flat - lo_flat)
    starts = torch.cat([vert, rand])
    sp = {k: torch.cat([v[order], v[order]]) for k, v in splits.items()}
    x = split_pgd(network, lo_flat, hi_flat, starts, C, torch.tensor(d, dtype=torch.float32),
                  torch.cat([rows, rows]), sp, steps=ATTACK_STEPS, stop=stop)
    if x is not None and is_violation(x.reshape(1, -1)) is not None:
        return x.reshape(-1)
    return None
