"""How many domains a branch-and-bound batch may hold: the memory model against the memory
this process may take.

Branch and bound bounds B domains at once (ReLU splitting: one CROWN and one beta-CROWN
call; input splitting: CROWN over B sub-boxes), and memory grows with B. A batch is sized
from the memory model's CROWN peak per box (`predict_peak` at batch 1 and 2, with the
network's row tile: its slope is one more box), for the spec rows at hand:

- ReLU splitting doubles from MIN_BATCH up to MAX_BATCH while the round (CROWN's slope x
  BETA_MEMORY_FACTOR per domain, for autograd's saved A-matrices and the alphas with their
  Adam moments) fits `memory_figure` (a quarter of the available memory, at most
  BAB_MEMORY_BYTES, as before); input splitting takes its given batch;
- and neither keeps a batch whose round does not fit the default budget (verify's, from
  runtime/accounting/available.py: DEFAULT_FRACTION of the memory available to the
  process, shared by the job's ranks on the CPU; on a GPU its free memory, per rank):
  the batch is halved, down to one domain, until it
  does. Where the batch fits, nothing changes; on a network whose one CROWN pass is most
  of the machine (cgan's upsampling generator: 12 GB predicted untiled) ReLU splitting no
  longer takes 8 boxes at once whatever the memory (it did: MIN_BATCH was a floor, and the
  row tile was not in the prediction).

A planned batch (`--memory-budget`, or the default budget where it chose row tiles: plan.json
`bab_batch`) is the planner's, not this module's. Every rank takes the same batch (`agree`:
a flag OR-ed over ranks).
"""

from __future__ import annotations

import torch

BAB_MEMORY_BYTES = 2 << 30      # at most this much for one batch of domains (memory_figure)
BETA_MEMORY_FACTOR = 4          # beta-CROWN's round against one CROWN pass (batch_for_memory)
MIN_BATCH, MAX_BATCH = 8, 128   # ReLU splitting's domains per batch, where they fit


def _free_bytes(network) -> int | None:
    """The memory this process may still take on the network's device (the CPU: the
    smaller of MemAvailable and its cgroup's headroom; a GPU: cudaMemGetInfo's free)."""
    try:
        if network.device.type == "cuda":
            return int(torch.cuda.mem_get_info(network.device)[0])
    except (RuntimeError, ValueError):
        return None
    from shardbound.runtime.accounting import available

    found = available.available_memory()
    return found.bytes if found is not None else None


def _ranks_here(network) -> int:
    comm = getattr(network, "comm", None)
    return max(1, int(getattr(comm, "world", 1) or 1))


def memory_figure(network) -> int:
    """Bytes ReLU branch and bound may grow its batches to: a quarter of the available
    memory of the network's device, at most BAB_MEMORY_BYTES; each tp rank of a job takes
    its own share of the machine."""
    free = _free_bytes(network)
    world = network.tp.comm.world if network.tp is not None else 1
    return min(BAB_MEMORY_BYTES, (free or BAB_MEMORY_BYTES) // (4 * world))


def default_budget_bytes(network) -> int | None:
    """verify's default budget per rank on this machine now (None: unknown, or switched off
    by `--memory-budget none`): the ceiling no batch may pass."""
    from shardbound.runtime.accounting.available import DEFAULT_FRACTION

    if not getattr(network, "default_budget", True):     # --memory-budget none
        return None
    free = _free_bytes(network)
    if free is None:
        return None
    shared = network.device.type != "cuda"      # ranks share the host, not their GPUs
    return int(free * DEFAULT_FRACTION) // (_ranks_here(network) if shared else 1)


def _crown_slope(network, rows: int) -> tuple[int, int]:
    """(CROWN's predicted peak for one box, the bytes one more box adds), with the
    network's row tile."""
    from shardbound.runtime.accounting.memory_model import network_shapes, predict_peak

    shapes = network_shapes(network)
    tile = getattr(network, "row_tile", None)
    one, two = (predict_peak(shapes, network.output.name, 1, batch=b, spec_rows=rows,
                             row_tile=tile)["peak_tracked_bytes"] for b in (1, 2))
    return one, max(two - one, 1)


def fit_batch(batch: int, need, ceiling: int | None, agree=lambda f: f) -> int:
    """`batch` halved (down to 1) until `need(b)` bytes fit `ceiling` on every rank."""
    if ceiling is None:
        return batch
    while batch > 1 and agree(need(batch) > ceiling):
        batch //= 2
    return batch


def batch_for_memory(network, rows: int, budget_bytes: int, agree=lambda f: f,
                     ceiling: int | None | bool = True) -> int:
    """ReLU splitting's domains per batch: a power of two from MIN_BATCH up to MAX_BATCH
    whose beta-CROWN round (CROWN's peak for one box, plus its slope x BETA_MEMORY_FACTOR
    per domain, for `rows` spec rows) fits `budget_bytes`; then halved below MIN_BATCH,
    down to 1, while it passes `ceiling` (default True: the default budget,
    `default_budget_bytes`; None: no ceiling). Doubling stops as soon as one rank's budget
    is reached (`agree`: a flag OR-ed over ranks), so every rank takes the same."""
    one, slope = _crown_slope(network, rows)
    per_box = slope * BETA_MEMORY_FACTOR
    b = MIN_BATCH
    while 2 * b <= MAX_BATCH and not agree(one + 2 * b * per_box > budget_bytes):
        b *= 2
    if ceiling is True:
        ceiling = default_budget_bytes(network)
    return fit_batch(b, lambda n: one + n * per_box, ceiling, agree)


def input_batch_for_memory(network, rows: int, batch: int, agree=lambda f: f,
                           ceiling: int | None | bool = True) -> int:
    """Input splitting's boxes per step: `batch`, halved while CROWN over that many boxes
    passes `ceiling` (default: the default budget)."""
    one, slope = _crown_slope(network, rows)
    if ceiling is True:
        ceiling = default_budget_bytes(network)
    return fit_batch(batch, lambda n: one + (n - 1) * slope, ceiling, agree)


def bab_round_peak(network, batch: int, rows: int) -> int:
    """The memory model's per-rank peak of one ReLU branch-and-bound round of `batch` domains
    with `rows` spec rows on this network (its mode, P, stream chunk and row tile): the
    larger of CROWN on the batch (intermediate passes: each rank its share of the neuron
    rows of every domain) and beta-CROWN, which in fsdp with row sharding runs on this
    rank's share of the batch's (domain, row) pairs, each a box with one spec row
    (`pair_split`), and elsewhere on the batch with every row. What the bench reports as
    predicted against the ledger's measured peak (bench/bab_fsdp.py)."""
    from shardbound.runtime.accounting.memory_model import network_shapes, predict_peak

    setup = network.memory_setup or {"fsdp": False, "stream_chunk_bytes": None}
    comm = getattr(network, "comm", None)
    world = max(1, int(getattr(comm, "world", 1) or 1))
    shard = network.rows.enabled if setup["fsdp"] else None
    common = dict(shard_rows=shard, stream_chunk_bytes=setup["stream_chunk_bytes"],
                  row_tile=network.row_tile)
    shapes = network_shapes(network)
    out = network.output.name
    crown = predict_peak(shapes, out, world, batch=batch, spec_rows=rows, method="crown",
                         **common)["peak_tracked_bytes"]
    if network.rows.enabled:
        boxes, per_box = -(-batch * rows // world), 1
    else:
        boxes, per_box = batch, rows
    beta = predict_peak(shapes, out, world, batch=boxes, spec_rows=per_box,
                        method="beta-crown", **common)["peak_tracked_bytes"]
    return max(crown, beta)
