"""Input elements a property fixes (lower == upper) folded in as constants
(compiler/fixed_inputs.py): a Slice whose starts are read from such an element compiles,
its bounds hold on samples (onnxruntime), and the program refuses boxes and properties that
fix the element elsewhere (runtime/program/fixed_inputs.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from shardbound.compiler.driver import compile_model
from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.fixed_inputs import FixedInputs
from shardbound.passes.manager import PassOptions
from shardbound.runtime import load

POSITION = 4            # x[4] is where the window starts, x[5] a fixed scale


def _model(seed=0):
    """y = W2 relu(W1 (x[5] * x[0:4][p:p+2])) with p = int(x[4]): the window position and
    the scale are read from the input, as cctsdb_yolo_2023 reads its patch position."""
    rng = np.random.default_rng(seed)
    c = lambda name, v: numpy_helper.from_array(np.asarray(v), name)   # noqa: E731
    inits = [c("s0", np.array([0], np.int64)), c("s4", np.array([4], np.int64)),
             c("ax", np.array([1], np.int64)), c("ip", np.array(POSITION, np.int64)),
             c("isc", np.array([5], np.int64)), c("two", np.array([2], np.int64)),
             c("W1", rng.standard_normal((2, 5)).astype(np.float32)),
             c("W2", rng.standard_normal((5, 2)).astype(np.float32))]
    nodes = [helper.make_node("Slice", ["x", "s0", "s4", "ax"], ["data"]),
             helper.make_node("Gather", ["x", "ip"], ["pf"], axis=1),
             helper.make_node("Cast", ["pf"], ["p"], to=TensorProto.INT64),
             helper.make_node("Add", ["p", "two"], ["pe"]),
             helper.make_node("Slice", ["data", "p", "pe", "ax"], ["win"]),
             helper.make_node("Gather", ["x", "isc"], ["scale"], axis=1),
             helper.make_node("Mul", ["win", "scale"], ["scaled"]),
             helper.make_node("MatMul", ["scaled", "W1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "window", [helper.make_tensor_value_info("x", 1, [1, 6])],
                              [helper.make_tensor_value_info("y", 1, [1, 2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    d = tmp_path_factory.mktemp("fixed")
    model = _model()
    path = str(d / "m.onnx")
    onnx.save(model, path)
    fixed = FixedInputs(np.array([POSITION, 5]), np.array([1.0, 0.7]))
    compile_model(path, str(d / "prog"), PassOptions(), fixed=fixed)
    return model, path, load(str(d / "prog")), d


def test_refused_without_the_property(folded, tmp_path):
    _, path, _, _ = folded
    with pytest.raises(ShardboundError, match="Slice"):
        compile_model(path, str(tmp_path / "p"), PassOptions())


def test_bounds_hold_on_samples(folded):
    import onnxruntime as ort

    model, _, verifier, _ = folded
    assert verifier.plan["fixed_inputs"] == {"indices": [4, 5], "values": [1.0, 0.7]}
    lower = np.array([-1.0, -0.5, 0.2, -2.0, 1.0, 0.7], np.float32)
    upper = np.array([0.5, 1.5, 0.9, -1.0, 1.0, 0.7], np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    xs = lower + rng.random((300, 6), dtype=np.float32) * (upper - lower)
    xs[:8, :4] = np.where(rng.random((8, 4)) < 0.5, lower[:4], upper[:4])   # corners too
    ys = np.concatenate([sess.run(None, {"x": x[None]})[0] for x in xs])
    for method in ("ibp", "crown"):
        lb, ub = verifier.bounds(torch.tensor(lower), torch.tensor(upper), method=method)
        assert (ys >= lb.numpy() - 1e-5).all() and (ys <= ub.numpy() + 1e-5).all(), method
    # the window is x[1:3]: the bounds do not depend on x[0] and x[3] at all
    wide = lower.copy(), upper.copy()
    wide[0][[0, 3]], wide[1][[0, 3]] = -50.0, 50.0
    lb2, ub2 = verifier.bounds(torch.tensor(wide[0]), torch.tensor(wide[1]))
    assert torch.equal(lb2, lb) and torch.equal(ub2, ub)
    y = verifier.forward(torch.tensor(xs[0])).numpy()
    np.testing.assert_allclose(y, ys[0], rtol=1e-5, atol=1e-6)


def test_differing_fixed_value_refused(folded):
    model, _, verifier, _ = folded
    lower = np.array([-1.0, -0.5, 0.2, -2.0, 2.0, 0.7], np.float32)
    upper = np.array([0.5, 1.5, 0.9, -1.0, 2.0, 0.7], np.float32)
    with pytest.raises(ShardboundError, match=r"input 4 is 2, .* fixes it at 1 "):
        verifier.bounds(torch.tensor(lower), torch.tensor(upper))
    lower[4] = upper[4] = 1.0
    upper[5] = 0.8                          # the scale is a range now
    with pytest.raises(ShardboundError, match=r"input 5 is \[0.69\d*, 0.80\d*\]"):
        verifier.bounds(torch.tensor(lower), torch.tensor(upper))
    with pytest.raises(ShardboundError, match="input 4"):
        verifier.forward(torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, 0.7]))


def test_verify_folds_and_checks_the_property(folded, tmp_path):
    """`verify` compiles as it is, is refused, folds the fixed inputs and answers; a property
    case that fixes the position elsewhere is refused by the program in one line."""
    from test_verify import _verify_in_process, _write_property

    from shardbound.runtime.verification.spec import Conjunction, Spec, SpecCase
    from shardbound.runtime.verification.verdict import verify
    from shardbound.runtime.parallel.dist import SingleComm

    _, path, verifier, _ = folded
    lower = [-1.0, -0.5, 0.2, -2.0, 1.0, 0.7]
    upper = [0.5, 1.5, 0.9, -1.0, 1.0, 0.7]
    prop = tmp_path / "p.vnnlib"
    _write_property(prop, lower, upper, np.array([[1.0, 0.0]]), [-1e4])     # unsat
    r = _verify_in_process([path, str(prop), "--timeout", "60", "--quiet"])
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "unsat", r.stdout + r.stderr
    moved = np.array(lower), np.array(upper)
    moved[0][4] = moved[1][4] = 2.0
    spec = Spec("moved.vnnlib", 6, 2, (SpecCase(moved[0], moved[1], (
        Conjunction(np.array([[1.0, 0.0]]), np.array([-1e4])),)),))
    with pytest.raises(ShardboundError, match="moved.vnnlib: case 0: input 4 is 2,"):
        verify(verifier, spec, 30.0, SingleComm())


def test_partial_folding_matches_the_model():
    """The folded model computes what the model does on every input that holds the fixed
    values, through ops that mix fixed and free elements (onnxruntime on both)."""
    import onnxruntime as ort

    from shardbound.compiler.fixed_inputs import fold_fixed_inputs

    i64 = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)   # noqa: E731
    inits = [i64("z", [0]), i64("three", [3]), i64("six", [6]), i64("eight", [8]),
             i64("ax", [1]), i64("five", 5), i64("shape", [1, 2]),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    nodes = [helper.make_node("Slice", ["x", "z", "three", "ax"], ["a"]),       # all fixed
             helper.make_node("Slice", ["x", "three", "six", "ax"], ["a2"]),    # x5 fixed
             helper.make_node("Concat", ["a", "a2"], ["b"], axis=1),
             helper.make_node("Mul", ["b", "b"], ["c"]),
             helper.make_node("Gather", ["x", "five"], ["pf"], axis=1),
             helper.make_node("Cast", ["pf"], ["p"], to=TensorProto.INT64),
             helper.make_node("Gather", ["c", "p"], ["d"], axis=1),
             helper.make_node("Greater", ["c", "half"], ["g"]),
             helper.make_node("Neg", ["c"], ["nc"]),
             helper.make_node("Where", ["g", "c", "nc"], ["e"]),
             helper.make_node("Expand", ["d", "shape"], ["de"]),
             helper.make_node("Slice", ["x", "six", "eight", "ax"], ["t"]),
             helper.make_node("Concat", ["e", "de", "t"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "mix", [helper.make_tensor_value_info("x", 1, [1, 8])],
                              [helper.make_tensor_value_info("y", 1, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    fixed = FixedInputs(np.array([0, 1, 2, 5]), np.array([0.3, -0.9, 1.25, 2.0]))
    out, count = fold_fixed_inputs(model, fixed, "mix.onnx")
    assert count >= 4 and len(out.graph.node) < len(nodes)
    # x[0:3] and c[p] (p = int(x5), c[5] = x5 * x5) are constants; c stays computed
    assert {"a", "de"} <= {t.name for t in out.graph.initializer}
    assert "c" in {o for n in out.graph.node for o in n.output}
    run = lambda m, x: ort.InferenceSession(   # noqa: E731
        m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    rng = np.random.default_rng(2)
    for _ in range(5):
        x = rng.standard_normal((1, 8)).astype(np.float32)
        x[0, fixed.indices] = fixed.folded
        np.testing.assert_array_equal(run(out, x), run(model, x))
