"""The run-time guard of `--memory-budget`, before a run starts.

The ledger (ledger.py) stops a run the moment its tracked bytes would pass the budget; this
check comes first: it predicts the run's per-rank peak with the memory model (every neuron
bounded: the most a run can take) and refuses a run that cannot fit before anything is
allocated, naming the node of the predicted peak. Every rank predicts the same number (the
model is per rank; tp: every rank predicts the largest rank's peak, tp_model.py), so every
rank of a job stops alike, without a collective. `Network.bounds` checks its boxes and spec;
verify's stages check each case's own C rows (runtime/verification/verdict.py).
"""

from __future__ import annotations

import math

from shardbound.runtime.accounting.ledger import MemoryBudgetExceeded, format_bytes
from shardbound.runtime.accounting.memory_model import METHOD_MODELS, network_shapes, predict_peak


def check_budget(network, lower, C, method: str) -> None:
    """Raise MemoryBudgetExceeded when `network`'s run of `method` over the boxes `lower`
    (B, ...) with spec C cannot fit the ledger's budget (no budget, or a method without a
    memory model: nothing to check here; the ledger still guards). tp: the largest rank's
    prediction, so every rank stops alike."""
    budget = network.ledger.budget
    setup = network.memory_setup
    if budget is None or setup is None:
        return
    if method not in ("ibp", "crown") and method not in METHOD_MODELS:
        return
    B = lower.shape[0]
    S = (math.prod(network.output_shape) if C is None
         else int(C.shape[-2]) if hasattr(C, "shape") else len(C))
    comm = getattr(network, "comm", None)
    world = comm.world if comm is not None else 1
    if network.tp is not None:
        pred = _tp_prediction(network, world, B, S, method)
    else:
        pred = predict_peak(network_shapes(network), network.output.name, world, batch=B,
                            spec_rows=S, method=method,
                            shard_rows=network.rows.enabled if setup["fsdp"] else None,
                            stream_chunk_bytes=setup["stream_chunk_bytes"],
                            row_tile=network.row_tile, order=network.order)
    need = pred["peak_tracked_bytes"]
    if need > budget:
        raise MemoryBudgetExceeded(
            f"memory budget exceeded: this {method} run needs {format_bytes(need)} per rank "
            f"({need} bytes predicted, peak at node {pred['peak_node']!r} in phase "
            f"{pred['peak_phase']}) of a budget of {format_bytes(budget)} ({budget} bytes); "
            "stopped before allocating. Recompile with --memory-budget for a plan that fits "
            "(more ranks, row tiles), or raise the budget")


def _tp_prediction(network, world: int, B: int, S: int, method: str) -> dict:
    """tp: the largest rank's prediction (tp_model.py), the same on every rank; the split of
    each zone is the one its Reduction made (runtime/parallel/tp_reduce.py)."""
    from shardbound.runtime.accounting import tp_model

    reductions = list(network.tp.zones.values())

    def ranges(channels, P):
        return type(reductions[0]).channel_ranges(channels, P)

    nodes, places = tp_model.network_places(network)
    return tp_model.predict_tp_peak(nodes, places, network.output.name, world, ranges,
                                    order=network.order, batch=B, spec_rows=S, method=method,
                                    row_tile=network.row_tile, refine=tp_model.refines(network),
                                    ibp_planned=tp_model.ibp_planned(network))
