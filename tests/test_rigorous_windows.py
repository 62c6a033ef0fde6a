"""Windowed rows of the rigorous CROWN (runtime/rigorous/window.py, issue 17): a grid node's
rows held only over the windows they reach must bound exactly what the dense rows bound (the
same terms; only exact zeros left out), with plain and with given alphas, and stay sound
(float64 evaluations for real, five float32 orders for float32) through padded, strided,
dilated and grouped convolutions, ReLU, Add, average pooling and a step without windows
(ConvTranspose: the row goes dense there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo
from test_soundness_modes import _check_sampling, _compile


def _grid_cnn():
    """(2, 7, 7) -> Conv 3x3 pad 1 -> ReLU -> Conv 3x3 stride 2 pads (1, 0, 1, 1) (+ a 1x1
    shortcut of the same grid: Add) -> ReLU -> grouped dilated Conv -> ReLU -> AveragePool ->
    ConvTranspose -> ReLU -> Flatten -> Gemm."""
    rng = np.random.default_rng(7)
    b = zoo.Builder(rng, (2, 7, 7))

    def conv(h, cin, cout, k, **kw):
        return b.op("Conv", [h, b.const(b.weight(cout, cin // kw.get("group", 1), k, k)),
                             b.const(rng.normal(0, .1, (cout,)))], **kw)
    h = b.relu(conv("x", 2, 4, 3, pads=[1, 1, 1, 1]))                              # (4, 7, 7)
    h = b.relu(b.op("Add", [conv(h, 4, 4, 3, strides=[2, 2], pads=[1, 0, 1, 1]),
                            conv(h, 4, 4, 1, strides=[2, 3])]))  # (4, 4, 3)
    h = b.relu(conv(h, 4, 4, 2, group=2, dilations=[2, 1], pads=[1, 1, 1, 1]))     # (4, 4, 4)
    h = b.op("AveragePool", [h], kernel_shape=[2, 2], strides=[1, 1])              # (4, 3, 3)
    h = b.relu(b.op("ConvTranspose", [h, b.const(b.weight(4, 2, 2, 2)),
                                      b.const(rng.normal(0, .1, (2,)))]))           # (2, 4, 4)
    return b.build(b.gemm(b.op("Flatten", [h], axis=1), 32, 3))


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    v = _compile(tmp_path_factory.mktemp("windows"), _grid_cnn(), "grid_cnn")
    rng = np.random.default_rng(1)
    centre = rng.uniform(-0.5, 0.5, int(np.prod(v.input_shape)))
    return v, centre - 0.3, centre + 0.3


def test_windowed_rows_bound_what_dense_rows_bound(grid):
    from shardbound.runtime.rigorous import RigorousBounds

    v, lower, upper = grid
    C = torch.cat([torch.eye(3), -torch.eye(3)]).double()
    got = {}
    for windowed in ("tiles", "one position, 3 rows a chunk", False):
        rig = RigorousBounds(v.network, "real")
        rig.windowed = bool(windowed)
        if windowed == "one position, 3 rows a chunk":
            rig._tile = lambda n: (1, 3)
        assert rig.crown_nodes
        lo, hi = rig.outward(lower[None], upper[None])
        lb = rig.spec_lower(lo, hi, C)
        # full alpha-CROWN's replayed intermediate passes: random alphas in [0, 1]
        node = sorted(rig.crown_nodes)[0]
        k = int(np.prod(rig.by_name[node].shape))
        index = torch.arange(k - 1, 0, -max(1, k // 8))        # a few, not in grid order
        gen = torch.Generator().manual_seed(3)
        alphas = {n.name: torch.rand(1, 2 * len(index), *n.shape, generator=gen,
                                     dtype=torch.float64)
                  for n in rig.nodes if n.op.kind == "relu"}
        lba = rig.spec_lower(lo, hi, C, node_alphas={node: (index, alphas)})
        got[windowed] = (lb, lba, rig.last_bounds)
    for windowed in ("tiles", "one position, 3 rows a chunk"):
        for a, b in zip(got[windowed][:2], got[False][:2]):
            assert torch.isfinite(a).all()
            assert torch.allclose(a, b, rtol=1e-9, atol=1e-9), windowed
        for name, (l, h) in got[windowed][2].items():
            dl, dh = got[False][2][name]
            assert torch.allclose(l, dl, rtol=1e-9, atol=1e-9), (windowed, name)
            assert torch.allclose(h, dh, rtol=1e-9, atol=1e-9), (windowed, name)


def test_windowed_rows_hold_for_float64_and_every_float32_order(grid):
    v, lower, upper = grid
    _check_sampling(v, lower, upper, 60, np.random.default_rng(2))


def test_kept_alphas_are_on_the_memory_ledger(grid):
    """Full alpha-CROWN's kept parameters (real / float32 mode): one more copy of every alpha
    in `alpha` while optimising, then `kept_alpha` until the root certificate drops them. The
    copy while optimising is of the working alphas (unstable neurons only, SparseAlpha); the
    replay is put back over the whole op (what the rigorous engine reads), so it is at least
    as large."""
    from shardbound.runtime.engine.full_alpha import full_alpha_crown
    from shardbound.runtime.engine.optimise import alpha_bytes

    v, lower, upper = grid
    net = v.network
    lo = torch.from_numpy(lower).float().reshape(1, *v.input_shape)
    hi = torch.from_numpy(upper).float().reshape(1, *v.input_shape)
    C = torch.eye(3)
    peaks = {}
    for replay in (None, {}):
        net.ledger.reset_peaks()
        full_alpha_crown(net, lo, hi, C, iterations=2, replay=replay)
        peaks[replay is None] = net.ledger.peak["alpha"]
    kept = sum(alpha_bytes(a) // 3 for _, a in replay["nodes"].values()) + alpha_bytes(
        replay["final"]) // 3
    assert kept > 0 and net.ledger.current["kept_alpha"] == kept
    assert 0 < peaks[False] - peaks[True] <= kept
    net.ledger.set("kept_alpha", 0)


def _product_mlp():
    """relu(W1 x) * sigmoid(W2 x) (a product of computed tensors, as nn4sys's mscn masks its
    set features), a Mul of two Gemms of either sign, a MatMul of two computed (2, 3) and
    (3, 2) matrices -> Gemm; 4 -> 6 -> 4 -> 2."""
    b = zoo.Builder(np.random.default_rng(9), (4,))
    h = b.op("Mul", [b.relu(b.gemm("x", 4, 6)), b.op("Sigmoid", [b.gemm("x", 4, 6)])])
    h = b.op("Mul", [b.gemm(h, 6, 6), b.gemm(h, 6, 6)])
    shape = b.const(np.array([1, 2, 3], np.int64)), b.const(np.array([1, 3, 2], np.int64))
    q = b.op("Reshape", [b.gemm(h, 6, 6), shape[0]])
    k = b.op("Reshape", [b.gemm(h, 6, 6), shape[1]])
    h = b.op("Flatten", [b.op("MatMul", [q, k])], axis=1)          # (2, 3) @ (3, 2), computed
    return b.build(b.gemm(h, 4, 2))


def test_products_of_computed_tensors_are_sound_and_agree_with_default(tmp_path):
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.rigorous import RigorousBounds
    from shardbound.runtime.verification.verdict import verify
    from test_soundness_modes import _spec

    v = _compile(tmp_path, _product_mlp(), "product_mlp")
    assert {"product", "matmul_xy"} <= {n.kind for n in v.network.nodes}
    rng = np.random.default_rng(4)
    lower, upper = -0.5 * np.ones(4), 0.5 * np.ones(4)
    _check_sampling(v, lower, upper, 200, rng)
    # a threshold below the rigorous lower bound: unsat in every mode; above the attained
    # minimum: sat in every mode
    rig = RigorousBounds(v.network, "real")
    lo, hi = rig.outward(lower[None], upper[None])
    lb = float(rig.spec_lower(lo, hi, torch.tensor([[1.0, 0.0]], dtype=torch.float64))[0, 0])
    ys = rig.forward64(torch.from_numpy(rng.uniform(lower, upper, (500, 4))))[:, 0]
    # (the default mode proves the first at its CROWN stage: the engine's bound is above it;
    # one verify costs about a second, most of it the attack, so real mode alone is run there)
    elb, _ = v.bounds(torch.from_numpy(lower).float(), torch.from_numpy(upper).float())
    t_unsat = lb - abs(lb) - 0.5
    assert float(elb[0]) > t_unsat
    for t, want, modes in ((t_unsat, "unsat", ("real",)),
                           (float(ys.min()) + 1e-3, "sat", ("default", "real", "float32"))):
        for mode in modes:
            r = verify(v, _spec(lower, upper, [1.0, 0.0], t), 30, SingleComm(), soundness=mode)
            assert r.verdict == want, (t, mode)
