"""IBP and CROWN bounds contain every sampled and attacked output, on every zoo model; forward
semantics match the ONNX reference evaluator; CROWN is at least as tight as IBP on the zoo."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx.reference import ReferenceEvaluator

import zoo
from conftest import random_box
from soundness import assert_sound


def _flat_forward(verifier):
    n_in = int(np.prod(verifier.input_shape))

    def forward(x):
        return verifier.network.forward(x.reshape(-1, *verifier.input_shape)).reshape(x.shape[0], -1)

    return forward, n_in


def _references(model):
    """onnxruntime, and onnx.reference where it is right: onnx 1.23's reference
    BatchNormalization disagrees with onnxruntime and with the ONNX spec formula, so models
    holding one are checked against onnxruntime alone."""
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    refs = [lambda feed: session.run(None, feed)[0]]
    if not any(n.op_type == "BatchNormalization" for n in model.graph.node):
        evaluator = ReferenceEvaluator(model)
        refs.append(lambda feed: evaluator.run(None, feed)[0])
    return refs


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_forward_matches_onnx_reference(compile_zoo, name):
    verifier, model, _ = compile_zoo(name)
    rng = np.random.default_rng(1)
    input_name = model.graph.input[0].name
    for _ in range(3):
        x = rng.uniform(-1, 1, size=(1, *verifier.input_shape)).astype(np.float32)
        got = verifier.forward(torch.from_numpy(x)).numpy()
        for ref in _references(model):
            expected = ref({input_name: x})
            np.testing.assert_allclose(got.reshape(-1), expected.reshape(-1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
@pytest.mark.parametrize("method", ["ibp", "crown", "alpha-crown"])
def test_bounds_are_sound(compile_zoo, name, method):
    verifier, _, _ = compile_zoo(name)
    rng = np.random.default_rng(2)
    lo, hi = random_box(rng, verifier.input_shape, radius=0.3)
    lb, ub = verifier.bounds(lo, hi, method=method)
    assert bool((lb <= ub).all())
    forward, _ = _flat_forward(verifier)
    assert_sound(forward, torch.from_numpy(lo), torch.from_numpy(hi), lb, ub, label=f"{name}/{method}")


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_crown_with_spec_matrix_is_sound(compile_zoo, name):
    verifier, _, _ = compile_zoo(name)
    rng = np.random.default_rng(3)
    lo, hi = random_box(rng, verifier.input_shape, radius=0.2)
    out = int(np.prod(verifier.output_shape))
    C = torch.from_numpy(rng.normal(size=(3, out)).astype(np.float32))
    forward, _ = _flat_forward(verifier)
    for method in ("ibp", "crown"):
        lb, ub = verifier.bounds(lo, hi, C=C, method=method)
        assert lb.shape == (3,)
        assert_sound(forward, torch.from_numpy(lo), torch.from_numpy(hi), lb, ub, C=C,
                     n=3000, label=f"{name}/{method}/C")


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_crown_at_least_as_tight_as_ibp(compile_zoo, name):
    verifier, _, _ = compile_zoo(name)
    rng = np.random.default_rng(4)
    lo, hi = random_box(rng, verifier.input_shape, radius=0.1)
    ilb, iub = verifier.bounds(lo, hi, method="ibp")
    clb, cub = verifier.bounds(lo, hi, method="crown")
    tol = 1e-5 * (1 + torch.maximum(ilb.abs(), iub.abs()))
    assert bool((clb >= ilb - tol).all()), (clb, ilb)
    assert bool((cub <= iub + tol).all()), (cub, iub)


def test_ibp_intermediate_plan_is_sound_and_looser(compile_zoo):
    crown, _, _ = compile_zoo("residual")
    mixed, _, _ = compile_zoo("residual", intermediate="ibp")
    rng = np.random.default_rng(5)
    lo, hi = random_box(rng, crown.input_shape, radius=0.3)
    lb_c, ub_c = crown.bounds(lo, hi)
    lb_m, ub_m = mixed.bounds(lo, hi)
    forward, _ = _flat_forward(mixed)
    assert_sound(forward, torch.from_numpy(lo), torch.from_numpy(hi), lb_m, ub_m, label="ibp-intermediate")
    assert float((ub_m - lb_m).sum()) >= float((ub_c - lb_c).sum()) - 1e-4


def test_batched_boxes_match_single_boxes(compile_zoo):
    verifier, _, _ = compile_zoo("cnn_batchnorm")
    rng = np.random.default_rng(6)
    boxes = [random_box(rng, verifier.input_shape, radius=0.05) for _ in range(3)]
    lo = np.stack([b[0] for b in boxes])
    hi = np.stack([b[1] for b in boxes])
    lb, ub = verifier.bounds(lo, hi)
    assert lb.shape == (3, 5)
    for i, (l, h) in enumerate(boxes):
        slb, sub = verifier.bounds(l, h)
        torch.testing.assert_close(lb[i], slb, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ub[i], sub, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mlp", "residual", "cnn_batchnorm"])
def test_alpha_crown_is_at_least_as_tight_as_crown_and_repeats(compile_zoo, name):
    verifier, _, _ = compile_zoo(name)
    lo, hi = random_box(np.random.default_rng(12), verifier.input_shape, radius=0.3)
    out = int(np.prod(verifier.output_shape))
    C = torch.from_numpy(np.random.default_rng(13).normal(size=(2, out)).astype(np.float32))
    clb, _ = verifier.bounds(lo, hi, C=C, method="crown")
    alb, aub = verifier.bounds(lo, hi, C=C, method="alpha-crown")
    alb2, aub2 = verifier.bounds(lo, hi, C=C, method="alpha-crown")
    assert bool((alb >= clb).all())
    assert torch.equal(alb, alb2) and torch.equal(aub, aub2)
    forward, _ = _flat_forward(verifier)
    assert_sound(forward, torch.from_numpy(lo), torch.from_numpy(hi), alb, aub, C=C, n=3000,
                 label=f"{name}/alpha")
