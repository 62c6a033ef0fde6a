"""vnncomp/prepare_instance.sh and run_instance.sh end to end on a tiny MLP (no shared
benchmarks needed): a trivially sat property gives `sat` with a counterexample that
onnxruntime confirms, a property far outside the IBP bounds gives `unsat`, a verifier that
fails still leaves a result file (`error`), and a wrong version string is refused."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import zoo
from test_verify import _forward, _parse_result

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
PREPARE = os.path.join(ROOT, "vnncomp", "prepare_instance.sh")
RUN = os.path.join(ROOT, "vnncomp", "run_instance.sh")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _write_property(path, lower, upper, row, d):
    """Violation region {x in box : row @ y <= d}."""
    lines = [f"(declare-const X_{i} Real)" for i in range(len(lower))]
    lines += [f"(declare-const Y_{j} Real)" for j in range(len(row))]
    for i, (lo, hi) in enumerate(zip(lower, upper)):
        lines += [f"(assert (>= X_{i} {float(lo)!r}))", f"(assert (<= X_{i} {float(hi)!r}))"]
    terms = " ".join(f"(* {float(c)!r} Y_{j})" for j, c in enumerate(row) if c != 0)
    lines.append(f"(assert (<= (+ {terms} 0.0) {float(d)!r}))")
    path.write_text("\n".join(lines) + "\n")


def _ibp(model, lower, upper):
    """Interval bounds of a Gemm(transB=1)/Relu chain, in float64."""
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    lo, hi = np.asarray(lower, np.float64), np.asarray(upper, np.float64)
    for node in model.graph.node:
        if node.op_type == "Gemm":
            w, b = inits[node.input[1]], inits[node.input[2]]
            mid, rad = (lo + hi) / 2, (hi - lo) / 2
            mid, rad = w @ mid + b, np.abs(w) @ rad
            lo, hi = mid - rad, mid + rad
        else:
            assert node.op_type == "Relu"
            lo, hi = np.maximum(lo, 0), np.maximum(hi, 0)
    return lo, hi


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vnncomp") / "dir with spaces"
    tmp.mkdir()
    model, shape = zoo.mlp(np.random.default_rng(0), sizes=(3, 8, 2))
    onnx_path = tmp / "tiny net.onnx"
    onnx.save(model, onnx_path)
    lower, upper = np.full(3, -0.25), np.full(3, 0.25)
    row = np.array([1.0, -1.0])
    y_centre = _forward(model, (lower + upper) / 2).astype(np.float64)
    _write_property(tmp / "sat prop.vnnlib", lower, upper, row, row @ y_centre + 0.1)
    lo, hi = _ibp(model, lower, upper)
    _write_property(tmp / "unsat prop.vnnlib", lower, upper, row, (lo[0] - hi[1]) - 10.0)
    env = dict(os.environ, SHARDBOUND_VNNCOMP_STATE=str(tmp / "state"))
    return tmp, model, onnx_path, lower, upper, row, env


def _sh(script, *args, env, timeout=60):
    return subprocess.run(["bash", script, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _run_instance(instance, prop, result):
    tmp, model, onnx_path, *_, env = instance
    res = _sh(PREPARE, "v1", "test", onnx_path, tmp / prop, env=env)
    assert res.returncode == 0, res.stderr
    result.write_text("stale\n")             # must be replaced, never read back
    res = _sh(RUN, "v1", "test", onnx_path, tmp / prop, result, 30, env=env)
    assert res.returncode == 0, res.stderr
    return res


def test_sat_instance_writes_a_checked_counterexample(instance):
    tmp, model, _, lower, upper, row, _ = instance
    result = tmp / "sat result.txt"
    res = _run_instance(instance, "sat prop.vnnlib", result)
    assert res.stdout.splitlines()[0] == "sat"
    verdict, values = _parse_result(result.read_text())
    assert verdict == "sat"
    x = np.array([values[f"X_{i}"] for i in range(3)])
    y_reported = np.array([values[f"Y_{j}"] for j in range(2)])
    assert np.all(x >= lower - 1e-6) and np.all(x <= upper + 1e-6)
    y = _forward(model, x).astype(np.float64)
    assert np.allclose(y, y_reported, rtol=1e-4, atol=1e-5)
    from shardbound.compiler.vnnlib import parse_vnnlib
    prop = parse_vnnlib(tmp / "sat prop.vnnlib")
    assert prop.is_counterexample(x, y)


def test_unsat_instance(instance):
    tmp = instance[0]
    result = tmp / "unsat result.txt"
    res = _run_instance(instance, "unsat prop.vnnlib", result)
    assert res.stdout.splitlines()[0] == "unsat"
    assert result.read_text().splitlines()[0] == "unsat"


def test_failing_verifier_still_writes_a_result(instance):
    tmp = instance[0]
    (tmp / "broken.vnnlib").write_text("(declare-const X_0 Real)\n(assert (<= X_0 1.2.3))\n")
    result = tmp / "broken result.txt"
    res = _run_instance(instance, "broken.vnnlib", result)
    assert result.read_text() == "error\n"
    assert "error" in res.stderr


def test_wrong_version_is_refused(instance):
    tmp, _, onnx_path, *_, env = instance
    res = _sh(PREPARE, "v2", "test", onnx_path, tmp / "sat prop.vnnlib", env=env)
    assert res.returncode != 0
    assert "v1" in res.stderr
    res = _sh(RUN, "v2", "test", onnx_path, tmp / "sat prop.vnnlib", tmp / "r.txt", 30, env=env)
    assert res.returncode != 0


def test_unclaimed_prestarted_verifier_is_stopped_and_prestart_can_be_off(instance):
    """run_instance.sh for a model other than the prepared one starts its own `shardbound
    verify` and stops the prestarted process left unused (a stand-in here: a sleeping
    process named like one, so no second torch start is paid); with
    SHARDBOUND_VNNCOMP_PRESTART=0 prepare_instance.sh starts nothing. (Every other test of
    this file runs through a real prestarted verifier, compiler/prestart.py.)"""
    import sys

    tmp, model, onnx_path, *_, env = instance
    state = env["SHARDBOUND_VNNCOMP_STATE"]
    off = dict(env, SHARDBOUND_VNNCOMP_PRESTART="0")
    res = _sh(PREPARE, "v1", "test", onnx_path, tmp / "unsat prop.vnnlib", env=off)
    assert res.returncode == 0 and not os.path.exists(os.path.join(state, "ready"))
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                 "shardbound.compiler.prestart"], start_new_session=True)
    try:
        # The state prepare_instance.sh leaves when it prestarted a process (with prestart
        # off it creates no state folder; the fresh-venv run met this test first without one).
        os.makedirs(state, exist_ok=True)
        with open(os.path.join(state, "run.pid"), "w", encoding="ascii") as f:
            f.write(f"{stand_in.pid}\n")
        with open(os.path.join(state, "ready"), "w", encoding="utf-8") as f:
            f.write(str(tmp / "another model.onnx"))
        result = tmp / "fallback result.txt"
        res = _sh(RUN, "v1", "test", onnx_path, tmp / "unsat prop.vnnlib", result, 30, env=env)
        assert res.returncode == 0, res.stderr
        assert result.read_text() == "unsat\n"
        assert stand_in.wait(timeout=10) != 0          # killed, not left running
        assert not os.path.exists(os.path.join(state, "ready"))
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()


def test_prestart_request_and_start_time(tmp_path, monkeypatch):
    """The request's NUL-separated fields, and the start time a prestarted verify counts its
    budget from (run_instance.sh's, not the long-lived process's)."""
    import time

    from shardbound.compiler import prestart
    from shardbound.compiler.verify_cmd import _given_start

    fifo = tmp_path / "request"                 # a plain file reads the same way
    values = ["1.5", "a b.onnx", "p.vnnlib", "r.txt", "30", "", "o", "e", "rc"]
    fifo.write_bytes(b"\0".join(v.encode() for v in values) + b"\0")
    assert prestart.read_request(str(fifo)) == dict(zip(prestart.FIELDS, values))
    fifo.write_bytes(b"1.5\0x")
    with pytest.raises(ValueError):
        prestart.read_request(str(fifo))
    now = time.time()
    monkeypatch.setenv(prestart.STARTED_AT_ENV, repr(now - 3.0))
    assert _given_start() == now - 3.0
    for bad in ("", "soon", repr(now + 100)):
        monkeypatch.setenv(prestart.STARTED_AT_ENV, bad)
        assert _given_start() is None
