"""Refuting a property's conjunctions with a mixed-integer program (small ReLU networks).

Where full alpha-CROWN and the first ReLU branch and bound leave a small network's property
open, the network is stated exactly as a MILP over the input box: every affine layer as
equalities, every ReLU neuron that its intermediate bounds leave unstable as the big-M
encoding with one binary (the bounds are the root prior, sound on the whole box), the stable
ones as identities or zeros. A conjunction (C y <= d) is refuted when HiGHS finds no point
with C y <= d + margin: the objective is its first row and `objective_bound` the threshold,
so the solver prunes every node whose LP bound clears it (no incumbent is needed, which is
what makes it fast: mnistfc prop_1_0.03's worst row took 14 CPU s pruned this way against
more than 45 CPU s left unfinished when solved to optimality). A point it does find is a
candidate counterexample, confirmed by the caller with a forward pass.

Solver settings (`OPTIONS`): HiGHS's primal heuristics off. With the threshold as
`objective_bound` an incumbent is of no use to the proof, and on prop_1_0.03 the heuristics
(RINS/RENS sub-MIPs, feasibility jump) took half of every row's time: the 9 rows fell from
~163 to ~58 CPU s (two rows that ran out of a 60 s cap finished in 8). The conjunctions are
tried easiest first and the stage stops at the first one it cannot refute: one open
conjunction leaves the property open whatever the others do, so its time goes back to
branch and bound (prop_3_0.03, which the MILP cannot prove, loses one share).

Soundness: HiGHS works in floating point with feasibility tolerances (1e-7 on rows, 1e-6 on
integrality), so "infeasible" is not a rigorous certificate; the margin (`margin`, 1e-3 plus
1e-5 of the row's scale) is what keeps the solver's tolerances from deciding a verdict. This
is why the stage runs in default mode only (`--soundness real|float32` skip it): there
every verdict must rest on a rigorous enclosure. Deterministic solver settings: one thread,
seed 0, presolve on, a fresh model per conjunction (no state carried from the one before);
only the time cap (a share of verify's budget) can change an outcome between machines, as
every budgeted stage's can.

Which networks: every node declares `mip_encoding` ("affine" on a 1-D input, "relu",
"view"; runtime/ops/base.py), the unstable neurons number at most MAX_BINARIES, and the
weights at most MAX_WEIGHTS; highspy (optional: `pip install highspy`) must import.
"""

from __future__ import annotations

import time

import numpy as np
import torch

MAX_BINARIES = 512          # unstable neurons (binaries); beyond it a MILP rarely finishes
MAX_WEIGHTS = 1 << 21       # nonzeros of the affine layers the model holds
OPTIONS = (("output_flag", False), ("threads", 1), ("random_seed", 0), ("presolve", "on"),
           ("mip_rel_gap", 0.0), ("mip_heuristic_effort", 0.0),
           ("mip_heuristic_run_feasibility_jump", False), ("mip_heuristic_run_rins", False),
           ("mip_heuristic_run_rens", False), ("mip_heuristic_run_root_reduced_cost", False))


def _highspy():
    try:
        import highspy
    except ImportError:
        return None
    return highspy


def _chain(net):
    """[(kind, node)] from the input to the output when every node is encodable and each
    takes the previous one, else None."""
    out, prev = [], None
    for n in net.nodes:
        if n.is_input:
            prev = n.name
            continue
        kind = getattr(type(n), "mip_encoding", None)
        if kind is None or tuple(n.inputs) != (prev,):
            return None
        if kind == "affine" and (len(n.in_shapes[0]) != 1 or len(n.shape) != 1):
            return None
        out.append((kind, n))
        prev = n.name
    return out if prev == net.output.name else None


def encodable(net, prior) -> bool:
    """Whether the MILP stage applies: an encodable chain, few enough unstable neurons (under
    `prior`, node -> (lower, upper)) and weights, and highspy installed."""
    chain = _chain(net)
    if not chain or _highspy() is None:
        return False
    unstable, weights = 0, 0
    for kind, n in chain:
        if kind == "relu":
            b = prior.get(n.inputs[0])
            if b is None:
                return False
            unstable += int(((b[0] < 0) & (b[1] > 0)).sum())
        elif kind == "affine":
            weights += int(n.param("weight").count_nonzero())
    return unstable <= MAX_BINARIES and weights <= MAX_WEIGHTS


class _Model:
    """The network over the box as HiGHS rows (float64 copies of the float32 parameters)."""

    def __init__(self, hs, net, prior, lo, hi):
        self.hs = hs
        self.h = h = hs.Highs()
        for k, v in OPTIONS:
            h.setOptionValue(k, v)
        self.n = 0
        self.inputs = cur = self._vars(lo, hi)
        # mag: a bound on |value| of every current variable (the margin's scale)
        self.mag = mag = np.maximum(np.abs(lo), np.abs(hi))
        for kind, node in _chain(net):
            if kind == "affine":
                w = node.param("weight").detach().double().cpu().numpy()
                b = node.param("bias")
                b = np.zeros(w.shape[0]) if b is None else b.detach().double().cpu().numpy()
                mag = np.abs(b) + np.abs(w) @ mag
                if node.name in prior:
                    lower, upper = (t.detach().double().reshape(-1).cpu().numpy()
                                    for t in prior[node.name])
                    mag = np.minimum(mag, np.maximum(np.abs(lower), np.abs(upper)))
                else:
                    lower, upper = -mag, mag
                cur = self._affine(w, b, cur, lower, upper)
            elif kind == "relu":
                cur = self._relu(cur, lower, upper)
        self.out, self.mag = cur, mag

    def _vars(self, lo, hi, integer=False):
        k = len(lo)
        self.h.addVars(k, np.asarray(lo, np.float64), np.asarray(hi, np.float64))
        idx = np.arange(self.n, self.n + k, dtype=np.int32)
        if integer:
            self.h.changeColsIntegrality(k, idx, np.full(k, self.hs.HighsVarType.kInteger))
        self.n += k
        return idx

    def _rows(self, lo, up, idx_rows, val_rows):
        starts = np.cumsum([0] + [len(r) for r in idx_rows[:-1]]).astype(np.int32)
        idx = np.concatenate(idx_rows).astype(np.int32)
        val = np.concatenate(val_rows).astype(np.float64)
        self.h.addRows(len(idx_rows), np.asarray(lo, np.float64), np.asarray(up, np.float64),
                       len(idx), starts, idx, val)

    def _affine(self, w, b, cur, lower, upper):
        z = self._vars(lower, upper)
        idx, val = [], []
        for j in range(w.shape[0]):
            nz = np.nonzero(w[j])[0]
            idx.append(np.r_[z[j], cur[nz]])
            val.append(np.r_[1.0, -w[j, nz]])
        self._rows(b, b, idx, val)                      # z - W x = b
        return z

    def _relu(self, z, lower, upper):
        inf = self.hs.kHighsInf
        a = self._vars(np.maximum(lower, 0), np.maximum(upper, 0))
        lo_r, up_r, idx, val = [], [], [], []
        for j in np.nonzero(lower >= 0)[0]:             # active: a = z
            lo_r.append(0.0); up_r.append(0.0); idx.append([a[j], z[j]]); val.append([1.0, -1.0])
        unstable = np.nonzero((lower < 0) & (upper > 0))[0]
        s = self._vars(np.zeros(len(unstable)), np.ones(len(unstable)), integer=True)
        for k, j in enumerate(unstable):                # inactive ones: a in [0, 0] already
            l, u = float(lower[j]), float(upper[j])
            lo_r += [0.0, -inf, -inf]
            up_r += [inf, -l, 0.0]
            idx += [[a[j], z[j]], [a[j], z[j], s[k]], [a[j], s[k]]]
            val += [[1.0, -1.0], [1.0, -1.0, -l], [1.0, -u]]  # a >= z, a <= z - l(1-s), a <= u s
        if idx:
            self._rows(lo_r, up_r, idx, val)
        return a


def margin(row_scale: np.ndarray) -> np.ndarray:
    """How far below the threshold a point must be ruled out for a refutation to count: the
    solver's tolerances times the sizes involved, with room to spare."""
    return 1e-3 + 1e-5 * row_scale


def refute(net, prior, lo, hi, C, d, owner, n_conj, open_conj, deadline, stop=None,
           order=None, stop_at_open=True):
    """(refuted (n_conj,) bool, candidates [flattened float64 inputs]) for the conjunctions
    `open_conj` (bool mask), C (rows, outputs) float64, d, owner as `SpecCase.stacked()`;
    each MILP gets twice an even share of the seconds left to `deadline` (time.monotonic();
    with `stop_at_open` a conjunction that uses it all ends the stage), taken highest
    `order` first (the root bound's margin: the easy ones end early and leave their
    time to the hard ones). `stop_at_open`: stop at the first conjunction left unrefuted
    (verify: the property is open then, whatever the rest do)."""
    hs = _highspy()
    lo64 = lo.detach().double().reshape(-1).cpu().numpy()
    hi64 = hi.detach().double().reshape(-1).cpu().numpy()
    C = np.asarray(C, np.float64)
    d = np.asarray(d, np.float64)
    refuted = np.zeros(n_conj, dtype=bool)
    candidates = []
    todo = [j for j in range(n_conj) if open_conj[j]]
    if order is not None:
        todo.sort(key=lambda j: (-float(order[j]), j))
    for k, j in enumerate(todo):
        left = deadline - time.monotonic()
        if left <= 0.05 or (stop is not None and stop()):
            break
        model = _Model(hs, net, prior, lo64, hi64)      # 0.02 s on mnistfc: no state carried
        h, out = model.h, model.out
        rows = np.nonzero(owner == j)[0]
        room = margin(np.abs(C[rows]) @ model.mag + np.abs(d[rows]))
        if len(rows) > 1:                               # the other rows: C_r y <= d_r + room
            model._rows(np.full(len(rows) - 1, -hs.kHighsInf), d[rows[1:]] + room[1:],
                        [out] * (len(rows) - 1), [C[r] for r in rows[1:]])
        cost = np.zeros(model.n)
        cost[out] = C[rows[0]]
        h.changeColsCost(model.n, np.arange(model.n, dtype=np.int32), cost)
        h.setOptionValue("objective_bound", float(d[rows[0]] + room[0]))
        h.setOptionValue("mip_max_improving_sols", 1)   # the first point found is the answer
        # twice an even share of what is left (all of it for the last): the stage stops at
        # the first conjunction it cannot refute, so the early ones must not be starved
        h.setOptionValue("time_limit", max(2 * left / (len(todo) - k + 1), 0.05))
        h.run()
        status = h.getModelStatus()
        if status == hs.HighsModelStatus.kInfeasible:
            refuted[j] = True
        elif h.getInfo().primal_solution_status == 2:   # a feasible point: try it
            x = np.asarray(h.getSolution().col_value)[model.inputs]
            candidates.append(np.clip(x, lo64, hi64))
        if stop_at_open and not refuted[j]:
            break
    return refuted, candidates
