"""Split refinement of intermediate bounds (runtime/engine/split_refine.py): never looser than
the bounds it starts from, sound by sampling and projected-gradient attacks on every tightened
node, tighter than CROWN and alpha-CROWN (fewer unstable neurons), bitwise repeatable; and
beta-CROWN's warm-started betas (runtime/engine/beta.py) stay sound from any start."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import zoo
from conftest import random_box
from soundness import assert_sound


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    tmp = tmp_path_factory.mktemp("split_refine")
    onnx.save(zoo.mlp(np.random.default_rng(2), sizes=(6, 24, 24, 24, 3))[0], tmp / "m.onnx")
    compile_model(str(tmp / "m.onnx"), str(tmp / "prog"), PassOptions(summation="fast"))
    return load(str(tmp / "prog")).network


def _node_values(net, name):
    def forward(x):
        vals = {}
        for n in net.nodes:
            vals[n.name] = (n.forward(*(vals[i] for i in n.inputs)) if n.inputs
                            else x.reshape(-1, *net.input_shape))
            if n.name == name:
                return vals[name].reshape(x.shape[0], -1)
        raise KeyError(name)
    return forward


def _unstable(known):
    return sum(int(((l < 0) & (h > 0)).sum()) for l, h in known.values())


def test_split_refinement_is_sound_tighter_and_repeats(mlp):
    from shardbound.runtime.engine.full_alpha import full_alpha_crown
    from shardbound.runtime.engine.split_refine import needs_refinement, refine_by_splits

    lo, hi = (torch.from_numpy(t).reshape(1, 6)
              for t in random_box(np.random.default_rng(4), (6,), radius=0.5))
    with torch.no_grad():
        ibp, known = mlp.intermediate_bounds(lo, hi)
    _, _, alpha_known = full_alpha_crown(mlp, lo, hi, iterations=10, cache=(ibp, known))
    assert needs_refinement(mlp, alpha_known)
    with torch.no_grad():
        better = refine_by_splits(mlp, lo, hi, alpha_known, rounds=12, iterations=5)
        again = refine_by_splits(mlp, lo, hi, alpha_known, rounds=12, iterations=5)
    tightened = 0
    for node, (l, h) in better.items():
        assert torch.equal(l, again[node][0]) and torch.equal(h, again[node][1]), node
        l0, h0 = alpha_known[node]
        assert bool((l >= l0).all() and (h <= h0).all()), node
        if torch.equal(l, l0) and torch.equal(h, h0):
            continue
        tightened += 1
        assert_sound(_node_values(mlp, node), lo, hi, l.reshape(-1), h.reshape(-1), n=2000,
                     label=f"split refinement {node}")
    assert tightened > 0
    assert _unstable(better) < _unstable(alpha_known) <= _unstable(known)


def test_split_refinement_leaves_nothing_to_do_without_earlier_unstable_neurons(mlp):
    from shardbound.runtime.engine.split_refine import needs_refinement, refine_by_splits

    x = torch.full((1, 6), 0.1)
    with torch.no_grad():
        _, known = mlp.intermediate_bounds(x, x)        # a point: every neuron stable
    assert not needs_refinement(mlp, known)
    out = refine_by_splits(mlp, x, x, known)
    assert all(out[k][0] is known[k][0] for k in known)


def test_beta_warm_start_from_any_betas_is_sound(mlp):
    """Betas carried over from a parent, even nonsense ones (negative, huge, at neurons the
    domain does not split), start a bound that still holds on the domain."""
    from shardbound.runtime.engine.beta import beta_crown

    lo, hi = torch.full((1, 6), -0.5), torch.full((1, 6), 0.5)
    C = torch.tensor([[1.0, -1.0, 0.0]])
    with torch.no_grad():
        ibp, known = mlp.intermediate_bounds(lo, hi)
    first = next(n for n in known if ((known[n][0] < 0) & (known[n][1] > 0)).any())
    j = int(torch.nonzero(((known[first][0] < 0) & (known[first][1] > 0)).reshape(-1))[0])
    s = torch.zeros_like(known[first][0], dtype=torch.int8)
    s.reshape(-1)[j] = 1                            # the domain assumes z_j >= 0
    splits = {first: s}
    clamped = dict(known)
    clamped[first] = (torch.where(s > 0, known[first][0].clamp(min=0), known[first][0]),
                      known[first][1])
    with torch.no_grad():
        lb0, _ = mlp.final_crown(ibp, clamped, lo, hi, C, lower_only=True)
    g = torch.Generator().manual_seed(0)
    bad = {first: 50 * torch.randn(1, 1, *s.shape[1:], generator=g)}
    with torch.no_grad():
        lb, _ = beta_crown(mlp, ibp, clamped, lo, hi, C, splits, lb0, iterations=3,
                           beta_start=(bad, torch.ones(1, dtype=torch.bool)))
    x = lo + torch.rand(4000, 6, generator=g) * (hi - lo)
    z = _node_values(mlp, first)(x)
    with torch.no_grad():
        y = mlp.forward(x.reshape(-1, *mlp.input_shape)).reshape(len(x), -1) @ C.T
    inside = z[:, j] >= 0
    assert bool(inside.any())
    assert float(y[inside].min()) >= float(lb[0, 0]) - 1e-4
