"""Full alpha-CROWN (runtime/engine/full_alpha.py): sound by sampling and attacks on the final
bounds and on every tightened intermediate node, never looser than CROWN, tighter than
alpha-CROWN of the final pass alone on a deep MLP, bitwise repeatable, and what
`--method full-alpha-crown` runs. fsdp P=1..4 bitwise equality is tests/test_determinism.py's
job (method full-alpha-crown)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch

import zoo
from conftest import random_box
from soundness import assert_sound, node_values

MODELS = {
    "deep_mlp": lambda: zoo.mlp(np.random.default_rng(2), sizes=(5, 24, 24, 24, 3)),
    "cnn_batchnorm": lambda: zoo.build("cnn_batchnorm"),
}


@pytest.fixture(scope="module")
def networks(tmp_path_factory):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    tmp = tmp_path_factory.mktemp("full_alpha")
    out = {}
    for name, make in MODELS.items():
        model, shape = make()
        onnx.save(model, tmp / f"{name}.onnx")
        compile_model(str(tmp / f"{name}.onnx"), str(tmp / name), PassOptions(summation="blocked"))
        out[name] = load(str(tmp / name)).network, shape
    return out


def _box(shape, seed, radius):
    return tuple(torch.from_numpy(t).reshape(1, *shape)
                 for t in random_box(np.random.default_rng(seed), shape, radius=radius))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_alpha_crown_is_sound_and_never_looser_than_crown(networks, name):
    from shardbound.runtime.engine.full_alpha import full_alpha_crown

    net, shape = networks[name]
    lo, hi = _box(shape, 1, 0.4)
    eye = torch.eye(net.output.shape[-1])
    C = eye[:1] - eye[1:]                   # y_0 - y_j, a robustness spec
    with torch.no_grad():
        ibp, known = net.intermediate_bounds(lo, hi)
        clb, cub = net.final_crown(ibp, known, lo, hi, C)
    lb, ub, tightened = full_alpha_crown(net, lo, hi, C, iterations=8)
    assert bool((lb >= clb).all() and (ub <= cub).all())
    assert float((lb - clb).sum()) > 0, "full alpha-CROWN gained nothing"
    assert_sound(lambda x: net.forward(x.reshape(-1, *shape)).reshape(x.shape[0], -1),
                 lo, hi, lb.reshape(-1), ub.reshape(-1), C=C, n=2000, label=name)
    changed = 0
    for node, (l, h) in tightened.items():
        assert bool((l >= known[node][0]).all() and (h <= known[node][1]).all()), node
        if not (torch.equal(l, known[node][0]) and torch.equal(h, known[node][1])):
            changed += 1
            assert_sound(node_values(net, node), lo, hi, l.reshape(-1), h.reshape(-1),
                         n=2000, label=f"{name}/{node}")
    assert changed > 0, name


def test_full_alpha_beats_final_pass_alpha_repeats_and_is_the_full_method(networks):
    from shardbound.runtime.engine.alpha import alpha_crown
    from shardbound.runtime.engine.full_alpha import full_alpha_crown

    net, shape = networks["deep_mlp"]
    lo, hi = _box(shape, 9, 0.3)
    final_only = alpha_crown(net, lo, hi)[0]
    lb, ub, _ = full_alpha_crown(net, lo, hi)
    assert float((lb - final_only).sum()) > 0
    again = net.bounds(lo, hi, method="full-alpha-crown")
    assert torch.equal(again[0], lb) and torch.equal(again[1], ub)
    # the rows each start node's alphas were made for, for the memory model
    assert net.alpha_rows and all(v > 0 for v in net.alpha_rows.values())


def test_fast_cnn_alphas_at_windows_match_dense_rows(tmp_path):
    """Under `fast` a conv start node's rows stay in patches form through the ReLUs before
    it, their alphas laid out at the windows (runtime/ops/patches.py `WindowAlpha`): the
    bounds are those of dense rows and dense alphas up to the rounding of window sums, sound,
    never looser than CROWN, and --soundness real's replay gets dense-layout alphas."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.engine.full_alpha import full_alpha_crown, start_nodes

    name = "cnn_batchnorm"
    model, shape = zoo.build(name)
    onnx.save(model, tmp_path / "m.onnx")
    compile_model(str(tmp_path / "m.onnx"), str(tmp_path / "p"), PassOptions(summation="fast"))
    net = load(str(tmp_path / "p")).network
    lo, hi = _box(shape, 3, 0.4)
    eye = torch.eye(net.output.shape[-1])
    C = eye[:1] - eye[1:]
    with torch.no_grad():
        ibp, known = net.intermediate_bounds(lo, hi)
        clb, _ = net.final_crown(ibp, known, lo, hi, C)
    from shardbound.runtime.ops.patches import Patches

    starts = start_nodes(net, known, 1, lower=lo, upper=hi)
    windowed = [s for s in starts if any(isinstance(f, Patches) for f in s.layout.values())]
    assert windowed, "no start node kept its rows in patches form"
    for s in windowed:
        for op, t in s.alphas.items():
            if isinstance(s.layout.get(op), Patches):   # (B, rows, C, ph, pw): a window
                assert t.shape[-2:] == s.layout[op].window
                assert t.shape[-2] * t.shape[-1] < math.prod(net.by_name[op].shape[1:])
    replay = {}
    lb, ub, _ = full_alpha_crown(net, lo, hi, C, iterations=6, replay=replay)
    net.patches = False
    try:
        dense_lb, dense_ub, _ = full_alpha_crown(net, lo, hi, C, iterations=6)
        dense_nodes = start_nodes(net, known, 1, lower=lo, upper=hi)
    finally:
        net.patches = True
    assert torch.allclose(lb, dense_lb, atol=1e-5, rtol=0), (lb - dense_lb).abs().max()
    assert torch.allclose(ub, dense_ub, atol=1e-5, rtol=0)
    assert bool((lb >= clb).all())
    for s in dense_nodes:           # replay's alphas in the dense layout (B, rows, *op shape)
        _, kept = replay["nodes"][s.node.name]
        assert {k: tuple(t.shape) for k, t in kept.items()} == \
            {k: (1, 2 * len(s.index), *net.by_name[k].shape) for k in s.alphas}
    assert_sound(lambda x: net.forward(x.reshape(-1, *shape)).reshape(x.shape[0], -1),
                 lo, hi, lb.reshape(-1), ub.reshape(-1), C=C, n=2000, label=name)


def test_blocked_conv_start_nodes_in_patches_keep_the_dense_bits(networks):
    """Under `blocked` (single mode) a conv start node's rows go through the ReLUs before it
    in patches form too, their alphas at the windows, with the ordered sums over the dense
    rows and the closed-form gradients of the ordered transposed conv and of `to_dense`:
    bitwise the bounds (final and tightened) of dense rows, which is what fsdp (no patches)
    computes."""
    from shardbound.runtime.engine.full_alpha import full_alpha_crown, start_nodes
    from shardbound.runtime.ops.patches import Patches

    net, shape = networks["cnn_batchnorm"]
    lo, hi = _box(shape, 3, 0.4)
    with torch.no_grad():
        _, known = net.intermediate_bounds(lo, hi)
    assert any(isinstance(f, Patches) for s in start_nodes(net, known, 1, lower=lo, upper=hi)
               for f in s.layout.values()), "no start node kept its rows in patches form"
    got = full_alpha_crown(net, lo, hi, iterations=3)
    net.patches = False
    try:
        dense = full_alpha_crown(net, lo, hi, iterations=3)
    finally:
        net.patches = True
    assert torch.equal(got[0], dense[0]) and torch.equal(got[1], dense[1])
    assert all(torch.equal(got[2][k][i], dense[2][k][i]) for k in dense[2] for i in (0, 1))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_relu_alphas_of_inexact_neurons_alone_keep_the_bits(networks, name, monkeypatch):
    """A ReLU's alphas kept for its inexact input neurons only (`SparseAlpha`) give bitwise
    the bounds of alphas over every neuron through the same step (blocked), with fewer
    parameters."""
    from shardbound.runtime.engine import full_alpha

    net, shape = networks[name]
    lo, hi = _box(shape, 5, 0.3)
    lb, ub, known = full_alpha.full_alpha_crown(net, lo, hi, iterations=4)
    with torch.no_grad():
        ibp, planned = net.intermediate_bounds(lo, hi)
    sparse = sum(t.numel() for s in full_alpha.start_nodes(net, planned, 1)
                 for t in s.alphas.values())
    from shardbound.runtime.ops.relaxation import ElementwiseRelaxation

    side = ElementwiseRelaxation._side          # the same step, closed-form gradient included
    monkeypatch.setattr(full_alpha, "_sparse_ok", lambda *a: False)
    monkeypatch.setattr(ElementwiseRelaxation, "_side",
                        lambda self, *a, closed_form=False: side(self, *a, closed_form=True))
    dense = sum(t.numel() for s in full_alpha.start_nodes(net, planned, 1)
                for t in s.alphas.values())
    dlb, dub, dknown = full_alpha.full_alpha_crown(net, lo, hi, iterations=4)
    assert sparse < dense
    assert torch.equal(lb, dlb) and torch.equal(ub, dub)
    assert all(torch.equal(known[k][0], dknown[k][0]) and torch.equal(known[k][1], dknown[k][1])
               for k in known)


@pytest.mark.parametrize("order", ["blocked", "exact"])
def test_ordered_transposed_conv_gradient_is_autograds(order):
    """`Conv2d._im2col_gradient` (the closed-form gradient of the differentiated ordered
    transposed conv) is bitwise autograd's through the composed kernel (channel-major
    columns), on a grouped, strided, dilated conv with uneven pads, in row chunks too."""
    from shardbound.runtime.ops import conv as conv_mod

    rng = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 3, 2, generator=rng)          # Cout 4, 2 groups of 3 inputs
    op = conv_mod.Conv2d("c", ["x"], [(6, 9, 8)], shape=(4, 4, 4), params={"weight": w},
                         order=order, strides=(2, 2), pads=(1, 0, 1, 1), dilations=(1, 2),
                         groups=2)
    A = torch.randn(5, 4, 4, 4, generator=rng)
    g = torch.randn(5, 6, 9, 8, generator=rng)
    grads = []
    for closed in (True, False):
        a = A.clone().requires_grad_(True)
        out = (op._ordered_transpose(a, w, (9, 8), (1, 0)) if closed
               else op._backward_im2col(a, w, (9, 8), (1, 0)))
        (out * g).sum().backward()
        grads.append((out.detach(), a.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    chunk = conv_mod.IM2COL_CHUNK
    conv_mod.IM2COL_CHUNK = 1               # one row per chunk: the same bits
    try:
        a = A.clone().requires_grad_(True)
        (op._ordered_transpose(a, w, (9, 8), (1, 0)) * g).sum().backward()
    finally:
        conv_mod.IM2COL_CHUNK = chunk
    assert torch.equal(a.grad, grads[1][1])


def test_alpha_cap_counts_alphas_as_stored(networks):
    """`max_alpha_elements` is compared with the alphas a start node will hold (a ReLU's
    inexact neurons only): a cap between that count and the whole-shape count keeps the start
    node, and its held alphas never exceed the cap (the whole-shape count had dropped bench
    mlp4096's third start node, leaving its bounds looser than auto_LiRPA's)."""
    from shardbound.runtime.engine import full_alpha

    net, shape = networks["deep_mlp"]
    lo, hi = _box(shape, 5, 0.3)
    with torch.no_grad():
        ibp, planned = net.intermediate_bounds(lo, hi)
    starts = full_alpha.start_nodes(net, planned, 1)
    last = starts[-1]
    held = sum(t.numel() for t in last.alphas.values())
    position = {n.name: i for i, n in enumerate(net.nodes)}
    whole = 2 * len(last.index) * sum(
        math.prod(r.alpha_init([planned.get(i) for i in r.inputs]).shape[1:])
        for r in net.optimisable_nodes() if position[r.name] < position[last.node.name])
    assert held < whole
    capped = full_alpha.start_nodes(net, planned, 1, max_alpha_elements=held)
    assert last.node.name in [s.node.name for s in capped]
    below = full_alpha.start_nodes(net, planned, 1, max_alpha_elements=held - 1)
    assert last.node.name not in [s.node.name for s in below]


def test_alpha_cap_of_conv_start_nodes_counts_whole_ops(networks):
    """A (C, H, W) start node is capped on whole-op counts (its rows may carry window alphas
    in single mode, up to a whole op's each), whatever the mode: a cap just below that count
    drops it even where its ReLUs' inexact neurons alone would fit."""
    from shardbound.runtime.engine import full_alpha

    net, shape = networks["cnn_batchnorm"]
    lo, hi = _box(shape, 5, 0.3)
    with torch.no_grad():
        ibp, planned = net.intermediate_bounds(lo, hi)
    conv = [s for s in full_alpha.start_nodes(net, planned, 1) if len(s.node.shape) == 3]
    assert conv
    s = conv[0]
    position = {n.name: i for i, n in enumerate(net.nodes)}
    before = [r for r in net.optimisable_nodes() if position[r.name] < position[s.node.name]]
    per = [full_alpha._per_row(net, before, planned, held=h) for h in (True, False)]
    held, whole = (2 * len(s.index) * sum(p.values()) for p in per)
    assert held < whole
    kept = [t.node.name for t in full_alpha.start_nodes(net, planned, 1,
                                                        max_alpha_elements=whole - 1)]
    assert s.node.name not in kept
