"""fsdp's stream chunk of each linear layer, chosen from what a rank holds.

fsdp streams a large linear weight in blocks (runtime/numerics/streaming.py); the block a rank
gathers is the one part of its peak that does not fall with P. With one fixed 4 MiB chunk the
whole 784x512 first layer of an MLP (1.53 MiB) stayed gathered at every P while the rest of
a rank's peak fell ~1/P, and fsdp missed 0.30x single mode at P=4; a fixed small chunk meets
it everywhere but makes every product many small collectives (time). So the plan chooses,
for each rank count P, each streamable layer's chunk:

1. the rank's reference peak R: the largest predicted peak (memory_model.predict_peak) over
   the bound methods CHOICE_METHODS, every layer streamed in MIN_CHUNK blocks: what the rank
   holds anyway (its parameter shards, its share of the A-matrices and alphas, bounds);
2. the common chunk c: the largest of ceiling, ceiling/2, ... (down to MIN_CHUNK) that is at
   most R x FRACTION, so a gathered block adds at most ~1/16 to the rank's peak at any P;
3. each layer whose weight is larger than c, in graph order, keeps the ceiling instead when
   that raises no method's predicted peak (its blocks are gathered where the peak is not):
   fewer, larger collectives where memory does not need small ones.

A pure function of the shapes, P, the summation order and the row tile: the compiler
(passes/memory_plan.py, recorded as plan.json's `stream_chunks`) and every rank of a run get
the same mapping. No chunk changes a bit of the bounds: each output element of a streamed
product is contracted whole, in the same order, whatever the blocks (streaming.py).
"""

from __future__ import annotations

import math

from shardbound.runtime.accounting.memory_model import F32, predict_peak

MIN_CHUNK = 64 << 10                     # the smallest chunk chosen (also the planner's)
FRACTION = 16                            # a gathered block: at most R / FRACTION
CHOICE_METHODS = ("crown", "full-alpha-crown")   # the heaviest bound methods a program runs


def streamable(nodes) -> list:
    """The nodes whose weight fsdp may stream: a 2-D weight of an op that streams it."""
    return [n for n in nodes if n.traits.streams_weight and len(n.weight_shape) == 2]


def choose_chunks(nodes, output: str, world: int, ceiling: int, order: str = "blocked",
                  row_tile: int | None = None) -> dict[str, int]:
    """node name -> stream chunk bytes for every streamable node of an fsdp program on
    `world` ranks (see the module doc); `ceiling`: the largest chunk (--stream-chunk-kib's
    default). `fast` never streams: every node gets the ceiling."""
    layers = streamable(nodes)
    chunks = {n.name: ceiling for n in layers}
    largest = max((math.prod(n.weight_shape) * F32 for n in layers), default=0)
    if order == "fast" or largest <= MIN_CHUNK:
        return chunks                   # nothing streams in blocks smaller than the weight

    def peaks(mapping) -> list[int]:
        return [predict_peak(nodes, output, world, shard_rows=True, method=m,
                             stream_chunk_bytes=mapping, row_tile=row_tile,
                             order=order)["peak_tracked_bytes"] for m in CHOICE_METHODS]

    reference = max(peaks({n.name: MIN_CHUNK for n in layers}))
    common = ceiling
    while common > MIN_CHUNK and common * FRACTION > reference:
        common //= 2
    common = max(common, min(MIN_CHUNK, ceiling))
    if common == ceiling or largest <= common:
        return chunks
    chunks = {n.name: common for n in layers}
    now = peaks(chunks)
    for n in layers:
        if math.prod(n.weight_shape) * F32 <= common:
            continue                    # gathered whole at either chunk
        trial = dict(chunks, **{n.name: ceiling})
        got = peaks(trial)
        if all(g <= p for g, p in zip(got, now)):
            chunks, now = trial, got
    return chunks
