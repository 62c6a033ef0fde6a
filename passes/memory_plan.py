"""memory_plan: the predicted per-rank memory of a CROWN run, for the world sizes of interest.

It replays the bound computation on shapes (shardbound.runtime.accounting.memory_model, the same model
`run --json` reports next to the measured ledger; tp mode: runtime/accounting/tp_model.py, the
largest rank's) for P = 1, 2, 4 and the `--nproc` asked for, with one box and the identity
spec. The result is attached to the input node, so `inspect` prints it and plan.json carries it.
In fsdp without --stream-chunk-kib it first chooses each streamable layer's stream chunk for
each of those P (runtime/accounting/chunk_choice.py), predicts with them and records them
(the `stream` annotation: plan.json's `stream_chunks`, which the runtime uses).
"""

from __future__ import annotations

from shardbound.compiler.ir import Graph
from shardbound.passes.annotations import MemoryPrediction, RankMemory, StreamChunks
from shardbound.runtime.accounting.chunk_choice import choose_chunks
from shardbound.runtime.accounting.memory_model import NodeShape, predict_peak
from shardbound.runtime.parallel.params import STREAM_CHUNK_BYTES


def graph_shapes(graph: Graph) -> list[NodeShape]:
    """The memory model's view of the IR (after bound_plan: which nodes CROWN bounds)."""
    return _shapes(graph)


def _shapes(graph: Graph) -> list[NodeShape]:
    plan = graph.annotations.get("bounds", {})
    return [NodeShape(n.name, n.op, n.inputs, n.shape,
                      tuple(int(graph.tensors[k].size) for _, k in n.params),
                      getattr(plan.get(n.name), "method", None) == "crown",
                      next((tuple(graph.tensors[k].shape) for role, k in n.params
                            if role == "weight"), ())) for n in graph.nodes]


def tp_graph_shapes(graph: Graph) -> tuple[list[NodeShape], dict, set]:
    """The tp memory model's view of the IR after tp_zones: whole shapes, each zone node's
    TpPlace, and the nodes whose planned bounds are IBP's."""
    from shardbound.runtime.accounting.tp_model import TpPlace, sliced_params

    notes = graph.annotations.get("tp", {})
    places = {}
    for n in graph.nodes:
        p = notes.get(n.name)
        if p is None or p.role not in ("column", "elementwise", "row"):
            continue
        params = [(role, tuple(graph.tensors[k].shape)) for role, k in n.params]
        places[n.name] = TpPlace(p.role, p.zone, p.channels, p.local_rows,
                                 sliced_params(p.role, n.shape, p.channels, params))
    plan = graph.annotations.get("bounds", {})
    ibp = {name for name, b in plan.items() if getattr(b, "method", None) == "ibp"}
    return _shapes(graph), places, ibp


def predict_tp(shapes, places, ibp, output: str, P: int, options, **kw) -> dict:
    """tp_model.predict_tp_peak for the IR of a tp program (every neuron: no box yet)."""
    from functools import partial

    from shardbound.runtime.accounting.tp_model import predict_tp_peak
    from shardbound.runtime.parallel.tp_reduce import channel_ranges

    return predict_tp_peak(shapes, places, output, P, partial(channel_ranges, options.summation),
                           order=options.summation, refine=bool(ibp), ibp_planned=ibp, **kw)


def memory_plan(graph: Graph, options) -> Graph:
    if options.mode == "tp":
        shapes, places, ibp = tp_graph_shapes(graph)
        parts = []
        for P in sorted({1, 2, 4, max(1, int(options.nproc))}):
            pred = predict_tp(shapes, places, ibp, graph.output, P, options,
                              row_tile=getattr(options, "row_tile", None))
            parts.append(RankMemory(P, int(pred["resident_param_bytes"]),
                                    int(pred["peak_tracked_bytes"])))
        return graph.annotate("memory", {graph.input.name: MemoryPrediction(tuple(parts))})
    shapes = _shapes(graph)
    fsdp = options.mode == "fsdp"
    shard_rows = (options.summation != "fast") if fsdp else None
    worlds = sorted({1, 2, 4, max(1, int(options.nproc))}) if fsdp else [1]
    tile = getattr(options, "row_tile", None)
    chunks = {P: options.stream_chunk_bytes for P in worlds}
    if fsdp and options.stream_chunk_bytes is None:     # chosen per layer and P
        chunks = {P: choose_chunks(shapes, graph.output, P, STREAM_CHUNK_BYTES,
                                   options.summation, tile) for P in worlds}
    parts = []
    for P in worlds:
        pred = predict_peak(shapes, graph.output, P, shard_rows=shard_rows,
                            stream_chunk_bytes=chunks[P], row_tile=tile)
        parts.append(RankMemory(P, int(pred["resident_param_bytes"]),
                                int(pred["peak_tracked_bytes"])))
    notes = {"memory": MemoryPrediction(tuple(parts))}
    if fsdp and options.stream_chunk_bytes is None:
        notes["stream"] = StreamChunks(tuple((P, tuple(chunks[P].items())) for P in worlds))
    for key, note in notes.items():
        graph = graph.annotate(key, {graph.input.name: note})
    return graph
