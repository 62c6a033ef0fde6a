"""The one projected-gradient loop behind alpha-CROWN, beta-CROWN and the optimised
intermediate bounds, and the relaxation parameters it optimises.

Each of them maximises a lower bound (one value per row) over parameters whose every feasible
value gives a sound bound: alpha (the relaxation parameters of every optimisable op, declared
by the op: `alpha_init`, `alpha_project_`), and for beta-CROWN the split multipliers beta >= 0.
So the loop is free to do anything, and the best value seen per row is kept. Adam (no
foreach kernels), a fixed iteration count, a fixed start and no randomness: results repeat bit
for bit, and under row sharding each rank optimises its own rows exactly as one process would
(a row's bound depends on its own parameters alone, and Adam is elementwise).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class ParamGroup:
    """Tensors optimised with one learning rate, and the in-place projection that puts them
    back into their feasible set after each step."""

    tensors: list[torch.Tensor]
    lr: float
    project: Callable[[], None]
    decay: float = 1.0          # the learning rate is multiplied by this after each step


def initial_alphas(network, known, B: int, S: int, nodes=None) -> dict[str, torch.Tensor]:
    """Per optimisable op (default: all of them), its starting parameters for S rows per box:
    (B, S, *alpha_shape), leaves that require grad."""
    alphas = {}
    for n in (network.optimisable_nodes() if nodes is None else nodes):
        init = n.alpha_init([known.get(i) for i in n.inputs])
        alphas[n.name] = init.unsqueeze(1).expand(B, S, *init.shape[1:]).clone().requires_grad_(True)
    return alphas


def alpha_group(network, alphas: dict[str, torch.Tensor], lr: float, decay: float = 1.0
                ) -> ParamGroup:
    """The alpha tensors as one group, each projected by its own op."""
    ops = [network.by_name[name] for name in alphas]

    def project():
        for op in ops:
            op.alpha_project_(alphas[op.name])

    return ParamGroup(list(alphas.values()), lr, project, decay)


def alpha_bytes(alphas: dict[str, torch.Tensor]) -> int:
    """What the ledger's `alpha` category holds: each tensor with Adam's two moments."""
    return 3 * sum(a.numel() * a.element_size() for a in alphas.values())


def maximise(objective: Callable[[bool], torch.Tensor], groups: list[ParamGroup],
             iterations: int, start: torch.Tensor | None = None, saved=None,
             stop: Callable[[], bool] | None = None, keep: dict | None = None) -> torch.Tensor:
    """The best value per element of `objective` over `iterations` + 1 evaluations: the
    starting parameters, then after each projected Adam step. `objective(last)` computes the
    value (differentiable unless `last`: the final evaluation takes no gradient); `start`, a
    value already known to hold (CROWN's), is a floor for the result. `saved`, a
    SavedTensorCounter, has the autograd-saved tensors counted in the ledger.

    `stop()` (a time budget: runtime/verification/budget.py) is asked before each step; when
    it says so the loop ends with the best value so far, which is as sound as any (every
    feasible parameter gives a valid bound). In a sharded run it must answer alike on every
    rank (the budget's answer is a collective).

    `keep` (key -> parameter tensor (B, S, ...), rows as the value's): replaced in place by
    detached copies holding, per row, the parameters of the evaluation that gave the row its
    best value (the starting ones where none beat `start`): the parameters behind the bound
    returned, which --soundness real/float32 re-evaluate rigorously. Only bookkeeping: the
    iterates and the result are the same bits with or without it."""
    params = [g for g in groups if g.tensors]
    kept = None if keep is None else {k: t.detach().clone() for k, t in keep.items()}
    opt = Adam([(g.tensors, g.lr) for g in params]) if params else None
    best = start.clone() if start is not None else None
    for it in range(iterations + 1):
        last = it == iterations
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        hooks = (torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
                 if saved is not None and not last else contextlib.nullcontext())
        with torch.no_grad() if last else torch.enable_grad():    # callers may run under no_grad
            with hooks:
                value = objective(last)
            if not last and value.requires_grad and value.numel():   # a rank may own no rows
                (-value.sum()).backward()
        if saved is not None:
            saved.clear()
        if kept is not None and value.numel():
            better = (value.detach() > best) if best is not None else torch.ones_like(
                value, dtype=torch.bool)
            for k, t in keep.items():
                w = better.reshape(*better.shape, *([1] * (t.dim() - better.dim())))
                kept[k] = torch.where(w, t.detach(), kept[k])
        best = value.detach() if best is None else torch.maximum(best, value.detach())
        if last or opt is None or (stop is not None and stop()):
            break
        opt.step()
        with torch.no_grad():
            for g in params:
                g.project()
        for i, g in enumerate(params):
            if g.decay != 1.0:          # an exponential schedule, as torch's ExponentialLR
                opt.groups[i] = (opt.groups[i][0], g.lr * g.decay ** (it + 1))
    if kept is not None:
        keep.update(kept)
    return best


class Adam:
    """Adam (betas 0.9 / 0.999, eps 1e-8, no weight decay), the arithmetic of torch.optim.Adam's
    single-tensor path step for step (tests/test_intermediate_alpha.py checks the bits). Not
    torch.optim itself: constructing a torch optimizer imports torch._dynamo, 0.9 s on an idle
    core and 6-11 s on a loaded one, paid by every process that runs alpha-CROWN once (every
    rank of every job)."""

    def __init__(self, groups, betas=(0.9, 0.999), eps=1e-8):
        self.groups = [(list(tensors), float(lr)) for tensors, lr in groups]
        self.betas, self.eps = betas, eps
        self.state: dict[int, tuple] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for tensors, _ in self.groups:
            for p in tensors:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        for tensors, lr in self.groups:
            for p in tensors:
                if p.grad is None:
                    continue
                key = id(p)
                if key not in self.state:
                    self.state[key] = (0, torch.zeros_like(p), torch.zeros_like(p))
                step, exp_avg, exp_avg_sq = self.state[key]
                step += 1
                self.state[key] = (step, exp_avg, exp_avg_sq)
                grad = p.grad
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1 ** step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(self.eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
