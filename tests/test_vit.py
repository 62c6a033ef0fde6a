"""Issue 15's small Vision Transformer (tests/zoo.py `vit_tiny`: patch Conv, class token by
Concat, positional embedding, 2 attention blocks with Softmax, BatchNorm norms, GELU MLPs,
mean pooling, a linear head; torch.onnx.export(..., dynamo=False)) in single mode: it
compiles into the bilinear, softmax and gelu kernels, its forward pass is onnxruntime's, IBP
and CROWN bounds hold every sampled and PGD point and CROWN is strictly tighter than IBP
(alpha-CROWN through the same kernels is sampled per op in tests/ops), and `verify` proves robustness at a small radius and finds a counterexample at a large
one. fsdp and tp bitwise single mode: tests/test_op_zoo.py (the same jobs as the op zoo)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import zoo
from soundness import assert_within, witness_values


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    tmp = tmp_path_factory.mktemp("vit")
    model, shape = zoo.build("vit_tiny")
    path = tmp / "vit.onnx"
    onnx.save(model, path)
    progs = {}
    for order in ("blocked", "fast"):
        compile_model(str(path), str(tmp / order), PassOptions(summation=order))
        progs[order] = load(str(tmp / order))
    x0 = np.random.default_rng(3).uniform(0, 1, size=(1, *shape)).astype(np.float32)
    return tmp, model, progs, x0


def _flat(verifier):
    return lambda x: verifier.network.forward(x.reshape(-1, 1, 8, 8)).reshape(x.shape[0], -1)


def test_compiles_to_the_new_kernels_and_matches_onnxruntime(vit):
    import onnxruntime as ort

    _, model, progs, x0 = vit
    kinds = {n.kind for n in progs["blocked"].network.nodes}
    assert {"matmul_xy", "softmax", "gelu", "conv2d", "move"} <= kinds, kinds
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    xs = np.random.default_rng(4).uniform(0, 1, size=(4, 1, 1, 8, 8)).astype(np.float32)
    for x in xs:
        want = session.run(None, {"x": x})[0]
        for verifier in progs.values():
            np.testing.assert_allclose(verifier.forward(torch.from_numpy(x)).numpy(), want,
                                       rtol=1e-4, atol=1e-5)


def test_crown_sound_and_strictly_tighter_than_ibp(vit):
    _, _, progs, x0 = vit
    eps = np.float32(0.02)
    lo, hi = torch.from_numpy(x0 - eps).reshape(-1), torch.from_numpy(x0 + eps).reshape(-1)
    values = witness_values(_flat(progs["fast"]), lo, hi, n=3000)
    width = {}
    for method in ("ibp", "crown"):     # alpha-CROWN through these kernels: tests/ops
        lb, ub = progs["blocked"].bounds(lo, hi, method=method)
        assert bool(torch.isfinite(lb).all() and torch.isfinite(ub).all()), method
        assert_within(values, lb.reshape(-1), ub.reshape(-1), label=f"vit/{method}")
        width[method] = (ub - lb).reshape(-1)
    assert bool((width["crown"] < width["ibp"]).all()), width


def _robustness_property(path, lo, hi, label, classes=3):
    """VNN-LIB: the region of the box where some other class scores at least `label`'s."""
    lines = [f"(declare-const X_{i} Real)" for i in range(lo.size)]
    lines += [f"(declare-const Y_{j} Real)" for j in range(classes)]
    for i, (a, b) in enumerate(zip(lo.reshape(-1), hi.reshape(-1))):
        lines += [f"(assert (>= X_{i} {float(a)!r}))", f"(assert (<= X_{i} {float(b)!r}))"]
    others = " ".join(f"(and (>= Y_{j} Y_{label}))" for j in range(classes) if j != label)
    lines.append(f"(assert (or {others}))")
    path.write_text("\n".join(lines) + "\n")


def test_verify_proves_a_small_radius_and_breaks_a_large_one(vit):
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.verification.spec import spec_from_property
    from shardbound.runtime.verification.verdict import verify

    tmp, model, progs, x0 = vit
    verifier = progs["fast"]
    y0 = verifier.forward(torch.from_numpy(x0)).reshape(-1)
    label = int(torch.argmax(y0))
    for eps, expected in ((0.005, "unsat"), (0.5, "sat")):
        lo, hi = (x0 - np.float32(eps)).reshape(-1), (x0 + np.float32(eps)).reshape(-1)
        prop = tmp / f"robust_{eps}.vnnlib"
        _robustness_property(prop, lo, hi, label)
        result = verify(verifier, spec_from_property(parse_vnnlib(str(prop))), 60, SingleComm())
        assert result.verdict == expected, (eps, result.verdict, result.stages)
        if expected == "sat":
            x = np.asarray(result.x, dtype=np.float32)
            assert np.all(x >= lo) and np.all(x <= hi)
            y = verifier.forward(torch.from_numpy(x).reshape(1, 1, 8, 8)).reshape(-1)
            assert int(torch.argmax(y)) != label or float(y.max()) == float(y[label])
