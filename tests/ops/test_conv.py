"""The conv family (runtime/ops/conv.py, compiler/lowering/conv.py): Conv, 1-D and 2-D, with
pads, strides, dilations, groups and auto_pad; ConvTranspose (1-D and 2-D: pads, strides,
output_padding, output_shape, groups, dilations, auto_pad)."""

from __future__ import annotations

from conv_helpers import conv_net
from harness import OpCase, generate


def _conv(**attrs):
    groups = attrs.get("group", 1)

    def apply(b, x, shape):
        c_in, H, W = shape[1:]
        c_out = 2 * groups
        k = attrs.pop("_k", 3) if "_k" in attrs else 3
        w = b.weight(c_out, c_in // groups, k, k)
        y = b.op("Conv", [x, b.const(w), b.const(b.rng.normal(0, 0.1, (c_out,)))], **attrs)
        return y, _out_shape(b, y, x, shape, c_out)
    return apply


def _out_shape(b, y, x, shape, c_out):
    """The conv's output shape, read off ONNX shape inference of the graph so far."""
    import onnx
    from onnx import TensorProto, helper

    probe = helper.make_graph(b.nodes, "p", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, *b.input_shape])], [], b.inits)
    model = helper.make_model(probe, opset_imports=[helper.make_opsetid("", b.opset)])
    for v in onnx.shape_inference.infer_shapes(model).graph.value_info:
        if v.name == y:
            return tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
    raise AssertionError("no inferred shape")


def _case(name, input_shape=(2, 6, 6), **attrs):
    return OpCase(name, "Conv", lambda rng, o: conv_net(rng, o, input_shape, _conv(**attrs),
                                                         pre_conv=False), opsets=(11,))


CASES = [
    _case("conv_pads", pads=[1, 0, 2, 1]),
    _case("conv_stride_dilation", strides=[2, 1], dilations=[1, 2], pads=[1, 1, 1, 1]),
    _case("conv_groups", input_shape=(4, 5, 5), group=2, pads=[1, 1, 1, 1]),
    _case("conv_same_upper", auto_pad="SAME_UPPER", strides=[2, 2]),
    _case("conv_same_lower", auto_pad="SAME_LOWER"),
]


# -- Conv 1-D and ConvTranspose ----------------------------------------------------------------------
def _conv1d(**attrs):
    def apply(b, x, shape):
        c_in, L = shape[1:]
        g = attrs.get("group", 1)
        y = b.op("Conv", [x, b.const(b.weight(2 * g, c_in // g, 3)),
                          b.const(b.rng.normal(0, 0.1, (2 * g,)))], **attrs)
        return y, _out_shape(b, y, x, shape, 2 * g)
    return apply


def _conv1d_net(rng, opset, attrs):
    """x (C, L) -> Conv1d -> Relu -> Conv1d -> Flatten -> Gemm."""
    import numpy as np
    import zoo

    b = zoo.Builder(rng, (2, 7), opset=opset)
    h, shape = _conv1d(**attrs)(b, "x", (1, 2, 7))
    h, shape = _conv1d(**attrs)(b, b.op("Relu", [h]), shape)
    h = b.op("Flatten", [h], axis=1)
    return b.build(b.gemm(h, int(np.prod(shape[1:])), 3)), (2, 7)


def _conv_transpose(**attrs):
    def apply(b, x, shape):
        c_in = shape[1]
        g = attrs.get("group", 1)
        k = attrs.pop("_k", None) or 3
        inputs = [x, b.const(b.weight(c_in, 2, k, k))]
        if attrs.pop("_bias", True):
            inputs.append(b.const(b.rng.normal(0, 0.1, (2 * g,))))
        y = b.op("ConvTranspose", inputs, **attrs)
        return y, _out_shape(b, y, x, shape, 2 * g)
    return apply


def _ct_case(name, input_shape=(2, 4, 4), opsets=(11,), reference=True, **attrs):
    return OpCase(name, "ConvTranspose",
                  lambda rng, o: conv_net(rng, o, input_shape, _conv_transpose(**dict(attrs)),
                                          pre_conv=False), opsets=opsets, reference=reference)


CASES += [
    OpCase("conv1d_pads_stride", "Conv", lambda rng, o: _conv1d_net(rng, o, dict(
        pads=[2, 1], strides=[2], dilations=[1])), opsets=(11,)),
    OpCase("conv1d_same_groups", "Conv", lambda rng, o: _conv1d_net(rng, o, dict(
        auto_pad="SAME_UPPER", group=2)), opsets=(13,)),
    _ct_case("conv_transpose_stride", strides=[2, 2], opsets=(9, 11)),
    _ct_case("conv_transpose_pads_outpad", strides=[2, 3], pads=[1, 0, 0, 2],
             output_padding=[1, 2]),
    _ct_case("conv_transpose_groups_dilations", input_shape=(4, 3, 3), group=2,
             dilations=[2, 1], strides=[1, 2], _bias=False,
             reference=False),     # onnx 1.23's reference ConvTranspose fails on groups
    _ct_case("conv_transpose_same_upper", auto_pad="SAME_UPPER", strides=[2, 2], _k=4),
    _ct_case("conv_transpose_same_lower", auto_pad="SAME_LOWER", strides=[2, 1], _k=2),
    _ct_case("conv_transpose_output_shape", strides=[2, 2], output_shape=[8, 7],
             reference=False),     # ... and on output_shape
]

generate(CASES, globals())


def test_conv_transpose_kernel_orders_agree_and_rows_are_independent():
    """Every summation order computes the same transposed convolution (to rounding) and its
    exact transpose; blocked / exact backward bits do not depend on the row split."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from shardbound.runtime.ops.conv import ConvTranspose2d

    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 3, 2, generator=g)
    b = torch.randn(6, generator=g)
    x = torch.randn(2, 4, 5, 4, generator=g)
    want = F.conv_transpose2d(x, w, b, stride=(2, 3), padding=0, output_padding=(1, 2),
                              groups=2, dilation=(1, 2))[:, :, 1:, :-1]
    A = torch.randn(2, 5, *want.shape[1:], generator=g)
    results = {}
    for order in ("fast", "blocked", "exact"):
        op = ConvTranspose2d("ct", ["x"], [(4, 5, 4)], params={"weight": w, "bias": b},
                             order=order, strides=(2, 3), pads=(1, 0, 0, 1), dilations=(1, 2),
                             groups=2, output_padding=(1, 2))
        assert op.shape == tuple(want.shape[1:])
        y = op.forward(x)
        assert torch.allclose(y, want, atol=1e-5), order
        (A_in,), bias = op.backward_linear(A)
        lhs = (A.double() * (y - b.reshape(1, -1, 1, 1)).double().unsqueeze(1)).flatten(2).sum(-1)
        rhs = (A_in.double() * x.double().unsqueeze(1)).flatten(2).sum(-1)
        assert torch.allclose(lhs, rhs, atol=1e-4), order
        results[order] = A_in
        if order != "fast":
            for a, c in ((0, 1), (1, 5)):
                (part,), pbias = op.backward_linear(A[:, a:c].contiguous())
                assert torch.equal(part, A_in[:, a:c]) and torch.equal(pbias, bias[:, a:c])
    assert np.allclose(results["blocked"].numpy(), results["exact"].numpy(), atol=1e-5)
