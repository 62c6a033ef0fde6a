"""Models with several inputs and several outputs: the property's X_i index the inputs'
flattened values in input order and Y_j the outputs' in output order (as VNN-COMP does); the
compiled network is one flat input and one flat output (compiler/frontend.py). Forward equals
onnxruntime, bounds are sound, fsdp is bitwise single, and `verify` answers sat (with every
input's values in the counterexample, in order) and unsat."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from multirank import assert_pairs_bitwise, compile_pairs, run_pairs
from soundness import assert_within, witness_values
from test_verify import _write_property

F32 = np.float32
SHAPES = {"a": [1, 2, 3], "b": [4]}          # a batched (2, 3) input and a batch-less (4,) one


def two_in_two_out():
    """a (1, 2, 3) -> Flatten -> Gemm 6 -> 5; b (4,) -> MatMul 4 -> 5 (W @ b as a row);
    h = ReLU(sum) feeds two outputs: y1 = Gemm 5 -> 2, y2 = h[1:4] * 2 (a Slice)."""
    rng = np.random.default_rng(0)
    init = lambda n, s: numpy_helper.from_array(rng.normal(0, 0.6, s).astype(F32), n)  # noqa: E731
    ints = lambda n, *v: numpy_helper.from_array(np.array(v, dtype=np.int64), n)  # noqa: E731
    nodes = [helper.make_node("Flatten", ["a"], ["af"], axis=1),
             helper.make_node("Gemm", ["af", "wa", "ba"], ["ha"], transB=1),
             helper.make_node("MatMul", ["b", "wb"], ["hb"]),
             helper.make_node("Add", ["ha", "hb"], ["s"]),
             helper.make_node("Relu", ["s"], ["h"]),
             helper.make_node("Gemm", ["h", "w1", "b1"], ["y1"], transB=1),
             helper.make_node("Slice", ["h", "s0", "s1", "sa"], ["hs"]),
             helper.make_node("Mul", ["hs", "two"], ["y2"])]
    inits = [init("wa", (5, 6)), init("ba", (5,)), init("wb", (4, 5)), init("w1", (2, 5)),
             init("b1", (2,)), ints("s0", 1), ints("s1", 4), ints("sa", 1),
             numpy_helper.from_array(np.array(2.0, F32), "two")]
    graph = helper.make_graph(
        nodes, "multi_io",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in SHAPES.items()],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [1, 2]),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, [1, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _onnx_outputs(model, flat):
    import onnxruntime as ort

    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds, k = {}, 0
    for name, shape in SHAPES.items():
        n = int(np.prod(shape))
        feeds[name] = np.asarray(flat[k:k + n], F32).reshape(shape)
        k += n
    return np.concatenate([o.reshape(-1) for o in s.run(None, feeds)])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    tmp = tmp_path_factory.mktemp("multi_io")
    model = two_in_two_out()
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp / "m.onnx")
    compile_model(str(tmp / "m.onnx"), str(tmp / "prog"), PassOptions())
    return tmp, model, load(str(tmp / "prog"))


def _box(seed, radius):
    c = np.random.default_rng(seed).uniform(-1, 1, 10).astype(F32)
    return c - F32(radius), c + F32(radius)


def test_forward_equals_onnxruntime(compiled):
    _, model, verifier = compiled
    assert tuple(verifier.network.input_shape) == (10,)
    for x in np.random.default_rng(1).normal(size=(4, 10)).astype(F32):
        got = verifier.forward(torch.from_numpy(x[None])).numpy().reshape(-1)
        np.testing.assert_allclose(got, _onnx_outputs(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("radius", [0.02, 0.7])
def test_bounds_are_sound(compiled, radius):
    _, _, verifier = compiled
    lo, hi = _box(2, radius)
    net = verifier.network
    forward = lambda x: net.forward(x.reshape(-1, *net.input_shape)).reshape(x.shape[0], -1)  # noqa: E731
    values = witness_values(forward, torch.from_numpy(lo), torch.from_numpy(hi))
    for method in ("ibp", "crown", "alpha-crown"):
        lb, ub = verifier.bounds(lo, hi, method=method)
        assert lb.shape[-1] == 5
        assert_within(values, lb, ub, label=f"multi_io/{radius}/{method}")


def test_verify_sat_lists_every_input_and_unsat(compiled):
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.verification.spec import spec_from_property
    from shardbound.runtime.verification.verdict import verify

    tmp, model, verifier = compiled
    lo, hi = _box(3, 0.3)
    row = np.array([[0.0, 1.0, 0.0, -1.0, 0.0]])       # y1[1] - y2[1]
    crown = float(verifier.bounds(lo, hi, C=row.astype(F32), method="crown")[0][0])
    mid = (lo + hi) / 2
    at_mid = float(row[0] @ _onnx_outputs(model, mid))
    for kind, d, expected in (("sat", at_mid + 1e-3, "sat"), ("unsat", crown - 0.1, "unsat")):
        prop = tmp / f"{kind}.vnnlib"
        _write_property(prop, lo, hi, row, [d])
        result = verify(verifier, spec_from_property(parse_vnnlib(str(prop))), 60, SingleComm())
        assert result.verdict == expected, (kind, result.verdict)
        if expected == "sat":
            x = np.asarray(result.x, dtype=np.float64)
            assert x.shape == (10,) and np.all(x >= lo) and np.all(x <= hi)
            assert float(row[0] @ _onnx_outputs(model, x)) <= d + 1e-5


MODE_METHODS = ["ibp", "crown"]


@pytest.fixture(scope="module")
def modes(tmp_path_factory):
    """The model's single, fsdp and tp programs (`blocked`): the single one run in process,
    the fsdp and tp ones in one job of 2 ranks."""
    tmp = tmp_path_factory.mktemp("multi_io_modes")
    onnx.save(two_in_two_out(), tmp / "m.onnx")
    lo, hi = _box(4, 0.2)
    case = [("multi_io", str(tmp / "m.onnx"), lo, hi)]
    pairs = {}
    for mode in ("fsdp", "tp"):
        (tmp / mode).mkdir()
        pairs[mode] = compile_pairs(tmp / mode, case, mode, summation="blocked")
    single, runs = run_pairs(tmp, pairs["fsdp"] + pairs["tp"], MODE_METHODS, (2,))
    return pairs, single, runs


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_modes_bitwise_single(modes, mode):
    pairs, single, runs = modes
    assert_pairs_bitwise(pairs[mode], single, runs, MODE_METHODS, label=(mode,))


def test_inspect_names_the_inputs_in_order(compiled):
    from shardbound.compiler.driver import inspect_model
    from shardbound.passes.manager import PassOptions

    tmp, _, _ = compiled
    header = inspect_model(str(tmp / "m.onnx"), PassOptions()).splitlines()[0]
    assert "input input(10,) = inputs 'a', 'b' (flattened, in order)" in header
