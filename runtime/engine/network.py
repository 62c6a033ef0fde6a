"""The bound engine: concrete forward, IBP and CROWN over a list of ops in topological order.

A generated program builds a `Network` (one commented block per IR node) and everything else
(the CLI, `runtime.load`, tests) drives it through this class. CROWN is the backward linear
relaxation of Zhang et al. 2018 on a DAG: A-matrices flow from a target node back to the input,
summed where a node has several consumers; the nodes that feed a relaxed op (a ReLU, a
sigmoid, a max-pool: any op whose `relaxed` trait is set) get their bounds first, in
topological order, by CROWN or IBP as the compiler's bound plan says. CROWN is not always
tighter than IBP (deep nets, wide boxes), and both are sound, so every CROWN bound -- the
intermediate ones and the final one -- is intersected with the IBP bound of the same node.
Bounds may be infinite (an op whose input box leaves its domain); NaN, which arithmetic on
them can make, becomes the vacuous bound after every IBP step and CROWN pass (`vacuous_nan`).

Sparse intermediate bounds: a neuron's bounds matter only where a relaxed consumer loses
something with them (`inexact_mask`: a stable ReLU neuron's relaxation is exact whatever its
bounds), so CROWN bounds only the neurons that are inexact under the tightest bounds known
before it (IBP from the box, IBP recomputed from the CROWN-tightened bounds of earlier nodes,
and a branch-and-bound prior); the others keep those bounds. The rows are chosen from bounds
every rank holds alike (tp zone nodes agree through their own hook) and every kernel's rows
are independent, so the bits do not depend on P, threads or row batching. A backward pass starts from the target's own rows (`Op.unit_backward`:
rows of a weight matrix, no identity times weight), so a target that is an affine map of the
input (the first layer) is bounded from its weights alone, without a backward pass.
`crown_rows` records how many rows each pass propagated (`run --json` reports it).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from shardbound.runtime.errors import ShardboundError
from shardbound.runtime.accounting.guard import check_budget
from shardbound.runtime.accounting.ledger import MemoryLedger, tensor_bytes
from shardbound.runtime.engine.box_terms import box_terms
from shardbound.runtime.engine.interval_helpers import (StorageBytes, expand_rows, intersect,
                                                        interval_matvec, vacuous_nan)
from shardbound.runtime.ops import Bounds, Op
from shardbound.runtime.ops.patches import (Patches, SparseAlpha, WindowAlpha, as_patches, dense,
                                            frame)
from shardbound.runtime.parallel.rows import RowSplit, unit_rows

METHODS = ("ibp", "crown", "alpha-crown", "full-alpha-crown")


class Network:
    def __init__(self, nodes: Sequence[Op], output: str, intermediate: dict[str, str],
                 order: str = "fast"):
        """`intermediate` maps every node whose bounds a later relaxation needs to the method
        ("crown" or "ibp") that computes them when the final method is CROWN."""
        self.nodes = list(nodes)
        self.by_name = {n.name: n for n in self.nodes}
        self.input = self.nodes[0]
        self.output = self.by_name[output]
        self.intermediate = dict(intermediate)
        self.order = order
        self.ledger = MemoryLedger()
        self.rows = RowSplit()          # the loader enables row sharding in fsdp runs
        self.device = torch.device("cpu")   # where parameters live (the loader may move them)
        # input values compiled in as constants (runtime/program/fixed_inputs.py): every box
        # and point is checked against them
        self.fixed_inputs = None
        # tp sets this: "ibp" intermediate bounds start from the tightest bounds known so far
        # (CROWN-tightened ones included) instead of the plain IBP pass from the input box.
        self.refine_ibp = False
        self.tp = None                  # tp mode: the zone ops' shared context (runtime.tp)
        # Rows of intermediate passes over (C, H, W) nodes go in patches form (their
        # receptive fields: runtime/ops/patches.py) through the ops that take them; not in
        # tp (zone ops take dense channel slices) nor fsdp (the memory model, which fsdp
        # plans with, predicts dense rows). Bits are the same either way.
        self.patches = True
        # Rows propagated by the last bound computation: planned node -> neurons that CROWN's
        # backward pass bounded (0: none, or bounded from its own weights alone); the output
        # -> spec rows of the final pass. Zone nodes (tp) count this rank's neurons.
        self.crown_rows: dict[str, int] = {}
        self.bounded_rows: dict[str, int] = {}  # rows each pass started with (memory model)
        # Full alpha-CROWN's start nodes -> neurons whose rows carry alphas (the memory
        # model); None when the last run optimised nothing
        self.alpha_rows: dict[str, int] | None = None
        self.alpha_neurons: dict[str, int] = {}     # ops with SparseAlpha -> their neurons
        self.budget = None              # verify: a time budget checked per CROWN-bounded node
        # Sparse rows chosen under IBP recomputed from the CROWN-tightened bounds of earlier
        # nodes (fewer rows, as auto_LiRPA does; bounds equal or tighter on most models, but
        # CROWN's adaptive lines are not monotone in their input bounds, so some can come out
        # looser) or, off, under IBP from the box alone: then the bounds are bitwise those of
        # bounding every neuron (tests/test_sparse_rows.py). Off by default: the bounds are
        # then the dense path's in every order (issue 13's "bounds unchanged"), and orders
        # differ only by rounding; on is an opt-in for speed (bench resnet: 2.6x fewer rows).
        self.sharpen_rows = False
        # The most rows one backward pass propagates at once (None: all of this rank's):
        # intermediate passes and plain CROWN final passes go tile by tile. Rows are
        # independent in every kernel, so under blocked/exact the bits are those of one pass;
        # the planner (passes/memory_budget.py) sets it through plan.json to fit a budget.
        self.row_tile: int | None = None
        # How the memory model sees this run (the loader sets it: fsdp or not, the stream
        # chunk); with a ledger budget, `bounds` checks the predicted peak before it starts.
        self.memory_setup: dict | None = None
        self.relaxed_consumers: dict[str, list[Op]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            if n.relaxed:
                for i in n.inputs:
                    if n not in self.relaxed_consumers[i]:
                        self.relaxed_consumers[i].append(n)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.input.shape

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.output.shape

    # -- concrete semantics ------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, *input_shape) -> (B, *output_shape)."""
        if self.fixed_inputs is not None:
            self.fixed_inputs.check_box(x, x, "point")
        values: dict[str, torch.Tensor] = {}
        for n in self.nodes:
            values[n.name] = n.forward(*(values[i] for i in n.inputs)) if n.inputs else x
            n.release()
        return values[self.output.name]

    # -- interval bound propagation ----------------------------------------------------------
    def ibp_all(self, lower: torch.Tensor, upper: torch.Tensor) -> dict[str, Bounds]:
        bounds: dict[str, Bounds] = {}
        held = StorageBytes()
        for n in self.nodes:
            self.ledger.where = n.name
            if not n.is_view and n.inputs:
                self.ledger.reserve(2 * lower.shape[0] * math.prod(n.shape) * 4, "bounds")
            bounds[n.name] = (vacuous_nan(n.ibp(*(bounds[i] for i in n.inputs))) if n.inputs
                              else (lower, upper))
            n.release()
            self.ledger.set("bounds", held.add(bounds[n.name]))
        return bounds

    # -- CROWN -------------------------------------------------------------------------------
    def crown(self, lower: torch.Tensor, upper: torch.Tensor, C: torch.Tensor | None = None
              ) -> Bounds:
        """Bounds of C @ output for each box; C is (S, out) or (B, S, out); result (B, S)."""
        ibp, known = self.intermediate_bounds(lower, upper)
        return self.final_crown(ibp, known, lower, upper, C)

    def intermediate_bounds(self, lower, upper, splits=None, prior=None
                            ) -> tuple[dict[str, Bounds], dict[str, Bounds]]:
        """(IBP bounds of every node, planned bounds of the nodes that feed relaxed ops).

        `splits` (branch and bound) maps a node that feeds a splittable op to an int8 tensor
        (B, *shape): +1 where the domain assumes the neuron >= 0 (lower bound raised to 0),
        -1 where it assumes <= 0 (upper bound lowered to 0), 0 free. Clamped bounds feed every later
        relaxation, so the bounds hold on the sub-domain where the assumptions are true; a
        clamp can leave lower > upper, meaning that sub-domain is empty.

        `prior` (branch and bound) maps the same nodes to bounds (B, *shape) already known to
        hold on each box (its parent's: a sub-box of a box, or a sub-domain, keeps them). They
        are intersected in, and CROWN then runs only for the neurons whose relaxation is
        inexact in some box of the batch under prior and IBP: a stable ReLU neuron's
        relaxation is exact whatever its bounds, so its other rows would buy nothing
        (measured: most rows of a deep domain)."""
        ibp = self.ibp_all(lower, upper)
        known: dict[str, Bounds] = {}
        refined: dict[str, Bounds] = {}
        refine = self.refine_ibp and "ibp" in self.intermediate.values()
        # Sparse rows are chosen under the tightest bounds known so far: IBP recomputed from
        # the CROWN-tightened bounds of earlier nodes (where an input's bounds are still
        # IBP's, the node's are too and are reused).
        sharpen = (self.sharpen_rows and not refine
                   and "crown" in self.intermediate.values())
        self.crown_rows, self.bounded_rows = {}, {}
        held = StorageBytes()
        held.add(t for b in ibp.values() for t in b)
        for n in self.nodes:
            if refine:
                refined[n.name] = (vacuous_nan(n.ibp(*(refined[i] for i in n.inputs)))
                                   if n.inputs else (lower, upper))
                n.release()
            elif sharpen:
                if not n.inputs or all(refined[i] is ibp[i] for i in n.inputs):
                    refined[n.name] = ibp[n.name]
                else:
                    refined[n.name] = vacuous_nan(n.ibp(*(refined[i] for i in n.inputs)))
                    n.release()
            how = self.intermediate.get(n.name)
            if (refine or sharpen) and how is None:     # kept: later IBP starts from it
                held.add(refined[n.name])
            if how is None:
                continue
            if how == "crown" and self.budget is not None:
                self.budget.check()         # raises BudgetExhausted, alike on every rank
            base = ibp[n.name]
            if prior is not None and n.name in prior:
                base = intersect(base, prior[n.name])
            if n is self.input:             # a relaxed op on the input: the box is exact
                known[n.name] = base
            elif how == "ibp":
                known[n.name] = intersect(refined[n.name], base) if refine else base
            elif refine and (prior is None or n.name not in prior):
                # Later IBP bounds start from this node's (see refine_ibp), so every neuron's
                # bound matters, exact relaxation or not.
                known[n.name] = intersect(self.crown_node(n, lower, upper, known), base)
            else:
                if sharpen and refined[n.name] is not ibp[n.name]:
                    base = intersect(refined[n.name], base)
                known[n.name] = self._crown_unstable(n, lower, upper, known, base)
            if splits is not None and n.name in splits:
                lo, hi = known[n.name]
                s = splits[n.name]
                known[n.name] = (torch.where(s > 0, lo.clamp(min=0), lo),
                                 torch.where(s < 0, hi.clamp(max=0), hi))
            if refine or sharpen:
                refined[n.name] = known[n.name]
            self.ledger.set("bounds", held.add(known[n.name]))
        self.forget_lines()
        return ibp, known

    def forget_lines(self) -> None:
        """Drop the CROWN lines remembered for this round's row tiles (held past it: every
        ReLU's lines of a whole branch-and-bound batch, which no memory figure counts)."""
        for n in self.nodes:
            memo = n.__dict__.get("_crown_lines")
            if memo is not None:
                memo.clear()

    def final_crown(self, ibp, known, lower, upper, C=None, alphas=None, input_A=None,
                    lower_only: bool = False, gather: bool = True, split_A=None,
                    extra_A=None, alpha_layout=None) -> Bounds:
        """The last backward pass, from the output through C (with alpha slopes if given).
        Pass a dict as `input_A` to receive the lower-side A-matrix at the input ("lA");
        with `lower_only` the upper bound is not computed (returned as None); a dict as
        `split_A` receives the lower-side A-matrix reaching each (interval-)splittable op (by its name:
        branching scores its neurons with it); `extra_A` maps nodes to lower-side terms
        (B, S_local, *shape) added to the A-matrix reaching them (beta-CROWN's split
        multipliers). Under row
        sharding each rank propagates its slice of the spec rows; `gather=False` returns that
        slice (alpha-CROWN optimises it locally) instead of all rows."""
        B = lower.shape[0]
        spec = self._spec_matrix(C, B)
        S = spec.shape[1]
        a, b = self.rows.my_range(S)
        self.crown_rows[self.output.name] = S
        tile = self.row_tile
        if (tile and b - a > tile and alphas is None and input_A is None and split_A is None
                and extra_A is None):          # plain CROWN: the rows go tile by tile
            parts = [self.backward(self.output, spec[:, r:min(r + tile, b)], lower, upper,
                                   known, None, None, lower_only) for r in range(a, b, tile)]
            lo = torch.cat([p[0] for p in parts], dim=1)
            hi = None if lower_only else torch.cat([p[1] for p in parts], dim=1)
        else:
            lo, hi = self.backward(self.output, spec[:, a:b], lower, upper, known, alphas,
                                   input_A, lower_only, split_A, extra_A, alpha_layout)
        if alphas is None:
            self.forget_lines()
        ilo, ihi = self._ibp_spec(ibp[self.output.name], C, B)
        if not gather:
            return (torch.maximum(lo, ilo[:, a:b]),
                    None if hi is None else torch.minimum(hi, ihi[:, a:b]))
        if input_A is not None:
            input_A["lA"] = self.rows.gather(input_A["lA"], S)
        for name in (split_A or {}):
            split_A[name] = self.rows.gather(split_A[name], S)
        lo = self.rows.gather(lo, S)
        hi = None if hi is None else self.rows.gather(hi, S)
        return torch.maximum(lo, ilo), (None if hi is None else torch.minimum(hi, ihi))

    def relaxed_nodes(self) -> list[Op]:
        """Ops whose backward step relaxes (needs its input bounds)."""
        return [n for n in self.nodes if n.relaxed]

    def optimisable_nodes(self) -> list[Op]:
        """Relaxed ops with optimisable relaxation parameters (alpha)."""
        return [n for n in self.nodes if n.relaxed and n.has_alpha]

    def splittable_nodes(self) -> list[Op]:
        """Relaxed ops that branch and bound may split at 0 on their input."""
        return [n for n in self.nodes if n.relaxed and n.splittable]

    def interval_splittable_nodes(self) -> list[Op]:
        """Relaxed ops that branch and bound may split on their input interval."""
        return [n for n in self.nodes if n.relaxed and n.interval_splittable]

    def inexact_mask(self, node: Op, bounds: Bounds) -> torch.Tensor:
        """Bool (B, *node.shape): where some relaxed consumer of `node` loses something with
        these bounds on it (the neurons whose bounds are worth tightening)."""
        mask = torch.zeros_like(bounds[0], dtype=torch.bool)
        for consumer in self.relaxed_consumers.get(node.name, ()):
            for name, m in zip(consumer.inputs, consumer.inexact_inputs(
                    [bounds if i == node.name else None for i in consumer.inputs])):
                if name == node.name and m is not None:
                    mask |= m
        return mask

    def any_inexact(self, known: dict[str, Bounds]) -> bool:
        """Whether any optimisable op's relaxation loses something under `known` (else
        optimising its parameters cannot change a bound)."""
        for n in self.optimisable_nodes():
            if any(bool(m.any()) for m in n.inexact_inputs([known.get(i) for i in n.inputs])
                   if m is not None):
                return True
        return False

    def rows_over_ranks(self, every: list[dict]) -> dict[str, int]:
        """`crown_rows` of the whole job from every rank's (in rank order): a tp zone node's
        counts are its ranks' own neurons, so they add up; every other count is the same on
        every rank."""
        out = dict(every[0]) if every else {}
        for name in out:
            if hasattr(self.by_name[name], "crown_bounds"):
                out[name] = sum(rows.get(name, 0) for rows in every)
        return out

    # -- neurons held by this rank (tp zone nodes hold a channel slice) ------------------------
    def neuron_range(self, node: Op) -> tuple[int, int, int]:
        """(start, stop, total): the flat indices of `node`'s neurons that this rank holds."""
        if hasattr(node, "neuron_range"):
            return node.neuron_range()
        n = math.prod(node.shape)
        return 0, n, n

    def gather_neurons(self, node: Op, t: torch.Tensor) -> torch.Tensor:
        """(b, this rank's neurons of `node`) -> (b, all its neurons), the same on every rank."""
        return node.gather_neurons(t) if hasattr(node, "gather_neurons") else t

    def any_over_ranks(self, flags: torch.Tensor) -> torch.Tensor:
        """A bool tensor OR-ed over ranks: decisions taken from rank-local neurons (tp) must
        agree so that every rank takes the same branch."""
        if self.tp is None:
            return flags
        return self.tp.comm.all_reduce_max(flags.to(torch.float32)) > 0

    def _ibp_spec(self, out_bounds: Bounds, C, B: int) -> Bounds:
        lo, hi = out_bounds[0].reshape(B, -1), out_bounds[1].reshape(B, -1)
        if C is None:
            return lo, hi
        return vacuous_nan(interval_matvec(self._spec_matrix(C, B).reshape(B, -1, lo.shape[1]),
                                             lo, hi, self.order))

    def crown_node(self, node: Op, lower, upper, known, index=None) -> Bounds:
        """CROWN bounds of every neuron of `node`, reshaped to it; with `index` (flat neuron
        indices), of those neurons only: (B, len(index)). The pass starts from the node's own
        rows (`unit_backward`), so no identity A-matrix is built where the op can do without
        one. A tp zone node (holding a slice of its neurons) bounds its own slice
        (runtime.tp)."""
        if hasattr(node, "crown_bounds"):
            out = node.crown_bounds(self, lower, upper, known, index)
            self.crown_rows[node.name] = (math.prod(node.shape) if index is None
                                          else len(index))
            # the rows of this rank's largest pass (P row tiles or its own neurons)
            self.bounded_rows[node.name] = getattr(node, "pass_rows", self.crown_rows[node.name])
            return out
        B = lower.shape[0]
        size = math.prod(node.shape)
        rows = size if index is None else len(index)
        a, b = self.rows.my_range(rows)
        chosen = (torch.arange(a, b) if index is None else torch.as_tensor(index)[a:b])
        lo, hi, propagated = self._tiled_rows_pass(node, chosen, lower, upper, known)
        self.crown_rows[node.name] = rows if propagated else 0
        self.bounded_rows[node.name] = rows
        both = self.rows.gather(torch.stack([lo, hi], dim=-1), rows)
        if index is not None:
            return both[..., 0], both[..., 1]
        return both[..., 0].reshape(B, *node.shape), both[..., 1].reshape(B, *node.shape)

    def _tiled_rows_pass(self, node: Op, chosen: torch.Tensor, lower, upper, known):
        """`_rows_pass` over `chosen` in tiles of at most `row_tile` rows, concatenated."""
        tile = self.row_tile
        if not tile or len(chosen) <= tile:
            return self._rows_pass(node, chosen, lower, upper, known)
        parts = [self._rows_pass(node, chosen[i:i + tile], lower, upper, known)
                 for i in range(0, len(chosen), tile)]
        return (torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1),
                any(p[2] for p in parts))

    def _rows_pass(self, node: Op, chosen: torch.Tensor, lower, upper, known):
        """(lower, upper, propagated) of the neurons `chosen` of `node`: the node's own
        backward step on its unit rows (closed form where the op has one), then the pass
        through the rest of the network; `propagated` is False when nothing but the input was
        left after the first step (an affine map of the box: bounded from its weights)."""
        B = lower.shape[0]
        # A view keeps the element order: its unit rows are its input's, at the same indices.
        while node.is_view and len(node.inputs) == 1 and node.inputs[0] != self.input.name:
            node = self.by_name[node.inputs[0]]
        patches = len(node.shape) == 3 and self._patches_ok()
        start = (None if node.relaxed
                 else node.unit_backward(chosen.to(lower.device), patches=patches))
        if start is None:
            if patches and node.accepts_patches:
                A = Patches.unit(chosen, node.shape, lower.dtype, lower.device)
            else:
                A = unit_rows(chosen, math.prod(node.shape), lower.dtype, lower.device)
                A = A.reshape(1, len(chosen), *node.shape)
            lo, hi = self.backward(node, expand_rows(A, B), lower, upper, known)
            return lo, hi, True
        A_ins, bias = start
        k = len(chosen)
        starts = {}
        for name, A in zip(node.inputs, A_ins):
            if A is None:
                continue
            A = expand_rows(A, B)
            starts[name] = A if name not in starts else starts[name] + A
        l_bias = torch.zeros(B, k, dtype=lower.dtype, device=lower.device)
        if bias is not None:
            l_bias = l_bias + bias
        node.release()
        steps = []
        lo, hi = self._propagate(node, starts, {n: A for n, A in starts.items()}, l_bias,
                                 l_bias, lower, upper, known, steps=steps)
        return lo, hi, any(not n.is_view for n in steps)

    def _patches_ok(self) -> bool:
        if not self.patches or self.tp is not None:
            return False
        return all(isinstance(p, torch.Tensor) or p is None          # fsdp holds shards
                   for n in self.nodes for p in n.params.values())

    def _crown_unstable(self, node: Op, lower, upper, known, base: Bounds) -> Bounds:
        """`base` tightened by CROWN on the neurons whose relaxation is inexact under it in
        some box (see `inexact_mask`)."""
        B = lower.shape[0]
        blo, bhi = base[0].reshape(B, -1), base[1].reshape(B, -1)
        index = torch.nonzero(self.inexact_mask(node, base).reshape(B, -1).any(dim=0)).reshape(-1)
        # A tp zone node may have to join collectives even with no neuron of its own to bound.
        if len(index) == 0 and not hasattr(node, "crown_bounds"):
            self.crown_rows[node.name] = self.bounded_rows[node.name] = 0
            return base
        clo, chi = self.crown_node(node, lower, upper, known, index.cpu())
        lo, hi = blo.clone(), bhi.clone()
        lo[:, index] = torch.maximum(blo[:, index], clo)
        hi[:, index] = torch.minimum(bhi[:, index], chi)
        return lo.reshape(base[0].shape), hi.reshape(base[1].shape)

    def backward(self, target: Op, A: torch.Tensor, lower, upper, known, alphas=None,
                 input_A=None, lower_only: bool = False, split_A=None, extra_A=None,
                 alpha_layout: dict | None = None) -> Bounds:
        """Propagate A (B, S, *target.shape) back to the input and concretise over the box.
        With `lower_only`, the upper side is skipped and returned as None. `alpha_layout`:
        see `_propagate`."""
        B, S = A.shape[:2]
        l_bias = torch.zeros(B, S, dtype=A.dtype, device=A.device)
        u_bias = torch.zeros(B, S, dtype=A.dtype, device=A.device)
        return self._propagate(target, {target.name: A},
                               {target.name: None if lower_only else A}, l_bias, u_bias,
                               lower, upper, known, alphas, input_A, split_A, extra_A,
                               alpha_layout=alpha_layout)

    def _propagate(self, target: Op, lAs: dict, uAs: dict, l_bias, u_bias, lower, upper, known,
                   alphas=None, input_A=None, split_A=None, extra_A=None, steps=None,
                   alpha_layout: dict | None = None) -> Bounds:
        """The backward pass from A-matrices standing at nodes up to `target` (lAs / uAs by
        node name; uAs None: lower side only) and the bias terms gathered so far, down to the
        input, concretised over the box. `steps`, a list, receives the ops stepped through.

        `alpha_layout` (full alpha-CROWN, runtime/engine/full_alpha.py) says how the alphas of
        the ops it names are laid out, instead of (B, S, *op shape): a Patches frame (the
        windows of the rows in patches form that reach the op: alphas (B, S, C, ph, pw),
        `WindowAlpha`, so the rows stay in patches form through it), or flat input indices
        (alphas (B, S, k) of those neurons only, `SparseAlpha`). Without `alphas` the pass
        fills it with the frames of every optimisable op that patches reach."""
        self.ledger.set("a_matrix", tensor_bytes([*lAs.values(), *uAs.values()]))
        lower_only = all(A is None for A in uAs.values())
        stop = self.nodes.index(target)
        # dense rows may become patches again (plain CROWN only: alpha layouts are fixed)
        local = [alphas is None and alpha_layout is None and split_A is None
                 and extra_A is None and self._patches_ok()]
        for n in reversed(self.nodes[:stop + 1]):
            if n is self.input:
                continue
            if n.name not in lAs:
                if extra_A is None or n.name not in extra_A:
                    continue
                # no A reaches n (a discrete op cut every path), but a split term starts here
                lAs[n.name] = torch.zeros_like(extra_A[n.name])
                uAs[n.name] = None if lower_only else torch.zeros_like(extra_A[n.name])
            lA, uA = lAs.pop(n.name), uAs.pop(n.name)
            if extra_A is not None and n.name in extra_A:
                lA = lA + extra_A[n.name]
            alpha = alphas.get(n.name) if alphas else None
            if alpha_layout is not None and isinstance(lA, Patches) and n.has_alpha:
                if alphas is None:
                    alpha_layout[n.name] = frame(lA.origin, lA.window, lA.node_shape,
                                                  lA.dtype, lA.device)
                elif alpha is not None and isinstance(alpha_layout.get(n.name), Patches):
                    if not torch.equal(lA.origin, alpha_layout[n.name].origin):
                        raise RuntimeError(f"{n.name}: rows reach it at other windows than "
                                           "its alphas were laid out for")
                    alpha = WindowAlpha(alpha)
            if alpha is not None and alpha_layout is not None and isinstance(
                    alpha_layout.get(n.name), torch.Tensor):
                alpha = SparseAlpha(alpha, alpha_layout[n.name])
            if local[0] and n.accepts_patches and len(n.shape) == 3:
                lA, uA = as_patches(n.shape, lA, uA, local)
            if (isinstance(lA, Patches) or isinstance(uA, Patches)) and (
                    not n.accepts_patches or (alpha is not None
                                              and not isinstance(alpha, WindowAlpha))
                    or (split_A is not None and (n.splittable or n.interval_splittable))):
                lA, uA = (dense(lA),) * 2 if uA is lA else (dense(lA), dense(uA))
            in_bounds = [known.get(i) for i in n.inputs]
            if split_A is not None and (n.splittable or n.interval_splittable):
                split_A[n.name] = lA
            self.ledger.where = n.name
            self._reserve_step(n, lA, uA)
            l_in, u_in, lb, ub = n.crown_backward(lA, uA, in_bounds, alpha=alpha)
            if steps is not None:
                steps.append(n)
            # The step's inputs, outputs and gathered parameters are all alive here.
            self.ledger.set("a_matrix", tensor_bytes([*lAs.values(), *uAs.values(), lA, uA,
                                                      *l_in, *u_in]))
            n.release()
            if lb is not None:
                l_bias = l_bias + lb
            if ub is not None:
                u_bias = u_bias + ub
            for name, la, ua in zip(n.inputs, l_in, u_in):
                if la is None and ua is None:   # zero: the op's lines are constants there
                    continue
                if name in lAs:
                    lAs[name] = lAs[name] + la
                    uAs[name] = None if ua is None else uAs[name] + ua
                else:
                    lAs[name], uAs[name] = la, ua
            self.ledger.set("a_matrix", tensor_bytes([*lAs.values(), *uAs.values(), *l_in, *u_in]))
        if self.input.name not in lAs:  # no path to the input passes an A (discrete ops)
            shape = (l_bias.shape[0], l_bias.shape[1], *self.input.shape)
            lAs[self.input.name] = l_bias.new_zeros(shape)
            uAs[self.input.name] = None if lower_only else lAs[self.input.name]
        lA, uA = lAs[self.input.name], uAs[self.input.name]
        if input_A is not None:
            input_A["lA"] = dense(lA)
        if uA is lA:                    # one A for both sides (an affine map of the box)
            mid, spread = self._box_terms(lA, lower, upper)
            lo, hi = mid - spread + l_bias, mid + spread + u_bias
        else:
            mid, spread = self._box_terms(lA, lower, upper)
            lo = mid - spread + l_bias
            hi = None
            if uA is not None:
                mid, spread = self._box_terms(uA, lower, upper)
                hi = mid + spread + u_bias
        self.ledger.set("a_matrix", 0)      # this pass's A-matrices are dropped now
        lo = torch.where(torch.isnan(lo), -math.inf, lo)
        return lo, None if hi is None else torch.where(torch.isnan(hi), math.inf, hi)

    def _reserve_step(self, n: Op, lA, uA) -> None:
        """Ask the ledger's budget for the A-matrices the step of `n` is about to make (dense
        rows: B x S x each input's elements; one tensor when both sides share, none for a
        view), so a run that cannot fit stops before allocating them."""
        if self.ledger.budget is None or n.is_view:
            return
        B, S = lA.shape[:2]
        sides = 1 if (uA is None or (uA is lA and n.backward_memory == "shared")) else 2
        self.ledger.reserve(sides * B * S * 4 * sum(math.prod(self.by_name[i].shape)
                                                    for i in n.inputs))

    def _concretize(self, A, lower, upper, lower_side: bool) -> torch.Tensor:
        """min (or max) of A x over the box: A.center -/+ |A|.radius, per row."""
        mid, spread = self._box_terms(A, lower, upper)
        return mid - spread if lower_side else mid + spread

    def _box_terms(self, A, lower, upper) -> Bounds:
        """(A.center, |A|.radius) per row in this network's summation order (box_terms.py)."""
        return box_terms(A, lower, upper, self.order)

    def _spec_matrix(self, C, B: int) -> torch.Tensor:
        out = math.prod(self.output_shape)
        if C is None:
            C = torch.eye(out)
        C = torch.as_tensor(C, dtype=torch.float32).to(self.device)
        given = tuple(C.shape)
        if C.dim() == 2:
            C = C.unsqueeze(0).expand(B, *C.shape)
        if C.dim() != 3 or C.shape[0] != B or C.shape[2] != out:
            raise ShardboundError(
                f"spec matrix C has shape {given}; expected (S, {out}) or ({B}, S, {out})")
        if not bool(torch.isfinite(C).all()):
            raise ShardboundError("spec matrix C holds a non-finite value (inf or nan); its rows "
                                  "must be finite linear functions of the outputs")
        return C.reshape(B, C.shape[1], *self.output_shape).contiguous()

    # -- one entry point -----------------------------------------------------------------------
    def bounds(self, lower: torch.Tensor, upper: torch.Tensor, C=None, method: str = "crown"
               ) -> Bounds:
        """Bounds (B, S) of C @ f(x) over the boxes; lower/upper are (B, *input_shape)."""
        if self.fixed_inputs is not None:
            self.fixed_inputs.check_box(lower, upper)
        try:
            check_budget(self, lower, C, method)
            return self._bounds(lower, upper, C, method)
        finally:
            self.ledger.set("bounds", 0)        # intermediate bounds are dropped on return
            self.ledger.set("a_matrix", 0)

    def _bounds(self, lower, upper, C, method) -> Bounds:
        if method == "ibp":
            return self._ibp_spec(self.ibp_all(lower, upper)[self.output.name], C, lower.shape[0])
        if method == "crown":
            return self.crown(lower, upper, C)
        if method == "alpha-crown":     # the final pass's alphas (tp's alpha-CROWN too)
            from shardbound.runtime.engine.alpha import alpha_crown

            return alpha_crown(self, lower, upper, C)
        if method == "full-alpha-crown":    # alphas per start node (tp: zone nodes too)
            from shardbound.runtime.engine.full_alpha import full_alpha_crown

            return full_alpha_crown(self, lower, upper, C)[:2]
        raise ShardboundError(f"unknown bound method {method!r}; choose one of {', '.join(METHODS)}")
