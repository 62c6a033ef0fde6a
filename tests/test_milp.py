"""The MILP stage (runtime/verification/milp.py): on a small ReLU MLP it refutes a threshold
that full alpha-CROWN cannot, the threshold is sound by sampling (10,000 points and the box's
vertices), a threshold the network attains is never refuted and its candidate point is a real
violation, and networks it cannot encode are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import zoo
from conftest import random_box

pytest.importorskip("highspy")


def _compile(tmp, model, name):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    onnx.save(model, tmp / f"{name}.onnx")
    compile_model(str(tmp / f"{name}.onnx"), str(tmp / name), PassOptions(summation="fast"))
    return load(str(tmp / name)).network


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """(network, lo, hi, C, root lb of C's row, prior, the row's exact minimum by MILP)."""
    import highspy

    from shardbound.runtime.engine.full_alpha import root_bounds
    from shardbound.runtime.verification import milp

    net = _compile(tmp_path_factory.mktemp("milp"),
                   zoo.mlp(np.random.default_rng(3), sizes=(6, 16, 16, 2))[0], "m")
    lo, hi = (torch.from_numpy(t).reshape(1, 6)
              for t in random_box(np.random.default_rng(5), (6,), radius=1.0))
    C = torch.tensor([[1.0, -1.0]])
    with torch.no_grad():
        cache = net.intermediate_bounds(lo, hi)
    lb, prior = root_bounds(net, lo, hi, C, cache)
    model = milp._Model(highspy, net, prior, lo.double().reshape(-1).numpy(),
                        hi.double().reshape(-1).numpy())
    cost = np.zeros(model.n)
    cost[model.out] = C[0].double().numpy()
    model.h.changeColsCost(model.n, np.arange(model.n, dtype=np.int32), cost)
    model.h.run()
    assert model.h.modelStatusToString(model.h.getModelStatus()) == "Optimal"
    return net, lo, hi, C, float(lb[0, 0]), prior, model.h.getInfo().objective_function_value


def _refute(setting, threshold):
    import time

    from shardbound.runtime.verification import milp
    net, lo, hi, C, _, prior, _ = setting
    return milp.refute(net, prior, lo, hi, C.double().numpy(), np.array([threshold]),
                       np.array([0]), 1, np.array([True]), time.monotonic() + 20)


def _sampled_min(setting):
    net, lo, hi, C, *_ = setting
    g = torch.Generator().manual_seed(0)
    xs = lo + (hi - lo) * torch.rand(10_000, 6, generator=g)
    corners = torch.tensor(np.array(np.meshgrid(*[[0, 1]] * 6)).reshape(6, -1).T, dtype=torch.float32)
    xs = torch.cat([xs, lo + (hi - lo) * corners])
    with torch.no_grad():
        return float((net.forward(xs) @ C.T).min())


def test_milp_refutes_what_alpha_crown_cannot_and_is_sound(setting):
    from shardbound.runtime.verification import milp

    net, lo, hi, C, lb, prior, exact = setting
    assert milp.encodable(net, prior)
    unstable = sum(int(((l < 0) & (h > 0)).sum()) for l, h in prior.values())
    assert unstable > 0
    assert exact - lb > 0.05, (lb, exact)          # alpha-CROWN leaves a gap to close
    threshold = (lb + exact) / 2                   # above alpha-CROWN's bound, below the truth
    assert _sampled_min(setting) >= exact - 1e-4   # the MILP's minimum is attained nowhere lower
    refuted, candidates = _refute(setting, threshold)
    assert refuted[0] and not candidates


def test_milp_never_refutes_an_attained_threshold(setting):
    net, lo, hi, C, lb, prior, exact = setting
    attained = _sampled_min(setting) + 1e-3
    refuted, candidates = _refute(setting, attained)
    assert not refuted[0]
    assert len(candidates) == 1
    x = torch.from_numpy(candidates[0]).float().reshape(1, 6)
    assert bool(((x >= lo - 1e-6) & (x <= hi + 1e-6)).all())
    with torch.no_grad():
        assert float(net.forward(x) @ C.T) <= attained + 1e-3


def test_milp_skips_what_it_cannot_encode(setting, tmp_path, monkeypatch):
    from shardbound.runtime.verification import milp

    net, *_, prior, _ = setting
    monkeypatch.setattr(milp, "MAX_BINARIES", 0)
    assert not milp.encodable(net, prior)          # too many unstable neurons
    monkeypatch.undo()
    other = _compile(tmp_path, zoo.mlp_matmul_add(np.random.default_rng(0))[0], "ma")
    assert milp._chain(other) is None              # an Add node: not an encodable chain


def test_milp_stops_at_the_first_conjunction_it_cannot_refute(setting):
    """Two conjunctions on the same row: the easier (first by `order`) is attained, so the
    property stays open and the refutable one is not tried (its time goes back to branch
    and bound); without `stop_at_open` both are decided."""
    import time

    from shardbound.runtime.verification import milp
    net, lo, hi, C, lb, prior, exact = setting
    attained, refutable = _sampled_min(setting) + 1e-3, (lb + exact) / 2
    C2 = np.concatenate([C.double().numpy()] * 2)
    d2 = np.array([attained, refutable])
    args = (net, prior, lo, hi, C2, d2, np.array([0, 1]), 2, np.array([True, True]))
    refuted, found = milp.refute(*args, time.monotonic() + 20, order=np.array([1.0, 0.0]))
    assert not refuted.any() and len(found) == 1
    refuted, found = milp.refute(*args, time.monotonic() + 20, order=np.array([1.0, 0.0]),
                                 stop_at_open=False)
    assert refuted.tolist() == [False, True] and len(found) == 1


def test_milp_flag_reaches_the_ranks():
    """`--milp auto|off` is a verify flag (no environment variable): parsed, defaulted to
    auto, passed to the ranks only when off, and refused in one line when misspelt."""
    from shardbound.options import RunOptions, parser_for
    from shardbound.runtime.program.main import _rank_argv

    p = parser_for("verify", "shardbound verify")
    assert p.parse_args(["m.onnx", "p.vnnlib"]).milp == "auto"
    assert p.parse_args(["m.onnx", "p.vnnlib", "--milp", "off"]).milp == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["m.onnx", "p.vnnlib", "--milp", "on"])
    box = dict(box="b.json")
    assert "--milp" not in _rank_argv(RunOptions(**box))[0]
    argv = _rank_argv(RunOptions(milp="off", **box))[0]
    assert argv[argv.index("--milp") + 1] == "off"
    ranks = parser_for("program", "program.py")
    assert RunOptions.from_namespace(ranks.parse_args(argv)).milp == "off"
