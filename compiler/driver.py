"""compile = import -> passes -> codegen; also what `inspect` shows."""

from __future__ import annotations

from shardbound.compiler.codegen import write_program
from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.frontend import import_onnx
from shardbound.compiler.ir import Graph, dump
from shardbound.passes.manager import PassOptions
from shardbound.passes.pipeline import pipeline


def plan_model(path: str, options: PassOptions, verify_each: bool = False) -> tuple[Graph, list[str]]:
    graph = import_onnx(path, max_elements=options.max_elements)
    manager = pipeline(options.mode, verify_each=verify_each)
    graph = manager.run(graph, options)
    return graph, [p.name for p in manager.passes]


def compile_model(path: str, out_dir: str, options: PassOptions) -> Graph:
    graph, passes = plan_model(path, options)
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
    return dump(graph)
