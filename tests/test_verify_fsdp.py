"""Verdicts and counterexamples of `verify --summation blocked` are the same, byte for byte, in
single mode and in fsdp with P = 2..4 (weights sharded and streamed, CROWN rows and alphas
split over the ranks), for a property the attack falsifies and one that needs branch and bound.

The reference is the command in single mode (called in this process). P = 2 is the command
itself, launching its ranks; P = 3 and 4 verify both properties in a rank job each
(tests/rank_driver.py: the verifier the command's ranks run, on the same fsdp program), which
saves a launcher process and a compile per run (processes were most of this file's time).
Those two jobs are the fsdp zoo's jobs of P = 3 and 4 (multirank.FSDP_ZOO_GUESTS: this file's
entries ride along, sparing 7 rank processes), so this file shares test_fsdp.py's xdist group.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import zoo
from multirank import FSDP_ZOO_GUESTS, compile_to, fsdp_zoo_runs
from test_verify import _verify, _verify_in_process, _write_property

# jobs of several processes (pyproject.toml); the fsdp zoo's group: its P = 3, 4 jobs run
# this file's verify entries (multirank.FSDP_ZOO_GUESTS, a per-process cache)
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("fsdp_zoo")]

PROPS = ("sat", "unsat")
OPTIONS = ["--summation", "blocked", "--stream-chunk-kib", "1"]
RANK_JOB_WORLDS = (3, 4)


def _properties(tmp):
    """The model (an MLP) and its two properties, written under `tmp`: (tmp, model path)."""
    from shardbound.runtime.program.loader import load

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


def _guest(tmp):
    """The properties, and the fsdp program (compiled as the command compiles it) verifying
    both in one rank-driver entry: ([entry], (tmp, model path, program, {prop: spec}))."""
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.verification.spec import spec_from_property

    tmp, path = _properties(tmp)
    program = compile_to(path, str(tmp / "fsdp_job"), mode="fsdp", summation="blocked",
                         stream_chunk_bytes=1024)
    specs = {}
    for prop in PROPS:
        spec = tmp / f"{prop}.json"
        spec.write_text(spec_from_property(parse_vnnlib(str(tmp / f"{prop}.vnnlib"))).to_json())
        specs[prop] = str(spec)
    return [{"dir": program, "specs": [specs[p] for p in PROPS]}], (tmp, path, program, specs)


FSDP_ZOO_GUESTS["verify_fsdp"] = (_guest, RANK_JOB_WORLDS)


@pytest.fixture(scope="module")
def guest(tmp_path_factory):
    return fsdp_zoo_runs(tmp_path_factory, "guests")["verify_fsdp"]


@pytest.fixture(scope="module")
def properties(guest):
    tmp, path, _, _ = guest["context"]
    return tmp, path


@pytest.fixture(scope="module")
def rank_jobs(guest):
    """{P: {prop: result text}} for P = 3, 4: the guest entry's results in the fsdp zoo's
    job of that P."""
    _, _, program, specs = guest["context"]
    return {P: {prop: guest[P][(program, specs[prop])]["text"] for prop in PROPS}
            for P in RANK_JOB_WORLDS}


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
