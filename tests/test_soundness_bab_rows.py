"""Branch and bound under `--soundness real|float32` at the cost of the default mode's
(issue 17): each domain's rigorous node bounds over its own unstable neurons (not the
batch's union), and rigorous bounds per spec row carried down the tree, so beta-CROWN
optimises only the (domain, row) pairs a parent did not prove rigorously, each pair's
Lagrangian re-evaluated on that pair alone.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import zoo

EPS = 0.1
EPS_SPLIT = 0.03     # the split-domain tests' box half-width
FRACTION = 0.8       # of the first layer's unstable neurons each of their domains splits
ROWS = np.array([[1.0, -1.0, 0.0], [1.0, 0.0, -1.0]])     # y0 - y1, y0 - y2 (3 outputs)


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    import onnx

    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    tmp = tmp_path_factory.mktemp("bab_rows")
    onnx.save(zoo.mlp(np.random.default_rng(0), sizes=(20, 20, 20, 3))[0], tmp / "m.onnx")
    compile_model(str(tmp / "m.onnx"), str(tmp / "m"), PassOptions())
    return load(str(tmp / "m"))


def _values(rig, xs):
    values = {}
    for n in rig.nodes:
        values[n.name] = n.forward([values[i] for i in n.inputs] if n.inputs else [xs])
    return values


def _domains(rig, lower, upper, k=6):
    """k domains, each with sign splits on a random FRACTION of the first ReLU layer's
    unstable neurons (the box of half-width EPS_SPLIT leaves some second-layer neurons
    stable, and which ones differs between domains), the signs those of a random point; and
    per domain 4000 points between that point and random points of the box, with the node
    values there (float64)."""
    lo, hi = rig.outward(lower[None], upper[None])
    root = rig.all_bounds(lo, hi)
    z = [n for n in rig.nodes if n.op.kind == "relu"][0].inputs[0]
    zl, zh = root[z]
    unstable = torch.nonzero(((zl < 0) & (zh > 0))[0]).reshape(-1)
    assert len(unstable) >= 4
    rng = np.random.default_rng(0)
    split = torch.zeros(k, zl.shape[1], dtype=torch.int8)
    points = []
    for b in range(k):
        centre = rng.uniform(lower, upper)
        far = rng.uniform(lower, upper, (4000, len(lower)))
        xs = centre + (far - centre) * rng.uniform(0, 1, (4000, 1))
        xs = torch.from_numpy(np.vstack([centre[None], xs]).astype(np.float32)
                              .astype(np.float64).clip(lower, upper))
        values = _values(rig, xs)
        sign = torch.where(values[z][0] >= 0, 1, -1).to(torch.int8)
        order = torch.from_numpy(rng.permutation(len(unstable)))
        pick = unstable[order[:int(len(unstable) * FRACTION)]]
        split[b, pick] = sign[pick]
        points.append(values)
    return z, {z: split}, points


def _inside(values, z, split):
    """The points whose split neurons have the domain's signs (bool (N,))."""
    return ((values[z] * split.double()) >= 0).all(dim=1)


def test_each_domain_bounds_its_own_unstable_neurons(net, monkeypatch):
    """A batch of domains with different splits: the rigorous CROWN of the second layer takes
    each domain's own inexact neurons as rows (fewer than the batch's union) once the
    domains carry bounds, gives each domain the bounds it gets alone (up to float64
    rounding), and they hold at every sampled point of each domain (float64 evaluations)."""
    from shardbound.runtime.rigorous import RigorousBounds
    from shardbound.runtime.rigorous.engine import RigorousBounds as Engine

    rig = RigorousBounds(net.network, "real")
    lower, upper = -EPS_SPLIT * np.ones(20), EPS_SPLIT * np.ones(20)
    lo, hi = rig.outward(lower[None], upper[None])
    z, splits, points = _domains(rig, lower, upper)
    k = len(splits[z])
    calls = []
    own = Engine._domain_rows

    def spy(self, n, mask, counts, *a):
        calls.append((int(counts.max()), int(mask.any(dim=0).sum())))
        return own(self, n, mask, counts, *a)
    los, his = lo.expand(k, -1), hi.expand(k, -1)
    # as branch and bound carries them: each domain's bounds from a first pass (IBP leaves
    # every second-layer neuron inexact, so that pass has the union's rows), then the pass
    # that starts from them, where the domains' inexact neurons differ
    carried = rig.all_bounds(los, his, splits)
    monkeypatch.setattr(Engine, "_domain_rows", spy)
    batch = rig.all_bounds(los, his, splits, cuts=carried)
    assert calls and all(r < union for r, union in calls), calls
    for b in range(k):
        alone = rig.all_bounds(lo, hi, {z: splits[z][b:b + 1]},
                               cuts={name: (l[b:b + 1], h[b:b + 1])
                                     for name, (l, h) in carried.items()})
        inside = _inside(points[b], z, splits[z][b])
        assert int(inside.sum()) > 100
        for name, (l, h) in batch.items():
            al, ah = alone[name]
            assert torch.allclose(l[b], al[0], rtol=1e-9, atol=1e-12), name
            assert torch.allclose(h[b], ah[0], rtol=1e-9, atol=1e-12), name
            v = points[b][name].reshape(len(inside), -1)[inside]
            assert (v >= l[b].reshape(1, -1)).all() and (v <= h[b].reshape(1, -1)).all(), name


def test_row_bounds_of_pairs_hold_and_are_as_tight_as_beta_crown(net):
    """LeafCertifier.row_bounds on a batch of split domains, with beta-CROWN's best
    parameters for some (domain, row) pairs (optimise_pairs): every row's rigorous bound
    holds at every sampled point of its domain, and an optimised pair's is as tight as
    beta-CROWN's float32 bound (to 1e-4), at least plain rigorous CROWN's."""
    from shardbound.runtime.rigorous import RigorousBounds
    from shardbound.runtime.verification.certificate import LeafCertifier
    from shardbound.runtime.verification.row_pairs import optimise_pairs

    network = net.network
    rig = RigorousBounds(network, "real")
    lower, upper = -EPS_SPLIT * np.ones(20), EPS_SPLIT * np.ones(20)
    lo, hi = rig.outward(lower[None], upper[None])
    z, splits, points = _domains(rig, lower, upper)
    k = len(splits[z])
    C = torch.tensor(ROWS, dtype=torch.float32)
    C64 = C.double()
    lo32 = torch.from_numpy(lower).float().expand(k, -1)
    hi32 = torch.from_numpy(upper).float().expand(k, -1)
    with torch.no_grad():
        ibp, known = network.intermediate_bounds(lo32, hi32, splits=splits)
        lb0, _ = network.final_crown(ibp, known, lo32, hi32, C, lower_only=True)
    pairs = torch.zeros(k, 2, dtype=torch.bool)
    pairs[::2, 0] = True
    pairs[1::2, 1] = True
    pairs[0, 1] = True
    best = {}
    lb_beta, _, _, _ = optimise_pairs(network, ibp, known, lo32, hi32, C, splits, lb0, pairs,
                                      20, None, None, "beta:", best_out=best)
    cert = LeafCertifier(rig, None, lambda ok: ok, lower=lambda *a, **kw: rig.spec_lower(
        *a, **kw), C=C64)
    los, his = lo.expand(k, -1), hi.expand(k, -1)
    bounds = rig.all_bounds(los, his, splits)
    plain = cert.row_bounds(los, his, splits, bounds)
    dom, row = torch.nonzero(pairs, as_tuple=True)
    rows = cert.row_bounds(los, his, splits, bounds, (dom, row, best["alphas"], best["betas"]))
    assert (rows >= plain).all() and bool((rows > plain + 1e-3).any())
    assert (rows[pairs] >= lb_beta[pairs].double() - 1e-4).all()
    for b in range(k):
        inside = _inside(points[b], z, splits[z][b])
        y = points[b][rig.output.name].reshape(len(inside), -1)[inside] @ C64.T
        assert int(inside.sum()) > 100 and (y >= rows[b]).all()


def test_real_mode_branch_and_bound_skips_rows_parents_proved(net, monkeypatch):
    """Branch and bound with the certifier real mode builds (`LeafCertifier` with
    `row_bounds`), on two rows that full alpha-CROWN leaves open: beta-CROWN is asked for
    fewer (domain, row) pairs than its domains have rows once a parent proved a row
    rigorously, and the leaves, closed by the carried rigorous row bounds, prove the box."""
    import shardbound.runtime.verification.relu_split as relu_split
    from shardbound.runtime.engine.full_alpha import root_bounds
    from shardbound.runtime.rigorous import RigorousBounds
    from shardbound.runtime.verification.certificate import LeafCertifier
    from shardbound.runtime.verification.spec import outward_box

    network = net.network
    rig = RigorousBounds(network, "real")
    lo, hi = outward_box(-EPS * np.ones(20), EPS * np.ones(20))
    C = torch.tensor(ROWS, dtype=torch.float32)
    with torch.no_grad():
        cache = network.intermediate_bounds(lo[None], hi[None])
    lb, prior = root_bounds(network, lo[None], hi[None], C, cache)
    d = lb[0].double().numpy() + 0.01               # both rows open after full alpha-CROWN
    owner = np.array([0, 1])                        # two conjunctions of one row each
    rlo, rhi = rig.outward(lo[None].double(), hi[None].double())
    box = rig.all_bounds(rlo, rhi)
    cert = LeafCertifier(rig, None, lambda ok: ok, box,
                         lower=lambda *a, **kw: rig.spec_lower(*a, **kw), C=C.double())
    asked = []
    own = relu_split.optimise_pairs

    def spy(network, ibp, known, lo, hi, C, splits, lb, pairs, *a, **kw):
        asked.append((int(pairs.sum()), int(pairs.any(dim=1).sum()) * pairs.shape[1]))
        return own(network, ibp, known, lo, hi, C, splits, lb, pairs, *a, **kw)
    monkeypatch.setattr(relu_split, "optimise_pairs", spy)
    run = lambda **kw: relu_split.relu_split(                               # noqa: E731
        network, C, d, owner, lo, hi, time.monotonic() + 60, lambda f: f, lambda xs: None,
        root_prior=prior, certify=cert, attack_domains=0, **kw)
    res = run()
    assert res.verdict == "unsat" and res.domains > 4, res
    assert asked and any(p < full for p, full in asked), asked
    # stopped after a few rounds and resumed (verify's first try, then the refined prior)
    done = len(asked)
    first = run(keep_state=True, stop=lambda: len(asked) >= done + 3)
    assert first.verdict == "timeout" and first.state is not None
    again = run(resume=first.state)
    assert again.verdict == "unsat" and again.domains > first.domains


def test_children_split_after_a_node_keep_its_carried_bounds(net):
    """domain_bounds with `since`: children whose last split is on the second layer get
    that layer's carried bounds (its CROWN depends only on the first layer's lines, which did
    not change), equal to recomputing them up to float64 rounding, and still holding at the
    sampled points; children split on the first layer are bounded afresh."""
    from shardbound.runtime.rigorous import RigorousBounds
    from shardbound.runtime.verification.certificate import LeafCertifier

    rig = RigorousBounds(net.network, "real")
    lower, upper = -EPS_SPLIT * np.ones(20), EPS_SPLIT * np.ones(20)
    lo, hi = rig.outward(lower[None], upper[None])
    z, splits, points = _domains(rig, lower, upper)
    k = len(splits[z])
    los, his = lo.expand(k, -1), hi.expand(k, -1)
    z2 = [n for n in rig.nodes if n.op.kind == "relu"][1].inputs[0]
    cert = LeafCertifier(rig, None, lambda ok: ok)
    parent = cert.domain_bounds(los, his, splits)
    zl, zh = parent[z2]
    s2 = torch.zeros(zl.shape, dtype=torch.int8)
    for b in range(k):          # each child: its parent's point's sign at an unstable z2
        j = int(torch.nonzero((zl[b] < 0) & (zh[b] > 0)).reshape(-1)[0])
        s2[b, j] = 1 if float(points[b][z2][0, j]) >= 0 else -1
    child = {z: splits[z], z2: s2}
    carried = {name: parent[name] for name in (z, z2)}
    calls = []
    own = rig._node_bounds
    rig._node_bounds = lambda n, b, lo, hi, fresh=None: (calls.append(fresh), own(n, b, lo, hi,
                                                                                 fresh))[1]
    kept = cert.domain_bounds(los, his, child, carried=carried, since=torch.ones(k).long())
    again = cert.domain_bounds(los, his, child, carried=carried)
    assert calls[0] is not None and not bool(calls[0].any()) and calls[1] is None
    for name, (l, h) in kept.items():
        assert torch.allclose(l, again[name][0], rtol=1e-9, atol=1e-12), name
        assert torch.allclose(h, again[name][1], rtol=1e-9, atol=1e-12), name
    for b in range(k):
        inside = _inside(points[b], z, splits[z][b]) & _inside(points[b], z2, s2[b])
        assert int(inside.sum()) > 20
        for name, (l, h) in kept.items():
            v = points[b][name].reshape(len(inside), -1)[inside]
            assert (v >= l[b]).all() and (v <= h[b]).all(), name
    first = cert.domain_bounds(los, his, child, carried=carried, since=torch.zeros(k).long())
    assert calls[2] is not None and bool(calls[2].all())
    assert all(torch.equal(first[n][0], again[n][0]) for n in first)


REFINED = __import__("pathlib").Path(__file__).parent / "data" / "refined_prior_mlp2.npz"


def _refined(tmp_path, refine=False):
    """zoo.mlp(seed 2) 20-20-20-3 on the box of half-width EPS: (network, lo, hi, C, full
    alpha-CROWN's bounds of ROWS, its intermediate bounds), with `refine` split
    refinement's instead (engine/split_refine.py: ~15 CPU s, so the test reads them from
    REFINED, written by `python tests/test_soundness_bab_rows.py`)."""
    import onnx

    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.engine.full_alpha import root_bounds
    from shardbound.runtime.engine.split_refine import refine_by_splits
    from shardbound.runtime.verification.spec import outward_box

    onnx.save(zoo.mlp(np.random.default_rng(2), sizes=(20, 20, 20, 3))[0], tmp_path / "m.onnx")
    compile_model(str(tmp_path / "m.onnx"), str(tmp_path / "m"), PassOptions())
    network = load(str(tmp_path / "m")).network
    lo, hi = outward_box(-EPS * np.ones(20), EPS * np.ones(20))
    C = torch.tensor(ROWS, dtype=torch.float32)
    with torch.no_grad():
        cache = network.intermediate_bounds(lo[None], hi[None])
        lb, prior = root_bounds(network, lo[None], hi[None], C, cache)
        if refine:
            prior = refine_by_splits(network, lo[None], hi[None], prior)
    return network, lo, hi, C, lb, prior


def test_domains_the_engine_finds_empty_are_closed_by_their_lagrangian(tmp_path, monkeypatch):
    """Real-mode branch and bound where the engine's bounds are tighter than the
    certificate's (the engine CROWN-bounds every neuron of every node under split
    refinement's prior; the certificate has the box's rigorous bounds and each domain's own
    inexact neurons), so its float32 clamps leave some domains empty that the rigorous node
    bounds do not: those are optimised by beta-CROWN from the rigorous floor and closed by
    their re-evaluated Lagrangian (before: set aside as unresolved, `unknown`). The proved
    thresholds lie below every sampled value and a PGD search finds no point under them;
    thresholds above a sampled point give `sat`."""
    import shardbound.runtime.verification.relu_split as relu_split
    from shardbound.runtime.rigorous import RigorousBounds
    from shardbound.runtime.verification.attack import pgd
    from shardbound.runtime.verification.certificate import LeafCertifier

    network, lo, hi, C, lb, prior = _refined(tmp_path)
    every = network.inexact_mask
    monkeypatch.setattr(network, "inexact_mask", lambda node, b: torch.ones_like(
        every(node, b), dtype=torch.bool))
    rig = RigorousBounds(network, "real")
    kept = np.load(REFINED)
    prior = {k: (torch.from_numpy(kept[k + ":lo"]), torch.from_numpy(kept[k + ":hi"]))
             if k + ":lo" in kept else v for k, v in prior.items()}
    owner = np.array([0, 1])
    rlo, rhi = rig.outward(lo[None].double(), hi[None].double())
    cert = LeafCertifier(rig, None, lambda ok: ok, rig.all_bounds(rlo, rhi),
                         lower=lambda *a, **kw: rig.spec_lower(*a, **kw), C=C.double())
    emptied = []
    own = relu_split.optimise_pairs

    def spy(network, ibp, known, lo, hi, C, splits, lb, pairs, *a, **kw):
        empty = torch.zeros(len(pairs), dtype=torch.bool)
        for l, h in known.values():
            empty |= (l > h).reshape(len(pairs), -1).any(dim=1).cpu()
        emptied.append(int((empty & pairs.any(dim=1)).sum()))
        return own(network, ibp, known, lo, hi, C, splits, lb, pairs, *a, **kw)
    monkeypatch.setattr(relu_split, "optimise_pairs", spy)

    def violation(xs):
        y = network.forward(xs.reshape(len(xs), 20)).reshape(len(xs), -1) @ C.T
        hit = torch.nonzero((y <= torch.from_numpy(d).float()).any(dim=1)).reshape(-1)
        return int(hit[0]) if len(hit) else None
    run = lambda: relu_split.relu_split(                                   # noqa: E731
        network, C, d, owner, lo, hi, time.monotonic() + 60, lambda f: f, violation,
        root_prior=prior, certify=cert, attack_domains=0)
    d = lb[0].double().numpy() + 0.02
    res = run()
    assert res.verdict == "unsat", res
    assert sum(emptied) > 0, emptied
    xs = torch.from_numpy(np.random.default_rng(3).uniform(-EPS, EPS, (20000, 20))).float()
    y = network.forward(xs).reshape(len(xs), -1).double() @ C.double().T
    assert (y.min(dim=0).values.numpy() > d).all()
    forward = lambda x: network.forward(x.reshape(len(x), 20)).reshape(len(x), -1)  # noqa
    assert pgd(forward, lo, hi, C, d, owner) is None
    # a threshold above a sampled value of row 0: a counterexample exists
    d = np.array([float(y[:, 0].min()) + 1e-3, float(y[:, 1].min()) - 10.0])
    res = run()
    assert res.verdict == "sat" and violation(res.x.reshape(1, -1)) == 0, res


if __name__ == "__main__":        # writes REFINED (see _refined)
    import sys
    import tempfile

    sys.path.insert(0, str(REFINED.parent.parent))
    *_, refined = _refined(__import__("pathlib").Path(tempfile.mkdtemp()), refine=True)
    np.savez(REFINED, **{f"{k}:{side}": b.numpy() for k, (lo, hi) in refined.items()
                         for side, b in (("lo", lo), ("hi", hi))})
