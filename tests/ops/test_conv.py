"""The conv family (runtime/ops/conv.py, compiler/lowering/conv.py): Conv, 2-D, with pads,
strides, dilations, groups and auto_pad."""

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

generate(CASES, globals())
