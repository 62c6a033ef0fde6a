"""fsdp weight streaming: large linear weights are gathered block by block, never whole.

Compiled with a tiny `stream_chunk_bytes`, every linear layer of the test models streams in many
blocks (row blocks forward, column blocks backward, re-gathered for alpha-CROWN gradients), and
the bounds must keep the bits of single mode for P = 2..4 while a rank never holds more than
one block of a weight. The `blocked` and `exact` programs share one job per world size."""

from __future__ import annotations

import pytest

from multirank import compile_pairs, run_job, shared_cases, zoo_cases

pytestmark = pytest.mark.multirank     # jobs of several processes (pyproject.toml)

CHUNK = 256      # bytes: 64 floats, smaller than most rows of the test weights
METHODS = ["ibp", "crown", "alpha-crown"]
WORLDS = {"blocked": (3, 4), "exact": (3,)}


def _compile_pairs(tmp, cases, order):
    return compile_pairs(tmp / order, cases, "fsdp", summation=order, stream_chunk_bytes=CHUNK)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """Streamed fsdp programs of the zoo models under `blocked` and `exact`, next to their
    single-mode programs: the single ones in one in-process job, the fsdp ones in one job per
    world size (each order on its WORLDS)."""
    tmp = tmp_path_factory.mktemp("streaming")
    for order in WORLDS:
        (tmp / order).mkdir()
    pairs = {"blocked": _compile_pairs(tmp, zoo_cases(tmp, ("mlp", "residual", "normalized_mlp"),
                                                      seed=5, radius=0.3), "blocked"),
             "exact": _compile_pairs(tmp, zoo_cases(tmp, ("mlp", "residual"), seed=5, radius=0.3),
                                     "exact")}
    reference = run_job(tmp, [s for p in pairs.values() for _, s, _ in p], METHODS, 1,
                        tag="single")
    worlds = sorted({P for ws in WORLDS.values() for P in ws})
    runs = {P: run_job(tmp, [f for order, p in pairs.items() if P in WORLDS[order]
                             for _, _, f in p], METHODS, P, tag="fsdp") for P in worlds}
    return tmp, pairs, reference, runs


def _check(pairs, reference, runs, methods, worlds):
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


def test_streamed_bounds_bitwise_equal_single_blocked(streamed):
    tmp, pairs, reference, runs = streamed
    _check(pairs["blocked"], reference, runs, METHODS, WORLDS["blocked"])
    acas = shared_cases("1_2", mnist_seed=None)
    if acas:     # a real network: 50x50 weights stream one row or column at a time
        acas_pairs = _compile_pairs(tmp, acas, "blocked")
        methods = ["ibp", "crown"]
        reference = run_job(tmp, [s for _, s, _ in acas_pairs], methods, 1, tag="acas_single")
        runs = {2: run_job(tmp, [f for _, _, f in acas_pairs], methods, 2, tag="acas_fsdp")}
        _check(acas_pairs, reference, runs, methods, (2,))


def test_streamed_bounds_bitwise_equal_single_exact(streamed):
    _, pairs, reference, runs = streamed
    _check(pairs["exact"], reference, runs, METHODS, WORLDS["exact"])
