"""Verdicts and counterexamples of `verify --summation blocked` are the same, byte for byte, in
single mode and in fsdp with P = 2..4 (weights sharded and streamed, CROWN rows and alphas
split over the ranks), for a property the attack falsifies and one that needs branch and bound.

The reference is the command in single mode (called in this process). P = 2 is the command
itself, launching its ranks; P = 3 and 4 verify both properties in one rank job each
(tests/rank_driver.py: the verifier the command's ranks run, on the same fsdp program), which
saves a launcher process and a compile per run (processes were most of this file's time).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import zoo
from multirank import compile_to, run_job
from test_verify import _verify, _verify_in_process, _write_property

pytestmark = pytest.mark.multirank     # jobs of several processes (pyproject.toml)


@pytest.fixture(scope="module")
def properties(tmp_path_factory):
    from shardbound.runtime.program.loader import load

    tmp = tmp_path_factory.mktemp("verify_fsdp")
    model, _ = zoo.mlp(np.random.default_rng(7), sizes=(3, 16, 16, 2))
    path = tmp / "net.onnx"
    onnx.save(model, path)
    lower, upper = np.full(3, -0.5), np.full(3, 0.5)
    net = load(compile_to(str(path), str(tmp / "probe"), summation="blocked"))
    x = np.random.default_rng(0).uniform(lower, upper, (20000, 3)).astype(np.float32)
    with_samples = net.forward(x).numpy()
    sampled_min = float(with_samples[:, 0].min())
    crown_lower, _ = net.bounds(lower.astype(np.float32), upper.astype(np.float32),
                                C=np.array([[1.0, 0.0]], dtype=np.float32))
    crown_lower = float(crown_lower[0])
    assert crown_lower < sampled_min
    row = np.array([[1.0, 0.0]])
    # Below every sampled output but above CROWN's bound: CROWN alone cannot prove it.
    unsat = crown_lower + 0.3 * (sampled_min - crown_lower)
    _write_property(tmp / "unsat.vnnlib", lower, upper, row, [unsat])
    _write_property(tmp / "sat.vnnlib", lower, upper, row, [sampled_min + 1e-3])
    return tmp, str(path)


PROPS = ("sat", "unsat")
OPTIONS = ["--summation", "blocked", "--stream-chunk-kib", "1"]


@pytest.fixture(scope="module")
def rank_jobs(properties):
    """{P: {prop: result text}} for P = 3, 4: the fsdp program (compiled as the command
    compiles it) verifying both properties in one job per P."""
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.verification.spec import spec_from_property

    tmp, path = properties
    program = compile_to(path, str(tmp / "fsdp_job"), mode="fsdp", summation="blocked",
                         stream_chunk_bytes=1024)
    specs = {}
    for prop in PROPS:
        spec = tmp / f"{prop}.json"
        spec.write_text(spec_from_property(parse_vnnlib(str(tmp / f"{prop}.vnnlib"))).to_json())
        specs[prop] = str(spec)
    entry = {"dir": program, "specs": [specs[p] for p in PROPS]}
    runs = {}
    for P in (3, 4):
        got = run_job(tmp, [entry], [], P, tag="verify_fsdp")
        runs[P] = {prop: got[(program, specs[prop])]["text"] for prop in PROPS}
    return runs


@pytest.mark.parametrize("prop", PROPS)
def test_fsdp_verdicts_and_counterexamples_equal_single(properties, rank_jobs, prop):
    tmp, path = properties
    vnnlib = str(tmp / f"{prop}.vnnlib")
    results = {}
    for P in (1, 2):
        mode = "single" if P == 1 else "fsdp"
        out = tmp / f"{prop}_{P}.txt"
        args = [path, vnnlib, *OPTIONS, "--result", str(out), "-q", "-o", str(tmp / f"{prop}_{mode}")]
        if P == 1:      # the single-mode reference: the CLI called in this process
            res = _verify_in_process(args)
        else:           # the command itself, launching P ranks
            res = _verify(args + ["--mode", mode, "--nproc", str(P)], timeout=300)
        assert res.returncode == 0, res.stderr
        results[P] = out.read_bytes()
    for P in (3, 4):
        results[P] = rank_jobs[P][prop].encode()
    assert results[1].decode().splitlines()[0] == prop
    for P in (2, 3, 4):
        assert results[P] == results[1], (prop, P)
