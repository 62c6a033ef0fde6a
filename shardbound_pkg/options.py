"""Every command-line flag of shardbound, defined once: one name, one meaning, one default.

`compile`, `shardbound {compile,run,verify,inspect}` and the generated `program.py` all build
their parsers from the tables here (`FLAGS`, `COMMANDS`), the README's flag tables are
generated from those parsers (`readme_tables`; `python -m shardbound.readme` rewrites
them, tests/test_readme_flags.py fails when they differ)
and the library defaults (`PassOptions`, the runtime's stream chunk) are these constants.

Why one module: flags used to be defined per command and drifted (`--timeout` was the
collective timeout in `run` and the wall-clock budget in `verify`; `--summation` defaulted to
blocked in `compile` and fast in `verify`; `--method` took other values per command). A
spelling that changes meaning keeps working for one release as a hidden alias that prints one
deprecation line (`DEPRECATED`).

Nothing here imports torch, onnx or the rest of shardbound: `--help` of every command is
answered by this module and argparse alone (measured: under 0.3 s; it took 4-15 s when the
CLI imported the runtime first).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, fields

MODES = ("single", "fsdp", "tp")
SUMMATIONS = ("blocked", "exact", "fast")
METHODS = ("ibp", "crown", "alpha-crown", "full-alpha-crown")
INTERMEDIATE = ("crown", "ibp")
DEVICES = ("cpu", "cuda", "auto")
SOUNDNESS = ("default", "real", "float32")
MILP = ("auto", "off")

STREAM_CHUNK_KIB = 4096          # fsdp: the most of one weight matrix a rank gathers at once
MAX_ELEMENTS = 1 << 26           # the largest tensor a model may declare or compute (256 MiB f32)
COLLECTIVE_TIMEOUT_S = 60.0
VERIFY_TIMEOUT_S = 300.0


# -- argparse types ---------------------------------------------------------------------------

def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (`nan`, `inf`, 0 and negatives are
    refused: each made a budget that never or always expires)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "m": 1 << 20,
               "mib": 1 << 20, "mb": 10 ** 6, "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9,
               "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12}


NO_BUDGET = 0       # `--memory-budget none`: no budget at all (verify: not even the default)


def memory_size(text: str) -> int:
    """argparse type: a positive size in bytes, `512MiB`, `2GB`, `1.5GiB`, `64k` or plain
    bytes (KiB/MiB/GiB and bare K/M/G are powers of 1024; KB/MB/GB powers of 1000), or
    `none` (NO_BUDGET)."""
    import re

    if str(text).strip().lower() == "none":
        return NO_BUDGET

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS or not float(m.group(1)) * _SIZE_UNITS[unit] >= 1:
        raise argparse.ArgumentTypeError(
            f"expected a memory size such as 512MiB, 2GB or 1073741824, got {text!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a user error like any other: one `error:` line, exit 2
    (instead of the usage block followed by a second line)."""

    def error(self, message: str):
        message = " ".join(str(message).split())
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


# -- the flags --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    """One flag (or positional argument) as argparse gets it."""

    names: tuple[str, ...]
    help: str
    default: object = None
    type: object = None
    choices: tuple | None = None
    metavar: str | None = None
    action: str | None = None
    hidden: bool = False            # for ranks and harnesses: not in --help or the README

    @property
    def positional(self) -> bool:
        return not self.names[0].startswith("-")

    @property
    def dest(self) -> str:
        if self.positional:
            return self.names[0]
        return self.names[-1].lstrip("-").replace("-", "_")

    def add_to(self, parser, required: bool = False) -> None:
        kw = {"help": argparse.SUPPRESS if self.hidden else self.help}
        if self.positional:
            parser.add_argument(self.names[0], metavar=self.metavar, **kw)
            return
        if self.action:
            kw["action"] = self.action
        else:
            kw.update(type=self.type, choices=self.choices, metavar=self.metavar)
        if required:
            kw["required"] = True
        parser.add_argument(*self.names, dest=self.dest, default=self.default, **kw)

    def usage(self) -> str:
        """The flag as the README's command table writes it."""
        if self.positional:
            return self.metavar or self.names[0]
        name = self.names[-1]
        if self.action:
            return name
        if self.choices:
            return f"{name} {'|'.join(self.choices)}"
        return f"{name} {self.metavar}"


def _flag(*names, **kw) -> Flag:
    return Flag(tuple(names), **kw)


FLAGS: dict[str, Flag] = {f.dest if not f.positional else f.names[0]: f for f in (
    # positionals
    _flag("model", metavar="MODEL.onnx", help="the ONNX network"),
    _flag("property", metavar="PROP.vnnlib",
          help="the VNN-LIB property (1.0 or 2.0, told apart by content)"),
    _flag("dir", metavar="DIR", help="a program directory written by `compile`"),
    # what to compile
    _flag("-o", "--out", metavar="DIR",
          help="where the compiled program goes (compile: default MODEL_shardbound next to the "
               "model; verify: kept in DIR instead of a temporary directory)"),
    _flag("--mode", choices=MODES, default=None,
          help="sharding mode (default single; with --memory-budget and no --mode, the "
               "planner's choice)"),
    _flag("--method", choices=METHODS, default=None,
          help="bound method: compile/inspect set the program's default (crown when not "
               "given), run and program.py override it for one run"),
    _flag("--intermediate", choices=INTERMEDIATE, default="crown",
          help="how CROWN bounds the inputs of relaxed ops outside tp zones (default crown)"),
    _flag("--tp-intermediate", choices=INTERMEDIATE, default="crown",
          help="tp mode: intermediate bounds of zone nodes by crown (collectives; single "
               "mode's bounds, bit for bit under blocked) or ibp (local, no communication, "
               "looser with every zone); default crown"),
    _flag("--summation", choices=SUMMATIONS, default="blocked",
          help="summation order of every contraction: blocked (default; the same bits for "
               "any thread and rank count), exact (correctly rounded: the same bits on any "
               "BLAS or device), fast (plain BLAS; run to run only, quickest)"),
    _flag("--stream-chunk-kib", type=positive_int, default=None, metavar="KIB",
          help="fsdp with blocked/exact: gather large weight matrices in blocks of at most "
               "this many KiB instead of whole, every layer alike (default: chosen per layer "
               "and rank count from what a rank holds, at most "
               f"{STREAM_CHUNK_KIB}; plan.json's stream_chunks)"),
    _flag("--max-elements", type=positive_int, default=MAX_ELEMENTS, metavar="N",
          help="refuse models with a tensor (input, constant or computed) of more than N "
               f"elements (default {MAX_ELEMENTS}); raise it for a model that really is "
               "that large"),
    _flag("--nproc", type=positive_int, default=None, metavar="P",
          help="the job's rank count: compile/inspect plan for P ranks (the tp channel "
               "split and fsdp memory per rank in the program, and run's default); run, "
               "verify and program.py launch P ranks (gloo on CPU). Default 1 (run: the "
               "program's)"),
    _flag("--memory-budget", type=memory_size, default=None, metavar="SIZE",
          help="tracked memory per rank (e.g. 512MiB, 2GB). compile/inspect/verify: plan to "
               "fit it (the first plan in a fixed order whose predicted peak fits: single, "
               "then fsdp or tp (where the network has tp zones; on the same P the smaller "
               "predicted peak, fsdp on a tie) on the fewest ranks (or --nproc), larger "
               "stream chunks and whole rows first, then row tiles; verify plans for the "
               "property's rows; inspect prints the choice; none fits: one line with the "
               "smallest peak). verify without it: a default budget, half the memory "
               "available to the process (MemAvailable, or its cgroup's limit if lower) "
               "shared by its ranks, for which only row tiles and batch sizes are chosen "
               "(never the mode or P) and which is not enforced. run/program: stop a run "
               "that would pass it before allocating (exit code 2; default: the budget the "
               "program was planned for). none: no budget (verify: not even the default; "
               "run: the planned one not enforced)"),
    _flag("--raw", action="store_true", default=False,
          help="inspect: the IR as imported, before any pass"),
    # what to bound
    _flag("--box", metavar="BOX.json",
          help='input box: {"lower": [...], "upper": [...]} over the flattened input'),
    _flag("--verify", metavar="SPEC.json",
          help="verify a property (a spec written by `shardbound verify`) instead of "
               "bounding a box"),
    _flag("--timeout", type=positive_seconds, default=VERIFY_TIMEOUT_S, metavar="S",
          help="verify: answer within S seconds of the command's start, compilation "
               f"included (default {VERIFY_TIMEOUT_S:g})"),
    _flag("--verify-timeout", type=positive_seconds, default=VERIFY_TIMEOUT_S, metavar="S",
          help=f"with --verify: give up after S seconds (default {VERIFY_TIMEOUT_S:g})"),
    _flag("--verify-deadline", type=float, default=None, metavar="T", hidden=True,
          help="with --verify: also give up at wall-clock time T (seconds since the epoch; "
               "`shardbound verify` passes its own budget to every rank)"),
    _flag("--started-at", type=float, default=None, metavar="T", hidden=True,
          help="with --verify: the wall-clock time the command started (for its final line)"),
    _flag("--collective-timeout", type=positive_seconds, default=COLLECTIVE_TIMEOUT_S,
          metavar="S",
          help="sharded runs: a collective that waits S seconds for a rank fails, naming "
               f"it (default {COLLECTIVE_TIMEOUT_S:g}; with --verify at most the time left "
               "of the budget, plus 1 s)"),
    _flag("--result", metavar="FILE", help="write the VNN-COMP result file"),
    _flag("--json", metavar="OUT.json",
          help="also write the result as JSON (run: lower, upper, bounds_sha256, memory; "
               "verify: the verdict, the deciding stage and box, every stage's times)"),
    _flag("--threads", type=positive_int, default=1, metavar="T",
          help="torch intra-op threads per rank (default 1; set explicitly so runs repeat)"),
    _flag("--device", choices=DEVICES, default="cpu",
          help="where to bound: cpu (default; gloo between ranks), cuda (nccl), or auto "
               "(cuda when available)"),
    _flag("--soundness", choices=SOUNDNESS, default="default",
          help="what unsat and bounds are sound for: default (the float32 engine; verdicts "
               "strict, counterexamples confirmed in float32 or float64), real (a rigorous "
               "enclosure of the network in exact arithmetic: float64 bounds with every "
               "rounding error accounted), float32 (also every float32 evaluation of the "
               "network, any summation order or FMA); real and float32 cover every op "
               "shardbound compiles (each kernel declares a rigorous step, Softmax, "
               "LayerNorm and the discrete ops included) but not tp mode, which they refuse "
               "in one line"),
    _flag("--milp", choices=MILP, default="auto",
          help="verify: the MILP stage (HiGHS, needs highspy) after the first ReLU branch-and-"
               "bound try. auto (default): where every node declares an exact MIP encoding "
               "(a chain of Linear/ReLU/view ops), at most 512 unstable ReLUs, in default "
               "soundness, one process; it stops at the first conjunction it cannot refute "
               "and hands the time left to branch and bound. off: never"),
    _flag("-q", "--quiet", action="store_true", default=False,
          help="no stage lines, tables or summaries: only errors and the answer a script "
               "reads (verify's verdict line; run's --json file; compile's files)"),
)}

# The flags of each command, in --help order. `program` is the generated program.py.
_PLAN = ("mode", "method", "intermediate", "tp_intermediate", "summation", "stream_chunk_kib",
         "max_elements", "nproc", "memory_budget")
_RUN = ("box", "verify", "result", "verify_timeout", "verify_deadline", "started_at", "json",
        "method", "nproc", "threads", "device", "collective_timeout", "memory_budget",
        "soundness", "milp", "quiet")
COMMANDS: dict[str, tuple[str, ...]] = {
    "compile": ("model", "out", *_PLAN, "quiet"),
    "inspect": ("model", *_PLAN, "raw"),
    "run": ("dir", *_RUN),
    "program": _RUN,
    "verify": ("model", "property", "mode", "nproc", "summation", "tp_intermediate",
               "stream_chunk_kib", "max_elements", "memory_budget", "timeout", "result",
               "json", "threads", "device", "soundness", "milp", "out", "quiet"),
}
REQUIRED_ONE_OF = {"run": ("box", "verify"), "program": ("box", "verify")}

HELP = {
    "compile": "compile MODEL.onnx into a program directory (program.py, weights.safetensors, "
               "plan.json)",
    "inspect": "print the bound IR of a model, one line per node, with every pass's "
               "annotations",
    "run": "bound a compiled program over an input box (or verify a spec)",
    "verify": "answer a VNN-LIB property: sat, unsat, unknown or timeout",
    "program": "run this compiled program (as `shardbound run DIR` does)",
}


@dataclass(frozen=True)
class Deprecated:
    """An old spelling kept for one release: `old` in `commands` means FLAGS[new]."""

    old: str
    new: str
    commands: tuple[str, ...]
    why: str


DEPRECATED = (
    Deprecated("--timeout", "collective_timeout", ("run", "program"),
               "in run it was the collective timeout, while verify's --timeout is the "
               "wall-clock budget"),
)


class _DeprecatedAction(argparse.Action):
    def __init__(self, option_strings, dest, note="", **kw):
        self.note = note
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {self.note}", file=sys.stderr, flush=True)
        setattr(namespace, self.dest, values)


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Every flag of `command` (a key of COMMANDS), plus its deprecated spellings."""
    names = COMMANDS[command]
    group = None
    one_of = REQUIRED_ONE_OF.get(command, ())
    for name in names:
        flag = FLAGS[name]
        if name in one_of:
            if group is None:
                group = parser.add_mutually_exclusive_group(required=True)
            flag.add_to(group)
        else:
            flag.add_to(parser)
    for d in DEPRECATED:
        if command in d.commands:
            new = FLAGS[d.new]
            parser.add_argument(d.old, dest=new.dest, type=new.type, metavar=new.metavar,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                                action=_DeprecatedAction,
                                note=f"{d.old} is deprecated here ({d.why}); use "
                                     f"{new.names[-1]} (the old spelling goes in the next "
                                     "release)")


def parser_for(command: str, prog: str) -> ArgumentParser:
    p = ArgumentParser(prog=prog, description=HELP[command])
    add_flags(p, command)
    return p


# -- typed values -----------------------------------------------------------------------------

@dataclass(frozen=True)
class RunOptions:
    """What `run`, `program.py` and the ranks of `verify` run with. `shardbound verify`
    builds one directly (no argparse Namespace); the entry points convert theirs with
    `from_namespace`. Defaults are the flags' defaults."""

    box: str | None = None
    verify: str | None = None
    result: str | None = None
    verify_timeout: float = FLAGS["verify_timeout"].default
    verify_deadline: float | None = None
    started_at: float | None = None
    json: str | None = None
    method: str | None = None
    nproc: int | None = None
    threads: int = FLAGS["threads"].default
    device: str = FLAGS["device"].default
    collective_timeout: float = FLAGS["collective_timeout"].default
    memory_budget: int | None = None
    soundness: str = FLAGS["soundness"].default
    milp: str = FLAGS["milp"].default
    quiet: bool = False
    no_watchdog: bool = False        # verify answers late itself: the rank's watchdog is off

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "RunOptions":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in known})


def pass_options(ns: argparse.Namespace):
    """PassOptions from a compile/inspect/verify Namespace."""
    from shardbound.passes.manager import PassOptions

    return PassOptions(mode=ns.mode or "single", method=getattr(ns, "method", None) or "crown",
                       intermediate=getattr(ns, "intermediate", FLAGS["intermediate"].default),
                       summation=ns.summation, nproc=ns.nproc or 1,
                       stream_chunk_bytes=(ns.stream_chunk_kib * 1024
                                           if ns.stream_chunk_kib is not None else None),
                       tp_intermediate=ns.tp_intermediate, max_elements=ns.max_elements,
                       memory_budget=getattr(ns, "memory_budget", None) or None,
                       mode_given=ns.mode is not None, nproc_given=ns.nproc is not None)


# -- the README's tables ----------------------------------------------------------------------

COMMAND_LINES = {     # how each command is typed, for the README
    "compile": "compile",
    "inspect": "shardbound inspect",
    "run": "shardbound run",
    "verify": "shardbound verify",
    "program": "python DIR/program.py",
}


def _visible(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        yield action


def _action_usage(action) -> str:
    if not action.option_strings:
        return action.metavar or action.dest
    name = max(action.option_strings, key=len)
    if action.nargs == 0:
        return name
    if action.choices:
        return f"{name} {'|'.join(action.choices)}"
    return f"{name} {action.metavar}"


def readme_tables(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """The README's command and flag tables, from the parsers themselves (`parsers`: command
    -> parser, as `shardbound.compiler.cli.all_parsers()` returns them)."""
    out = ["| command | flags | what it does |", "|---|---|---|"]
    seen: dict[str, list[str]] = {}
    for command, parser in parsers.items():
        parts = []
        one_of = [g._group_actions for g in parser._mutually_exclusive_groups if g.required]
        for action in _visible(parser):
            group = next((g for g in one_of if action in g), None)
            if group is not None and action is not group[0]:
                continue                # written with the first flag of its group
            if group is not None:
                text = "(" + " \\| ".join(_action_usage(a).replace("|", "\\|")
                                           for a in group) + ")"
                parts.append(text)
                continue
            text = _action_usage(action).replace("|", "\\|")
            parts.append(text if not action.option_strings else f"[{text}]")
            if action.option_strings:
                seen.setdefault(action.dest, []).append(command)
        usage = " ".join(parts)
        out.append(f"| `{COMMAND_LINES[command]}` | `{usage}` | {HELP[command]} |")
    out += ["", "| flag | commands | default | meaning |", "|---|---|---|---|"]
    for name, flag in FLAGS.items():
        if flag.positional or flag.hidden or name not in seen:
            continue
        default = "-" if flag.default in (None, False) else f"`{flag.default}`"
        spelled = ", ".join(f"`{n}`" for n in flag.names)
        out.append(f"| {spelled} | {', '.join(seen[name])} | {default} | "
                   f"{flag.help.replace('|', '/')} |")
    if DEPRECATED:
        out += ["", "Deprecated spellings (one more release; each prints one line when used):",
                ""]
        for d in DEPRECATED:
            out.append(f"- `{d.old}` in {', '.join(d.commands)}: now "
                       f"`{FLAGS[d.new].names[-1]}` ({d.why}).")
    return "\n".join(out) + "\n"
