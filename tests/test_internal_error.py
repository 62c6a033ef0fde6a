"""A bug of ours (an exception that is not a ShardboundError) reaches a user of a console
script as one line naming the exception and where it was raised, with exit code 4, never as
a traceback; SHARDBOUND_TRACEBACK=1 shows the traceback (runtime/program/main.py `guarded`).
The bug is planted by replacing the compile step in a child interpreter that then runs the
`compile` entry point as its own process would (argv None)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PLANT = ("import sys; import shardbound.compiler.cli as cli\n"
         "def broken(args):\n"
         "    raise KeyError('planted')\n"
         "cli._compile = broken\n"
         "sys.argv = ['compile', 'model.onnx']\n"
         "cli.compile_main()\n")


def _run(tmp_path, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SHARDBOUND_TRACEBACK")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", PLANT], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)


def test_an_internal_error_is_one_line_with_exit_code_4(tmp_path):
    r = _run(tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 4, r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: internal error: <string>:3: KeyError: ")
    assert "planted" in lines[0] and "SHARDBOUND_TRACEBACK=1" in lines[0]


def _broken():
    raise KeyError("planted")


def test_the_traceback_when_asked_or_called_from_python(monkeypatch):
    from shardbound.runtime.program.main import guarded

    monkeypatch.delenv("SHARDBOUND_TRACEBACK", raising=False)
    with pytest.raises(KeyError):           # a call from Python (own=False) propagates
        guarded(_broken)
    monkeypatch.setenv("SHARDBOUND_TRACEBACK", "1")
    with pytest.raises(KeyError):           # asked for: the traceback, even owning the process
        guarded(_broken, own=True)
