"""CROWN in the runtime matches the independent float64 reference CROWN on MLPs (1e-5 rel)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import reference_crown
import zoo
from conftest import random_box, shared_path


def _check(verifier, model, lo, hi):
    lb, ub = verifier.bounds(lo, hi, method="crown")
    rl, ru = reference_crown.crown(model, lo, hi)
    scale = 1e-5 * max(1.0, float(np.abs(np.concatenate([rl, ru])).max()))
    np.testing.assert_allclose(lb.numpy(), rl, rtol=1e-5, atol=scale)
    np.testing.assert_allclose(ub.numpy(), ru, rtol=1e-5, atol=scale)


@pytest.mark.parametrize("name", zoo.MLPS)
@pytest.mark.parametrize("radius", [0.01, 0.1, 0.5])
def test_crown_matches_reference_on_zoo_mlps(compile_zoo, name, radius):
    verifier, model, _ = compile_zoo(name)
    lo, hi = random_box(np.random.default_rng(7), verifier.input_shape, radius=radius)
    _check(verifier, model, lo, hi)


@pytest.mark.parametrize("sizes", [(3, 7, 2), (10, 32, 32, 32, 6), (20, 64, 1)])
def test_crown_matches_reference_on_varied_depths(tmp_path, sizes):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    model, shape = zoo.mlp(np.random.default_rng(len(sizes)), sizes=sizes)
    onnx.save(model, tmp_path / "m.onnx")
    compile_model(str(tmp_path / "m.onnx"), str(tmp_path / "p"), PassOptions())
    verifier = load(str(tmp_path / "p"))
    lo, hi = random_box(np.random.default_rng(8), shape, radius=0.2)
    _check(verifier, model, lo, hi)


def test_crown_matches_reference_on_acasxu(tmp_path):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    path = shared_path("acasxu", "ACASXU_run2a_1_1_batch_2000.onnx")
    compile_model(path, str(tmp_path / "p"), PassOptions())
    verifier = load(str(tmp_path / "p"))
    model = onnx.load(path)
    rng = np.random.default_rng(9)
    lo = rng.uniform(-0.3, 0.2, 5).astype(np.float32)
    _check(verifier, model, lo, lo + 0.05)
