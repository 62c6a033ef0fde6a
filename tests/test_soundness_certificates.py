"""The certificates of `--soundness real|float32` for what the engine proves beyond CROWN
(issue 17): full alpha-CROWN's root proof, re-evaluated with its own optimised alphas
(intermediate and final); branch-and-bound leaves, certified with the rigorous root bounds as
their prior and beta-CROWN's best iterate; and leaves of general branch and bound, which
assume an interval of a Sigmoid's input (the certifier is given those interval splits).

Each network is built here with more than 16 inputs, so that `verify` takes the full
alpha-CROWN and neuron-splitting path (input splitting below that).
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
import torch

import zoo
from shardbound.runtime.parallel.dist import SingleComm
from shardbound.runtime.verification.spec import Conjunction, Spec, SpecCase
from shardbound.runtime.verification.verdict import verify

EPS = 0.1
ROW = np.array([1.0, -1.0, 0.0])      # y0 - y1 >= d, on both networks (3 outputs)


def _relu20():
    return zoo.mlp(np.random.default_rng(0), sizes=(20, 20, 20, 3))[0]


def _sigmoid20(sizes=(20, 12, 12, 3), scale=2.0):
    """Two Sigmoid layers, first weights scaled up (pre-activations wide enough that the
    relaxation loses and interval splits pay)."""
    rng = np.random.default_rng(0)
    b = zoo.Builder(rng, (sizes[0],))
    h = "x"
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = b.weight(n_out, n_in) * (scale if i < len(sizes) - 2 else 1.0)
        bias = rng.normal(0, 0.1, size=(n_out,)).astype(np.float32)
        h = b.op("Gemm", [h, b.const(w), b.const(bias)], transB=1)
        if i < len(sizes) - 2:
            h = b.op("Sigmoid", [h])
    return b.build(h)


def _compile(tmp, model, name):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    path = tmp / f"{name}.onnx"
    onnx.save(model, path)
    compile_model(str(path), str(tmp / name), PassOptions())
    return load(str(tmp / name))


def _spec(n, d):
    case = SpecCase(-EPS * np.ones(n), EPS * np.ones(n),
                    (Conjunction(ROW[None].copy(), np.asarray([d], np.float64)),))
    return Spec("t", n, len(ROW), (case,))


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("certificates")
    return {"relu": _compile(tmp, _relu20(), "relu20"),
            "sigmoid": _compile(tmp, _sigmoid20(), "sigmoid20")}


def _forward64(rig, xs):
    values = {}
    for n in rig.nodes:
        values[n.name] = n.forward([values[i] for i in n.inputs] if n.inputs else [xs])
    return values


def test_full_alpha_root_proof_is_certified_with_its_own_alphas(nets):
    """CROWN -0.48 < d = -0.33 < full alpha-CROWN -0.32: real and float32 answer unsat at the
    alpha-CROWN stage (before: plain rigorous CROWN refused the root proof, and branch and
    bound had to redo it)."""
    v = nets["relu"]
    for mode in ("real", "float32"):
        r = verify(v, _spec(20, -0.33), 20, SingleComm(), soundness=mode)
        assert r.verdict == "unsat" and r.stages[-1] == "case 0: alpha-crown", (mode, r.stages)


def test_leaf_certificates_use_the_root_prior_and_hold(nets):
    """The root certificate's bounds equal full alpha-CROWN's up to rounding, hold at sampled
    points, and as the prior of a leaf (a split neuron, beta-CROWN's best iterate) give a
    certificate as tight as the engine's float32 leaf bound, which plain rigorous CROWN
    intermediate bounds miss by far."""
    from shardbound.runtime.engine.beta import beta_crown
    from shardbound.runtime.engine.full_alpha import root_bounds
    from shardbound.runtime.rigorous import RigorousBounds

    v = nets["relu"]
    net, rig = v.network, RigorousBounds(v.network, "real")
    lower, upper = -EPS * np.ones(20), EPS * np.ones(20)
    lo32, hi32 = torch.from_numpy(lower).float()[None], torch.from_numpy(upper).float()[None]
    C = torch.tensor(ROW[None], dtype=torch.float32)
    C64 = C.double()
    with torch.no_grad():
        cache = net.intermediate_bounds(lo32, hi32)
    replay = {}
    lb_root, prior = root_bounds(net, lo32, hi32, C, cache, replay=replay)
    lo, hi = rig.outward(lower[None], upper[None])
    plain = rig.spec_lower(lo, hi, C64)
    root = rig.spec_lower(lo, hi, C64, lagrangian=(replay["final"], None),
                          node_alphas=replay["nodes"], both=True)
    rig_prior = rig.last_bounds
    assert float(root) >= float(lb_root) - 1e-5 and float(root) > float(plain) + 0.1
    # a leaf: the first layer's most unstable neuron (by the engine's root prior) >= 0
    z = [n for n in net.nodes if n.kind == "relu"][0].inputs[0]
    zl, zh = prior[z]
    j = int(torch.argmax(torch.minimum(-zl, zh).reshape(-1)))
    split = torch.zeros(zl.shape, dtype=torch.int8)
    split.reshape(-1)[j] = 1
    splits = {z: split}
    with torch.no_grad():
        ibp, known = net.intermediate_bounds(lo32, hi32, splits=splits, prior=prior)
        lb0, _ = net.final_crown(ibp, known, lo32, hi32, C, lower_only=True)
    best = {}
    lb_leaf, _ = beta_crown(net, ibp, known, lo32, hi32, C, splits, lb0, best_out=best)
    lag = (best["alphas"], best["betas"])
    with_prior = rig.spec_lower(lo, hi, C64, splits, lag, prior=rig_prior)
    without = rig.spec_lower(lo, hi, C64, splits, lag)
    assert float(with_prior) >= float(lb_leaf) - 1e-4
    assert float(without) < float(lb_leaf) - 1e-3
    # every bound holds at points of the box (the root) and of the leaf (z_j >= 0)
    xs = torch.from_numpy(np.random.default_rng(0).uniform(lower, upper, (4000, 20))
                          .astype(np.float32).astype(np.float64))
    values = _forward64(rig, xs)
    y = values[rig.output.name].reshape(len(xs), -1) @ C64.T
    assert (y >= root).all()
    inside = values[z].reshape(len(xs), -1)[:, j] >= 0
    assert int(inside.sum()) > 100 and (y[inside] >= with_prior).all()


def test_interval_split_leaves_are_certified_with_their_intervals(nets):
    """A Sigmoid network that full alpha-CROWN does not prove (-0.6285 < d = -0.626) and
    branch and bound by interval splits does in two leaves: the rigorous certificate closes
    them because each leaf's interval assumptions reach it (`cuts`; without them every leaf
    is bounded over the whole interval, none is certified and the run times out).
    Branch and bound is called directly, without its attacks."""
    from shardbound.runtime.engine.full_alpha import root_bounds
    from shardbound.runtime.rigorous import RigorousBounds
    from shardbound.runtime.verification.relu_split import relu_split
    from shardbound.runtime.verification.spec import outward_box

    v = nets["sigmoid"]
    net, rig = v.network, RigorousBounds(v.network, "real")
    lo, hi = outward_box(-EPS * np.ones(20), EPS * np.ones(20))
    C = torch.tensor(ROW[None], dtype=torch.float32)
    d, owner = np.array([-0.626]), np.array([0])
    with torch.no_grad():
        cache = net.intermediate_bounds(lo[None], hi[None])
    lb, prior = root_bounds(net, lo[None], hi[None], C, cache)
    assert float(lb) < d[0]
    seen = []

    def certify(los, his, splits=None, lagrangian=None, cuts=None):
        seen.append(cuts is not None and any(bool(torch.isfinite(a).any() | torch.isfinite(b)
                                                  .any()) for a, b in cuts.values()))
        return rig.refuted(los, his, C.double(), d, owner, 1, splits, lagrangian, cuts=cuts)

    res = relu_split(net, C, d, owner, lo, hi, time.monotonic() + 20, lambda f: f,
                     lambda xs: None, root_prior=prior, certify=certify, attack_domains=0)
    assert res.verdict == "unsat" and any(seen), (res, seen)


def test_leaves_the_certificate_refuses_are_split_again_never_counted(nets):
    """relu_split under a certifier that refuses what the float32 engine proves: a refused
    leaf stays open and is split further (refusing the first round's leaves costs more
    domains than accepting them, and still ends unsat once the certifier accepts), and
    refusing every leaf never gives unsat nor any proved share (issue 17)."""
    from shardbound.runtime.engine.full_alpha import root_bounds
    from shardbound.runtime.verification.relu_split import relu_split
    from shardbound.runtime.verification.spec import outward_box

    net = nets["relu"].network
    lo, hi = outward_box(-EPS * np.ones(20), EPS * np.ones(20))
    C = torch.tensor(ROW[None], dtype=torch.float32)
    with torch.no_grad():
        cache = net.intermediate_bounds(lo[None], hi[None])
    lb, prior = root_bounds(net, lo[None], hi[None], C, cache)
    d, owner = np.array([float(lb) + 0.005]), np.array([0])      # needs branch and bound

    def run(refuse):
        calls = []

        def certify(los, his, splits=None, lagrangian=None, cuts=None):
            calls.append(len(los))
            return torch.full((len(los),), not refuse(len(calls)), dtype=torch.bool)
        res = relu_split(net, C, d, owner, lo, hi, time.monotonic() + 600, lambda f: f,
                         lambda xs: None, root_prior=prior, certify=certify,
                         attack_domains=0, stop=lambda: len(calls) >= 40)
        return res, calls

    accepted, _ = run(lambda k: False)
    refused_first, calls = run(lambda k: k == 1)
    assert accepted.verdict == refused_first.verdict == "unsat"
    assert refused_first.domains > accepted.domains and len(calls) >= 2
    never, calls = run(lambda k: True)
    assert never.verdict != "unsat" and never.verified_fraction == 0.0 and len(calls) >= 40
