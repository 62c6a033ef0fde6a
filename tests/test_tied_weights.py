"""Tied weights: one ONNX initializer fed to several nodes (two branches sharing a layer, as
nn4sys' pensieve_small_parallel does). The compiled program stores each node's parameters
under its own name; safetensors refuses tensors that share memory, so the writer must copy
the shared ones (compiler/codegen.py). Forward equals onnxruntime and the bounds are sound."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from soundness import assert_within, witness_values

F32 = np.float32


def tied_branches() -> onnx.ModelProto:
    """x (1, 4) -> Gemm(W, b) -> ReLU -> Gemm(V) = y1;  x * 2 -> Gemm(W, b) -> ReLU -> Gemm(V) = y2;
    y = Concat(y1, y2): W, b and V each feed two nodes."""
    rng = np.random.default_rng(0)
    init = lambda n, s: numpy_helper.from_array(rng.normal(0, 0.7, s).astype(F32), n)  # noqa: E731
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["h1"], transB=1),
             helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("Gemm", ["r1", "V"], ["y1"], transB=1),
             helper.make_node("Mul", ["x", "two"], ["x2"]),
             helper.make_node("Gemm", ["x2", "W", "b"], ["h2"], transB=1),
             helper.make_node("Relu", ["h2"], ["r2"]),
             helper.make_node("Gemm", ["r2", "V"], ["y2"], transB=1),
             helper.make_node("Concat", ["y1", "y2"], ["y"], axis=1)]
    inits = [init("W", (6, 4)), init("b", (6,)), init("V", (3, 6)),
             numpy_helper.from_array(np.array(2.0, F32), "two")]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 4])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    tmp = tmp_path_factory.mktemp("tied")
    model = tied_branches()
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp / "m.onnx")
    compile_model(str(tmp / "m.onnx"), str(tmp / "prog"), PassOptions())
    return model, load(str(tmp / "prog"))


def test_forward_equals_onnxruntime(compiled):
    import onnxruntime as ort

    model, verifier = compiled
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for x in np.random.default_rng(1).normal(size=(4, 1, 4)).astype(F32):
        got = verifier.forward(torch.from_numpy(x)).numpy().reshape(-1)
        want = session.run(None, {"x": x})[0].reshape(-1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bounds_are_sound(compiled):
    _, verifier = compiled
    c = np.random.default_rng(2).uniform(-1, 1, (1, 4)).astype(F32)
    lo, hi = c - F32(0.4), c + F32(0.4)
    net = verifier.network
    forward = lambda x: net.forward(x.reshape(-1, *net.input_shape)).reshape(x.shape[0], -1)  # noqa: E731
    values = witness_values(forward, torch.from_numpy(lo), torch.from_numpy(hi), n=2000)
    for method in ("ibp", "crown"):
        lb, ub = verifier.bounds(lo, hi, method=method)
        assert_within(values, lb, ub, label=f"tied/{method}")
