"""plan.json's fsdp stream chunks, put on the loaded network's weight shards.

A program compiled without --stream-chunk-kib records each streamable layer's chunk per rank
count (`stream_chunks`: {"P": {node: bytes}}, runtime/accounting/chunk_choice.py); one
compiled with it (or by the memory-budget planner) has one `stream_chunk_bytes` for every
layer. A run on a P the plan has no entry for chooses with the same pure function of the
shapes, so every rank still gets the same mapping without a collective. The memory model is
then given exactly the chunks the shards use (`memory_setup`).
"""

from __future__ import annotations

from shardbound.runtime.errors import ShardboundError

from shardbound.runtime.parallel.params import STREAM_CHUNK_BYTES


def stream_chunk_bytes(plan: dict) -> int:
    """The one chunk of every layer, or the ceiling of the chosen ones (plan.json's
    `stream_chunk_bytes`)."""
    value = plan.get("stream_chunk_bytes", STREAM_CHUNK_BYTES)
    if not isinstance(value, int) or isinstance(value, bool) or value < 4:
        raise ShardboundError(f"plan.json: stream_chunk_bytes must be an integer >= 4, got "
                              f"{value!r}; recompile the model")
    return value


def layer_chunks(plan: dict, network, world: int):
    """This run's chunks: an int (every layer alike) or {node name: bytes}."""
    ceiling = stream_chunk_bytes(plan)
    table = plan.get("stream_chunks")
    if table is None:
        return ceiling
    if not isinstance(table, dict):
        raise ShardboundError("plan.json: stream_chunks must be an object {P: {node: bytes}}; "
                              "recompile the model")
    chosen = table.get(str(world))
    if chosen is None:
        from shardbound.runtime.accounting.chunk_choice import choose_chunks
        from shardbound.runtime.accounting.memory_model import network_shapes

        return choose_chunks(network_shapes(network), network.output.name, world, ceiling,
                             network.order, network.row_tile)
    if not isinstance(chosen, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 4 for v in chosen.values()):
        raise ShardboundError(f"plan.json: stream_chunks[{str(world)!r}] must map node names to "
                              "integers >= 4; recompile the model")
    return dict(chosen)


def apply_chunks(network, chunks) -> None:
    """Give each fsdp weight shard its layer's chunk (a whole-tensor weight: nothing)."""
    if not isinstance(chunks, dict):
        return
    for node in network.nodes:
        weight = node.params.get("weight") if isinstance(node.params, dict) else None
        if node.name in chunks and hasattr(weight, "chunk_bytes"):
            weight.chunk_bytes = chunks[node.name]
