"""Split refinement of intermediate bounds (runtime/engine/split_refine.py): never looser than
the bounds it starts from, sound by sampling and projected-gradient attacks on every tightened
node, tighter than CROWN and alpha-CROWN (fewer unstable neurons), bitwise repeatable; and
beta-CROWN's warm-started betas (runtime/engine/beta.py) stay sound from any start."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo
from conftest import compile_onnx_in, random_box
from soundness import assert_sound, node_values


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    model = zoo.mlp(np.random.default_rng(2), sizes=(6, 24, 24, 24, 3))[0]
    return compile_onnx_in(tmp_path_factory.mktemp("split_refine"), model, summation="fast")[0].network


def _unstable(known):
    return sum(int(((l < 0) & (h > 0)).sum()) for l, h in known.values())


def test_split_refinement_is_sound_tighter_and_repeats(mlp):
    from shardbound.runtime.engine.full_alpha import full_alpha_crown
    from shardbound.runtime.engine.split_refine import needs_refinement, refine_by_splits

    lo, hi = (torch.from_numpy(t).reshape(1, 6)
              for t in random_box(np.random.default_rng(4), (6,), radius=0.5))
    with torch.no_grad():
        ibp, known = mlp.intermediate_bounds(lo, hi)
    _, _, alpha_known = full_alpha_crown(mlp, lo, hi, iterations=5, cache=(ibp, known))
    assert needs_refinement(mlp, alpha_known)
    with torch.no_grad():
        better = refine_by_splits(mlp, lo, hi, alpha_known, rounds=8, iterations=4)
        again = refine_by_splits(mlp, lo, hi, alpha_known, rounds=8, iterations=4)
    tightened = 0
    for node, (l, h) in better.items():
        assert torch.equal(l, again[node][0]) and torch.equal(h, again[node][1]), node
        l0, h0 = alpha_known[node]
        assert bool((l >= l0).all() and (h <= h0).all()), node
        if torch.equal(l, l0) and torch.equal(h, h0):
            continue
        tightened += 1
        assert_sound(node_values(mlp, node), lo, hi, l.reshape(-1), h.reshape(-1), n=2000,
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
    z = node_values(mlp, first)(x)
    with torch.no_grad():
        y = mlp.forward(x.reshape(-1, *mlp.input_shape)).reshape(len(x), -1) @ C.T
    inside = z[:, j] >= 0
    assert bool(inside.any())
    assert float(y[inside].min()) >= float(lb[0, 0]) - 1e-4


def _bab_case(net):
    """A box, two spec rows and thresholds 90% of the way from an attack's minimum down to
    alpha-CROWN's bound: unsat, a few rounds of 8 domains."""
    from shardbound.runtime.engine.full_alpha import root_bounds
    from soundness import attack_min

    lo, hi = torch.full((6,), -0.2), torch.full((6,), 0.2)
    C = torch.tensor([[1.0, -1.0, 0.0], [1.0, 0.0, -1.0]])
    forward = lambda x: net.forward(x.reshape(-1, 6)).reshape(len(x), -1)     # noqa: E731
    g = torch.Generator().manual_seed(0)
    found = [attack_min(forward, lo, hi, C[i:i + 1], g, n=500) for i in range(2)]
    with torch.no_grad():
        cache = net.intermediate_bounds(lo.reshape(1, 6), hi.reshape(1, 6))
    lb, prior = root_bounds(net, lo.reshape(1, 6), hi.reshape(1, 6), C, cache)
    d = np.array([found[i] - 0.9 * (found[i] - float(lb[0, i])) for i in range(2)])

    def violation(dd):
        def check(xs):
            with torch.no_grad():
                v = (forward(xs) @ C.T).double()
            hit = torch.nonzero((v <= torch.from_numpy(dd)).any(dim=1)).reshape(-1)
            return int(hit[0]) if len(hit) else None
        return check
    return lo, hi, C, np.array([0, 1]), d, found, prior, violation


@pytest.fixture(scope="module")
def bab_case(mlp):
    return _bab_case(mlp)


def test_a_stopped_tree_resumed_is_the_uninterrupted_tree(mlp, bab_case):
    """relu_split(keep_state=) then resume= on the same prior: the same domains, the same
    verdict; resumed under a split-refined prior (tighter): still unsat."""
    from shardbound.runtime.engine.split_refine import refine_by_splits
    from shardbound.runtime.verification.relu_split import relu_split

    lo, hi, C, owner, d, _, prior, violation = bab_case
    run = lambda dd, **kw: relu_split(mlp, C, dd, owner, lo, hi, float("inf"),  # noqa: E731
                                      lambda f: f, violation(dd), batch=8, iterations=5, **kw)
    whole = run(d, root_prior=prior)
    assert whole.verdict == "unsat" and whole.domains > 16
    rounds = [0]

    def progress(*_):
        rounds[0] += 1
    first = run(d, root_prior=prior, keep_state=True, progress=progress,
                stop=lambda: rounds[0] >= 2)
    assert first.verdict == "timeout" and first.state is not None and first.domains == 3
    again = run(d, root_prior=prior, resume=first.state)
    assert (again.verdict, again.domains) == ("unsat", whole.domains)
    with torch.no_grad():
        tighter = refine_by_splits(mlp, lo.reshape(1, 6), hi.reshape(1, 6), prior, rounds=4,
                                   iterations=3)
    rounds[0] = 0
    first = run(d, root_prior=prior, keep_state=True, progress=progress,
                stop=lambda: rounds[0] >= 2)
    assert run(d, root_prior=tighter, resume=first.state).verdict == "unsat"


def test_beta_on_open_row_pairs_matches_whole_domains(mlp, bab_case):
    """row_pairs.optimise_pairs bounds each open (domain, row) pair as beta-CROWN on whole
    domains bounds that row (rows are optimised independently), leaves the other pairs as
    they were, and keeps the rows' parameters in the whole-domain layout."""
    from shardbound.runtime.engine.beta import beta_crown
    from shardbound.runtime.verification.relu_split import BETA_KEY
    from shardbound.runtime.verification.row_pairs import optimise_pairs

    lo, hi, C, _, _, _, prior, _ = bab_case
    B = 3
    blo, bhi = lo.expand(B, 6).clone(), hi.expand(B, 6).clone()
    first = next(n for n in prior if ((prior[n][0] < 0) & (prior[n][1] > 0)).any())
    j = torch.nonzero(((prior[first][0] < 0) & (prior[first][1] > 0)).reshape(-1))[:, 0]
    s = torch.zeros(B, *prior[first][0].shape[1:], dtype=torch.int8)
    s.reshape(B, -1)[0, j[0]], s.reshape(B, -1)[1, j[0]] = 1, -1      # box 2: no split
    splits = {first: s}
    pb = {k: (v[0].expand(B, *v[0].shape[1:]), v[1].expand(B, *v[1].shape[1:]))
          for k, v in prior.items()}
    with torch.no_grad():
        ibp, known = mlp.intermediate_bounds(blo, bhi, splits=splits, prior=pb)
        lb0, _ = mlp.final_crown(ibp, known, blo, bhi, C, lower_only=True)
        whole, _ = beta_crown(mlp, ibp, known, blo, bhi, C, splits, lb0, iterations=4)
    pairs = torch.tensor([[True, True], [False, True], [True, False]])
    out, lA, idx, params = optimise_pairs(mlp, ibp, known, blo, bhi, C, splits, lb0, pairs,
                                          4, None, None, BETA_KEY)
    assert torch.allclose(out[pairs], whole[pairs], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~pairs], lb0[~pairs])
    assert lA.shape == (int(pairs.sum()), 6) and torch.equal(idx, torch.arange(B))
    assert all(t.shape[:2] == (B, 2) for t in params.values())
    assert (BETA_KEY + first) in params
