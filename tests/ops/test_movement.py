"""The movement family (runtime/ops/movement.py, compiler/lowering/movement.py): Concat,
Slice, Split, Gather, GatherElements, Expand, Tile, DepthToSpace, SpaceToDepth, Resize and
Upsample (nearest: `move`; linear and cubic: `resample`), and the layout changes that take
the size-1 batch axis elsewhere (Transpose, Flatten, Reshape, Squeeze: compiler/context.py).

Each case puts the op on the input box and again behind a Gemm (`twice`), so its CROWN step
meets real A-matrices; the forward pass is checked against onnxruntime (and onnx.reference),
bounds by sampling and PGD (tests/ops/harness.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo
from harness import OpCase, generate

I64 = np.int64


def twice(rng, opset, input_shape, apply, outputs=3):
    """x -> apply -> Reshape (1, -1) -> Gemm back to x's size -> Reshape -> apply -> Reshape
    (1, -1) -> Gemm. `apply(b, tensor, full_shape) -> tensor`."""
    b = zoo.Builder(rng, input_shape, opset=opset)
    full = (1, *input_shape)
    n = int(np.prod(input_shape))
    flat = b.const(np.array([1, -1], dtype=I64))
    h = b.op("Reshape", [apply(b, "x", full), flat])
    h = b.gemm(h, _numel(b, h), n)
    h = b.op("Reshape", [h, b.const(np.array(full, dtype=I64))])
    h = b.op("Reshape", [apply(b, h, full), flat])
    return b.build(b.gemm(h, _numel(b, h), outputs)), tuple(input_shape)


def _numel(b, tensor):
    """The element count of `tensor`: onnxruntime runs the graph so far on zeros (shape
    inference does not know every old op)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    probe = helper.make_graph(b.nodes, "p", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, *b.input_shape])], [helper.make_tensor_value_info(
            tensor, TensorProto.FLOAT, None)], b.inits)
    model = helper.make_model(probe, opset_imports=[helper.make_opsetid("", b.opset)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return int(session.run(None, {"x": np.zeros((1, *b.input_shape), np.float32)})[0].size)


def _case(name, op, apply, shape=(2, 4, 5), opsets=(13,), reference=True, **kw):
    return OpCase(name, op, lambda rng, o: twice(rng, o, shape, lambda b, x, f: apply(b, x, f, o)),
                  opsets=opsets, reference=reference, **kw)


def ints(*v):
    return np.array(v, dtype=I64)


# -- Concat ----------------------------------------------------------------------------------------
def _concat(axis, with_const=True):
    def apply(b, x, full, opset):
        parts = [x, b.op("Relu", [x]), b.op("Neg", [x])]
        if with_const:
            shape = list(full)
            shape[axis] = 2
            parts.insert(1, b.const(b.rng.uniform(-1, 1, shape).astype(np.float32)))
        return b.op("Concat", parts, axis=axis)
    return apply


# -- Slice and Split --------------------------------------------------------------------------------
def _slice_attr(b, x, full, opset):
    return b.op("Slice", [x], starts=[0, 1, -4], ends=[100, -1, 4], axes=[1, 2, 3])


def _slice_inputs(starts, ends, axes, steps):
    def apply(b, x, full, opset):
        return b.op("Slice", [x, b.const(ints(*starts)), b.const(ints(*ends)),
                              b.const(ints(*axes)), b.const(ints(*steps))])
    return apply


def _split(how):
    def apply(b, x, full, opset):
        if how == "attribute":
            parts = b.op("Split", [x], n_out=2, axis=2, split=[1, 3])
        elif how == "leading":          # the first part is a prefix of the input: still a move
            parts = b.op("Split", [x, b.const(ints(1, 1))], n_out=2, axis=1)
        elif how == "input":
            parts = b.op("Split", [x, b.const(ints(3, 2))], n_out=2, axis=-1)
        else:
            parts = b.op("Split", [x], n_out=3, axis=3, num_outputs=3)      # 2, 2, 1
        first = parts
        second = parts[:-1] + "1"
        axis = {"attribute": 2, "leading": 1}.get(how, 3)
        return b.op("Concat", [second, b.op("Relu", [first])], axis=axis)
    return apply


# -- Gather, GatherElements -------------------------------------------------------------------------
def _gather(axis, indices):
    def apply(b, x, full, opset):
        return b.op("Gather", [x, b.const(np.asarray(indices, dtype=I64))], axis=axis)
    return apply


def _gather_elements(b, x, full, opset):
    idx = b.rng.integers(-4, 4, size=(1, 2, 3, 5))
    return b.op("GatherElements", [x, b.const(idx.astype(I64))], axis=2)


# -- ScatterND (constant indices; cctsdb's box decoding) --------------------------------------------
def _scatter_nd(const_data, opset_attr=False):
    """Rows (0, c, h) of x replaced by computed updates (a row sum of x, reshaped), one index
    given twice (the later wins) and one negative; or a constant data tensor with computed
    rows."""
    def apply(b, x, full, opset):
        idx = np.array([[0, 1, 2], [0, 0, -1], [0, 1, 0], [0, 1, 2]], dtype=I64)
        axes = b.const(ints(2)) if opset >= 13 else None
        s = (b.op("ReduceSum", [x, axes], keepdims=0) if axes is not None else
             b.op("ReduceSum", [x], axes=[2], keepdims=0))                       # (1, 2, 5)
        upd = b.op("Reshape", [b.op("Concat", [s, b.op("Neg", [s])], axis=1),
                               b.const(ints(4, full[3]))])                      # (4, 5)
        data = b.const(b.rng.normal(0, 1, full).astype(np.float32)) if const_data else x
        attrs = {"reduction": "none"} if opset_attr else {}
        return b.op("ScatterND", [data, b.const(idx), upd], **attrs)
    return apply


# -- Expand, Tile, DepthToSpace, SpaceToDepth ---------------------------------------------------------
def _expand(target):
    def apply(b, x, full, opset):
        h = b.op("ReduceSum", [x], axes=[2], keepdims=1) if opset < 13 else \
            b.op("ReduceSum", [x, b.const(ints(2))], keepdims=1)
        return b.op("Expand", [h, b.const(ints(*target))])
    return apply


def _tile(repeats):
    def apply(b, x, full, opset):
        return b.op("Tile", [x, b.const(ints(*repeats))])
    return apply


def _depth_space(mode):
    def apply(b, x, full, opset):
        attrs = {} if mode is None else {"mode": mode}
        y = b.op("DepthToSpace", [x], blocksize=2, **attrs)              # (1, 1, 4, 6)
        return b.op("SpaceToDepth", [b.op("Relu", [y])], blocksize=2)   # (1, 4, 2, 3)
    return apply


# -- the batch axis moves -----------------------------------------------------------------------------
def _layout(kind):
    def apply(b, x, full, opset):
        if kind == "transpose_batch":
            return b.op("Transpose", [x], perm=[1, 0, 3, 2])            # (2, 1, 5, 4)
        if kind == "transpose_any":
            return b.op("Transpose", [x], perm=[2, 3, 0, 1])            # (4, 5, 1, 2)
        if kind == "flatten_2":
            h = b.op("Flatten", [x], axis=2)                            # (2, 20): no batch axis
            return b.op("Transpose", [b.op("Relu", [h])], perm=[1, 0])
        if kind == "squeeze_batch":
            h = b.op("Squeeze", [x, b.const(ints(0))])                  # (2, 4, 5)
            return b.op("Gather", [h, b.const(ints(1, 0))], axis=0)
        if kind == "reshape_merge":
            return b.op("Reshape", [x, b.const(ints(8, 5))])            # merges the batch axis
        raise ValueError(kind)
    return apply


CASES = [
    _case("concat_channels", "Concat", _concat(1), opsets=(7, 13)),
    _case("concat_last", "Concat", _concat(-1)),
    _case("concat_batch_axis", "Concat", _concat(0)),
    _case("concat_computed_only", "Concat", _concat(2, with_const=False)),
    _case("slice_attributes", "Slice", _slice_attr, opsets=(9,)),
    _case("slice_steps", "Slice", _slice_inputs([-1, 0, 1], [-100, 5, 3], [2, 3, 1], [-1, 2, 1]),
          opsets=(10, 13)),
    _case("slice_clamped", "Slice", _slice_inputs([-9, 2], [2 ** 62, -2 ** 62], [-1, 2], [1, -2])),
    _case("split_attribute", "Split", _split("attribute"), opsets=(11,)),
    _case("split_input", "Split", _split("input"), opsets=(13,)),
    _case("split_leading", "Split", _split("leading"), opsets=(13,)),
    _case("split_num_outputs", "Split", _split("num_outputs"), opsets=(18,), reference=False),
    _case("scatter_nd", "ScatterND", _scatter_nd(False), opsets=(11, 13)),
    _case("scatter_nd_const_data", "ScatterND", _scatter_nd(True), opsets=(13,)),
    _case("scatter_nd_reduction_none", "ScatterND", _scatter_nd(False, True), opsets=(16,)),
    _case("gather_repeats", "Gather", _gather(1, [1, -2, 1])),
    _case("gather_scalar_batch", "Gather", _gather(0, 0), opsets=(11,)),
    _case("gather_2d", "Gather", _gather(-1, [[4, 0], [1, 1], [2, 3]])),
    _case("gather_many", "Gather", _gather(3, list(range(5)) * 14)),
    _case("gather_elements", "GatherElements", _gather_elements, opsets=(11, 13)),
    _case("expand", "Expand", _expand([1, 1, 3, 1])),
    _case("expand_rank", "Expand", _expand([2, 1, 1, 2, 1]), opsets=(8, 13)),
    _case("tile", "Tile", _tile([1, 2, 1, 2])),
    _case("tile_batch_axis", "Tile", _tile([2, 1, 1, 1]), opsets=(7,)),
    _case("depth_space_dcr", "DepthToSpace", _depth_space("DCR"), shape=(4, 2, 3)),
    _case("depth_space_crd", "DepthToSpace", _depth_space("CRD"), shape=(4, 2, 3), opsets=(11,)),
    _case("depth_space_old", "SpaceToDepth", _depth_space(None), shape=(4, 2, 3), opsets=(9,)),
    _case("transpose_batch_axis", "Transpose", _layout("transpose_batch")),
    _case("transpose_any", "Transpose", _layout("transpose_any")),
    _case("flatten_axis_2", "Flatten", _layout("flatten_2"), opsets=(11,)),
    _case("squeeze_batch_axis", "Squeeze", _layout("squeeze_batch")),
    _case("reshape_merges_batch", "Reshape", _layout("reshape_merge")),
]


# -- Resize and Upsample --------------------------------------------------------------------------------
def _resize(mode, scales=None, sizes=None, coordinates=None, nearest=None, axes=None, **attrs):
    def apply(b, x, full, opset):
        kw = dict(attrs, mode=mode)
        if coordinates is not None:
            kw["coordinate_transformation_mode"] = coordinates
        if nearest is not None:
            kw["nearest_mode"] = nearest
        if axes is not None:
            kw["axes"] = axes
        if opset < 11:
            return b.op("Resize", [x, b.const(np.array(scales, np.float32))], **kw)
        roi = b.const(np.zeros(0, np.float32))
        if sizes is not None:
            no_scales = b.const(np.zeros(0, np.float32)) if opset < 13 else ""
            return b.op("Resize", [x, roi, no_scales, b.const(ints(*sizes))], **kw)
        return b.op("Resize", [x, roi, b.const(np.array(scales, np.float32))], **kw)
    return apply


def _upsample(mode, scales):
    def apply(b, x, full, opset):
        if opset < 9:
            return b.op("Upsample", [x], mode=mode, scales=[float(s) for s in scales])
        return b.op("Upsample", [x, b.const(np.array(scales, np.float32))], mode=mode)
    return apply


def _rcase(name, op, apply, opsets=(13,), shape=(2, 3, 4), **kw):
    return _case(name, op, apply, shape=shape, opsets=opsets, **kw)


CASES += [
    _rcase("resize_10_nearest", "Resize", _resize("nearest", [1, 1, 2, 1.5]), opsets=(10,),
           reference=False),      # onnx.reference's Resize-10 needs sizes
    _rcase("resize_10_linear", "Resize", _resize("linear", [1, 1, 2, 2]), opsets=(10,),
           reference=False),
    _rcase("resize_nearest_half_pixel", "Resize", _resize("nearest", [1, 1, 1.7, 0.75]),
           opsets=(11, 13)),
    _rcase("resize_nearest_asym_floor", "Resize",
           _resize("nearest", [1, 1, 2, 2], coordinates="asymmetric", nearest="floor")),
    _rcase("resize_nearest_ceil_sizes", "Resize",
           _resize("nearest", sizes=[1, 2, 5, 7], coordinates="align_corners", nearest="ceil")),
    _rcase("resize_nearest_tf", "Resize",
           _resize("nearest", [1, 1, 2, 3], coordinates="tf_half_pixel_for_nn",
                   nearest="round_prefer_ceil"), reference=False),   # not in onnx.reference
    _rcase("resize_linear_half_pixel", "Resize", _resize("linear", [1, 1, 2, 1.5])),
    _rcase("resize_linear_down", "Resize", _resize("linear", [1, 1, 0.7, 0.5])),
    _rcase("resize_linear_align", "Resize",
           _resize("linear", sizes=[1, 2, 5, 7], coordinates="align_corners"), opsets=(11,)),
    _rcase("resize_linear_pytorch", "Resize",
           _resize("linear", [1, 1, 2, 2], coordinates="pytorch_half_pixel")),
    _rcase("resize_linear_asymmetric", "Resize",
           _resize("linear", [1, 1, 2, 2], coordinates="asymmetric")),
    _rcase("resize_cubic", "Resize", _resize("cubic", [1, 1, 2, 1.5])),
    _rcase("resize_cubic_exclude", "Resize",
           _resize("cubic", [1, 1, 1.5, 2], exclude_outside=1, cubic_coeff_a=-0.5)),
    _rcase("resize_18_axes", "Resize", _resize("linear", sizes=[6, 3], axes=[2, 3]),
           opsets=(18,)),
    _rcase("resize_19_symmetric", "Resize",
           _resize("linear", sizes=[5, 9], axes=[2, 3], coordinates="half_pixel_symmetric",
                   keep_aspect_ratio_policy="not_larger"), opsets=(19,)),
    _rcase("resize_nearest_channels", "Resize", _resize("nearest", [1, 2, 1, 1])),
    _rcase("upsample_7_nearest", "Upsample", _upsample("nearest", [1, 1, 2, 3]), opsets=(7,),
           reference=False),       # onnx.reference's Upsample takes scales as an input only
    _rcase("upsample_7_linear", "Upsample", _upsample("linear", [1, 1, 2, 2]), opsets=(7,),
           reference=False),
    _rcase("upsample_9", "Upsample", _upsample("nearest", [1, 1, 3, 2]), opsets=(9,)),
    _rcase("upsample_9_linear", "Upsample", _upsample("linear", [1, 1, 1.5, 2]), opsets=(9,),
           reference=False),
]

generate(CASES, globals())


# -- the kernels themselves ------------------------------------------------------------------------
def _adjoint_and_rows(op, in_shapes, order_rows=((0, 1), (1, 4), (4, 6))):
    """forward is linear with backward_linear as its exact transpose (<A, M x + c> = <M^T A,
    x> + A . c), and the backward bits do not depend on which rows of A go together."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, *s, generator=g) for s in in_shapes]
    y = op.forward(*xs)
    assert tuple(y.shape[1:]) == op.shape
    A = torch.randn(2, 6, *op.shape, generator=g)
    A_in, bias = op.backward_linear(A)
    lhs = (A.double() * y.double().unsqueeze(1)).flatten(2).sum(-1)
    rhs = sum((a.double() * x.double().unsqueeze(1)).flatten(2).sum(-1) for a, x in zip(A_in, xs))
    if bias is not None:
        rhs = rhs + bias.double()
    assert torch.allclose(lhs, rhs, atol=1e-4)
    # Row independence is bitwise under the ordered summations; `fast` takes bias terms as one
    # BLAS product over all rows (numerics/contract.py), whose bits may depend on the row count.
    same = torch.equal if op.order != "fast" else (lambda x, y: torch.allclose(x, y, atol=1e-5))
    for a, b in order_rows:
        part, pbias = op.backward_linear(A[:, a:b].contiguous())
        for p, full in zip(part, A_in):
            assert torch.equal(p, full[:, a:b])
        assert (pbias is None) == (bias is None) and (bias is None or same(pbias, bias[:, a:b]))


@pytest.mark.parametrize("order", ["fast", "blocked", "exact"])
def test_move_concat_with_constants_is_linear_and_row_independent(order):
    """Two inputs and a constant block joined on axis 0 (one input twice), a reversed range
    and a transpose: one map, constants in `fill`."""
    from shardbound.runtime.ops.movement import Move, _source_array

    steps = (("concat", 0, (0, -2, 1, 0)), ("range", 2, 1, -1, -1), ("transpose", (2, 0, 1)))
    source = _source_array([(1, 5, 2), (1, 5, 2)], (0, 0), steps)
    assert source.shape == (2, 5, 5)
    fill = np.where(source < 0, np.random.default_rng(1).normal(size=source.shape), 0.0)
    op = Move("m", ["a", "b"], [(1, 5, 2), (1, 5, 2)], order=order, steps=steps,
              params={"fill": torch.tensor(fill, dtype=torch.float32)})
    _adjoint_and_rows(op, [(1, 5, 2), (1, 5, 2)])


@pytest.mark.parametrize("order", ["fast", "blocked", "exact"])
def test_resample_is_linear_and_row_independent(order):
    from shardbound.runtime.ops.movement import Resample

    op = Resample("r", ["x"], [(2, 5, 300)], order=order, axes=(1, 2), sizes=(9, 450),
                  scales=(1.8, 1.5), coordinates="half_pixel", mode="cubic")
    _adjoint_and_rows(op, [(2, 5, 300)])


def test_nearest_and_linear_weights_match_onnx_reference():
    """The interpolation matrices applied to a vector equal onnx.reference's Resize along
    one axis, for every coordinate mode and both directions of scaling."""
    from onnx.reference.ops.op_resize import _interpolate_1d_along_axis, _linear_coeffs

    from shardbound.runtime.ops.movement import interpolation_matrix

    data = np.random.default_rng(0).normal(size=7)
    for mode in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric",
                 "half_pixel_symmetric"):
        for out_len in (3, 7, 11, 16):
            scale = out_len / 7
            want = _interpolate_1d_along_axis(data, 0, scale, out_len, _linear_coeffs,
                                              coordinate_transformation_mode=mode)
            got = interpolation_matrix(7, out_len, scale, mode) @ data
            np.testing.assert_allclose(got, want, atol=1e-12, err_msg=f"{mode} -> {out_len}")


def test_tp_roles_follow_the_map():
    """A move (or resample, reduce) is elementwise in a tp zone exactly when it acts on each
    channel alone with the same map."""
    from shardbound.runtime.ops import NodeFacts, OP_TYPES

    def roles(kind, in_shape, **attrs):
        op = OP_TYPES[kind]("n", ["x"], [in_shape], **attrs)
        facts = NodeFacts(shape=op.shape, in_shapes=(in_shape,), attrs=attrs)
        return OP_TYPES[kind].tp_roles_of(facts)

    spatial = (("unsqueeze", (0,)), ("range", 3, 4, 0, -1), ("resize_nearest", 2, 6, 2.0,
                                                             "asymmetric", "floor"),
               ("squeeze", (0,)))
    assert roles("move", (260, 3, 5), steps=spatial, expand_front=(0,)) == ("elementwise",)
    assert roles("move", (260, 3, 5), steps=(("range", 0, 0, 100, 1),)) == ()
    assert roles("move", (260, 3, 5), steps=(("transpose", (0, 2, 1)),)) == ("elementwise",)
    assert roles("move", (260, 3, 5), steps=(("transpose", (1, 0, 2)),)) == ()
    assert roles("move", (260, 3, 5), steps=(("expand", (2, 1, 3, 5)),)) == ()
    assert roles("move", (260, 15), steps=(("reshape", (260, 3, 5)),)) == ()
    assert roles("resample", (4, 3, 5), axes=(1,), sizes=(6,), scales=(2.0,)) == ("elementwise",)
    assert roles("resample", (4, 3, 5), axes=(0,), sizes=(6,), scales=(1.5,)) == ()
    assert roles("reduce_sum", (4, 3, 5), axes=(1, 2)) == ("elementwise",)
    assert roles("reduce_sum", (4, 3, 5), axes=(0,)) == ()
