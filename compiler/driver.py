"""compile = import -> passes -> codegen; also what `inspect` shows."""

from __future__ import annotations

from dataclasses import replace

from shardbound.compiler.codegen import write_program
from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.frontend import import_onnx
from shardbound.compiler.ir import Graph, dump
from shardbound.passes.manager import STREAM_CHUNK_BYTES, PassManager, PassOptions
from shardbound.passes.pipeline import pipeline


def plan_model(path: str, options: PassOptions, verify_each: bool = False) -> tuple[Graph, list[str]]:
    graph, _, passes = plan_with_options(path, options, verify_each)
    return graph, passes


def plan_with_options(path: str, options: PassOptions, verify_each: bool = False,
                      plan_out: list | None = None, fixed=None
                      ) -> tuple[Graph, PassOptions, list[str]]:
    """Import and run the passes; with --memory-budget, first choose the plan that fits
    (passes/memory_budget.py) from the shapes after canonicalize and bound_plan, then run the
    chosen mode's pipeline with the chosen options (returned: codegen writes them).

    verify's default budget (`options.budget_source`) plans but is not enforced: a plan of
    whole rows (the prediction fits as it is) compiles exactly the program of no budget
    (the same plan.json, the same bits); one with row tiles keeps its tile and batch, and
    no `memory_budget_bytes`. `plan_out` gets the choice (verify's --json report)."""
    imported = import_onnx(path, max_elements=options.max_elements, fixed=fixed)
    chosen = None
    if options.memory_budget is not None:
        from shardbound.passes.memory_budget import choose, planned_options
        from shardbound.passes.memory_plan import graph_shapes

        front = PassManager([p for p in pipeline("single").passes
                             if p.name in ("canonicalize", "bound_plan")])
        planned = front.run(imported, options)
        chosen = choose(graph_shapes(planned), planned.output, options, source=path,
                        tp=(_tp_view(planned, options)   # the default budget keeps the mode
                            if not options.budget_source or options.mode == "tp" else None),
                        spec_rows=options.spec_rows)
        if plan_out is not None:
            plan_out.append(chosen)
        if not options.budget_source:
            options = planned_options(chosen, options)
        elif chosen.row_tile or chosen.stream_chunk_kib * 1024 != (options.stream_chunk_bytes
                                                                    or STREAM_CHUNK_BYTES):
            options = replace(planned_options(chosen, options), memory_budget=None)
        else:                           # fits untouched: today's program, bit for bit
            options, chosen = replace(options, memory_budget=None), None
    manager = pipeline(options.mode, verify_each=verify_each)
    graph = manager.run(imported, options)
    if chosen is not None:
        graph = graph.annotate("budget", {graph.input.name: chosen})
    return graph, options, [p.name for p in manager.passes]


def _tp_view(planned: Graph, options: PassOptions):
    """The network as tp mode would run it (its zones, and the bound plan tp_zones gives
    zone nodes), for the planner; None where tp cannot run (--summation exact)."""
    from dataclasses import replace

    from shardbound.passes.memory_budget import TpShapes
    from shardbound.passes.memory_plan import tp_graph_shapes
    from shardbound.passes.tp_zones import tp_zones
    from shardbound.runtime.parallel.tp_reduce import REDUCTIONS

    if options.summation not in REDUCTIONS:
        return None
    shapes, places, ibp = tp_graph_shapes(tp_zones(planned, replace(options, nproc=1)))
    return TpShapes(shapes, places, frozenset(ibp))


def compile_model(path: str, out_dir: str, options: PassOptions,
                  plan_out: list | None = None, fixed=None) -> Graph:
    """`fixed` (compiler/fixed_inputs.FixedInputs): input elements to fold in as constants;
    the program records them and refuses boxes that do not fix them to the same values."""
    graph, options, passes = plan_with_options(path, options, plan_out=plan_out, fixed=fixed)
    try:
        write_program(graph, options, passes, out_dir)
    except OSError as e:
        where = e.filename or out_dir
        raise ShardboundError(f"{out_dir}: cannot write the compiled program ({where}: "
                              f"{e.strerror or type(e).__name__}); choose a writable -o DIR") from None
    return graph


def inspect_model(path: str, options: PassOptions, raw: bool = False) -> str:
    if raw:
        return dump(import_onnx(path, max_elements=options.max_elements))
    graph, _ = plan_model(path, options)
    text = dump(graph)
    plan = graph.annotations.get("budget", {}).get(graph.input.name)
    if plan is not None:
        text += f"plan: {plan.text()}\n"
    return text
