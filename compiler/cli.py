"""Command line: `compile MODEL.onnx ...` and `shardbound {compile,run,inspect} ...`.

User errors (bad model, bad box, bad flag) print one line naming the file and node or field,
and exit with code 2; they never show a traceback. Exit codes: 0 done, 2 user input, 3 a rank
failed or hung, 130 interrupted (Ctrl-C or SIGTERM: one line `interrupted`).
"""

from __future__ import annotations

import argparse
import os
import sys

from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.verify_cmd import (add_max_elements_argument,
                                            add_stream_chunk_argument,
                                            add_tp_intermediate_argument, add_verify_arguments,
                                            positive_int, run_verify)
from shardbound.runtime.program.main import (ArgumentParser, add_run_arguments, guarded, leave,
                                             own_process)

MODES = ("single", "fsdp", "tp")
SUMMATIONS = ("blocked", "exact", "fast")


def _add_compile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX network to compile")
    p.add_argument("-o", "--out", metavar="DIR",
                   help="output directory (default: MODEL_shardbound next to the model)")
    _add_plan_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, default="single",
                   help="sharding mode (default single)")
    p.add_argument("--method", choices=("ibp", "crown"), default="crown",
                   help="default bound method of the program (default crown)")
    p.add_argument("--intermediate", choices=("crown", "ibp"), default="crown",
                   help="how CROWN bounds the inputs of ReLUs (default crown)")
    p.add_argument("--summation", choices=SUMMATIONS, default="blocked",
                   help="summation order of every contraction: blocked (default; the same bits "
                        "for any thread count and rank count), exact (correctly rounded: the "
                        "same bits on any BLAS or device), fast (plain BLAS; run-to-run only)")
    add_stream_chunk_argument(p)
    add_tp_intermediate_argument(p)
    add_max_elements_argument(p)


def _options(args):
    from shardbound.passes.manager import PassOptions

    nproc = getattr(args, "nproc", 1)
    if nproc < 1:
        raise ShardboundError(f"--nproc must be at least 1, got {nproc}")
    return PassOptions(mode=args.mode, method=args.method, intermediate=args.intermediate,
                       summation=args.summation, nproc=nproc,
                       stream_chunk_bytes=args.stream_chunk_kib * 1024,
                       tp_intermediate=args.tp_intermediate, max_elements=args.max_elements)


def _compile(args) -> int:
    from shardbound.compiler.driver import compile_model

    out = args.out or os.path.splitext(args.model)[0] + "_shardbound"
    if os.path.exists(out) and not os.path.isdir(out):
        raise ShardboundError(f"{out}: exists and is not a directory; choose another -o DIR")
    graph = compile_model(args.model, out, _options(args))
    if not args.quiet:
        params = sum(int(v.size) for v in graph.tensors.values())
        print(f"compiled {graph.source}: {len(graph.nodes)} nodes, {params} parameters, "
              f"mode {args.mode} -> {out}/program.py")
    return 0


def _inspect(args) -> int:
    from shardbound.compiler.driver import inspect_model

    sys.stdout.write(inspect_model(args.model, _options(args), raw=args.raw))
    return 0


def _run(args) -> int:
    from shardbound.runtime.program.main import run

    return run(args.dir, args)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="shardbound",
        description="Compile ONNX networks into sharded, deterministic bound-propagation programs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("compile", help="compile MODEL.onnx into a program directory")
    _add_compile_arguments(p)
    p.set_defaults(fn=_compile)
    p = sub.add_parser("run", help="bound a compiled program over an input box")
    p.add_argument("dir", metavar="DIR", help="a directory written by `compile`")
    add_run_arguments(p)
    p.add_argument("--nproc", type=positive_int, default=1, metavar="P",
                   help="launch P ranks on this machine (gloo on CPU); default 1")
    p.set_defaults(fn=_run)
    p = sub.add_parser("verify", help="verify a VNN-LIB property: sat, unsat, unknown or timeout")
    add_verify_arguments(p, MODES)
    p.set_defaults(fn=run_verify)
    p = sub.add_parser("inspect", help="print the bound IR of a model, one line per node")
    p.add_argument("model", metavar="MODEL.onnx")
    _add_plan_arguments(p)
    p.add_argument("--raw", action="store_true", help="the IR as imported, before any pass")
    p.add_argument("--nproc", type=int, default=1, metavar="P",
                   help="also predict per-rank memory for P ranks (fsdp) or show each "
                        "zone's channel split over P ranks (tp)")
    p.set_defaults(fn=_inspect)
    return parser


def main(argv=None) -> None:
    own = own_process(argv)
    args = build_parser().parse_args(argv)
    leave(guarded(args.fn, args), own)


def compile_main(argv=None) -> None:
    """The `compile` console script: `compile MODEL.onnx --mode single -o DIR`."""
    own = own_process(argv)
    parser = ArgumentParser(prog="compile", description="Compile an ONNX network into a "
                                     "shardbound program directory.")
    _add_compile_arguments(parser)
    args = parser.parse_args(argv)
    leave(guarded(_compile, args), own)


if __name__ == "__main__":
    main()
