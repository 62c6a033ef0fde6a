"""alpha-CROWN: optimise the lower-relaxation slopes of unstable ReLUs for tighter lower bounds.

Every slope in [0, 1] gives a sound lower line, so any alpha is sound; projected gradient
ascent (Adam, clamped to [0, 1]) on the sum of the spec rows' lower bounds picks good ones
(Xu et al. 2021). Intermediate bounds stay those of the CROWN plan. One alpha per (box, spec
row, neuron); the initial alphas are CROWN's slopes, the iteration count is fixed and there is
no randomness, so results repeat bit for bit. The best bound seen per row is kept.
"""

from __future__ import annotations

import torch

from shardbound.runtime.ledger import SavedTensorCounter

DEFAULT_ITERATIONS = 20
DEFAULT_LR = 0.25


def alpha_crown(network, lower: torch.Tensor, upper: torch.Tensor, C=None,
                iterations: int = DEFAULT_ITERATIONS, lr: float = DEFAULT_LR, cache=None):
    """Bounds (B, S) of C f(x): lower optimised by alpha-CROWN, upper from plain CROWN.

    `cache` may hold (ibp, known) from an earlier intermediate pass on the same boxes."""
    with torch.no_grad():
        ibp, known = cache if cache is not None else network.intermediate_bounds(lower, upper)
        lb_all, ub = network.final_crown(ibp, known, lower, upper, C)
    if iterations <= 0:
        return lb_all, ub
    # Under row sharding each rank optimises the alphas of its own spec rows only: a row's
    # bound depends on its own alphas alone, and Adam is elementwise, so this is exactly the
    # single-process optimisation, with 1/P of the alpha memory.
    S_all = lb_all.shape[1]
    a, b = network.rows.my_range(S_all)
    lb0 = lb_all[:, a:b]
    B, S = lb0.shape
    alphas = {}
    for relu in network.relu_nodes():
        lo, hi = known[relu.inputs[0]]
        init = (hi > -lo).to(lo.dtype).unsqueeze(1).expand(B, S, *relu.shape)
        alphas[relu.name] = init.clone().requires_grad_(True)
    unstable = any(bool(((known[r.inputs[0]][0] < 0) & (known[r.inputs[0]][1] > 0)).any())
                   for r in network.relu_nodes())
    tp = getattr(network, "tp", None)
    if tp is not None:      # tp ranks hold different neurons of a zone: agree on the decision
        unstable = bool(tp.comm.all_reduce_max(torch.tensor([float(unstable)])).item())
    if not alphas or not unstable:   # the same decision on every rank
        return lb_all, ub
    ledger = network.ledger
    saved = SavedTensorCounter(ledger)
    # Each slope tensor lives with Adam's two moment tensors of the same shape.
    ledger.set("alpha", 3 * sum(a.numel() * a.element_size() for a in alphas.values()))
    try:
        best = _optimise(network, alphas, lb0, ibp, known, lower, upper, C, iterations, lr, saved)
    finally:
        saved.clear()
        ledger.set("alpha", 0)
    return network.rows.gather(best, S_all), ub


def _optimise(network, alphas, lb0, ibp, known, lower, upper, C, iterations, lr, saved):
    """Projected Adam on the slopes; the best lower bound per row over all iterations."""
    opt = torch.optim.Adam(list(alphas.values()), lr=lr, foreach=False)
    best = lb0.clone()
    for _ in range(iterations):
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():    # callers may run under no_grad
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                lb, _ = network.final_crown(ibp, known, lower, upper, C, alphas,
                                            lower_only=True, gather=False)
            if lb.requires_grad and lb.numel():   # a rank may own no spec rows
                (-lb.sum()).backward()
        saved.clear()
        best = torch.maximum(best, lb.detach())
        opt.step()
        with torch.no_grad():
            for a in alphas.values():
                a.clamp_(0, 1)
    with torch.no_grad():
        lb, _ = network.final_crown(ibp, known, lower, upper, C, alphas, lower_only=True,
                                    gather=False)
        best = torch.maximum(best, lb)
    return best
