"""alpha-CROWN: optimise the relaxation parameters of every optimisable op (ReLU lower slopes,
and whatever other relaxed ops declare) for tighter lower bounds.

Every feasible alpha gives sound lines, so projected gradient ascent (runtime/engine/
optimise.py) on the sum of the spec rows' lower bounds picks good ones (Xu et al. 2021).
Intermediate bounds stay those of the CROWN plan. One alpha per (box, spec row, neuron); the
initial alphas are CROWN's own choices, the iteration count is fixed and there is no
randomness, so results repeat bit for bit. The best bound seen per row is kept.
"""

from __future__ import annotations

import torch

from shardbound.runtime.accounting.ledger import SavedTensorCounter
from shardbound.runtime.engine.optimise import alpha_bytes, alpha_group, initial_alphas, maximise

DEFAULT_ITERATIONS = 20
DEFAULT_LR = 0.25


def alpha_crown(network, lower: torch.Tensor, upper: torch.Tensor, C=None,
                iterations: int = DEFAULT_ITERATIONS, lr: float = DEFAULT_LR, cache=None,
                stop=None):
    """Bounds (B, S) of C f(x): lower optimised by alpha-CROWN, upper from plain CROWN.

    `cache` may hold (ibp, known) from an earlier intermediate pass on the same boxes;
    `stop()` ends the optimisation early (a time budget; see `optimise.maximise`)."""
    with torch.no_grad():
        ibp, known = cache if cache is not None else network.intermediate_bounds(lower, upper)
        lb_all, ub = network.final_crown(ibp, known, lower, upper, C)
    if iterations <= 0:
        return lb_all, ub
    # Under row sharding each rank optimises the alphas of its own spec rows only.
    S_all = lb_all.shape[1]
    a, b = network.rows.my_range(S_all)
    lb0 = lb_all[:, a:b]
    B, S = lb0.shape
    alphas = initial_alphas(network, known, B, S)
    inexact = network.any_inexact(known)
    tp = getattr(network, "tp", None)
    if tp is not None:      # tp ranks hold different neurons of a zone: agree on the decision
        inexact = bool(tp.comm.all_reduce_max(torch.tensor([float(inexact)])).item())
    if not alphas or not inexact:   # the same decision on every rank
        return lb_all, ub
    ledger = network.ledger
    saved = SavedTensorCounter(ledger)
    ledger.set("alpha", alpha_bytes(alphas))

    def objective(last):
        return network.final_crown(ibp, known, lower, upper, C, alphas, lower_only=True,
                                   gather=False)[0]

    try:
        best = maximise(objective, [alpha_group(network, alphas, lr)], iterations, start=lb0,
                        saved=saved, stop=stop)
    finally:
        saved.clear()
        ledger.set("alpha", 0)
    return network.rows.gather(best, S_all), ub
