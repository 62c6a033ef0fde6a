"""Rigorous IBP + CROWN over a compiled network, from the nodes' declared steps (core.py).

Per node in topological order: IBP from its step (rounded outward), then, for the nodes the
compiler's bound plan bounds by CROWN (`network.intermediate`) that are not a box or an affine
map of one (IBP is exact there), a backward pass for the neurons some relaxed consumer's
relaxation is inexact on (`inexact_inputs`); ReLU split assumptions are clamps on the bounds.
The backward pass sums each step's computed coefficients, charges and bias lower bounds, and
concretises over the input box from its centre and radius (core.box_lower: dot products with
a gamma allowance, one ulp down). float32 mode charges |Lambda| . delta at every node with a
float32 allowance.

The final pass may carry a Lagrangian (beta-CROWN's leaves, issue 17): the relaxations'
optimised parameters (alpha, any feasible value) and split multipliers beta >= 0 injected as
-beta s at each split neuron z (s = +1 for z >= 0, -1 for z <= 0), which bounds c.f(x) -
sum beta s z(x) <= c.f(x) on the domain: the same certificate as the engine's, re-evaluated
with the rounding accounted for.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from shardbound.runtime.errors import ShardboundError
from shardbound.runtime.rigorous import window
from shardbound.runtime.rigorous.core import (DT, RowAccount, absdot_upper, box_lower,
                                              dot_lower, down, step_class, up)

SOUNDNESS = ("default", "real", "float32")
ROW_CHUNK = 512          # intermediate rows bounded per backward pass, at most
ROW_BYTES = 256 << 20    # and fewer where a row's temporaries are large (a 52 x 52 conv)


def check_covered(network, soundness: str) -> None:
    """A one-line refusal naming the first node whose kernel declares no rigorous step, and a
    model in tp mode (zone ops hold slices)."""
    if soundness not in SOUNDNESS:
        raise ShardboundError(f"--soundness must be one of {', '.join(SOUNDNESS)}, got "
                              f"{soundness!r}")
    if soundness == "default":
        return
    if getattr(network, "tp", None) is not None:
        raise ShardboundError(f"--soundness {soundness}: not available in tp mode yet; use "
                              "--mode single or fsdp")
    for n in network.nodes:
        if step_class(n) is None:
            raise ShardboundError(
                f"--soundness {soundness}: node '{n.name}' ({n.kind}) is not covered by the "
                "rigorous error account yet (its kernel declares no rigorous step: "
                "runtime/rigorous/); use --soundness default")


def covered_kinds() -> list[str]:
    from shardbound.runtime.ops import OP_TYPES

    return sorted(k for k, cls in OP_TYPES.items() if step_class(cls) is not None)


class RigorousBounds:
    """Rigorous IBP + CROWN of a compiled network (see the module docstring)."""

    windowed = True      # grid nodes' rows over the windows they reach (window.py)

    def __init__(self, network, soundness: str):
        check_covered(network, soundness)
        self.float32 = soundness == "float32"
        self.nodes = [step_class(op)(op) for op in network.nodes]
        for n in self.nodes:
            n.float32 = self.float32
        self.by_name = {n.name: n for n in self.nodes}
        self.input = self.nodes[0]
        self.output = self.by_name[network.output.name]
        self.input_shape = network.input_shape
        self.relaxed_consumers = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            if n.op.relaxed:
                for i in n.inputs:
                    self.relaxed_consumers[i].append(n)
        # IBP is exact on a box and on an affine map of one: no CROWN there
        boxed, exact = {}, {}
        for n in self.nodes:
            if not n.inputs:
                boxed[n.name] = exact[n.name] = True
                continue
            boxed[n.name] = n.box == "view" and all(boxed[i] for i in n.inputs)
            exact[n.name] = boxed[n.name] or (n.box == "affine" and len(n.inputs) == 1
                                              and boxed[n.inputs[0]])
        per_row = 2 * 4 * 8 * max(n.row_elements() for n in self.nodes)    # lower + upper
        self.row_chunk = max(1, min(ROW_CHUNK, ROW_BYTES // per_row))
        self.crown_nodes = {name for name, how in network.intermediate.items()
                            if how == "crown" and name in exact and not exact[name]
                            and self.relaxed_consumers[name]}

    # -- concrete ------------------------------------------------------------------------------
    def forward64(self, x: torch.Tensor) -> torch.Tensor:
        """The network in float64 at x (B, n) flattened: (B, n_out) (rounded, not rigorous: the
        float64 confirmation of a counterexample)."""
        values = {}
        x = x.to(DT).reshape(-1, *self.input_shape)
        with torch.no_grad():
            for n in self.nodes:
                values[n.name] = n.forward([values[i] for i in n.inputs] if n.inputs else [x])
        return values[self.output.name].reshape(x.shape[0], -1)

    @staticmethod
    def outward(lower, upper):
        def as64(v):        # a copy: the spec's arrays are read-only
            if isinstance(v, torch.Tensor):
                return v.to(DT)
            return torch.from_numpy(np.array(v, dtype=np.float64))
        return down(as64(lower)), up(as64(upper))

    # -- bounds --------------------------------------------------------------------------------
    def _backward(self, target: str, L0: torch.Tensor, bounds, lo, hi, alphas=None,
                  extra=None, mags=None) -> torch.Tensor:
        """A rigorous lower bound (B, S) of L0 . value(target) over the boxes; `extra` (node ->
        (B, S, *shape)) is added to the coefficients arriving at a node (beta), `alphas`
        (node -> (B, S, ...)) go to the relaxations' steps. `mags`: a dict the row chunks of
        one node's bounds share (the magnitudes max(|l|, |h|) are the same for all of them,
        and a weighted step's |W| m is made once from the same tensor)."""
        B, S = L0.shape[:2]
        walk = RowAccount(target, L0, torch.zeros(B, S, dtype=DT), bounds,
                          {} if mags is None else mags, lambda a, b, name: a + b)
        stop = self.nodes.index(self.by_name[target])
        for n in reversed(self.nodes[:stop + 1]):
            if extra is not None and n.name in extra:
                walk.give(n.name, extra[n.name].to(DT), None)
            L = walk.acc.pop(n.name, None)
            if L is None:
                continue
            if not n.inputs:
                walk.gain(box_lower(L.reshape(B, S, -1), lo, hi))
                continue
            if self.float32:
                delta = self._delta[n.name]
                if delta is not None:
                    walk.charge(absdot_upper(L.reshape(B, S, -1), delta.reshape(B, 1, -1)))
            alpha = None if alphas is None else alphas.get(n.name)
            parts, bias = n.back(L, [bounds[i] for i in n.inputs],
                                 [walk.mag(i) for i in n.inputs], alpha)
            if bias is not None:
                walk.gain(bias)
            for name, (L_in, charge) in zip(n.inputs, parts):
                walk.give(name, L_in, charge)
        return torch.nan_to_num(walk.c, nan=-math.inf)

    def _inexact(self, n, bounds):
        """Bool (B, *shape): where some relaxed consumer of n loses something with n's bounds."""
        mask = torch.zeros_like(bounds[n.name][0], dtype=torch.bool)
        for consumer in self.relaxed_consumers[n.name]:
            given = [bounds[n.name] if i == n.name else None for i in consumer.inputs]
            rule = getattr(consumer, "inexact_inputs", consumer.op.inexact_inputs)
            for name, m in zip(consumer.inputs, rule(given)):
                if name == n.name and m is not None:
                    mask |= m
        return mask

    def _node_bounds(self, n, bounds, lo, hi, fresh=None):
        """CROWN lower and upper bounds of the neurons of n whose relaxation is inexact in
        some box, the rest kept; `fresh` (B,) bool: only those boxes (the others keep the
        bounds they have, which hold)."""
        if fresh is not None and not bool(fresh.all()):
            return self._some_boxes(n, bounds, lo, hi, fresh)
        l, h = bounds[n.name]
        B = l.shape[0]
        fl, fh = l.reshape(B, -1), h.reshape(B, -1)
        mask = self._inexact(n, bounds).reshape(B, -1)
        idx = torch.nonzero(mask.any(dim=0)).reshape(-1)
        if len(idx) == 0:
            return l, h
        M = fl.shape[1]
        new_l, new_h = fl.clone(), fh.clone()
        if self.windowed and window.is_grid(n.shape):
            self._window_rows(n, idx, bounds, lo, hi, new_l, new_h)
            return new_l.reshape(l.shape), new_h.reshape(h.shape)
        mags = {}
        counts = mask.sum(dim=1)
        if int(counts.max()) < len(idx):
            self._domain_rows(n, mask, counts, bounds, lo, hi, new_l, new_h, mags)
            return new_l.reshape(l.shape), new_h.reshape(h.shape)
        for at in range(0, len(idx), self.row_chunk):
            rows = idx[at:at + self.row_chunk]
            eye = torch.zeros(len(rows), M, dtype=DT)
            eye[torch.arange(len(rows)), rows] = 1.0
            L0 = torch.cat([eye, -eye]).unsqueeze(0).expand(B, -1, -1).reshape(B, 2 * len(rows),
                                                                               *n.shape)
            c = self._backward(n.name, L0, bounds, lo, hi, mags=mags)
            new_l[:, rows] = torch.maximum(new_l[:, rows], c[:, :len(rows)])
            new_h[:, rows] = torch.minimum(new_h[:, rows], -c[:, len(rows):])
        return new_l.reshape(l.shape), new_h.reshape(h.shape)

    def _some_boxes(self, n, bounds, lo, hi, fresh):
        """`_node_bounds` on the boxes `fresh` only, the others' bounds kept."""
        l, h = bounds[n.name]
        if not bool(fresh.any()):
            return l, h
        at = torch.nonzero(fresh).reshape(-1)
        sub = {k: (a.index_select(0, at), b.index_select(0, at)) for k, (a, b) in bounds.items()}
        held = self._delta
        self._delta = {k: None if v is None else v.index_select(0, at) for k, v in held.items()}
        try:
            sl, sh = self._node_bounds(n, sub, lo.index_select(0, at), hi.index_select(0, at))
        finally:
            self._delta = held
        l, h = l.clone(), h.clone()
        l[at], h[at] = sl, sh
        return l, h

    def _domain_rows(self, n, mask, counts, bounds, lo, hi, new_l, new_h, mags):
        """`_node_bounds` with each box's own inexact neurons as its rows (mask (B, M)), not
        the batch's union: branch and bound's domains differ in which neurons their splits
        and carried bounds leave unstable. Each box gets max(counts) rows per side, its own
        neurons in index order, then zero rows (their results are not used); a row's bound
        holds for its neuron whatever the other rows are."""
        B, M = mask.shape
        r = int(counts.max())
        # each box's inexact neurons first (index order), then the others: a permutation, so
        # the positions of one box are distinct
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :r]
        valid = torch.arange(r).unsqueeze(0) < counts.unsqueeze(1)
        for at in range(0, r, self.row_chunk):
            pos, ok = order[:, at:at + self.row_chunk], valid[:, at:at + self.row_chunk]
            k = pos.shape[1]
            eye = torch.zeros(B, k, M, dtype=DT)
            eye.scatter_(2, pos.unsqueeze(-1), ok.unsqueeze(-1).to(DT))
            L0 = torch.cat([eye, -eye], dim=1).reshape(B, 2 * k, *n.shape)
            c = self._backward(n.name, L0, bounds, lo, hi, mags=mags)
            cur_l, cur_h = new_l.gather(1, pos), new_h.gather(1, pos)
            new_l.scatter_(1, pos, torch.where(ok, torch.maximum(cur_l, c[:, :k]), cur_l))
            new_h.scatter_(1, pos, torch.where(ok, torch.minimum(cur_h, -c[:, k:]), cur_h))

    def _tile(self, n):
        """The largest spatial tile (side, rows per chunk) whose rows fit the row budget,
        from the windows a centre tile's rows reach (window.reach)."""
        C, H, W = n.shape
        for t in (16, 8, 4, 2, 1):
            if t > max(H, W):
                continue
            y0, x0 = max(0, (H - t) // 2), max(0, (W - t) // 2)
            wins = window.reach(self, n.name, (y0, x0, min(t, H), min(t, W)))
            cap = min(ROW_CHUNK, ROW_BYTES // (2 * 4 * 8 * window.row_elements(self, wins)))
            if 2 * C * t * t <= cap or t == 1:
                return t, max(1, cap // 2)
        raise AssertionError("unreachable")

    def _window_rows(self, n, idx, bounds, lo, hi, new_l, new_h, alphas=None):
        """`_node_bounds` / `_alpha_node_bounds` with windowed rows (window.py): the neurons
        idx of each spatial tile together, their A-matrices only over the windows they
        reach (`alphas`: op -> (B, 2 len(idx), ...), rows z_i then -z_i in idx's order)."""
        C, H, W = n.shape
        B = new_l.shape[0]
        k = len(idx)
        t, per_chunk = self._tile(n)
        self._window_mags = {}
        where = torch.arange(k)
        for (y0, x0, th, tw), pos_all in window.tiles(idx, n.shape, t, where):
            for at in range(0, len(pos_all), per_chunk):
                pos = pos_all[at:at + per_chunk]
                rows = idx[pos]
                r = len(rows)
                al = None if alphas is None else {
                    name: torch.cat([a[:, pos], a[:, k + pos]], dim=1)
                    for name, a in alphas.items()}
                ch, ys, xs = rows // (H * W), (rows % (H * W)) // W, rows % W
                eye = torch.zeros(r, C, th, tw, dtype=DT)
                eye[torch.arange(r), ch, ys - y0, xs - x0] = 1.0
                L0 = torch.cat([eye, -eye]).unsqueeze(0).expand(B, -1, -1, -1, -1)
                c = window.backward(self, n.name, window.Win(L0, y0, x0), bounds, lo, hi, al)
                new_l[:, rows] = torch.maximum(new_l[:, rows], c[:, :r])
                new_h[:, rows] = torch.minimum(new_h[:, rows], -c[:, r:])
        self._window_mags = None

    def _alpha_node_bounds(self, n, bounds, lo, hi, index, alphas):
        """n's bounds intersected with the backward passes of its neurons `index` (rows z_i,
        then -z_i) with the given relaxation parameters (op name -> (B, 2 len(index), ...)):
        full alpha-CROWN's intermediate passes, re-evaluated (any feasible alpha is sound)."""
        l, h = bounds[n.name]
        B = l.shape[0]
        new_l, new_h = l.reshape(B, -1).clone(), h.reshape(B, -1).clone()
        M, k = new_l.shape[1], len(index)
        if self.windowed and window.is_grid(n.shape) and k:
            self._window_rows(n, index, bounds, lo, hi, new_l, new_h, alphas)
            return new_l.reshape(l.shape), new_h.reshape(h.shape)
        mags = {}
        for at in range(0, k, self.row_chunk):
            rows = index[at:at + self.row_chunk]
            r = len(rows)
            eye = torch.zeros(r, M, dtype=DT)
            eye[torch.arange(r), rows] = 1.0
            L0 = torch.cat([eye, -eye]).unsqueeze(0).expand(B, -1, -1).reshape(B, 2 * r, *n.shape)
            al = {name: torch.cat([a[:, at:at + r], a[:, k + at:k + at + r]], dim=1)
                  for name, a in alphas.items()}
            c = self._backward(n.name, L0, bounds, lo, hi, al, mags=mags)
            new_l[:, rows] = torch.maximum(new_l[:, rows], c[:, :r])
            new_h[:, rows] = torch.minimum(new_h[:, rows], -c[:, r:])
        return new_l.reshape(l.shape), new_h.reshape(h.shape)

    def f32_deltas(self, bounds) -> None:
        """float32 mode: each node's evaluation allowance from `bounds` (node -> (lower,
        upper)), what `_backward` charges, as `all_bounds` sets it; real mode: none read."""
        self._delta = {}
        for n in self.nodes:
            if not self.float32 or not n.inputs or n.name not in bounds:
                self._delta[n.name] = None
                continue
            self._delta[n.name] = _f32_allowance(n, bounds)

    @staticmethod
    def _restrict(name, bound, prior, splits, cuts):
        """A node's bounds intersected with what is known to hold on the domain: `prior`
        (bounds of the whole box, rigorous), `cuts` (interval splits: the domain assumes
        the neuron in [a, b]) and `splits` (sign splits, as clamps at 0)."""
        l, h = bound
        for known in (prior, cuts):
            if known is not None and name in known:
                pl, ph = known[name]
                l = torch.maximum(l, pl.to("cpu", DT).reshape(-1, *l.shape[1:]))
                h = torch.minimum(h, ph.to("cpu", DT).reshape(-1, *h.shape[1:]))
        if splits is not None and name in splits:
            s = splits[name].to("cpu")
            l, h = torch.where(s > 0, l.clamp(min=0), l), torch.where(s < 0, h.clamp(max=0), h)
        return l, h

    def all_bounds(self, lo, hi, splits=None, prior=None, cuts=None, node_alphas=None,
                   check=None, fresh=None):
        """Rigorous bounds of every node over the boxes lo, hi (B, n) float64 (already
        outward), with ReLU split assumptions applied (name of a ReLU input -> int8 (B,
        *shape)), interval splits `cuts` (node -> (a, b) (B, *shape): the domain assumes a
        <= z <= b) and `prior` (node -> rigorous bounds over the whole box, (1, *shape))
        intersected in before the node is bounded by CROWN (fewer inexact neurons).
        `node_alphas` (node -> (neuron indices, {op: alphas})): full alpha-CROWN's
        intermediate passes, re-evaluated beside plain CROWN (both bounds hold). `check()`
        runs before each CROWN-bounded node (the verify budget's, which raises when spent).
        `fresh` (node -> (B,) bool): the boxes whose CROWN of that node is computed; the
        others keep what `cuts` and `prior` give (branch and bound's carried bounds, where
        no split before the node changed since they were computed)."""
        B = lo.shape[0]
        bounds = {}
        self._delta = {}
        for n in self.nodes:
            if not n.inputs:
                bounds[n.name] = (lo.reshape(B, *n.shape), hi.reshape(B, *n.shape))
                self._delta[n.name] = None
                continue
            ins = [bounds[i] for i in n.inputs]
            bounds[n.name] = n.ibp(ins, self.float32)
            if self.float32:
                self._delta[n.name] = _f32_allowance(n, bounds)
            bounds[n.name] = self._restrict(n.name, bounds[n.name], prior, splits, cuts)
            if n.name in self.crown_nodes:
                if check is not None:
                    check()
                bounds[n.name] = self._node_bounds(
                    n, bounds, lo, hi, None if fresh is None else fresh.get(n.name))
            if node_alphas and n.name in node_alphas:
                index, alphas = node_alphas[n.name]
                alphas = {k: a.detach().to("cpu", DT) for k, a in alphas.items()}
                bounds[n.name] = self._alpha_node_bounds(n, bounds, lo, hi,
                                                         index.to("cpu"), alphas)
        return bounds

    def spec_lower(self, lo, hi, C, splits=None, lagrangian=None, prior=None, cuts=None,
                   node_alphas=None, both=False, bounds=None) -> torch.Tensor:
        """(B, S) rigorous lower bounds of C . f(x) (C (S, n_out) float64, or (B, S, n_out):
        rows per box) over each box;
        +inf for a box that the split assumptions leave empty. `lagrangian` = (alphas, betas):
        the final pass's relaxation parameters (op name -> (B, S, ...)) and split multipliers
        (split node -> (B, S, *shape), >= 0; their split signs from `splits`). prior, cuts,
        node_alphas: see `all_bounds`. `both`: with a lagrangian, the plain CROWN pass too
        (each row keeps the larger; both hold). `bounds`: what `all_bounds` gave for these
        boxes with the same arguments (or tighter rigorous ones), reused (the CROWN stage's,
        verdict.py; branch and bound's carried ones, certificate.py). The node
        bounds used are left in `self.last_bounds`."""
        lo = lo.to(DT).reshape(lo.shape[0], -1)
        hi = hi.to(DT).reshape(hi.shape[0], -1)
        B = lo.shape[0]
        C = torch.as_tensor(C, dtype=DT)
        # (S, n_out): the same rows on every box; (B, S, n_out): each box its own rows (branch
        # and bound's (domain, row) pairs, certificate.py)
        Cb = C.unsqueeze(0).expand(B, -1, -1) if C.dim() == 2 else C
        alphas = extra = None
        if lagrangian is not None:
            alphas, betas = lagrangian
            # the engine's parameters may live on a GPU: the rigorous bounds are on the CPU
            alphas = {k: a.detach().to("cpu", DT) for k, a in (alphas or {}).items()}
            extra = {}
            for name, beta in (betas or {}).items():
                s = splits[name].to("cpu", DT).unsqueeze(1)
                extra[name] = -(beta.detach().to("cpu", DT).clamp(min=0) * s)
        with torch.no_grad():
            if bounds is None:
                bounds = self.all_bounds(lo, hi, splits, prior, cuts, node_alphas)
            else:       # float32: the allowances of these bounds, not the last call's
                self.f32_deltas(bounds)
            self.last_bounds = bounds
            L0 = Cb.reshape(B, Cb.shape[1], *self.output.shape)
            lb = self._backward(self.output.name, L0, bounds, lo, hi, alphas, extra)
            if both and lagrangian is not None:
                lb = torch.maximum(lb, self._backward(self.output.name, L0, bounds, lo, hi))
            ol, oh = bounds[self.output.name]
            sel = torch.where(Cb >= 0, ol.reshape(B, 1, -1), oh.reshape(B, 1, -1))
            lb = torch.maximum(lb, dot_lower(Cb, sel))
            empty = torch.zeros(B, dtype=torch.bool)
            for l, h in bounds.values():
                empty |= (l > h).reshape(B, -1).any(dim=1)
        return torch.where(empty.unsqueeze(1), torch.full_like(lb, math.inf), lb)

    def refuted(self, lo, hi, C, d, owner, n_conj, splits=None, lagrangian=None, **given
                ) -> torch.Tensor:
        """(B,) bool: every conjunction has a row whose rigorous lower bound is > d (`given`:
        spec_lower's prior, cuts, node_alphas, both, bounds)."""
        import numpy as np

        from shardbound.runtime.verification.input_split import refuted_conjunctions

        lb = self.spec_lower(lo, hi, C, splits, lagrangian, **given)
        # d as read is the float64 nearest a decimal: compare with the next float64 above it
        d_up = np.nextafter(np.asarray(d, np.float64), np.inf)
        return refuted_conjunctions(lb, d_up, owner, n_conj).all(dim=1)


def rigorous_box_bounds(verifier, lower, upper, soundness: str, lb, ub):
    """`run --box --soundness real|float32`: the rigorous bounds of every output (float32,
    rounded outward), intersected with nothing from the float32 engine (lb, ub give the
    result's shape)."""
    from shardbound.runtime.rigorous.core import to_float32_outward

    rig = RigorousBounds(verifier.network, soundness)
    lo = torch.as_tensor(lower, dtype=DT).reshape(-1, math.prod(verifier.input_shape))
    hi = torch.as_tensor(upper, dtype=DT).reshape(-1, math.prod(verifier.input_shape))
    lo, hi = rig.outward(lo, hi)
    m = math.prod(verifier.output_shape)
    eye = torch.eye(m, dtype=DT)
    both = rig.spec_lower(lo, hi, torch.cat([eye, -eye]))        # one pass: lower and upper
    l64, h64 = both[:, :m], -both[:, m:]
    l32, h32 = to_float32_outward(l64, h64)
    return l32.reshape(lb.shape), h32.reshape(ub.shape)


def _f32_allowance(n, bounds):
    """Node n's float32 evaluation allowance from the bounds (node -> (lower, upper)) of its
    inputs and of its own output: what `_backward` charges in float32 mode."""
    mags = [torch.maximum(bounds[i][0].abs(), bounds[i][1].abs()) for i in n.inputs]
    return n.f32_delta(mags, bounds[n.name])
