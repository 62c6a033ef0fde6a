"""Constant computation (compiler/lowering/constants.py, compiler/frontend.py `_fold`): every
kind of constant subgraph folds with onnx.reference to what onnxruntime computes (Shape with
start / end, Size, ConstantOfShape, Range, comparisons and logic, Where, Cast, ArgMax,
ReduceMax, OneHot, Expand and Tile of constants), and the ops still evaluated only on
constants (NonZero, IsNaN, IsInf, BitShift, shape sources) are refused in one line that says
why when applied to the network input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import zoo
from harness import OpCase, generate
from test_movement import ints

F32 = np.float32


def _net(shape, middle):
    """x -> Add(x, middle(b, x)) -> Relu -> Flatten -> Gemm: middle builds a constant (from
    constants and the shape of x) of x's shape or broadcasting into it."""
    def build(rng, opset):
        b = zoo.Builder(rng, shape, opset=opset)
        h = b.op("Add", ["x", middle(b, "x")])
        h = b.op("Flatten", [b.op("Relu", [h])], axis=1)
        return b.build(b.gemm(h, int(np.prod(shape)), 3)), shape
    return build


def _shape_start_end(b, x):
    """Shape(x, start=-2) -> ConstantOfShape(0.25) -> Cast: (4, 5) of 0.25."""
    s = b.op("Shape", [x], start=-2)
    c = b.op("ConstantOfShape", [s], value=onnx.numpy_helper.from_array(np.array([0.25], F32)))
    return b.op("Cast", [c], to=onnx.TensorProto.FLOAT)


def _size_range(b, x):
    """Size(x) / 8 as a float, Range(0, 5, 1) cast to float: (5,) = size/8 + range."""
    n = b.op("Cast", [b.op("Size", [x])], to=onnx.TensorProto.FLOAT)
    r = b.op("Range", [b.const(np.array(0, np.int64)), b.const(np.array(5, np.int64)),
                       b.const(np.array(1, np.int64))])
    return b.op("Add", [b.op("Cast", [r], to=onnx.TensorProto.FLOAT),
                        b.op("Div", [n, b.const(np.array(8, F32))])])


def _logic_where(b, x):
    """Equal / Less / Greater / Not / And / Or on a Range, then Where picks 1.5 or -0.5."""
    r = b.op("Range", [b.const(np.array(0, np.int64)), b.const(np.array(5, np.int64)),
                       b.const(np.array(1, np.int64))])
    eq = b.op("Equal", [r, b.const(np.array(2, np.int64))])
    lt = b.op("Less", [r, b.const(np.array(1, np.int64))])
    gt = b.op("Greater", [r, b.const(np.array(3, np.int64))])
    cond = b.op("Or", [b.op("And", [b.op("Not", [eq]), lt]), gt])
    return b.op("Where", [cond, b.const(np.array(1.5, F32)), b.const(np.array(-0.5, F32))])


def _argmax_onehot(b, x):
    """ArgMax and ReduceMax of a constant matrix, OneHot of constant indices."""
    m = b.const(b.rng.normal(0, 1, (4, 5)).astype(F32))
    am = b.op("ArgMax", [m], axis=1, keepdims=0)                        # (4,) int64
    oh = b.op("OneHot", [am, b.const(np.array(5, np.int64)),
                         b.const(np.array([0.0, 1.0], F32))], axis=-1)  # (4, 5)
    mx = b.op("ReduceMax", [m], axes=[1], keepdims=1)                   # (4, 1)
    return b.op("Add", [oh, mx])


def _expand_tile_const(b, x):
    """Expand, Tile, Gather, Slice and Concat of constants: (4, 5)."""
    c = b.op("Expand", [b.const(np.array([[0.5], [-1.0]], F32)), b.const(ints(1, 5))])  # (2, 5)
    t = b.op("Tile", [b.const(np.array([[1.0, 2.0]], F32)), b.const(ints(2, 1))])     # (2, 2)
    g = b.op("Gather", [t, b.const(ints(0, 1, 1, 0, 1))], axis=1)                    # (2, 5)
    s = b.op("Slice", [c, b.const(ints(0)), b.const(ints(1)), b.const(ints(0))])      # (1, 5)
    return b.op("Concat", [b.op("Add", [s, g]), b.op("Sub", [s, g])], axis=0)          # (4, 5)


CASES = [
    OpCase("fold_shape_start_end", "Shape", _net((2, 4, 5), _shape_start_end), opsets=(15,)),
    OpCase("fold_size_range", "Size", _net((3, 5), _size_range), opsets=(11, 13)),
    OpCase("fold_logic_where", "Equal", _net((3, 5), _logic_where), opsets=(11,)),
    OpCase("fold_argmax_onehot", "ArgMax", _net((4, 5), _argmax_onehot), opsets=(11,)),
    OpCase("fold_expand_tile", "Expand", _net((2, 4, 5), _expand_tile_const), opsets=(13,)),
]

generate(CASES, globals())


# -- the discrete ops on the network input: one line that says why -----------------------------------
def _compile_error(tmp_path, build):
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.errors import ShardboundError
    from shardbound.passes.manager import PassOptions

    b = zoo.Builder(np.random.default_rng(0), (3, 4), opset=13)
    y = build(b)
    model = b.build(y)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(ShardboundError) as err:
        compile_model(str(path), str(tmp_path / "out"), PassOptions())
    message = str(err.value)
    assert "\n" not in message and message.startswith("m.onnx")
    return message


@pytest.mark.parametrize("op", ["IsNaN", "IsInf"])
def test_a_bit_level_op_on_the_input_is_refused_with_its_reason(tmp_path, op):
    """(Comparisons, logic, ArgMax and rounding of the input are the discrete family's now:
    tests/ops/test_discrete.py.)"""
    def build(b):
        h = b.op(op, ["x"], name="the_op")
        h = b.op("Cast", [h], to=onnx.TensorProto.FLOAT)
        return b.op("Add", ["x", h])
    message = _compile_error(tmp_path, build)
    assert f"{op} (opset 13, first node 'the_op')" in message
    assert f"; {op}: applied to the network input, these test or shift" in message


def test_a_cast_to_uint32_of_the_input_is_refused(tmp_path):
    def build(b):
        return b.op("Cast", [b.op("Cast", ["x"], to=onnx.TensorProto.UINT32, name="to_u32")],
                    to=onnx.TensorProto.FLOAT)
    message = _compile_error(tmp_path, build)
    assert "'to_u32'" in message and "UINT32 is not supported" in message


def test_gather_with_computed_indices_is_refused(tmp_path):
    def build(b):
        idx = b.op("Cast", [b.op("Relu", ["x"])], to=onnx.TensorProto.INT64, name="to_int")
        return b.op("Gather", [b.const(np.ones((5,), F32)), idx], name="the_gather")
    message = _compile_error(tmp_path, build)
    assert "'the_gather'" in message and "indices that depend on the network input" in message
