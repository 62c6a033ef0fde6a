"""A verifier process started ahead of its instance (vnncomp/prepare_instance.sh).

    python -m shardbound.compiler.prestart STATE_DIR MODEL.onnx

Why: on ACAS Xu an instance's own work is a fraction of a second, and `import torch`, the
compiler's imports (onnx, jinja2) and compiling the network cost 1.2-2 CPU seconds of every
fresh `shardbound verify` process: three quarters of the family's time. VNN-COMP gives
`prepare_instance.sh` (untimed, called before each instance with the model and property)
for converting the model; this process does that conversion there and keeps the result in
memory: it imports what a verify needs, compiles MODEL once (which also warms every import
and first-call kernel), writes STATE_DIR/ready (the model path) and waits for ONE request on
the FIFO STATE_DIR/request. It never reads the property before the request: nothing of the
instance's analysis happens ahead of the timed run.

A request (written by run_instance.sh) is NUL-separated fields: the wall-clock time
run_instance.sh started, MODEL, PROPERTY, RESULT, TIMEOUT, threads (or empty), and the files
for stdout and stderr, and the FIFO that gets the exit code. The process then runs exactly the command that
run_instance.sh would have started (`shardbound verify MODEL PROPERTY --timeout TIMEOUT
--result RESULT --quiet --summation fast [--threads N]`), its budget counted from
run_instance.sh's start (SHARDBOUND_VERIFY_STARTED_AT), and exits: one instance per process,
so nothing (memory, caches, RNG state) passes from one instance to the next. Unclaimed, it
exits SHARDBOUND_VNNCOMP_IDLE seconds (default 300) after it was ready. Its CPU seconds
before and after the request go to STATE_DIR/cpu (`prepare request`), for bench/vnncomp.py.
"""

from __future__ import annotations

import os
import sys
import threading
import time

STARTED_AT_ENV = "SHARDBOUND_VERIFY_STARTED_AT"
IDLE_ENV = "SHARDBOUND_VNNCOMP_IDLE"
FIELDS = ("started_at", "model", "property", "result", "timeout", "threads", "out", "err", "rc")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def warm_up(model: str) -> None:
    """Import and compile what a verify of `model` runs, and run one CROWN pass, so that the
    timed request pays for none of it. Failures are left for the request to report."""
    import tempfile

    import torch  # noqa: F401

    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib  # noqa: F401
    from shardbound.options import pass_options
    from shardbound.runtime.program.loader import load
    from shardbound.runtime.verification import verdict  # noqa: F401
    from shardbound.compiler.cli import build_parser

    args = build_parser().parse_args(["verify", model, "unused.vnnlib", "--summation", "fast"])
    with tempfile.TemporaryDirectory(prefix="shardbound-prestart-") as tmp:
        out = os.path.join(tmp, "program")
        compile_model(model, out, pass_options(args))
        verifier = load(out)
        net = verifier.network
        with torch.no_grad():
            lo = torch.zeros((1, *net.input_shape))
            cache = net.intermediate_bounds(lo - 1e-3, lo + 1e-3)
            rows = int(torch.Size(net.output_shape).numel())
            net.final_crown(*cache, lo - 1e-3, lo + 1e-3, torch.eye(rows))


def read_request(fifo: str) -> dict:
    with open(fifo, "rb") as f:         # blocks until run_instance.sh writes
        raw = f.read()
    parts = raw.split(b"\0")
    if len(parts) < len(FIELDS):
        raise ValueError(f"malformed request ({len(parts)} fields)")
    return {k: os.fsdecode(v) for k, v in zip(FIELDS, parts)}


def serve(state: str, model: str) -> int:
    try:
        warm_up(model)
    except Exception:  # noqa: BLE001 - the request compiles again and reports the error
        pass
    fifo = os.path.join(state, "request")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    ready = os.path.join(state, "ready")
    with open(ready + ".tmp", "w", encoding="utf-8") as f:
        f.write(model)
    os.replace(ready + ".tmp", ready)
    idle = float(os.environ.get(IDLE_ENV, "300"))
    unclaimed = threading.Timer(idle, lambda: os._exit(0))     # never claimed: go away
    unclaimed.daemon = True
    unclaimed.start()
    req = read_request(fifo)
    unclaimed.cancel()
    prepare_cpu = _cpu()
    # The exit code goes through run_instance.sh's FIFO, held open from here: its reader gets
    # the code, or end of file the moment this process dies. Waiting for the process itself
    # took 1.3 s past its os._exit here (an exited process stays until its reaper, init,
    # collects it), which put a timed-out instance over its timeout.
    done = open(req["rc"], "w", encoding="ascii")      # noqa: SIM115 - held to the end
    os.environ[STARTED_AT_ENV] = req["started_at"]
    argv = ["verify", req["model"], req["property"], "--timeout", req["timeout"],
            "--result", req["result"], "--quiet", "--summation", "fast"]
    if req["threads"]:
        argv += ["--threads", req["threads"]]
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, req["out"]), (2, req["err"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    from shardbound.compiler.cli import build_parser
    from shardbound.runtime.program.main import guarded

    code = 2
    try:
        args = build_parser().parse_args(argv)
        code = guarded(args.fn, args, own=True)
    except SystemExit as e:             # argparse: a bad TIMEOUT or threads value
        code = e.code if isinstance(e.code, int) else 2
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _write(os.path.join(state, "cpu"), f"{prepare_cpu:.6f} {_cpu() - prepare_cpu:.6f}\n")
        try:
            done.write(f"{code}\n")
            done.close()
        except OSError:
            pass
    return code


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        pass


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit("usage: python -m shardbound.compiler.prestart STATE_DIR MODEL.onnx")
    from shardbound.runtime.program import interrupts

    interrupts.install()                # SIGTERM from prepare_instance.sh: clean stop
    code = serve(*argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)                      # skip torch's teardown (see main.leave)


if __name__ == "__main__":
    main()
