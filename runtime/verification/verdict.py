"""Turn bounds into answers: sat (with a confirmed counterexample), unsat, unknown, timeout.

Per case of the property: (1) a projected-gradient attack; (2) CROWN on the whole box;
then, when the input is small enough, (3) branch and bound by input splitting; else (3)
full alpha-CROWN (runtime/engine/full_alpha.py), whose tightened intermediate bounds every
branch-and-bound domain then inherits, (4) a stronger attack and branch and bound by ReLU
splitting with beta-CROWN bounds.
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

from shardbound.runtime.accounting.guard import check_budget
from shardbound.runtime.engine.full_alpha import root_bounds
from shardbound.runtime.engine.split_refine import needs_refinement, refine_by_splits
from shardbound.runtime.errors import ShardboundError
from shardbound.runtime.verification.attack import pgd
from shardbound.runtime.verification.budget import Budget, BudgetExhausted
from shardbound.runtime.verification import milp
from shardbound.runtime.verification.batch_memory import input_batch_for_memory
from shardbound.runtime.verification.branching import can_split
from shardbound.runtime.verification.input_split import BATCH as INPUT_SPLIT_BATCH
from shardbound.runtime.verification.input_split import input_split, refuted_conjunctions
from shardbound.runtime.verification.relu_split import relu_split
from shardbound.runtime.verification.stages import StageLog
from shardbound.runtime.verification.spec import Spec, SpecCase, inside_box, outward_box, violated_conjunctions
from shardbound.runtime.program.grad_mode import outside_inference_mode

FIRST_TRY_SHARE = 0.1    # of the time left: ReLU branch and bound before split refinement
REFINE_SHARE = 0.25      # of the time left, at most, for split refinement of the root prior
MILP_SHARE = 0.6         # of the time left after the first try, at most, for the MILP stage
# `--milp auto` (the default) runs the MILP stage where milp.encodable says it applies; it
# stops at the first conjunction it cannot refute, so an instance branch and bound proves
# and the MILP does not (mnistfc prop_3_0.03) loses one conjunction's share of that time.
SPLIT_MAX_INPUTS = 16     # input splitting beyond this many inputs rarely finishes
# default mode confirms counterexamples in float64 too for networks up to this many weights
DEFAULT_FLOAT64_ELEMENTS = 1 << 22


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
    def __init__(self, verifier, case: SpecCase, budget: Budget, comm, progress, start,
                 soundness: str = "default", rigorous=None, milp: str = "auto"):
        self.net = verifier.network
        self.soundness = soundness
        self.milp = milp             # --milp: auto (where milp.encodable) or off
        self.rig = rigorous          # RigorousBounds: float64 forward, and certificates
        self._whole_box = None       # the rigorous verdict on the whole box, once
        self._box_bounds = None      # the rigorous bounds of every node over it, once
        self._replay = None          # full alpha-CROWN's parameters, for the root certificate
        self._root = None            # (proved, rigorous bounds of every node) on the whole box
        self._rig_prior = None       # those bounds after split refinement (rigorous/refine.py)
        self.case = case
        self.budget = budget
        self.deadline = budget.deadline if budget.deadline is not None else float("inf")
        self.comm = comm
        self.progress = progress
        self.start = start          # start(stage): a stage line, and its record
        self.lo, self.hi = outward_box(case.lower, case.upper)
        self.C, self.d, self.owner = case.stacked()
        self.C64 = self.C.double() if not case.conjunctions else torch.from_numpy(
            np.concatenate([k.C for k in case.conjunctions], axis=0))
        self.n_conj = len(case.conjunctions)

    def forward_flat(self, x):
        """Flattened outputs on the CPU for flattened inputs on the CPU (the network may
        live on a GPU)."""
        x = x.reshape(-1, *self.net.input_shape).to(self.net.device)
        return self.net.forward(x).reshape(x.shape[0], -1).cpu()

    @property
    def forward64(self):
        """The network in float64 on flattened CPU points (covered ops), or None."""
        return None if self.rig is None else self.rig.forward64

    def confirm(self, x) -> tuple[np.ndarray, np.ndarray] | None:
        """A plain forward pass at a float32 point inside the real (float64) box: the point
        evaluated is the point reported. A box too narrow to hold a float32 value in some
        input (l == u not representable) has no such point: nothing is confirmed there.
        The VNN-LIB region is non-strict (C y <= d): slack exactly 0 is a counterexample.
        Where the float32 pass does not violate, the network evaluated in float64 at the
        same float32 point (covered ops) may: either confirmation is a counterexample, and
        the output reported is the evaluation that violated."""
        x = inside_box(x.reshape(-1), self.case.lower, self.case.upper)
        xd = x.double().numpy()
        if not bool(np.all((xd >= self.case.lower) & (xd <= self.case.upper))):
            return None
        with torch.no_grad():
            y = self.forward_flat(x.reshape(1, -1))[0]
        if violated_conjunctions(y, self.case):
            return x.numpy().astype(np.float64), y.numpy().astype(np.float64)
        if self.rig is not None:
            y64 = self.rig.forward64(x.reshape(1, -1))[0]
            if violated_conjunctions(y64, self.case):
                return x.numpy().astype(np.float64), y64.numpy()
        return None

    def _violating(self, ys) -> np.ndarray:
        """(N,) bool: the outputs ys (N, m) that meet some conjunction (C y <= d, float64)."""
        yv = ys.detach().double().reshape(ys.shape[0], -1).numpy()
        hit = np.zeros(len(yv), dtype=bool)
        for k in self.case.conjunctions:
            hit |= np.all(yv @ k.C.T <= k.d, axis=1)
        return hit

    def is_violation(self, xs):
        """The first of the points xs (N, n) confirmed as a counterexample (float32 or
        float64 evaluation, see `confirm`), or None."""
        with torch.no_grad():
            hit = self._violating(self.forward_flat(xs))
            if self.rig is not None:
                hit |= self._violating(self.rig.forward64(xs.cpu()))
        for i in np.nonzero(hit)[0].tolist():
            if self.confirm(xs[i]) is not None:
                return i
        return None

    def vertex_counterexample(self, lA, open_rows=None):
        """The box vertex minimising each row's linear lower bound (lA (1, R, n)), tried as a
        counterexample: where the bound is exact up to rounding (a linear region) and the
        threshold is met with slack 0, this is the point."""
        lA = lA.reshape(lA.shape[0], lA.shape[1], -1).cpu()
        verts = torch.where(lA > 0, self.lo.reshape(1, 1, -1), self.hi.reshape(1, 1, -1))
        verts = verts.reshape(-1, verts.shape[-1])
        if open_rows is not None:
            verts = verts[open_rows.reshape(-1)]
        if not len(verts):
            return None
        i = self.is_violation(verts)
        return None if i is None else self.confirm(verts[i])

    def certified(self) -> bool:
        """--soundness real/float32: the whole box proved by the rigorous bounds (computed
        once per case); default mode: True (the engine's float32 bounds decide)."""
        if self.rig is None or self.soundness == "default":
            return True
        if self._whole_box is None:
            lo, hi = self._rigorous_box()
            ok = self.rig.refuted(lo, hi, self.C64, self.d, self.owner, self.n_conj,
                                  bounds=self.box_bounds())
            self._whole_box = not self.agree(not bool(ok[0]))
        return self._whole_box

    def _rigorous_box(self):
        return self.rig.outward(self.case.lower.reshape(1, -1), self.case.upper.reshape(1, -1))

    def box_bounds(self):
        """--soundness real/float32: the rigorous bounds (float64) of every node over the
        whole box, once per case: the certificate's and, rounded outward to float32, the
        engine's own at the CROWN stage (`crown_intermediate`)."""
        if self._box_bounds is None:
            with torch.no_grad():
                self._box_bounds = self.rig.all_bounds(*self._rigorous_box(),
                                                       check=self.budget.check)
        return self._box_bounds

    def crown_intermediate(self, lo, hi):
        """The CROWN stage's (IBP bounds, planned bounds). Default mode: the engine's. Under
        --soundness real/float32 the planned bounds are the rigorous ones (`box_bounds`,
        float32 outward) intersected with the engine's IBP, not the engine's CROWN: the
        certificate needs the rigorous CROWN of the same nodes anyway, and it holds for
        every point of the box, so the engine's later stages may start from it (one CROWN
        of the nodes instead of two: TinyYOLO's grid nodes, 52 CPU s of the engine's)."""
        if not self.rigorous:
            return self.net.intermediate_bounds(lo, hi)
        from shardbound.runtime.engine.interval_helpers import intersect
        from shardbound.runtime.rigorous import to_float32_outward

        rig = self.box_bounds()
        ibp = self.net.ibp_all(lo, hi)
        known = {}
        for name in self.net.intermediate:
            l64, h64 = rig[name]
            l32, h32 = to_float32_outward(l64, h64)
            el, eh = ibp[name]
            known[name] = intersect(ibp[name], (l32.reshape(el.shape).to(el.device),
                                                h32.reshape(eh.shape).to(eh.device)))
        return ibp, known

    @property
    def rigorous(self) -> bool:
        return self.rig is not None and self.soundness != "default"

    def root_certificate(self):
        """--soundness real/float32 after full alpha-CROWN: (the whole box proved, the rigorous
        bounds of every node over it), once per case. Full alpha-CROWN's own parameters are
        re-evaluated under the error account (`replay`: each start node's intermediate
        alphas, then the final pass's, beside plain CROWN's; any alpha in range gives a
        bound), so its root proof is certified as it was found, and the node bounds become
        the prior of every branch-and-bound leaf's certificate (they hold on the whole box)."""
        if self._root is None:
            replay = self._replay or {}
            lo, hi = self.rig.outward(self.case.lower.reshape(1, -1),
                                      self.case.upper.reshape(1, -1))
            final = replay.get("final")
            ok = self.rig.refuted(lo, hi, self.C64, self.d, self.owner, self.n_conj,
                                  lagrangian=(final, None) if final else None,
                                  node_alphas=replay.get("nodes"), both=True)
            self._root = (not self.agree(not bool(ok[0])), self.rig.last_bounds)
            replay.clear()          # re-evaluated: the kept parameters are not needed again
            self.net.ledger.set("kept_alpha", 0)
        return self._root

    def certify(self):
        """For branch and bound in --soundness real/float32: a LeafCertifier
        (runtime/verification/certificate.py), called (los, his, splits, lagrangian, cuts,
        bounds) -> (B,) bool, the domains the rigorous bounds prove (lagrangian: beta-CROWN's
        (alphas, betas) for those domains, or None; cuts: the interval splits' bounds, or
        None; bounds: its `domain_bounds` of them), with the root certificate's bounds as
        the prior; None in default mode."""
        if not self.rigorous:
            return None
        from shardbound.runtime.verification.certificate import LeafCertifier

        prior = None
        if self._replay is not None:
            prior = self._rig_prior or self.root_certificate()[1]

        def refuted(los, his, splits, lagrangian, **given):
            return self.rig.refuted(los, his, self.C64, self.d, self.owner, self.n_conj,
                                    splits, lagrangian, **given)

        def agree(ok):
            # every rank closes the same domains (float64 bits could differ across ranks
            # only on different machines; one collective makes it certain)
            return ~(self.comm.all_reduce_max((~ok).to(torch.float32)) > 0)
        def lower(los, his, C, splits, lagrangian, **given):
            return self.rig.spec_lower(los, his, C, splits, lagrangian, **given)
        return LeafCertifier(self.rig, refuted, agree, prior, self.budget.check, lower,
                             self.C64)

    def domain_attack(self, lo, hi):
        """A short attack inside branch-and-bound domains (lo, hi: (k, n), searched in one
        batch)."""
        return pgd(self.forward_flat, lo, hi, self.C, self.d, self.owner, restarts=2, steps=15,
                   stop=self.budget, forward64=self.forward64)

    def split_inputs(self, cache):
        """Branch and bound by input splitting, every domain inheriting the intermediate
        bounds of `cache` (ibp, known)."""
        self.budget.check()
        self.start("input-split")
        # as many boxes per step as fit the default budget (runtime/verification/batch_memory.py)
        batch = input_batch_for_memory(self.net, self.C.shape[0], INPUT_SPLIT_BATCH, self.agree)
        res = input_split(self.net, self.C, self.d, self.owner, self.lo, self.hi,
                          self.deadline, self.agree, self.is_violation, progress=self.progress,
                          attack=self.domain_attack, root_prior=cache[1], stop=self.budget,
                          certify=self.certify(), batch=batch)
        self.progress.done()
        if res.verdict == "sat":
            return "sat", self.confirm(res.x)
        return res.verdict, None

    def _bab_answer(self, res):
        if res.verdict == "sat":
            return "sat", self.confirm(res.x)
        return res.verdict, None

    def refine_prior(self, lo, hi, known):
        """Branch and bound's root prior with the intermediate bounds tightened by split
        refinement (runtime/engine/split_refine.py), in at most REFINE_SHARE of the time
        left (its rounds are fixed; the clock only cuts them short on a slow machine)."""
        if not needs_refinement(self.net, known):
            return known
        self.start("split-refine")
        until = time.monotonic() + REFINE_SHARE * self.budget.remaining()
        stop = lambda: self.budget.expired() or self.agree(time.monotonic() > until)  # noqa
        leaves = [] if self.rigorous and self._replay is not None else None
        with torch.no_grad():
            refined = refine_by_splits(self.net, lo, hi, known, stop=stop, leaves=leaves)
            if leaves:
                # the certificates' prior: the same refinement, re-evaluated rigorously
                from shardbound.runtime.rigorous.refine import refined_bounds

                self._rig_prior = refined_bounds(self.rig, self.root_certificate()[1],
                                                 *self._rigorous_box(), leaves,
                                                 check=self.budget.check)
        return refined

    def milp_refute(self, lo, hi, prior, lb, tree=None):
        """The MILP stage (runtime/verification/milp.py) on the conjunctions the root bounds
        `lb` leave open and the first try's tree `tree` (a BabState) does not prove on every
        open domain, in at most MILP_SHARE of the time left: ("unsat", None) when it
        refutes them all, ("sat", cex) for a confirmed point it found, else None. Default
        mode only (a float solver's "infeasible" is no rigorous enclosure), one process
        (no tp zones, no row sharding), networks `milp.encodable` accepts; never under
        `--milp off`."""
        net = self.net
        if (self.milp == "off" or self.soundness != "default"
                or getattr(net, "tp", None) is not None
                or net.rows.enabled or not milp.encodable(net, prior)):
            return None
        self.start("milp")
        done = refuted_conjunctions(lb, self.d, self.owner, self.n_conj).reshape(-1).numpy()
        if tree is not None and tree.unresolved == 0 and len(tree.plb):
            # closed leaves proved every conjunction, each open one carries its parent's
            # per-row bounds: a conjunction they all refute is refuted on the whole box
            done = done | refuted_conjunctions(tree.plb, self.d, self.owner,
                                               self.n_conj).all(dim=0).numpy()
        until = time.monotonic() + MILP_SHARE * self.budget.remaining()
        gap = (lb.double()[0] - torch.from_numpy(self.d)).numpy()
        closest = np.array([gap[self.owner == j].max() for j in range(self.n_conj)])
        refuted, candidates = milp.refute(net, prior, lo, hi, self.C64.numpy(), self.d,
                                          self.owner, self.n_conj, ~done, until,
                                          stop=self.budget.expired, order=closest)
        for x in candidates:
            if (cex := self.confirm(torch.from_numpy(x).float())) is not None:
                return "sat", cex
        if not self.agree(not bool((refuted | done).all())):
            return "unsat", None
        return None

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
        # --memory-budget: a case whose bounds (on its own C rows) cannot fit stops here,
        # before anything is allocated; the ledger guards what follows.
        for method in ("crown", "full-alpha-crown"):
            check_budget(self.net, lo, C_dev, method)
        budget = self.budget
        budget.check()
        self.start("attack")
        x = pgd(self.forward_flat, self.lo, self.hi, self.C, self.d, self.owner, stop=budget,
                forward64=self.forward64)
        if x is not None and (cex := self.confirm(x)) is not None:
            return "sat", cex
        budget.check()
        self.start("crown")
        with torch.no_grad():
            cache = self.crown_intermediate(lo, hi)
            grab = {}
            lb, _ = self.net.final_crown(*cache, lo, hi, C_dev, input_A=grab)
            lb = lb.cpu()
        if self.refuted(lb):
            # Before `unsat`: the vertex that minimises CROWN's linear bound (a threshold
            # the network attains there with slack 0 is sat, whatever the rounding of lb).
            cex = self.vertex_counterexample(grab["lA"])
            if cex is not None:
                return "sat", cex
            if self.certified():
                return "unsat", None
        if self.lo.numel() <= SPLIT_MAX_INPUTS:
            # Input splitting straight after CROWN: full alpha-CROWN's tighter root bounds
            # saved under 1% of ACAS Xu's domains and cost 0.1-0.3 s per box, a fifth of the
            # family's branch-and-bound time (sub-boxes tighten CROWN faster than alphas do).
            return self.split_inputs(cache)
        # Full alpha-CROWN; its tightened intermediate bounds are branch and bound's root prior.
        budget.check()
        self.start("alpha-crown")
        self._replay = {} if self.rigorous else None
        lb, prior = root_bounds(self.net, lo, hi, C_dev, cache, stop=budget, replay=self._replay)
        cache = (cache[0], prior)
        lb = lb.cpu()
        if self.refuted(lb) and (not self.rigorous or self.root_certificate()[0]):
            return "unsat", None
        budget.check()
        self.start("attack-strong")
        x = pgd(self.forward_flat, self.lo, self.hi, self.C, self.d, self.owner,
                restarts=32, steps=150, seed=1, stop=budget, forward64=self.forward64)
        if x is not None and (cex := self.confirm(x)) is not None:
            return "sat", cex
        if can_split(self.net):
            budget.check()
            self.start("relu-split")
            planned = getattr(self.net, "bab_batch", None)      # --memory-budget's plan
            prior = cache[1]
            bab = lambda prior, **kw: relu_split(                       # noqa: E731
                self.net, self.C, self.d, self.owner, self.lo, self.hi, self.deadline,
                self.agree, self.is_violation, progress=self.progress, root_prior=prior,
                certify=self.certify(), **({"batch": planned} if planned else {}), **kw)
            if needs_refinement(self.net, prior):
                # A first try on the root prior as it is, in FIRST_TRY_SHARE of the time left:
                # the easy instances end here, without paying for split refinement; the
                # others continue the first try's tree under the refined prior (its open
                # domains' bounds intersected with it; proved domains stay proved).
                until = time.monotonic() + FIRST_TRY_SHARE * budget.remaining()
                res = bab(prior, final_share=0.0, keep_state=True,
                          stop=lambda: budget.expired() or self.agree(time.monotonic() > until))
                self.progress.done()
                if res.verdict != "timeout" or budget.expired():
                    return self._bab_answer(res)
                budget.check()
                if (answer := self.milp_refute(lo, hi, prior, lb, res.state)) is not None:
                    return answer
                budget.check()
                prior = self.refine_prior(lo, hi, prior)
                budget.check()
                self.start("relu-split")
                res = bab(prior, stop=budget, resume=res.state)
            else:
                res = bab(prior, stop=budget)
            self.progress.done()
            return self._bab_answer(res)
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


def rigorous_for(network, soundness: str):
    """The rigorous bounds of `network` for --soundness real/float32 (a one-line error when an
    op is not covered); in default mode the same machinery where the ops are covered (for the
    float64 confirmation of counterexamples), else None."""
    from shardbound.runtime.rigorous import RigorousBounds, check_covered

    if soundness != "default":
        return RigorousBounds(network, soundness)
    try:
        check_covered(network, "real")
    except ShardboundError:
        return None
    # a float64 copy of the weights: not for networks where that costs real memory
    elements = sum(p.numel() if isinstance(p, torch.Tensor) else int(getattr(p, "numel", 0))
                   for n in network.nodes for p in n.params.values() if p is not None)
    if elements > DEFAULT_FLOAT64_ELEMENTS:
        return None
    return RigorousBounds(network, "real")


@outside_inference_mode
def verify(verifier, spec: Spec, timeout_s: float, comm, quiet: bool = True,
           deadline: float | None = None, stages: StageLog | None = None,
           soundness: str = "default", milp: str = "auto") -> Result:
    """The verdict on `spec` for the compiled network behind `verifier`, within `timeout_s`
    seconds (or by `deadline`, a time.monotonic() value, when given: the caller's budget).
    Every rank of a job gets the same verdict at the same point. `stages` prints the stage
    lines (on a terminal) and keeps the records; by default a silent one. `milp`: --milp
    (auto or off)."""
    start = time.monotonic()
    if deadline is None:
        deadline = start + timeout_s
    budget = Budget(deadline, comm)
    if stages is None:
        stages = StageLog(time.time(), quiet=quiet, boxes=len(spec.cases))
    stages.boxes = len(spec.cases)
    check_spec_fits(spec, verifier.input_shape, verifier.output_shape)
    net = verifier.network
    fixed = getattr(net, "fixed_inputs", None)     # values folded in (runtime/program/fixed_inputs.py)
    if fixed is not None:
        for i, case in enumerate(spec.cases):
            fixed.check_case(case.lower, case.upper, f"{spec.source}: case {i}")
    rigorous = rigorous_for(net, soundness)
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
                                 lambda s, i=i: stages.start(s, i), soundness, rigorous, milp)
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
