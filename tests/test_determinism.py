"""Determinism (DESIGN.md D1, D2): bitwise-identical bounds across runs, thread counts and world
sizes, for the `blocked` and `exact` summation orders, on the zoo and the shared networks.
Every comparison is bitwise (bounds_sha256 / torch.equal), never allclose."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import random_box
from multirank import compile_pairs, run_job, shared_cases, zoo_cases

pytestmark = pytest.mark.multirank     # jobs of several processes (pyproject.toml)

MODELS = ("mlp", "cnn_batchnorm", "residual", "cnn_avgpool")
METHODS = ["ibp", "crown", "alpha-crown"]
FULL = {"blocked": ["full-alpha-crown"], "exact": []}    # full alpha-CROWN: blocked is the claim


def _models(tmp):
    return (zoo_cases(tmp, MODELS, seed=21, radius=0.2)
            + shared_cases("1_9", (-0.3, -0.2, -0.5, 0.3, 0.3), 0.1, mnist_seed=4))


@pytest.fixture(scope="module", params=["blocked", "exact"])
def compiled(request, tmp_path_factory):
    order = request.param
    tmp = tmp_path_factory.mktemp(f"det_{order}")
    return order, tmp, compile_pairs(tmp, _models(tmp), "fsdp", summation=order)


def test_bounds_identical_across_threads_and_world_sizes(compiled):
    order, tmp, pairs = compiled
    methods = METHODS + FULL[order]
    singles = [s for _, s, _ in pairs]
    ref = run_job(tmp, singles, methods, 1, threads=1, tag="t1")
    two = run_job(tmp, singles, methods, 1, threads=2, tag="t2")
    for name, s, _ in pairs:
        for m in methods:
            assert two[(s["dir"], m)]["sha"] == ref[(s["dir"], m)]["sha"], (order, name, m, "threads")
    for P in (1, 2, 3, 4):
        got = run_job(tmp, [f for _, _, f in pairs], methods, P, threads=1 + (P == 2), tag="fsdp")
        for name, s, f in pairs:
            for m in methods:
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
