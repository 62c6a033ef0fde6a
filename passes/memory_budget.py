"""Plan for a memory budget: the first plan, in a fixed order, whose predicted peak fits.

`--memory-budget SIZE` is tracked bytes per rank (the ledger's measure: resident and gathered
parameters, A-matrices, bounds, alpha-CROWN's slopes and autograd). The planner enumerates
candidate plans in one documented order, predicts each one's per-rank peak with the memory
model (runtime/accounting/memory_model.py, the same function `run --json` reports as
`predicted_peak_tracked_bytes`) for every method the program must run, and takes the first
that fits. The order, cheapest change to the default plan first:

1. ranks P: the given --nproc only; else 1, 2, 3, ... up to MAX_RANKS (fewest ranks first);
2. mode: single for P = 1; for P > 1 fsdp, and tp too where the network has tp zones (the
   given --mode only, when one was given: fsdp or tp may then run on P = 1). When both fsdp
   and tp have a plan that fits on the same P, the one with the smaller predicted peak per
   rank is taken, fsdp on a tie (fsdp's bounds are single mode's whatever the intermediate
   method; tp's are with --tp-intermediate crown). tp is not offered with --summation exact
   (tp refuses it);
3. row tile: all of a rank's rows in one backward pass first, then tiles of 2^k rows, the
   largest first (smaller tiles: more, smaller kernel calls; the same bits under
   blocked/exact; in tp they cut the passes of nodes outside zones and the final pass);
4. stream chunk (fsdp with blocked/exact, which stream large weights): --stream-chunk-kib
   (default 4 MiB) first, then halved down to MIN_CHUNK, every layer alike (a plan chosen
   here fixes it; without a budget the chunk is chosen per layer: chunk_choice.py).

Everything is a pure function of the shapes and the options, so the choice is deterministic.
A P whose resident weights alone pass the budget is skipped without enumerating it. When no
candidate fits, the error names the smallest predicted peak over every P tried and what to do.
For verify (plan_methods holding alpha-crown), the plan also fixes the ReLU branch-and-bound
batch: the most domains per batch (from BAB_BATCHES) whose batched beta-CROWN round fits
(the "beta-crown" figure: runtime/accounting/beta_model.py; tp: alpha-CROWN's).

verify's default budget (no --memory-budget: `options.budget_source` says where it comes
from, runtime/accounting/available.py) plans in the mode and on the P the user asked for
(single, P=1 unless told otherwise): only row tiles, stream chunks and the batch are chosen,
never more ranks or another mode; the plan line and the error name the budget's source.

Method coverage comes from the memory model's registry (`METHOD_MODELS`): a method with a
registered figure is planned like CROWN; one without is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardbound.compiler.errors import ShardboundError
from shardbound.passes.annotations import Annotation
from shardbound.runtime.accounting.ledger import format_bytes
from shardbound.runtime.accounting.memory_model import METHOD_MODELS, predict_peak
from shardbound.runtime.parallel.params import STREAM_CHUNK_BYTES

MAX_RANKS = 64
from shardbound.runtime.accounting.chunk_choice import MIN_CHUNK  # noqa: E402  (one floor)
BAB_BATCHES = (32, 16, 8, 4, 2, 1)
BAB_METHOD = "beta-crown"       # the figure of a batched round (runtime/accounting/beta_model.py)


@dataclass(frozen=True)
class Candidate:
    mode: str
    nproc: int
    row_tile: int | None
    stream_chunk_bytes: int


@dataclass(frozen=True)
class BudgetPlan(Annotation):
    """The planner's choice (on the input node: `inspect` prints it, plan.json keeps it)."""

    budget: int
    mode: str
    nproc: int
    row_tile: int
    stream_chunk_kib: int
    resident_bytes: int
    peak_bytes: int
    method: str
    peak_node: str
    tried: int
    bab_batch: int = 0
    spec_rows: int = 0              # the property's rows planned for (0: one per output)
    source: str = ""                # verify's default budget: where it comes from

    def budget_text(self) -> str:
        if self.source:
            return f"memory budget {format_bytes(self.budget)} per rank ({self.source})"
        return f"--memory-budget {format_bytes(self.budget)} per rank"

    def as_json(self) -> dict:
        """verify --json's `plan`: the budget, where it comes from, and what it chose."""
        return {"budget_bytes": self.budget, "source": self.source or "--memory-budget",
                "mode": self.mode, "nproc": self.nproc, "row_tile": self.row_tile,
                "bab_batch": self.bab_batch, "predicted_peak_bytes": self.peak_bytes,
                "method": self.method, "peak_node": self.peak_node}

    def text(self) -> str:
        tile = f"row tile {self.row_tile}" if self.row_tile else "whole rows"
        chunk = f", stream chunk {self.stream_chunk_kib} KiB" if self.mode == "fsdp" else ""
        bab = f", bab batch {self.bab_batch}" if self.bab_batch else ""
        spec = f", {self.spec_rows} spec rows" if self.spec_rows else ""
        return (f"{self.budget_text()} -> {self.mode} P="
                f"{self.nproc}, {tile}{chunk}{bab}{spec}: predicted peak per rank "
                f"{format_bytes(self.peak_bytes)} ({self.method}, at {self.peak_node}), "
                f"resident {format_bytes(self.resident_bytes)}; candidate {self.tried} in "
                "order")


def _tiles(max_rows: int) -> list[int | None]:
    """None (whole rows), then powers of two below `max_rows`, largest first."""
    out: list[int | None] = [None]
    k = max(0, (max_rows - 1).bit_length() - 1)
    while k >= 0 and max_rows > 1:
        out.append(1 << k)
        k -= 1
    return out


def _chunks(options, mode: str, nproc: int) -> list[int]:
    first = options.stream_chunk_bytes or STREAM_CHUNK_BYTES
    if mode != "fsdp" or nproc == 1 or options.summation == "fast":
        return [first]
    out, c = [first], first // 2
    while c >= MIN_CHUNK:
        out.append(c)
        c //= 2
    return out


def _ranks(options) -> list[int]:
    if options.nproc_given or options.budget_source:    # the default budget keeps P
        return [options.nproc]
    if options.mode_given and options.mode == "fsdp":
        return list(range(1, MAX_RANKS + 1))
    if options.mode_given and options.mode == "single":
        return [1]
    return list(range(1, MAX_RANKS + 1))


def _modes_for(options, nproc: int, tp) -> list[str]:
    """The modes tried on `nproc` ranks (their candidates compete: see the module doc)."""
    if options.mode_given or options.budget_source:     # the default budget keeps the mode
        return [options.mode]
    if nproc == 1:
        return ["single"]
    return ["fsdp", "tp"] if tp is not None and tp.places else ["fsdp"]


def candidates(options, max_rows: int, nproc: int, mode: str | None = None):
    """The candidates of `mode` (default: the first mode tried) for `nproc` ranks, in the
    documented order."""
    mode = mode or _modes_for(options, nproc, None)[0]
    if mode == "single" and nproc > 1:
        return
    for tile in _tiles(max_rows):
        for chunk in _chunks(options, mode, nproc):
            yield Candidate(mode, nproc, tile, chunk)


def _methods(options) -> tuple[str, ...]:
    methods = tuple(options.plan_methods) or (options.method,)
    for m in methods:       # full alpha-CROWN: predict_peak's own figure
        if m not in ("ibp", "crown", "full-alpha-crown") and m not in METHOD_MODELS:
            raise ShardboundError(f"--memory-budget: the memory model has no figure for method "
                                  f"{m!r}; plan without a budget or choose another method")
    return methods


@dataclass(frozen=True)
class TpShapes:
    """The tp memory model's view of the network (passes/memory_plan.py tp_graph_shapes)."""

    shapes: list
    places: dict
    ibp: frozenset


def predict(shapes, output: str, cand: Candidate, options, method: str, batch: int = 1,
            spec_rows: int | None = None, tp: TpShapes | None = None) -> dict:
    """The memory model's per-rank prediction for one candidate plan."""
    if cand.mode == "tp":
        from shardbound.passes.memory_plan import predict_tp

        return predict_tp(tp.shapes, tp.places, set(tp.ibp), output, cand.nproc, options,
                          batch=batch, spec_rows=spec_rows, method=method,
                          row_tile=cand.row_tile)
    fsdp = cand.mode == "fsdp"
    return predict_peak(shapes, output, cand.nproc, batch=batch, spec_rows=spec_rows,
                        shard_rows=(options.summation != "fast") if fsdp else None,
                        method=method, stream_chunk_bytes=cand.stream_chunk_bytes,
                        row_tile=cand.row_tile, order=options.summation)


def _worst(shapes, output, cand, options, methods, spec_rows=None, tp=None) -> dict:
    preds = [dict(predict(shapes, output, cand, options, m, spec_rows=spec_rows, tp=tp),
                  method=m) for m in methods]
    return max(preds, key=lambda p: p["peak_tracked_bytes"])


def choose(shapes, output: str, options, source: str = "model", tp: TpShapes | None = None,
           spec_rows: int | None = None) -> BudgetPlan:
    """The first candidate whose predicted peak fits `options.memory_budget`, or a one-line
    ShardboundError with the smallest predicted peak. `tp`: the network as tp sees it (None:
    tp is not offered); `spec_rows`: the property's rows of the final pass (verify: its C
    rows; default `options.spec_rows`; None: the identity over the outputs)."""
    budget = int(options.memory_budget)
    if spec_rows is None:
        spec_rows = options.spec_rows
    if options.mode == "tp" and tp is None and (options.mode_given or options.budget_source):
        raise ShardboundError(f"{source}: --memory-budget with --mode tp: tp does not run "
                              f"--summation {options.summation}; plan with blocked or fast")
    methods = _methods(options)
    max_rows = max([math.prod(s.shape) for s in shapes if s.crown_bounds]
                   + [math.prod(shapes[-1].shape)] + [1] + [spec_rows or 1])
    max_rows = max(max_rows, max((math.prod(s.shape) for s in shapes if s.name == output),
                                 default=1))
    smallest = None
    tried = 0
    for P in _ranks(options):
        fits = []
        for mode in _modes_for(options, P, tp):
            ms = methods
            cands = list(candidates(options, max_rows, P, mode))
            if not cands:
                continue

            def worst(cand):
                return _worst(shapes, output, cand, options, ms, spec_rows, tp)

            floor = worst(cands[-1])            # smallest tile and chunk
            if smallest is None or (floor["peak_tracked_bytes"]
                                    < smallest[0]["peak_tracked_bytes"]):
                smallest = (floor, cands[-1])
            if floor["peak_tracked_bytes"] > budget:
                tried += len(cands)
                continue
            for cand in cands:
                tried += 1
                pred = worst(cand)
                if pred["peak_tracked_bytes"] <= budget:
                    fits.append((pred["peak_tracked_bytes"], len(fits), cand, pred, ms, tried))
                    break
        if fits:
            _, _, cand, pred, ms, at = min(fits)    # smaller peak; fsdp (listed first) on a tie
            return BudgetPlan(budget, cand.mode, cand.nproc, cand.row_tile or 0,
                              cand.stream_chunk_bytes // 1024,
                              int(pred["resident_param_bytes"]),
                              int(pred["peak_tracked_bytes"]), pred["method"],
                              pred["peak_node"], at,
                              _bab_batch(shapes, output, cand, options, budget, ms, tp,
                                         spec_rows), spec_rows or 0, options.budget_source)
    if smallest is None:
        raise ShardboundError(f"{source}: --memory-budget: no plan to try (mode "
                              f"{options.mode}, --nproc {options.nproc})")
    need, cand = smallest
    if options.budget_source:
        raise ShardboundError(
            f"{source}: no plan fits the memory budget {format_bytes(budget)} per rank "
            f"({options.budget_source}): the smallest predicted peak is "
            f"{format_bytes(need['peak_tracked_bytes'])} ({need['peak_tracked_bytes']} bytes: "
            f"{cand.mode} on P={cand.nproc}, row tile {cand.row_tile or 'all'}, "
            f"{need['method']}, at node {need['peak_node']!r}); free memory, give "
            "--mode fsdp --nproc P with a --memory-budget for more ranks, or run without a "
            "budget with --memory-budget none")
    more = (f"more ranks than --nproc {options.nproc}" if options.nproc_given
            else "fsdp instead of --mode single (its ranks share the weights)"
            if options.mode_given and options.mode == "single"
            else f"more than {MAX_RANKS} ranks")
    raise ShardboundError(
        f"{source}: no plan fits --memory-budget {format_bytes(budget)} per rank: the smallest "
        f"predicted peak is {format_bytes(need['peak_tracked_bytes'])} "
        f"({need['peak_tracked_bytes']} bytes: {cand.mode} on P={cand.nproc}, row tile "
        f"{cand.row_tile or 'all'}, {need['method']}, at node {need['peak_node']!r}); raise the "
        f"budget to at least that, plan for {more}, or bound with --method ibp")


def _bab_batch(shapes, output, cand, options, budget, methods, tp=None,
               spec_rows=None) -> int:
    """verify: the most branch-and-bound domains per batch whose run fits: beta-CROWN's
    figure when one is registered (BAB_METHOD), else alpha-CROWN's at that batch (a domain
    is one box of the batch: its slopes, bounds and A-matrices)."""
    if "alpha-crown" not in methods or not options.plan_methods:     # verify only
        return 0
    method = BAB_METHOD if BAB_METHOD in METHOD_MODELS and cand.mode != "tp" else "alpha-crown"
    for b in BAB_BATCHES:
        if predict(shapes, output, cand, options, method, batch=b, spec_rows=spec_rows, tp=tp)[
                "peak_tracked_bytes"] <= budget:
            return b
    return 1


def planned_options(plan: BudgetPlan, options):
    """`options` with the planner's choice in it (what the pipeline and codegen then use)."""
    return replace(options, mode=plan.mode, nproc=plan.nproc,
                   stream_chunk_bytes=plan.stream_chunk_kib * 1024,
                   row_tile=plan.row_tile or None, bab_batch=plan.bab_batch or None)
