"""Turn bounds into answers: sat (with a confirmed counterexample), unsat, unknown, timeout.

Per case of the property: (1) a projected-gradient attack; (2) CROWN on the whole box;
(3) full alpha-CROWN (runtime/engine/full_alpha.py), whose tightened intermediate bounds
every branch-and-bound domain then inherits; (4) branch and bound by input splitting
when the input is small enough, else a stronger attack and branch and bound by ReLU splitting with beta-CROWN bounds.
The property is sat as soon as one case has a counterexample that a plain forward pass
confirms, and unsat when every case is proved. Results follow VNN-COMP.

One time budget (`budget.Budget`) covers every stage: each asks it at its own steps (PGD
steps, optimiser iterations, CROWN-bounded nodes, branch-and-bound rounds), and a spent
budget ends the run with `timeout`, on every rank at the same point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from shardbound.runtime.engine.full_alpha import root_bounds
from shardbound.runtime.errors import ShardboundError
from shardbound.runtime.verification.attack import pgd
from shardbound.runtime.verification.budget import Budget, BudgetExhausted
from shardbound.runtime.verification.input_split import input_split, refuted_conjunctions
from shardbound.runtime.verification.relu_split import relu_split
from shardbound.runtime.verification.stages import StageLog
from shardbound.runtime.verification.spec import Spec, SpecCase, inside_box, outward_box, violated_conjunctions

SPLIT_MAX_INPUTS = 16     # input splitting beyond this many inputs rarely finishes


@dataclass
class Result:
    verdict: str
    x: np.ndarray | None = None        # counterexample input (flattened), for sat
    y: np.ndarray | None = None        # its output
    seconds: float = 0.0
    stages: list[str] = field(default_factory=list)   # "case I: STAGE", every stage run
    records: list = field(default_factory=list)       # their StageRecords (times, boxes)
    decided: object = None                            # the StageRecord that decided it

    def vnncomp_text(self) -> str:
        """The VNN-COMP result file: the verdict, then for sat the assignment."""
        if self.verdict != "sat":
            return self.verdict + "\n"
        parts = [f"(X_{i} {float(v)!r})" for i, v in enumerate(self.x)]
        parts += [f"(Y_{j} {float(v)!r})" for j, v in enumerate(self.y)]
        return "sat\n(" + "\n ".join(parts) + ")\n"


class _CaseRunner:
    def __init__(self, verifier, case: SpecCase, budget: Budget, comm, progress, start):
        self.net = verifier.network
        self.case = case
        self.budget = budget
        self.deadline = budget.deadline if budget.deadline is not None else float("inf")
        self.comm = comm
        self.progress = progress
        self.start = start          # start(stage): a stage line, and its record
        self.lo, self.hi = outward_box(case.lower, case.upper)
        self.C, self.d, self.owner = case.stacked()
        self.n_conj = len(case.conjunctions)

    def forward_flat(self, x):
        """Flattened outputs on the CPU for flattened inputs on the CPU (the network may
        live on a GPU)."""
        x = x.reshape(-1, *self.net.input_shape).to(self.net.device)
        return self.net.forward(x).reshape(x.shape[0], -1).cpu()

    def confirm(self, x) -> tuple[np.ndarray, np.ndarray] | None:
        """A plain forward pass at a float32 point inside the real (float64) box: the point
        evaluated is the point reported. A box too narrow to hold a float32 value in some
        input (l == u not representable) has no such point: nothing is confirmed there."""
        x = inside_box(x.reshape(-1), self.case.lower, self.case.upper)
        xd = x.double().numpy()
        if not bool(np.all((xd >= self.case.lower) & (xd <= self.case.upper))):
            return None
        with torch.no_grad():
            y = self.forward_flat(x.reshape(1, -1))[0]
        if violated_conjunctions(y, self.case):
            return x.numpy().astype(np.float64), y.numpy().astype(np.float64)
        return None

    def is_violation(self, xs):
        with torch.no_grad():
            ys = self.forward_flat(xs)
        for i in range(xs.shape[0]):
            if violated_conjunctions(ys[i], self.case) and self.confirm(xs[i]) is not None:
                return i
        return None

    def domain_attack(self, lo, hi):
        """A short attack inside one branch-and-bound domain."""
        return pgd(self.forward_flat, lo, hi, self.C, self.d, self.owner, restarts=2, steps=15,
                   stop=self.budget)

    def agree(self, flag: bool) -> bool:
        return bool(self.comm.all_reduce_max(torch.tensor([float(flag)]))[0] > 0)

    def refuted(self, lb) -> bool:
        return bool(refuted_conjunctions(lb, self.d, self.owner, self.n_conj).all())

    def run(self):
        if self.n_conj == 0:
            return "unsat", None
        if any(len(k.d) == 0 for k in self.case.conjunctions):   # no output constraint
            self.start("attack")
            return "sat", self.confirm((self.lo + self.hi) / 2)
        shape = (1, *self.net.input_shape)
        dev = self.net.device
        lo, hi = self.lo.reshape(shape).to(dev), self.hi.reshape(shape).to(dev)
        C_dev = self.C.to(dev)
        budget = self.budget
        budget.check()
        self.start("attack")
        x = pgd(self.forward_flat, self.lo, self.hi, self.C, self.d, self.owner, stop=budget)
        if x is not None and (cex := self.confirm(x)) is not None:
            return "sat", cex
        budget.check()
        self.start("crown")
        with torch.no_grad():
            cache = self.net.intermediate_bounds(lo, hi)
            lb, _ = self.net.final_crown(*cache, lo, hi, C_dev)
            lb = lb.cpu()
        if self.refuted(lb):
            return "unsat", None
        # Full alpha-CROWN; its tightened intermediate bounds are branch and bound's root prior.
        budget.check()
        self.start("alpha-crown")
        lb, prior = root_bounds(self.net, lo, hi, C_dev, cache, stop=budget)
        cache = (cache[0], prior)
        lb = lb.cpu()
        if self.refuted(lb):
            return "unsat", None
        if self.lo.numel() <= SPLIT_MAX_INPUTS:
            self.start("input-split")
            res = input_split(self.net, self.C, self.d, self.owner, self.lo, self.hi,
                              self.deadline, self.agree, self.is_violation, progress=self.progress,
                              attack=self.domain_attack, root_prior=cache[1], stop=budget)
            self.progress.done()
            if res.verdict == "sat":
                return "sat", self.confirm(res.x)
            return res.verdict, None
        budget.check()
        self.start("attack-strong")
        x = pgd(self.forward_flat, self.lo, self.hi, self.C, self.d, self.owner,
                restarts=32, steps=150, seed=1, stop=budget)
        if x is not None and (cex := self.confirm(x)) is not None:
            return "sat", cex
        if self.net.splittable_nodes():
            budget.check()
            self.start("relu-split")
            res = relu_split(self.net, self.C, self.d, self.owner, self.lo, self.hi,
                             self.deadline, self.agree, self.is_violation,
                             progress=self.progress, root_prior=cache[1], stop=budget)
            self.progress.done()
            if res.verdict == "sat":
                return "sat", self.confirm(res.x)
            return res.verdict, None
        return ("timeout" if budget.expired() else "unknown"), None


def check_spec_fits(spec: Spec, input_shape, output_shape) -> None:
    """A property about another network (input or output count) is a user error, named
    (it failed inside the attack: `mat1 and mat2 shapes cannot be multiplied`)."""
    n_in = int(np.prod(input_shape))
    n_out = int(np.prod(output_shape))
    if spec.num_inputs != n_in:
        raise ShardboundError(f"{spec.source}: the property has {spec.num_inputs} inputs (X_0.."
                              f"X_{spec.num_inputs - 1}) but the model takes {n_in}; check that "
                              "the property belongs to this model")
    widths = {k.C.shape[1] for c in spec.cases for k in c.conjunctions}
    if spec.num_outputs != n_out or widths - {n_out}:
        m = max(widths | {spec.num_outputs})
        raise ShardboundError(f"{spec.source}: the property constrains {m} outputs (Y_0..Y_{m - 1})"
                              f" but the model has {n_out}; check that the property belongs "
                              "to this model")


def verify(verifier, spec: Spec, timeout_s: float, comm, quiet: bool = True,
           deadline: float | None = None, stages: StageLog | None = None) -> Result:
    """The verdict on `spec` for the compiled network behind `verifier`, within `timeout_s`
    seconds (or by `deadline`, a time.monotonic() value, when given: the caller's budget).
    Every rank of a job gets the same verdict at the same point. `stages` prints the stage
    lines (on a terminal) and keeps the records; by default a silent one."""
    start = time.monotonic()
    if deadline is None:
        deadline = start + timeout_s
    budget = Budget(deadline, comm)
    if stages is None:
        stages = StageLog(time.time(), quiet=quiet, boxes=len(spec.cases))
    stages.boxes = len(spec.cases)
    check_spec_fits(spec, verifier.input_shape, verifier.output_shape)
    net = verifier.network
    net.budget = budget

    def result(verdict, box=None, x=None, y=None):
        stages.end()
        decided = stages.last(box) if box is not None else stages.last()
        names = [f"case {r.box}: {r.stage}" for r in stages.records if r.box is not None]
        return Result(verdict, x, y, time.monotonic() - start, names, list(stages.records),
                      decided)

    verdicts = []
    try:
        for i, case in enumerate(spec.cases):
            runner = _CaseRunner(verifier, case, budget, comm, stages,
                                 lambda s, i=i: stages.start(s, i))
            try:
                verdict, cex = runner.run()
            except BudgetExhausted:
                stages.done()
                verdict, cex = "timeout", None
            if verdict == "sat" and cex is not None:
                return result("sat", i, cex[0], cex[1])
            if verdict == "sat":      # a sat without a confirmed point is not reported
                verdict = "unknown"
            verdicts.append(verdict)
            if verdict == "timeout":
                return result("timeout", i)
    finally:
        net.budget = None
    if all(v == "unsat" for v in verdicts) and len(verdicts) == len(spec.cases):
        return result("unsat")
    first = next(i for i, v in enumerate(verdicts) if v != "unsat")
    return result("unknown", first)
