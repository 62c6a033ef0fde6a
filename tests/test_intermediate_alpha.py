"""Optimised intermediate bounds (runtime/engine/intermediate_alpha.py): sound by sampling and
projected-gradient attacks on every tightened node, never looser than CROWN's, tighter on a
deep MLP (fewer unstable neurons), and bitwise repeatable."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import zoo
from conftest import random_box
from soundness import assert_sound, node_values


def _network(tmp_path, model, name):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    compile_model(str(path), str(tmp_path / name), PassOptions(summation="fast"))
    return load(str(tmp_path / name)).network


MODELS = {
    "deep_mlp": lambda: zoo.mlp(np.random.default_rng(2), sizes=(5, 24, 24, 24, 3)),
    "cnn_batchnorm": lambda: zoo.build("cnn_batchnorm"),
    "residual": lambda: zoo.build("residual"),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimised_intermediate_bounds_are_sound_and_no_looser(tmp_path, name):
    from shardbound.runtime.engine.intermediate_alpha import optimise_intermediate_bounds

    model, shape = MODELS[name]()
    net = _network(tmp_path, model, name)
    tightened = 0
    for seed in range(3):
        lo, hi = (torch.from_numpy(t).reshape(1, *shape)
                  for t in random_box(np.random.default_rng(seed), shape, radius=0.4))
        with torch.no_grad():
            _, known = net.intermediate_bounds(lo, hi)
        better = optimise_intermediate_bounds(net, lo, hi, known)
        for node, (l, h) in better.items():
            assert bool((l >= known[node][0]).all() and (h <= known[node][1]).all()), node
            if torch.equal(l, known[node][0]) and torch.equal(h, known[node][1]):
                continue
            tightened += 1
            assert_sound(node_values(net, node), lo, hi, l.reshape(-1), h.reshape(-1),
                         n=4000, seed=seed, label=f"{name}/{node}/box {seed}")
    assert tightened > 0, name


def test_optimised_intermediate_bounds_cut_unstable_neurons_and_repeat(tmp_path):
    from shardbound.runtime.engine.intermediate_alpha import optimise_intermediate_bounds

    model, shape = MODELS["deep_mlp"]()
    net = _network(tmp_path, model, "deep_mlp")
    lo, hi = (torch.from_numpy(t).reshape(1, 5)
              for t in random_box(np.random.default_rng(9), (5,), radius=0.3))
    with torch.no_grad():
        _, known = net.intermediate_bounds(lo, hi)
    better = optimise_intermediate_bounds(net, lo, hi, known)
    again = optimise_intermediate_bounds(net, lo, hi, known)

    def unstable(bounds):
        return sum(int(((l < 0) & (h > 0)).sum()) for l, h in bounds.values())

    def width(bounds):
        return sum(float((h - l).sum()) for l, h in bounds.values())

    print("unstable", unstable(known), "->", unstable(better),
          "width", width(known), "->", width(better))
    assert unstable(better) < unstable(known)
    assert width(better) < width(known)
    for node in better:
        assert torch.equal(better[node][0], again[node][0])
        assert torch.equal(better[node][1], again[node][1])


def test_the_optimiser_is_torch_adam_bit_for_bit_without_importing_dynamo():
    """engine/optimise.Adam replaces torch.optim.Adam (whose construction imports
    torch._dynamo: ~1 s per process): the same parameters after 25 steps on two groups with
    their own learning rates, and a fresh process runs alpha-CROWN without torch._dynamo."""
    import subprocess
    import sys

    from shardbound.runtime.engine.optimise import Adam

    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 13, generator=g).requires_grad_()
    c = torch.randn(5, generator=g).requires_grad_()
    b, d = a.detach().clone().requires_grad_(), c.detach().clone().requires_grad_()
    ref = torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [c], "lr": 0.03}],
                           foreach=False)
    ours = Adam([([b], 0.1), ([d], 0.03)])
    for _ in range(25):
        for (x, y), opt in (((a, c), ref), ((b, d), ours)):
            opt.zero_grad(set_to_none=True)
            ((x ** 3).sum() + (y.sin() * x[0, :5]).sum()).backward()
            opt.step()
    assert torch.equal(a, b) and torch.equal(c, d)
    code = ("import sys, torch\n"
            "from shardbound.runtime.engine.optimise import maximise, ParamGroup\n"
            "p = torch.zeros(3, requires_grad=True)\n"
            "maximise(lambda last: -(p - 1).pow(2), [ParamGroup([p], 0.1, lambda: None)], 5)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
