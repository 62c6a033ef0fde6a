"""Branch and bound: ReLU-split domains with beta-CROWN bounds are sound on their sub-domain,
parent bounds carried into children stay sound, ReLU splitting proves what alpha-CROWN alone
cannot and finds counterexamples, and input splitting proves and refutes
thresholds around a grid-computed minimum."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import zoo
from soundness import REL_TOL, attack_min, sample_box


def _load(tmp_path, model, name="net"):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    compile_model(str(path), str(tmp_path / name), PassOptions(summation="fast"))
    return load(str(tmp_path / name)).network


def _values(net, x):
    """Every node's concrete value for a batch of flattened inputs."""
    vals = {}
    for n in net.nodes:
        vals[n.name] = (n.forward(*(vals[i] for i in n.inputs)) if n.inputs
                        else x.reshape(-1, *net.input_shape))
    return vals


def _in_domain(net, vals, splits):
    """(N,) bool: the points whose pre-activations satisfy every sign assumption."""
    ok = torch.ones(next(iter(vals.values())).shape[0], dtype=torch.bool)
    for name, s in splits.items():
        z = vals[name].reshape(len(ok), -1)
        s = s.reshape(-1)
        ok &= ((z * s.float()) >= 0)[:, s != 0].all(dim=1)
    return ok


def _domain_points(net, lo, hi, C, splits, gen, n=40000):
    """Sampled points of the box, plus points pushed by PGD to lower every row of C f while
    a penalty pulls them into the sub-domain; only those inside the sub-domain are kept."""
    pts = sample_box(lo, hi, n, gen)
    x = (lo + torch.rand(64 * C.shape[0], lo.numel(), generator=gen) * (hi - lo)).requires_grad_()
    rows = torch.arange(C.shape[0]).repeat(64)
    step = (hi - lo) / 8
    for _ in range(60):
        vals = _values(net, x)
        obj = (vals[net.output.name].reshape(len(x), -1) @ C.T)[torch.arange(len(x)), rows]
        pen = sum(torch.relu(-vals[k].reshape(len(x), -1) * s.reshape(1, -1).float()).sum(1)
                  for k, s in splits.items())
        (g,) = torch.autograd.grad((obj + 100 * pen).sum(), x)
        with torch.no_grad():
            x -= step * g.sign()
            x.copy_(torch.maximum(torch.minimum(x, hi), lo))
        step = step * 0.93
    pts = torch.cat([pts, x.detach()])
    with torch.no_grad():
        vals = _values(net, pts)
    keep = _in_domain(net, vals, splits)
    return pts[keep], vals[net.output.name].reshape(len(pts), -1)[keep] @ C.T


def test_relu_split_domains_are_sound(tmp_path):
    """Random sign assumptions on unstable neurons: the clamped CROWN bound and the
    beta-CROWN bound hold at every sampled or attacked point of the sub-domain; a domain found
    empty has no such point; beta helps somewhere."""
    from shardbound.runtime.engine.beta import beta_crown
    from shardbound.runtime.engine.optimise import initial_alphas

    net = _load(tmp_path, zoo.mlp(np.random.default_rng(3), sizes=(5, 12, 12, 3))[0])
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(1)
    C = torch.tensor([[1.0, -1.0, 0.0], [0.0, 1.0, -1.0]])
    improved, checked = 0, 0
    for trial in range(8):
        c = torch.from_numpy(rng.uniform(-1, 1, 5).astype(np.float32))
        lo, hi = (c - 0.6).reshape(1, 5), (c + 0.6).reshape(1, 5)
        with torch.no_grad():
            _, root = net.intermediate_bounds(lo, hi)
        splits = {}
        for name, (l, h) in root.items():
            unstable = torch.nonzero(((l < 0) & (h > 0)).reshape(-1)).reshape(-1)
            s = torch.zeros(l.numel(), dtype=torch.int8)
            pick = unstable[torch.randperm(len(unstable), generator=gen)[:2]]
            s[pick] = torch.from_numpy(rng.choice([-1, 1], len(pick)).astype(np.int8))
            splits[name] = s.reshape(l.shape)
        with torch.no_grad():
            ibp, known = net.intermediate_bounds(lo, hi, splits=splits)
            lb0, _ = net.final_crown(ibp, known, lo, hi, C, lower_only=True)
            lb, _ = beta_crown(net, ibp, known, lo, hi, C, splits, lb0, iterations=20)
            # A warm start (branch and bound's children start from their parent's alphas):
            # any start, here random slopes, still gives a sound bound.
            shapes = {k: v.shape for k, v in initial_alphas(net, known, 1, C.shape[0]).items()}
            start = {k: torch.rand(v, generator=gen) for k, v in shapes.items()}
            lb_warm, _ = beta_crown(net, ibp, known, lo, hi, C, splits, lb0, iterations=5,
                                    alpha_start=(start, torch.ones(1, dtype=torch.bool)))
        assert bool((lb >= lb0).all()) and bool((lb_warm >= lb0).all())
        pts, vals = _domain_points(net, lo.reshape(-1), hi.reshape(-1), C, splits, gen)
        empty = any(bool((k[0] > k[1]).any()) for k in known.values())
        if empty:
            assert len(pts) == 0, f"trial {trial}: a domain with points was called empty"
            continue
        checked += len(pts)
        slack = REL_TOL * (1 + lb.abs())
        assert bool((vals >= lb - slack).all()), (trial, vals.min(0).values, lb)
        assert bool((vals >= lb_warm - slack).all()), (trial, vals.min(0).values, lb_warm)
        improved += int(bool((lb > lb0 + 1e-4).any()))
    assert checked > 1000 and improved > 0


def test_parent_bounds_carried_into_children_stay_sound(tmp_path):
    """A child box bounded with its parent's intermediate bounds as `prior`: every bound lies
    inside the prior and the final bounds hold by sampling."""
    net = _load(tmp_path, zoo.mlp(np.random.default_rng(4), sizes=(4, 16, 16, 2))[0])
    lo, hi = torch.full((1, 4), -0.8), torch.full((1, 4), 0.8)
    with torch.no_grad():
        _, parent = net.intermediate_bounds(lo, hi)
        clo, chi = lo.clone(), hi.clone()
        clo[0, 1] = 0.0                                      # the right half along input 1
        ibp, known = net.intermediate_bounds(clo, chi, prior=parent)
        lb, ub = net.final_crown(ibp, known, clo, chi)
    for name, (l, h) in known.items():
        assert bool((l >= parent[name][0]).all() and (h <= parent[name][1]).all())
    gen = torch.Generator().manual_seed(2)
    x = sample_box(clo.reshape(-1), chi.reshape(-1), 20000, gen)
    with torch.no_grad():
        y = net.forward(x).reshape(len(x), -1)
    slack = REL_TOL * (1 + torch.maximum(lb.abs(), ub.abs()))
    assert bool((y >= lb - slack).all() and (y <= ub + slack).all())


@pytest.fixture(scope="module")
def wide_input_net(tmp_path_factory):
    """24 inputs (too many for input splitting): ReLU splitting's territory."""
    tmp = tmp_path_factory.mktemp("relubab")
    return _load(tmp, zoo.mlp(np.random.default_rng(11), sizes=(24, 20, 20, 3))[0])


def test_relu_split_proves_below_the_minimum_and_refutes_above(wide_input_net):
    from shardbound.runtime.engine.alpha import alpha_crown
    from shardbound.runtime.verification.relu_split import relu_split

    net = wide_input_net
    C = torch.tensor([[1.0, -1.0, 0.0]])
    owner = np.zeros(1, dtype=int)
    lo, hi = torch.full((24,), -0.5), torch.full((24,), 0.5)
    gen = torch.Generator().manual_seed(0)
    found = attack_min(lambda x: net.forward(x.reshape(-1, *net.input_shape)).reshape(len(x), -1),
                       lo, hi, C, gen)
    shape = (1, *net.input_shape)
    lb_alpha = float(alpha_crown(net, lo.reshape(shape), hi.reshape(shape), C)[0])
    assert lb_alpha < found - 0.5          # alpha-CROWN alone is far from the minimum

    def is_violation(d):
        def check(xs):
            with torch.no_grad():
                v = (net.forward(xs.reshape(-1, *net.input_shape)).reshape(len(xs), -1)
                     @ C.T)[:, 0].double()
            hit = torch.nonzero(v <= d).reshape(-1)
            return int(hit[0]) if len(hit) else None
        return check

    # Below the minimum that sampling and attacks find, with room for what they miss.
    d = found - 0.2 * (found - lb_alpha)
    res = relu_split(net, C, np.array([d]), owner, lo, hi, time.monotonic() + 120,
                     lambda f: f, is_violation(d))
    assert res.verdict == "unsat", res
    # Above it: the counterexample comes from a domain's bound-minimising vertex.
    d = found + 0.05
    res = relu_split(net, C, np.array([d]), owner, lo, hi, time.monotonic() + 120,
                     lambda f: f, is_violation(d))
    assert res.verdict == "sat"
    with torch.no_grad():
        y = net.forward(res.x.reshape(1, *net.input_shape)).reshape(-1) @ C[0]
    assert float(y) <= d and bool(((res.x >= lo) & (res.x <= hi)).all())


def test_input_split_around_a_grid_minimum(tmp_path):
    """Two inputs: a 600 x 600 grid minimum and a Lipschitz constant bracket the true minimum;
    input splitting proves the threshold below and refutes the one above."""
    from shardbound.runtime.verification.input_split import input_split

    model, _ = zoo.mlp(np.random.default_rng(8), sizes=(2, 24, 24, 1))
    net = _load(tmp_path, model)
    lo, hi = torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 1.0])
    g = torch.linspace(-1, 1, 600)
    grid = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    with torch.no_grad():
        vals = net.forward(grid).reshape(-1)
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer if t.dims and len(t.dims) == 2]
    lip = float(np.prod([np.abs(w).sum(axis=1).max() for w in weights]))   # inf -> inf norms
    h = float(g[1] - g[0])
    true_min_lo = float(vals.min()) - lip * h / 2
    C = torch.tensor([[1.0]])
    owner = np.zeros(1, dtype=int)

    def is_violation(d):
        def check(xs):
            with torch.no_grad():
                v = net.forward(xs.reshape(-1, 2)).reshape(-1).double()
            hit = torch.nonzero(v <= d).reshape(-1)
            return int(hit[0]) if len(hit) else None
        return check

    d = true_min_lo - 1e-3
    res = input_split(net, C, np.array([d]), owner, lo, hi, time.monotonic() + 60,
                      lambda f: f, is_violation(d))
    assert res.verdict == "unsat", res
    d = float(vals.min()) + 1e-3
    res = input_split(net, C, np.array([d]), owner, lo, hi, time.monotonic() + 60,
                      lambda f: f, is_violation(d))
    assert res.verdict == "sat"
    assert float(net.forward(res.x.reshape(1, 2)).reshape(-1)[0]) <= d


def _tanh_mlp(seed=1, sizes=(20, 12, 12, 2)):
    """An MLP whose every hidden unit is a Tanh (no ReLU: nothing to split by sign)."""
    b = zoo.Builder(np.random.default_rng(seed), (sizes[0],))
    h = "x"
    for i in range(len(sizes) - 1):
        h = b.gemm(h, sizes[i], sizes[i + 1])
        if i < len(sizes) - 2:
            h = b.op("Tanh", [h])
    return b.build(h)


def test_interval_splitting_proves_what_crown_cannot_on_a_tanh_mlp(tmp_path):
    """GenBaB-style branch and bound on smooth units (relu_split with interval splits):
    a threshold between alpha-CROWN's bound and the minimum that sampling and PGD find (20
    inputs: not input splitting's territory) is proved, the children's intervals halving
    Tanh inputs; the proved threshold lies below every sampled value (soundness); a threshold
    above a found point is `sat` through `verify`."""
    from shardbound.runtime.engine.alpha import alpha_crown
    from shardbound.runtime.verification.branching import can_split
    from shardbound.runtime.verification.relu_split import relu_split

    net = _load(tmp_path, _tanh_mlp())
    assert not net.splittable_nodes() and can_split(net)
    C = torch.tensor([[1.0, -1.0]])
    owner = np.zeros(1, dtype=int)
    lo, hi = torch.full((20,), -0.1), torch.full((20,), 0.1)
    shape = (1, 20)
    gen = torch.Generator().manual_seed(0)
    forward = lambda x: net.forward(x.reshape(-1, 20)).reshape(len(x), -1)      # noqa: E731
    found = attack_min(forward, lo, hi, C, gen)
    lb_crown = float(net.crown(lo.reshape(shape), hi.reshape(shape), C)[0])
    lb_alpha = float(alpha_crown(net, lo.reshape(shape), hi.reshape(shape), C)[0])
    d = found - 0.85 * (found - lb_alpha)
    assert lb_crown < lb_alpha < d < found

    def is_violation(xs):
        with torch.no_grad():
            v = (forward(xs) @ C.T)[:, 0].double()
        hit = torch.nonzero(v <= d).reshape(-1)
        return int(hit[0]) if len(hit) else None

    res = relu_split(net, C, np.array([d]), owner, lo, hi, time.monotonic() + 60,
                     lambda f: f, is_violation, iterations=0)
    assert res.verdict == "unsat" and res.domains > 1, res
    with torch.no_grad():
        y = forward(sample_box(lo, hi, 20000, gen)) @ C.T
    assert float(y.min()) >= d

    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.verification.spec import spec_from_property
    from shardbound.runtime.verification.verdict import verify

    lines = [f"(declare-const X_{i} Real)" for i in range(20)] + ["(declare-const Y_0 Real)",
                                                                  "(declare-const Y_1 Real)"]
    lines += [f"(assert (>= X_{i} -0.1))\n(assert (<= X_{i} 0.1))" for i in range(20)]
    lines.append(f"(assert (<= (+ Y_0 (* -1.0 Y_1)) {found + 0.01!r}))")
    (tmp_path / "sat.vnnlib").write_text("\n".join(lines) + "\n")
    from shardbound.runtime import load

    result = verify(load(str(tmp_path / "net")), spec_from_property(
        parse_vnnlib(str(tmp_path / "sat.vnnlib"))), 30, SingleComm())
    assert result.verdict == "sat"


def test_interval_split_children_are_sound_on_their_halves(tmp_path):
    """A split of a Tanh input z_j at its split point: each child's bounds (the parent's with
    z_j's interval halved, as relu_split carries them) hold at every sampled point of the box
    whose z_j lies in that half, and together the halves cover the parent's points."""
    from shardbound.runtime.verification.branching import interval_split_ops

    net = _load(tmp_path, _tanh_mlp(seed=2, sizes=(6, 10, 10, 2)))
    lo, hi = torch.full((1, 6), -0.4), torch.full((1, 6), 0.4)
    with torch.no_grad():
        _, parent = net.intermediate_bounds(lo, hi)
    op = interval_split_ops(net)[-1]                   # the deeper Tanh: its input is computed
    z = op.inputs[0]
    gen = torch.Generator().manual_seed(4)
    x = sample_box(lo.reshape(-1), hi.reshape(-1), 20000, gen)
    with torch.no_grad():
        vals = _values(net, x)
    j = int(op.interval_slack(*parent[z]).reshape(-1).argmax())
    p = op.split_point(parent[z][0], parent[z][1]).reshape(-1)[j]
    covered = torch.zeros(len(x), dtype=torch.bool)
    for side in (0, 1):
        prior = {k: (l.clone(), h.clone()) for k, (l, h) in parent.items()}
        prior[z][1 - side].reshape(-1)[j] = p
        with torch.no_grad():
            ibp, known = net.intermediate_bounds(lo, hi, prior=prior)
            lb, ub = net.final_crown(ibp, known, lo, hi)
        zj = vals[z].reshape(len(x), -1)[:, j]
        inside = zj <= p if side == 0 else zj >= p
        covered |= inside
        y = vals[net.output.name].reshape(len(x), -1)[inside]
        slack = REL_TOL * (1 + torch.maximum(lb.abs(), ub.abs()))
        assert len(y) > 100 and bool((y >= lb - slack).all() and (y <= ub + slack).all())
    assert bool(covered.all())
