"""What a person sees at the command line (issue #20): help answered without torch, and
verify's stage lines on a terminal (captured through a pseudo-terminal), silent with -q and
when piped, with the final line naming the verdict, the stage and the box that decided it.

No test here asserts a duration: `--help` being quick is checked by what it imports (no
torch, no onnx), which is what made it take 4-15 s.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys

import numpy as np
import onnx
import pytest

import zoo

HEAVY = ("torch", "onnx", "numpy", "jinja2", "networkx", "onnx_graphsurgeon")

HELP_COMMANDS = {
    "shardbound": ["-m", "shardbound", "--help"],
    "shardbound compile": ["-m", "shardbound", "compile", "--help"],
    "shardbound run": ["-m", "shardbound", "run", "--help"],
    "shardbound verify": ["-m", "shardbound", "verify", "--help"],
    "shardbound inspect": ["-m", "shardbound", "inspect", "--help"],
    "compile (console script)": ["-c", "import sys; from shardbound.compiler.cli import "
                                 "compile_main; sys.argv[0] = 'compile'; compile_main()",
                                 "--help"],
    "bad flag": ["-m", "shardbound", "verify", "net.onnx", "p.vnnlib", "--no-such-flag"],
}


def _imported(stderr: str) -> set[str]:
    """Top-level package names from `python -X importtime` lines ('import time: a | b | m')."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize("what", sorted(HELP_COMMANDS))
def test_help_and_bad_flags_import_no_torch(what):
    res = subprocess.run([sys.executable, "-X", "importtime", *HELP_COMMANDS[what]],
                         capture_output=True, text=True, timeout=120)
    imported = _imported(res.stderr)
    assert "argparse" in imported, "importtime output not recognised"
    heavy = sorted(set(HEAVY) & imported)
    assert not heavy, f"`{what}` imported {heavy} before answering"
    if what == "bad flag":
        assert res.returncode == 2 and "--no-such-flag" in res.stderr
    else:
        assert res.returncode == 0 and "usage:" in res.stdout


def test_python_dash_m_shardbound_is_the_shardbound_command():
    a = subprocess.run([sys.executable, "-m", "shardbound", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert a.returncode == 0
    assert a.stdout.startswith("usage: shardbound ")
    for command in ("compile", "run", "verify", "inspect"):
        assert command in a.stdout


# -- verify's stage lines ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def unsat_problem(tmp_path_factory):
    """A small MLP and a property CROWN proves in both of its two boxes."""
    tmp = tmp_path_factory.mktemp("stages")
    model, _ = zoo.mlp(np.random.default_rng(5), sizes=(3, 12, 12, 2))
    onnx.save(model, tmp / "net.onnx")
    lines = [f"(declare-const X_{i} Real)" for i in range(3)]
    lines += ["(declare-const Y_0 Real)", "(declare-const Y_1 Real)"]
    lines += [f"(assert (<= X_{i} 0.1))" for i in range(1, 3)]
    lines += [f"(assert (>= X_{i} -0.1))" for i in range(1, 3)]
    lines += ["(assert (or (and (>= X_0 -0.1) (<= X_0 0.0)) (and (>= X_0 0.0) (<= X_0 0.1))))",
              "(assert (>= Y_0 1000.0))"]
    (tmp / "unsat.vnnlib").write_text("\n".join(lines) + "\n")
    return tmp


def _verify_on_a_terminal(args, timeout=180) -> tuple[int, str]:
    """Run `shardbound verify ARGS` with stdout and stderr on a pseudo-terminal; (exit code,
    everything it wrote, with \\r\\n as \\n)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "shardbound", "verify", *args],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env=dict(os.environ, TERM="dumb"), close_fds=True)
    os.close(slave)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            if not ready:
                proc.kill()
                pytest.fail("verify wrote nothing for too long on the terminal")
            try:
                data = os.read(master, 4096)
            except OSError:             # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    code = proc.wait(timeout=60)
    return code, b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


STAGE_LINE = re.compile(r"^\[\s*\d+\.\d\d s\] (box (\d+)/(\d+)  )?(.+)$")


def test_stage_lines_on_a_terminal(unsat_problem):
    tmp = unsat_problem
    code, text = _verify_on_a_terminal([str(tmp / "net.onnx"), str(tmp / "unsat.vnnlib")])
    assert code == 0, text
    lines = [line for line in text.splitlines() if line.strip()]
    stages = [STAGE_LINE.match(line) for line in lines]
    stages = [m for m in stages if m]
    labels = [m.group(4) for m in stages]
    assert labels[0] == "compile", text
    assert "CROWN" in labels, text
    boxes = {m.group(2) for m in stages if m.group(2)}
    assert boxes == {"1", "2"} and all(m.group(3) == "2" for m in stages if m.group(2)), text
    times = [float(line[1:line.index(" s]")]) for line in lines if STAGE_LINE.match(line)]
    assert times == sorted(times), text
    # the verdict, then the final line: verdict, deciding stage and box, time since start
    tail = [line for line in lines if not STAGE_LINE.match(line)]
    assert tail[-2] == "unsat", text
    final = re.fullmatch(r"# unsat\.vnnlib: unsat -- every box proved, the last \(box 2 of 2\)"
                         r" by (.+); (\d+\.\d\d) s since the command started", tail[-1])
    assert final, text
    assert final.group(1) in labels
    assert float(final.group(2)) >= times[-1]


def test_quiet_on_a_terminal_prints_only_the_verdict(unsat_problem):
    tmp = unsat_problem
    code, text = _verify_on_a_terminal([str(tmp / "net.onnx"), str(tmp / "unsat.vnnlib"), "-q"])
    assert code == 0, text
    assert text.split() == ["unsat"], text


def test_piped_output_has_no_stage_lines(unsat_problem):
    tmp = unsat_problem
    res = subprocess.run([sys.executable, "-m", "shardbound", "verify", str(tmp / "net.onnx"),
                          str(tmp / "unsat.vnnlib")], capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "unsat" and len(lines) == 2 and lines[1].startswith("# unsat.vnnlib: ")
    assert not any(STAGE_LINE.match(line) for line in lines)
