"""Command line: `compile MODEL.onnx ...` and `shardbound {compile,run,verify,inspect} ...`.

Every flag comes from `shardbound.options` (one name, one meaning, one default for every
command and the generated program). This module imports nothing heavy at the top: `--help`
and bad flags are answered before torch, onnx or the passes load.

User errors (bad model, bad box, bad flag) print one line naming the file and node or field,
and exit with code 2; they never show a traceback. Exit codes: 0 done, 2 user input, 3 a rank
failed or hung, 130 interrupted (Ctrl-C or SIGTERM: one line `interrupted`).
"""

from __future__ import annotations

import argparse
import os
import sys

from shardbound.options import HELP, ArgumentParser, RunOptions, add_flags, parser_for
from shardbound.runtime.errors import ShardboundError
from shardbound.runtime.program.main import guarded, leave, own_process


# What only compile, inspect and verify need (pyproject's `compile` extra); a compiled
# program runs with torch, numpy and safetensors alone.
COMPILE_ONLY = ("onnx", "onnx_graphsurgeon", "networkx", "jinja2")


def require_compile_dependencies(command: str) -> None:
    """One line naming what is missing, instead of an ImportError traceback from deep in the
    importer, when shardbound was installed without its `compile` extra."""
    import importlib.util

    missing = [m for m in COMPILE_ONLY if importlib.util.find_spec(m) is None]
    if missing:
        raise ShardboundError(f"{command}: needs {', '.join(missing)}, which only compiling "
                              "uses; install them with pip install 'shardbound[compile]'")


def _compile(args) -> int:
    require_compile_dependencies("compile")
    from shardbound.compiler.driver import compile_model
    from shardbound.options import pass_options

    out = args.out or os.path.splitext(args.model)[0] + "_shardbound"
    if os.path.exists(out) and not os.path.isdir(out):
        raise ShardboundError(f"{out}: exists and is not a directory; choose another -o DIR")
    graph = compile_model(args.model, out, pass_options(args))
    if not args.quiet:
        params = sum(int(v.size) for v in graph.tensors.values())
        plan = graph.annotations.get("budget", {}).get(graph.input.name)
        mode = plan.mode if plan is not None else (args.mode or "single")
        print(f"compiled {graph.source}: {len(graph.nodes)} nodes, {params} parameters, "
              f"mode {mode} -> {out}/program.py")
        if plan is not None:
            print(f"plan: {plan.text()}")
    return 0


def _inspect(args) -> int:
    require_compile_dependencies("inspect")
    from shardbound.compiler.driver import inspect_model
    from shardbound.options import pass_options

    sys.stdout.write(inspect_model(args.model, pass_options(args), raw=args.raw))
    return 0


def _run(args) -> int:
    from shardbound.runtime.program.main import run

    return run(args.dir, RunOptions.from_namespace(args))


def _verify(args) -> int:
    require_compile_dependencies("verify")
    from shardbound.compiler.verify_cmd import run_verify

    return run_verify(args)


COMMAND_FUNCTIONS = {"compile": _compile, "run": _run, "verify": _verify, "inspect": _inspect}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="shardbound",
        description="Compile ONNX networks into sharded, deterministic bound-propagation "
                    "programs, and answer VNN-LIB properties with them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=ArgumentParser)
    for command in ("compile", "run", "verify", "inspect"):
        p = sub.add_parser(command, help=HELP[command], description=HELP[command])
        add_flags(p, command)
        p.set_defaults(fn=COMMAND_FUNCTIONS[command])
    return parser


def compile_parser() -> argparse.ArgumentParser:
    return parser_for("compile", "compile")


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, as the README's tables are generated from them."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    from shardbound.options import parser_for as program_parser

    return {"compile": compile_parser(), "inspect": sub.choices["inspect"],
            "run": sub.choices["run"], "verify": sub.choices["verify"],
            "program": program_parser("program", "program.py")}


def main(argv=None) -> None:
    own = own_process(argv)
    args = build_parser().parse_args(argv)
    leave(guarded(args.fn, args, own=own), own)


def compile_main(argv=None) -> None:
    """The `compile` console script: `compile MODEL.onnx --mode single -o DIR`."""
    own = own_process(argv)
    args = compile_parser().parse_args(argv)
    leave(guarded(_compile, args, own=own), own)


if __name__ == "__main__":
    main()
