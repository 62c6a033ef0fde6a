"""Determinism (DESIGN.md D1, D2): bitwise-identical bounds across runs, thread counts and world
sizes, for the `blocked` and `exact` summation orders, on the zoo and the shared networks.
Every comparison is bitwise (bounds_sha256 / torch.equal), never allclose."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import random_box
from multirank import FSDP_EXACT_MODELS, FSDP_METHODS, fsdp_zoo_runs

# jobs of several processes (pyproject.toml); one xdist group with test_fsdp.py, whose blocked
# zoo jobs it reads (multirank.fsdp_zoo_runs, a per-process cache)
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("fsdp_zoo")]

MODELS = FSDP_EXACT_MODELS          # (and FSDP_ZOO_MODELS, a superset, under blocked)
METHODS = FSDP_METHODS              # IBP, CROWN, alpha-CROWN
# full alpha-CROWN: blocked is the claim (multirank.fsdp_zoo_runs runs it on the zoo models)


@pytest.fixture(scope="module", params=["blocked", "exact"])
def runs(request, tmp_path_factory):
    """Single programs on 1 and 2 threads and fsdp programs on P = 1..4 ranks
    (multirank.fsdp_jobs), from multirank.fsdp_zoo_runs: `blocked`, test_fsdp.py's zoo
    programs and runs (the same models and layout_ops); `exact`, this file's models (other
    seeds and boxes) in the same jobs."""
    return request.param, fsdp_zoo_runs(tmp_path_factory, request.param)


def test_bounds_identical_across_threads_and_world_sizes(runs):
    order, jobs = runs
    pairs, ref, two = jobs["pairs"], jobs["t1"], jobs["t2"]
    assert set(MODELS) <= {name for name, _, _ in pairs}
    if order == "blocked":
        assert all("full-alpha-crown" in s.get("extra_methods", ())
                   for name, s, _ in pairs if name in MODELS)
    for name, s, _ in pairs:
        for m in METHODS + s.get("extra_methods", []):
            assert two[(s["dir"], m)]["sha"] == ref[(s["dir"], m)]["sha"], (order, name, m, "threads")
    assert sorted(jobs["fsdp"]) == [1, 2, 3, 4]
    for P, got in jobs["fsdp"].items():   # 2 threads per rank at P = 2
        for name, s, f in pairs:
            for m in METHODS + s.get("extra_methods", []):
                assert got[(f["dir"], m)]["sha"] == ref[(s["dir"], m)]["sha"], (order, name, m, P)


def test_three_runs_give_identical_bounds(compile_zoo):
    verifier, _, _ = compile_zoo("residual", summation="blocked")
    lo, hi = random_box(np.random.default_rng(3), verifier.input_shape, radius=0.3)
    runs = [verifier.bounds(lo, hi, method=m) for m in ("crown",) * 3]
    for lb, ub in runs[1:]:
        assert torch.equal(lb, runs[0][0]) and torch.equal(ub, runs[0][1])


def test_fast_order_repeats_run_to_run(compile_zoo):
    verifier, _, _ = compile_zoo("cnn_batchnorm", summation="fast")
    lo, hi = random_box(np.random.default_rng(3), verifier.input_shape, radius=0.3)
    a = verifier.bounds(lo, hi)
    b = verifier.bounds(lo, hi)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_exact_contraction_is_independent_of_block_order_and_threads():
    """The same contraction with its K axis permuted (another block order) and under 1 and 2
    threads: `exact` gives the same bits; the float64 reference agrees to 1 ulp."""
    from shardbound.runtime.numerics import contract

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 1000, generator=g)
    w = torch.randn(23, 1000, generator=g)
    perm = torch.randperm(1000, generator=g)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = contract.matmul(x, w, "exact")
        torch.set_num_threads(2)
        b = contract.matmul(x[:, perm].contiguous(), w[:, perm].contiguous(), "exact")
        c = contract.matmul(x[5:9], w, "exact")
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(a, b)
    assert torch.equal(a[5:9], c)
    ref = (x.double() @ w.double().T).float()
    assert torch.equal(a, ref) or float((a - ref).abs().max()) <= float(ref.abs().max()) * 2 ** -23
