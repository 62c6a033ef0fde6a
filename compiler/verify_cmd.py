"""`shardbound verify MODEL.onnx PROP.vnnlib`: compile, then run the verifier on P ranks.

The model is compiled (into --out, or a temporary directory), the VNN-LIB property is parsed
here (with errors naming the file, line and token) and handed to the program as a spec file;
the compiled program then verifies it in-process or on --nproc ranks. The timeout covers the
whole command from the start of its process (interpreter start-up and compilation included,
as a harness measures it): every stage checks the budget, the ranks get the deadline as a
wall-clock time, collectives time out with it, and a watchdog answers `timeout` if the
verdict is not out shortly after it. The temporary compile directory is removed on every
exit, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from shardbound.options import RunOptions

# The verdict is out by --timeout S in every mode. The stages stop STOP_MARGIN before S; a
# stage stuck inside one long torch call (a CROWN pass over a big conv layer) is answered
# `timeout` by the watchdog, which fires ANSWER_HEADROOM before S in one process. With ranks
# the launcher first kills ranks still running DEADLINE_GRACE (1 s) after the stage deadline
# and answers, so the ranks' stages stop earlier (STOP_MARGIN_RANKS) and the watchdog, a
# last backstop behind the launcher, waits for it (WATCHDOG_GRACE_RANKS).
STOP_MARGIN = 0.5               # one process: stages stop this long before --timeout
STOP_MARGIN_RANKS = 1.5         # ranks: room for the launcher's kill (1 s) before S
ANSWER_HEADROOM = 0.1           # one process: the watchdog's answer lands this long before S
WATCHDOG_GRACE_RANKS = 1.3      # ranks: past the stage deadline, after the launcher's kill


def run_verify(args) -> int:
    from shardbound.runtime.program import interrupts
    from shardbound.runtime.program.verify_main import (VerifyDeadline, answer_timeout,
                                                        process_age)
    from shardbound.runtime.verification.stages import StageLog

    # The command's budget counts from the process start (interpreter and imports included);
    # a call from Python (a test session, a notebook) counts from the call: a process that
    # has run for an hour must not start with its budget spent.
    # A process started ahead of its request (compiler/prestart.py) counts from the request.
    started_at = _given_start() or (
        time.time() - (0.0 if not interrupts.installed() else process_age()))
    nproc = args.nproc or 1
    watchdog = None

    def budget_for(nproc):
        """The stages' deadline for a job of `nproc` ranks, and its watchdog (replacing the
        one before)."""
        nonlocal watchdog
        margin, grace = stop_margins(args.timeout, nproc)
        deadline = VerifyDeadline.at_wall(started_at + args.timeout - margin)
        if watchdog is not None:
            watchdog.cancel()
        if interrupts.installed():      # this process is the command (not a call from Python)
            watchdog = interrupts.Deadline(deadline.monotonic,
                                           lambda: _late_answer(args, started_at), grace)
        return deadline

    deadline = budget_for(nproc)
    tmp = tempfile.mkdtemp(prefix="shardbound-verify-")

    def remove_tmp():
        shutil.rmtree(tmp, ignore_errors=True)

    interrupts.add_cleanup(remove_tmp)
    stages = StageLog(started_at, quiet=args.quiet)
    try:
        stages.start("compile")
        spec_path, out = _compile_for_verify(args, tmp)
        if args.memory_budget is not None and args.nproc is None:
            from shardbound.runtime.program.loader import read_plan

            nproc = int(read_plan(out).get("nproc", 1))     # the planner's rank count
            if nproc > 1:
                deadline = budget_for(nproc)
        if deadline.remaining() <= 0:           # compilation used the whole budget
            answer_timeout(args.result, args.json, os.path.basename(args.property), started_at)
            return 0
        if nproc > 1:
            stages.start("launch")
        stages.end()
        _write_prelude(spec_path, stages.records)
        from shardbound.runtime.program.main import run

        return run(out, RunOptions(verify=spec_path, result=args.result, json=args.json,
                                   verify_timeout=deadline.remaining(),
                                   verify_deadline=deadline.wall, started_at=started_at,
                                   nproc=nproc, threads=args.threads, device=args.device,
                                   collective_timeout=max(1.0, deadline.remaining() + 1.0),
                                   memory_budget=args.memory_budget,
                                   soundness=args.soundness, milp=args.milp,
                                   quiet=args.quiet,
                                   no_watchdog=True))
    finally:
        if watchdog is not None:
            watchdog.cancel()
        interrupts.remove_cleanup(remove_tmp)
        remove_tmp()


def stop_margins(timeout: float, nproc: int) -> tuple[float, float]:
    """(how long before `timeout` the stages stop, how long after that the watchdog answers)
    for a job of `nproc` ranks. Short timeouts stop at most a tenth early."""
    if nproc <= 1:
        margin = min(STOP_MARGIN, timeout / 10)
        return margin, max(0.0, margin - ANSWER_HEADROOM)
    return min(STOP_MARGIN_RANKS, timeout / 10), WATCHDOG_GRACE_RANKS


def _given_start() -> float | None:
    """The wall-clock start that compiler/prestart.py passes for its request (the time
    run_instance.sh started), or None."""
    from shardbound.compiler.prestart import STARTED_AT_ENV

    try:
        given = float(os.environ.get(STARTED_AT_ENV, ""))
    except ValueError:
        return None
    return given if 0 < given <= time.time() + 1 else None


def _compile_for_verify(args, tmp: str) -> tuple[str, str]:
    """Parse the property, compile the model (into -o DIR or the temporary directory) and
    write the spec the program reads; (spec path, program directory)."""
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.options import pass_options
    from shardbound.runtime.verification.spec import spec_from_property
    from shardbound.runtime.verification.verdict import check_spec_fits

    prop = parse_vnnlib(args.property)
    out = args.out or os.path.join(tmp, "program")
    from dataclasses import replace

    options = default_budget(args, pass_options(args))
    spec = spec_from_property(prop)
    if options.memory_budget is not None:       # verify runs CROWN, alpha-CROWN and BaB
        # on the property's rows: every case's conjunctions stacked (SpecCase.stacked)
        options = replace(options, plan_methods=("crown", "alpha-crown", "full-alpha-crown"),
                          spec_rows=spec_rows(spec))
    plans: list = []
    graph = _compile_folding_if_needed(args.model, out, options, plans, prop)
    check_spec_fits(spec, graph.input.shape, graph.node(graph.output).shape)
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        f.write(spec.to_json())
    if plans:
        _write_plan(spec_path, plans[0], tiled=graph.annotations.get("budget") is not None,
                    quiet=args.quiet)
    return spec_path, out


def _compile_folding_if_needed(model: str, out: str, options, plans: list, prop):
    """Compile the model as it is; where that is refused and the property fixes some input
    elements (lower == upper in every case), compile again with them folded in as constants
    (compiler/fixed_inputs.py): a shape or index the model computes from fixed inputs is then
    static. The program is then specific to those values (plan.json "fixed_inputs"). Only
    on a refusal, so a model that compiles as it is keeps its program bit for bit."""
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.errors import ShardboundError
    from shardbound.compiler.fixed_inputs import FixedInputs

    try:
        return compile_model(model, out, options, plan_out=plans)
    except ShardboundError:
        fixed = FixedInputs.from_cases(prop.cases)
        if fixed is None:
            raise
    del plans[:]
    try:
        return compile_model(model, out, options, plan_out=plans, fixed=fixed)
    except ShardboundError as e:
        raise ShardboundError(f"{e} (with the {fixed.indices.size} input values the property "
                              "fixes folded in as constants)") from None


def default_budget(args, options):
    """`options` with verify's default memory budget when none was given: DEFAULT_FRACTION
    of the memory available to the process (runtime/accounting/available.py) shared by the
    job's ranks, planned in the mode and on the P asked for (row tiles, stream chunks and
    batches only) and not enforced. `--memory-budget none` (0), a budget given, or an
    unreadable machine: `options` as they are."""
    if args.memory_budget is not None or options.memory_budget is not None:
        return options
    if options.mode == "single" and options.nproc > 1:      # nothing of P to plan
        return options
    from dataclasses import replace

    from shardbound.runtime.accounting import available

    gpu = _device_reader(args)          # a GPU per rank (nccl): not shared by the ranks
    found = available.default_budget(1 if gpu else options.nproc, reader=gpu)
    if found is None:
        return options
    return replace(options, memory_budget=found.per_rank, budget_source=found.describe())


def _device_reader(args):
    """Where the tracked bytes will live: a GPU's free memory for --device cuda (auto: when
    one is there), else None (the host's: available.available_memory)."""
    if getattr(args, "device", "cpu") == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from shardbound.runtime.accounting.available import Available

    return lambda: Available(int(torch.cuda.mem_get_info()[0]), "cudaMemGetInfo free")


def _write_plan(spec_path: str, plan, tiled: bool, quiet: bool) -> None:
    """The default budget's choice: into the spec file (rank 0's --json report carries it as
    `plan`), and one `plan:` line on a terminal when it changed the program (row tiles)."""
    import json
    import sys

    with open(spec_path, encoding="utf-8") as f:
        data = json.load(f)
    data["plan"] = dict(plan.as_json(), changed=tiled)
    if not tiled and plan.source:       # today's program: its batch is chosen at run time
        data["plan"]["bab_batch"] = None
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    if tiled and plan.source and not quiet:     # a terminal's stage lines, else stderr
        print(f"plan: {plan.text()}", flush=True,
              file=sys.stdout if sys.stdout.isatty() else sys.stderr)


def spec_rows(spec) -> int:
    """The most rows a final pass of `spec` carries: one case's conjunctions stacked."""
    return max([sum(len(k.d) for k in case.conjunctions) for case in spec.cases] + [1])


def _write_prelude(spec_path: str, records) -> None:
    """The stages run here (compile, launch) go to the ranks inside the spec file, so rank 0's
    --json report and stage records hold them too."""
    import json

    with open(spec_path, encoding="utf-8") as f:
        data = json.load(f)
    data["prelude"] = [r.as_json() for r in records]
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def _late_answer(args, started_at: float) -> None:
    """The watchdog's answer (it then runs the cleanups: ranks killed, temporary files gone);
    the --json report's seconds_since_start counts from the command's start like every
    other answer's."""
    from shardbound.runtime.program.report import write_output

    print("timeout", flush=True)
    if args.result:
        write_output(args.result, "timeout\n")
    if args.json:
        from shardbound.runtime.program.verify_main import report_json

        write_output(args.json, report_json("timeout", os.path.basename(args.property),
                                            time.time() - started_at))
