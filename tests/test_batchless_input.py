"""Inputs without a batch axis (an ONNX input of shape (6,) or (3, 4): the first axis is not
1 or symbolic): the model is one sample as it stands (compiler/context.py, `batched`). It
compiles, its forward pass equals onnxruntime's on the same flat values, and its IBP / CROWN /
alpha-CROWN bounds are sound (sampling + PGD)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from soundness import assert_within, witness_values

F32 = np.float32


def _model(shape, nodes, inits, out_shape, opset=13):
    rng = np.random.default_rng(0)
    tensors = [numpy_helper.from_array(rng.normal(0, 0.5, s).astype(F32) if v is None else v, n)
               for n, s, v in inits]
    graph = helper.make_graph(nodes, "batchless",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                              tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def vector_mlp():
    """x (6,) -> MatMul (6, 8) -> + b -> Relu -> MatMul (8, 3) -> y (3,)."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    return _model((6,), nodes, [("w1", (6, 8), None), ("b1", (8,), None),
                                ("w2", (8, 3), None)], [3]), (6,)


def matrix_net():
    """x (3, 4) -> Transpose (4, 3) -> MatMul (3, 5) -> Relu -> Slice rows 1: -> Flatten
    (1, 15) -> Gemm -> y (1, 2): the first axis is a data axis that later moves."""
    ints = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             helper.make_node("MatMul", ["t", "w1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Slice", ["r", "s0", "s1", "sa"], ["s"]),
             helper.make_node("Flatten", ["s"], ["f"], axis=0),
             helper.make_node("Gemm", ["f", "w2", "b2"], ["y"], transB=1)]
    inits = [("w1", (3, 5), None), ("s0", None, ints(1)), ("s1", None, ints(4)),
             ("sa", None, ints(0)), ("w2", (2, 15), None), ("b2", (2,), None)]
    return _model((3, 4), nodes, inits, [1, 2]), (3, 4)


@pytest.fixture(params=[vector_mlp, matrix_net], ids=lambda f: f.__name__)
def compiled(request, tmp_path):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    model, shape = request.param()
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    compile_model(str(path), str(tmp_path / "prog"), PassOptions())
    return model, shape, load(str(tmp_path / "prog"))


def test_forward_equals_onnxruntime(compiled):
    import onnxruntime as ort

    model, shape, verifier = compiled
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for x in np.random.default_rng(1).normal(size=(4, *shape)).astype(F32):
        want = s.run(None, {"x": x})[0].reshape(-1)
        got = verifier.forward(torch.from_numpy(x.reshape(1, -1))).numpy().reshape(-1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("radius", [0.01, 0.5, 3.0])
def test_bounds_are_sound(compiled, radius):
    _, shape, verifier = compiled
    center = np.random.default_rng(2).uniform(-1, 1, int(np.prod(shape))).astype(F32)
    lo, hi = center - F32(radius), center + F32(radius)
    net = verifier.network
    forward = lambda x: net.forward(x.reshape(-1, *net.input_shape)).reshape(x.shape[0], -1)  # noqa: E731
    values = witness_values(forward, torch.from_numpy(lo), torch.from_numpy(hi))
    widths = {}
    for method in ("ibp", "crown", "alpha-crown"):
        lb, ub = verifier.bounds(lo, hi, method=method)
        assert_within(values, lb, ub, label=f"batchless/{radius}/{method}")
        widths[method] = float((ub - lb).mean())
    assert widths["crown"] <= widths["ibp"] * (1 + 1e-6)


@pytest.mark.parametrize("dtype,name", [(TensorProto.DOUBLE, "float64"),
                                        (TensorProto.FLOAT16, "float16")])
def test_a_float64_or_float16_input_is_computed_in_float32_and_inspect_says_so(tmp_path, dtype,
                                                                               name):
    from shardbound.compiler.driver import inspect_model
    from shardbound.passes.manager import PassOptions

    nodes = [helper.make_node("Cast", ["x"], ["xc"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["xc", "w"], ["y"])]
    graph = helper.make_graph(nodes, "typed", [helper.make_tensor_value_info("x", dtype, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
                              [numpy_helper.from_array(np.ones((3, 2), F32), "w")])
    path = tmp_path / "typed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    header = inspect_model(str(path), PassOptions()).splitlines()[0]
    assert f"input input(3,) = input 'x' ({name}, computed in float32)" in header
