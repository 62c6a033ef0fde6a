"""The pass manager: an explicit, ordered list of named passes per mode, with a verifier.

The verifier runs before and after the pipeline (and after every pass when `verify_each` is set,
as the tests do). A failing pass raises PassError naming the pass and the passes before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.ir import Graph
from shardbound.compiler.naming import is_identifier
from shardbound import options as _flags
from shardbound.runtime.ops import OP_TYPES

PassFn = Callable[[Graph, "PassOptions"], Graph]

# The largest tensor a model may declare or compute, in elements (256 MiB of float32): far
# above real verification networks (a 3x32x32 CNN's largest layer has 65,536), far below
# what a 150-byte file could ask for (a declared 1x20000x20000 input took 3.2 GB to refuse).
MAX_ELEMENTS = _flags.MAX_ELEMENTS
STREAM_CHUNK_BYTES = _flags.STREAM_CHUNK_KIB * 1024


@dataclass(frozen=True)
class PassOptions:
    """What the passes and codegen are asked for; the defaults are the command-line flags'
    (shardbound.options), so Python callers and `compile` get the same program."""

    mode: str = "single"
    method: str = "crown"              # the program's default final bound method
    intermediate: str = _flags.FLAGS["intermediate"].default   # nodes feeding a relaxed op
    summation: str = _flags.FLAGS["summation"].default
    nproc: int = 1                     # the rank count the program is planned for
    # fsdp: most of one weight gathered at once, every layer alike; None: chosen per layer
    # and rank count, at most STREAM_CHUNK_BYTES (runtime/accounting/chunk_choice.py)
    stream_chunk_bytes: int | None = None
    tp_intermediate: str = _flags.FLAGS["tp_intermediate"].default   # tp zone nodes
    max_elements: int = MAX_ELEMENTS   # import: the largest tensor (elements) a model may have
    # --memory-budget (bytes per rank): the planner (passes/memory_budget.py) picks mode, P,
    # stream chunk and row tile to fit it; it keeps `mode` / `nproc` when they were given.
    memory_budget: int | None = None
    # Where memory_budget comes from when the user gave none: verify's default budget
    # (runtime/accounting/available.py; its description). With it the planner keeps the
    # mode and P and chooses only row tiles, stream chunks and branch-and-bound batches.
    budget_source: str = ""
    mode_given: bool = False
    nproc_given: bool = False
    row_tile: int | None = None        # the most rows a backward pass propagates at once
    bab_batch: int | None = None       # verify: ReLU branch-and-bound domains per batch
    plan_methods: tuple[str, ...] = ()  # methods the budget must fit (default: `method`)
    spec_rows: int | None = None       # rows of the final pass the budget plans for (verify:
                                       # the property's C rows; None: one per output)


@dataclass(frozen=True)
class Pass:
    name: str
    run: PassFn


class PassError(Exception):
    """A bug in a pass (not in the user's model): names the pass and what ran before it."""


@dataclass
class PassManager:
    passes: list[Pass]
    verify_each: bool = False
    log: list[str] = field(default_factory=list)

    def run(self, graph: Graph, options: PassOptions) -> Graph:
        verify(graph, "import")
        done: list[str] = []
        for p in self.passes:
            try:
                graph = p.run(graph, options)
                if self.verify_each:
                    verify(graph, p.name)
            except ShardboundError:
                raise
            except Exception as e:
                before = ", ".join(done) or "none"
                raise PassError(f"pass {p.name!r} failed (passes before it: {before}): "
                                f"{type(e).__name__}: {e}") from e
            done.append(p.name)
            self.log.append(p.name)
        verify(graph, done[-1] if done else "import")
        return graph


def verify(graph: Graph, after: str) -> None:
    """Structural invariants every pass must keep."""
    def fail(msg):
        raise PassError(f"IR verifier failed after {after!r}: {msg}")

    if not graph.nodes or graph.nodes[0].op != "input":
        fail("the first node must be the input")
    seen: set[str] = set()
    for n in graph.nodes:
        if not is_identifier(n.name):
            fail(f"node name {n.name!r} is not a safe identifier")
        if n.name in seen:
            fail(f"duplicate node name {n.name!r}")
        if n.op not in OP_TYPES:
            fail(f"node {n.name!r} has unknown op {n.op!r}")
        for i in n.inputs:
            if i not in seen:
                fail(f"node {n.name!r} reads {i!r} before it is defined")
        for role, key in n.params:
            if key not in graph.tensors:
                fail(f"node {n.name!r} parameter {role} -> missing tensor {key!r}")
        seen.add(n.name)
    if graph.output not in seen:
        fail(f"output {graph.output!r} is not a node")
    for key, values in graph.annotations.items():
        for name in values:
            if name not in seen:
                fail(f"annotation {key!r} refers to unknown node {name!r}")
