"""Soundness of IBP and CROWN on the real networks in ../shared/benchmarks (skipped when absent):
10,000 sampled points plus projected-gradient attacks inside each property's input box."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from conftest import SHARED, shared_path
from soundness import assert_sound

ACAS = sorted(glob.glob(os.path.join(SHARED, "acasxu", "ACASXU_*.onnx")))


def _compiled(tmp_path, path):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    compile_model(path, str(tmp_path / "prog"), PassOptions())
    return load(str(tmp_path / "prog"))


def _box(prop_path):
    from shardbound.compiler.vnnlib import parse_vnnlib

    case = parse_vnnlib(prop_path).cases[0]
    return torch.tensor(case.lower, dtype=torch.float32), torch.tensor(case.upper, dtype=torch.float32)


def _check(verifier, lo, hi, label):
    def forward(x):
        return verifier.network.forward(x.reshape(-1, *verifier.input_shape)).reshape(x.shape[0], -1)

    for method in ("ibp", "crown"):
        lb, ub = verifier.bounds(lo, hi, method=method)
        assert_sound(forward, lo, hi, lb, ub, label=f"{label}/{method}")


@pytest.mark.parametrize("net", [os.path.basename(p) for p in ACAS] or ["absent"])
def test_acasxu_bounds_are_sound(tmp_path, net):
    path = shared_path("acasxu", net)
    verifier = _compiled(tmp_path, path)
    for prop in ("prop_1.vnnlib", "prop_3.vnnlib"):
        lo, hi = _box(shared_path("acasxu", prop))
        _check(verifier, lo, hi, f"{net}/{prop}")


@pytest.mark.parametrize("prop", ["prop_0_0.03.vnnlib", "prop_7_0.05.vnnlib"])
def test_mnistfc_bounds_are_sound(tmp_path, prop):
    verifier = _compiled(tmp_path, shared_path("mnistfc", "mnist-net_256x2.onnx"))
    lo, hi = _box(shared_path("mnistfc", prop))
    _check(verifier, lo, hi, prop)
