"""beta-CROWN for branch and bound: split constraints enter the bound through multipliers.

On a domain that assumes s_j z_j(x) >= 0 for some input neurons z_j of splittable ops (s_j =
+1 for z_j >= 0, -1 for z_j <= 0), for any beta_j >= 0

    min over the domain of c.f(x)  >=  min over the box of [c.f(x) - sum_j beta_j s_j z_j(x)],

because the subtracted term is >= 0 on the domain. The right side is bounded by one CROWN
pass with -beta_j s_j injected into the A-matrix at z_j (`final_crown(..., extra_A=)`), so
every beta >= 0 gives a sound bound, and unlike clamping the split's bounds alone it carries
the split into the input space (Wang et al. 2021). The shared loop (runtime/engine/
optimise.py) maximises the bound over betas and alphas jointly (projected to beta >= 0 and
each op's alpha set) for a fixed number of iterations from a fixed start: deterministic. The
best bound per row is kept. Intermediate bounds stay fixed. Under row sharding each rank
optimises its own spec rows (as in alpha-CROWN).

The ledger counts the call as alpha-CROWN's: `alpha` holds the alphas and betas with Adam's
two moments and the split terms -beta s (one per split node, alive through every pass),
`autograd` what the graph saves (SavedTensorCounter); the memory model's "beta-crown"
figure (runtime/accounting/beta_model.py) predicts that peak for a batch of domains.
"""

from __future__ import annotations

import torch

from shardbound.runtime.accounting.ledger import SavedTensorCounter
from shardbound.runtime.engine.optimise import (ParamGroup, alpha_bytes, alpha_group,
                                                initial_alphas, maximise)

DEFAULT_ITERATIONS = 20
LR_ALPHA = 0.25
LR_BETA = 0.05
DECAY = 1.0


def beta_crown(network, ibp, known, lower, upper, C, splits, lb_start,
               iterations: int = DEFAULT_ITERATIONS, stop=None, alpha_start=None,
               alpha_out=None, beta_out=None, beta_start=None, best_out=None):
    """(lower bounds (B, S) of C f(x) on each domain, at least `lb_start` (a sound bound of
    the same rows, e.g. CROWN's); the input A-matrix (B, S, *input) of the last iteration, or
    None). `splits` maps nodes feeding splittable ops to int8 (B, *shape). The A-matrix's
    minimising box vertex is where the optimised relaxation expects a violation: a
    counterexample candidate that respects the split constraints better than CROWN's.
    `stop()` ends the optimisation early (a time budget; see `optimise.maximise`).

    Warm start (branch and bound's children start from their parent's optimised slopes):
    `alpha_start` = ({op name: (B, S_local, *alpha shape)}, (B,) bool: the domains that have
    one); the others start from CROWN's slopes. Any feasible start is sound; the start is
    projected onto each op's alpha set first. A dict as `alpha_out` receives the alphas of
    the last iteration (detached), in the same layout; a dict as `beta_out` their betas (split
    node -> (B, S_local, *shape), >= 0): with the alphas, a Lagrangian that --soundness
    real/float32 re-evaluates rigorously (any alpha in range and beta >= 0 gives a bound).
    `beta_start` = ({split node: (B, S_local, *shape)}, (B,) bool), the parents' betas in the
    same way: a child's split multipliers start where its parent's ended (the new split's at
    0, as the parent never had a gradient there), clamped to >= 0 first; `beta_out` then
    has every split node of `splits` (zeros where a batch has no split there), so that the
    layout is the same in every round.
    A dict as `best_out` receives, under "alphas" and "betas", per row the parameters of the
    iteration that gave the bound returned (the best, not the last: the certificate of
    --soundness real/float32 re-evaluates those; the last ones warm-start the children; a
    warm start is only where the iterates begin, so the best may be the warm start itself)."""
    S_all = lb_start.shape[1]
    a, b = network.rows.my_range(S_all)
    start = lb_start[:, a:b]
    B, S = start.shape
    if S == 0 or iterations <= 0:
        return network.rows.gather(start.clone(), S_all), None
    alphas = initial_alphas(network, known, B, S)
    if alpha_start is not None:
        start_alphas, has = alpha_start
        with torch.no_grad():
            for name, a in alphas.items():
                if name in start_alphas and start_alphas[name].shape == a.shape:
                    w = has.to(a.device).reshape(B, *([1] * (a.dim() - 1)))
                    a.copy_(torch.where(w, start_alphas[name].to(a.device), a))
                    network.by_name[name].alpha_project_(a)
    betas, signs = {}, {}
    for name, s in splits.items():
        if bool((s != 0).any()):
            signs[name] = s.to(lower.dtype).unsqueeze(1)                      # (B, 1, *shape)
            betas[name] = torch.zeros(B, S, *s.shape[1:], dtype=lower.dtype,
                                      device=lower.device)
            if beta_start is not None and name in beta_start[0] \
                    and beta_start[0][name].shape == betas[name].shape:
                w = beta_start[1].to(lower.device).reshape(B, *([1] * s.dim()))
                # A start at a neuron this domain does not split has no gradient: zero it.
                free = (s == 0).unsqueeze(1)
                init = beta_start[0][name].to(lower.device).clamp(min=0).masked_fill(free, 0)
                betas[name] = torch.where(w, init, betas[name])
            betas[name].requires_grad_(True)

    def project_betas():
        for t in betas.values():
            t.clamp_(min=0)

    grab = {}

    def objective(last):
        extra = {name: -betas[name] * signs[name] for name in betas}
        return network.final_crown(ibp, known, lower, upper, C, alphas, lower_only=True,
                                   gather=False, extra_A=extra, input_A=grab)[0]

    groups = [alpha_group(network, alphas, LR_ALPHA, DECAY),
              ParamGroup(list(betas.values()), LR_BETA, project_betas, DECAY)]
    ledger = network.ledger
    saved = SavedTensorCounter(ledger)
    keep = None
    if best_out is not None:
        keep = {**{("alpha", k): a for k, a in alphas.items()},
                **{("beta", k): b for k, b in betas.items()}}
    # betas with their moments (and the copy of the start); the kept best parameters (real /
    # float32 mode) are one more copy of every alpha and beta
    kept_bytes = 0 if keep is None else sum(t.numel() * t.element_size() for t in keep.values())
    ledger.set("alpha", alpha_bytes(alphas) + 4 * sum(t.numel() * t.element_size()
                                                      for t in betas.values()) + kept_bytes)
    try:
        best = maximise(objective, groups, iterations, start=start, stop=stop, saved=saved,
                        keep=keep)
    finally:
        saved.clear()
        ledger.set("alpha", 0)
    if alpha_out is not None:
        alpha_out.update({name: a.detach() for name, a in alphas.items()})
    if beta_out is not None:
        beta_out.update({name: b.detach() for name, b in betas.items()})
        for name, sp in splits.items():     # the same layout in every round
            if name not in beta_out:
                beta_out[name] = torch.zeros(B, S, *sp.shape[1:], dtype=lower.dtype,
                                             device=lower.device)
    if best_out is not None:
        best_out["alphas"] = {k[1]: t for k, t in keep.items() if k[0] == "alpha"}
        best_out["betas"] = {k[1]: t for k, t in keep.items() if k[0] == "beta"}
    return network.rows.gather(best, S_all), network.rows.gather(grab["lA"].detach(), S_all)
