"""fsdp weight streaming: large linear weights are gathered block by block, never whole.

Compiled with a tiny `stream_chunk_bytes`, every linear layer of the test models streams in many
blocks (row blocks forward, column blocks backward, re-gathered for alpha-CROWN gradients), and
the bounds must keep the bits of single mode for P = 2..4 while a rank never holds more than
one block of a weight. Every run is an entry in the fsdp zoo's jobs (multirank.FSDP_ZOO_GUESTS:
the zoo models' P = 3, 4 runs, 7 rank processes fewer; ACAS Xu and `exact` at P = 2, 4 fewer),
so this file shares its xdist group."""

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


def _check(tmp, pairs, methods, worlds, tag, runs):
    """The pairs' streamed fsdp programs on each P of `worlds` (their results in `runs`,
    {P: results}, from the fsdp zoo's jobs) bitwise their single programs (in this process)."""
    reference = run_job(tmp, [s for _, s, _ in pairs], methods, 1, tag=f"{tag}_single")
    for P in worlds:
        got = runs[P]
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


def _p2_guest(tmp):
    """The P = 2 runs, entries in the fsdp zoo's P = 2 job (2 threads a rank: the orders'
    bits do not depend on threads, test_determinism.py) instead of two jobs of their own (4
    rank processes fewer, ~3.5 CPU-s of start-up each): ACAS Xu 1_2 under `blocked` (IBP and
    CROWN) when present, the zoo MLP and residual model under `exact`. Context: (tmp, acas
    pairs, exact pairs)."""
    (tmp / "acas").mkdir()
    (tmp / "exact").mkdir()
    acas = shared_cases("1_2", mnist_seed=None)
    acas_pairs = _compile_pairs(tmp / "acas", acas, "blocked") if acas else []
    models = zoo_cases(tmp / "exact", ("mlp", "residual"), seed=5, radius=0.3)
    exact_pairs = _compile_pairs(tmp / "exact", models, "exact")
    entries = ([{**f, "methods": ACAS_METHODS} for _, _, f in acas_pairs]
               + [f for _, _, f in exact_pairs])
    return entries, (tmp, acas_pairs, exact_pairs)


ACAS_METHODS = ["ibp", "crown"]
FSDP_ZOO_GUESTS["streaming_p2"] = (_p2_guest, (2,))


def test_streamed_bounds_bitwise_equal_single_blocked(tmp_path_factory):
    guests = fsdp_zoo_runs(tmp_path_factory, "guests")
    guest = guests["streaming"]
    tmp, pairs = guest["context"]
    _check(tmp, pairs, METHODS, ZOO_WORLDS, "zoo", runs=guest)
    p2 = guests["streaming_p2"]
    tmp, acas_pairs, _ = p2["context"]
    if acas_pairs:     # a real network: 50x50 weights stream one row or column at a time
        _check(tmp, acas_pairs, ACAS_METHODS, (2,), "acas", runs=p2)


def test_streamed_bounds_bitwise_equal_single_exact(tmp_path_factory):
    p2 = fsdp_zoo_runs(tmp_path_factory, "guests")["streaming_p2"]
    tmp, _, exact_pairs = p2["context"]
    _check(tmp, exact_pairs, METHODS, (2,), "exact", runs=p2)
