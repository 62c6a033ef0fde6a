"""Split refinement made rigorous (runtime/rigorous/refine.py, issue 17): the refinement's
final leaves, re-evaluated with their own parameters under the error account, tighten the
rigorous bounds (fewer unstable neurons) and hold at sampled points in float64, in `real`
and `float32`; exporting the leaves leaves the engine's refinement the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo
from conftest import compile_onnx_in, random_box


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    model = zoo.mlp(np.random.default_rng(2), sizes=(6, 24, 24, 24, 3))[0]
    return compile_onnx_in(tmp_path_factory.mktemp("rigorous_refine"), model, summation="fast")[0].network


def _unstable(bounds, names):
    return sum(int(((bounds[n][0] < 0) & (bounds[n][1] > 0)).sum()) for n in names)


def test_refined_prior_is_rigorous_tighter_and_leaves_bits_alone(mlp):
    from shardbound.runtime.engine.full_alpha import full_alpha_crown
    from shardbound.runtime.engine.split_refine import refine_by_splits
    from shardbound.runtime.rigorous import RigorousBounds
    from shardbound.runtime.rigorous.refine import refined_bounds

    lower, upper = random_box(np.random.default_rng(4), (6,), radius=0.5)
    lo, hi = (torch.from_numpy(t).reshape(1, 6) for t in (lower, upper))
    with torch.no_grad():
        ibp, known = mlp.intermediate_bounds(lo, hi)
    _, _, alpha_known = full_alpha_crown(mlp, lo, hi, iterations=5, cache=(ibp, known))
    leaves = []
    with torch.no_grad():
        plain = refine_by_splits(mlp, lo, hi, alpha_known, rounds=8, iterations=4)
        float_refined = refine_by_splits(mlp, lo, hi, alpha_known, rounds=8, iterations=4,
                                         leaves=leaves)
    for node, (l, h) in plain.items():
        assert torch.equal(l, float_refined[node][0]) and torch.equal(h, float_refined[node][1])
    targets = [rec.node for rec in leaves]
    assert len(targets) >= 1
    rng = np.random.default_rng(0)
    xs = rng.uniform(lower, upper, (3000, 6))
    xs[:500] = np.where(rng.random((500, 6)) < 0.5, lower, upper)     # vertices
    xs = torch.from_numpy(xs.astype(np.float32).astype(np.float64))
    for mode in ("real", "float32"):
        rig = RigorousBounds(mlp, mode)
        lo64, hi64 = rig.outward(lower[None], upper[None])
        root = rig.all_bounds(lo64, hi64)
        refined = refined_bounds(rig, root, lo64, hi64, leaves)
        assert _unstable(refined, targets) < _unstable(root, targets), mode
        values = {}
        for n in rig.nodes:
            values[n.name] = n.forward([values[i] for i in n.inputs] if n.inputs else [xs])
        for node in targets:
            l, h = refined[node]
            l0, h0 = root[node]
            assert bool((l >= l0).all() and (h <= h0).all()), (mode, node)
            v = values[node].reshape(len(xs), -1)
            assert bool((v >= l.reshape(1, -1)).all() and (v <= h.reshape(1, -1)).all()), \
                (mode, node)
