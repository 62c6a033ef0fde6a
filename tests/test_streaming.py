"""fsdp weight streaming: large linear weights are gathered block by block, never whole.

Compiled with a tiny `stream_chunk_bytes`, every linear layer of the test models streams in many
blocks (row blocks forward, column blocks backward, re-gathered for alpha-CROWN gradients), and
the bounds must keep the bits of single mode for P = 2..4 while a rank never holds more than
one block of a weight. The zoo models' P = 3, 4 runs are entries in the fsdp zoo's jobs
(multirank.FSDP_ZOO_GUESTS: 7 rank processes fewer), so this file shares its xdist group."""

from __future__ import annotations

import pytest

from multirank import (FSDP_ZOO_GUESTS, compile_pairs, fsdp_zoo_runs, run_job, shared_cases,
                       zoo_cases)

# jobs of several processes (pyproject.toml); the fsdp zoo's group: its P = 3, 4 jobs run
# the zoo models' streamed programs (multirank.FSDP_ZOO_GUESTS, a per-process cache)
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("fsdp_zoo")]

CHUNK = 256      # bytes: 64 floats, smaller than most rows of the test weights
METHODS = ["ibp", "crown", "alpha-crown"]


def _compile_pairs(tmp, cases, order):
    return compile_pairs(tmp, cases, "fsdp", summation=order, stream_chunk_bytes=CHUNK)


def _check(tmp, pairs, methods, worlds, tag, runs=None):
    """The pairs' streamed fsdp programs on each P of `worlds` (a job of their own, or the
    results in `runs`, {P: results}) bitwise their single programs (in this process)."""
    reference = run_job(tmp, [s for _, s, _ in pairs], methods, 1, tag=f"{tag}_single")
    for P in worlds:
        got = (runs[P] if runs is not None
               else run_job(tmp, [f for _, _, f in pairs], methods, P, tag=f"{tag}_fsdp"))
        for name, s, f in pairs:
            for m in methods:
                assert got[(f["dir"], m)]["sha"] == reference[(s["dir"], m)]["sha"], (name, m, P)
            mem = got[(f["dir"], "crown")]["memory"]
            # One weight block (at most CHUNK bytes, or one row/column when that is larger)
            # or one bias vector: far below any whole weight matrix of these models.
            assert 0 < mem["peak_gathered_param_bytes"] <= max(CHUNK, 4 * 50), (name, P, mem)
            assert abs(mem["predicted"] - mem["peak_tracked_bytes"]) \
                <= 0.10 * mem["peak_tracked_bytes"], (name, P, mem)


ZOO_WORLDS = (3, 4)


def _zoo_guest(tmp):
    """The zoo models' streamed pairs under `blocked`: ([fsdp entries], (tmp, pairs))."""
    models = zoo_cases(tmp, ("mlp", "residual", "normalized_mlp"), seed=5, radius=0.3)
    pairs = _compile_pairs(tmp, models, "blocked")
    return [f for _, _, f in pairs], (tmp, pairs)


FSDP_ZOO_GUESTS["streaming"] = (_zoo_guest, ZOO_WORLDS)     # its METHODS are the jobs' own


def test_streamed_bounds_bitwise_equal_single_blocked(tmp_path_factory, tmp_path):
    guest = fsdp_zoo_runs(tmp_path_factory, "guests")["streaming"]
    tmp, pairs = guest["context"]
    _check(tmp, pairs, METHODS, ZOO_WORLDS, "zoo", runs=guest)
    acas = shared_cases("1_2", mnist_seed=None)
    if acas:     # a real network: 50x50 weights stream one row or column at a time
        _check(tmp_path, _compile_pairs(tmp_path, acas, "blocked"), ["ibp", "crown"], (2,),
               "acas")


def test_streamed_bounds_bitwise_equal_single_exact(tmp_path):
    models = zoo_cases(tmp_path, ("mlp", "residual"), seed=5, radius=0.3)
    _check(tmp_path, _compile_pairs(tmp_path, models, "exact"), METHODS, (2,), "exact")
