"""The layout family (runtime/ops/layout.py, compiler/lowering/layout.py): reshapes by every
exporter's spelling, transposes, pass-through ops, the constant sources, and Pad (every mode,
negative pads, pads as attributes or inputs, the axes input) with its index map
(runtime/ops/index_map.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo
from conv_helpers import conv_net
from harness import OpCase, generate


def _net(rng, opset, middle, input_shape=(2, 3, 4), outputs=3):
    """x -> middle(b, x) -> Flatten -> Gemm -> Relu -> Gemm."""
    b = zoo.Builder(rng, input_shape, opset=opset)
    h = middle(b, "x")
    h = b.op("Flatten", [h], axis=1)
    h = b.relu(b.gemm(h, int(np.prod(input_shape)), 8))
    return b.build(b.gemm(h, 8, outputs)), input_shape


def _reshape_const(b, x):
    return b.op("Reshape", [x, b.const(np.array([1, 6, -1], dtype=np.int64))])


def _reshape_via_shape(b, x):
    """Shape -> Gather-free arithmetic on constants -> Reshape: the target is computed from a
    Shape node (constant output) and folded."""
    s = b.op("Shape", [x])
    return b.op("Reshape", [b.relu(x), s])


def _squeeze_unsqueeze(axes_as_input):
    def middle(b, x):
        if axes_as_input:
            h = b.op("Unsqueeze", [x, b.const(np.array([2], dtype=np.int64))])
            return b.op("Squeeze", [b.relu(h), b.const(np.array([2], dtype=np.int64))])
        h = b.op("Unsqueeze", [x], axes=[2])
        return b.op("Squeeze", [b.relu(h)], axes=[2])
    return middle


def _transpose(b, x):
    return b.op("Transpose", [b.relu(x)], perm=[0, 2, 3, 1])


def _relu(b, x):
    return b.relu(x)


def _identity_dropout_cast(b, x):
    h = b.op("Identity", [x])
    h = b.op("Dropout", [b.relu(h)])
    return b.op("Cast", [h], to=1)


def _constant(b, x):
    c = b.op("Constant", [], value=zoo.numpy_helper.from_array(
        np.full((1, 2, 3, 4), 0.25, dtype=np.float32)))
    return b.op("Add", [b.relu(x), c])


def _case(name, op, middle, opsets=(13,)):
    return OpCase(name, op, lambda rng, o: _net(rng, o, middle), opsets=opsets)


def _pad(mode="constant", pads=(0, 0, 1, 2, 0, 0, 2, 1), value=None, axes=None, how="input"):
    """x -> Pad -> Relu (the op on the box, then behind a conv: see conv_net); `how` gives
    pads as an input (opset 11+) or the `pads` attribute (opset 2-10)."""
    def apply(b, x, shape):
        attrs = {"mode": mode}
        if how == "attribute":
            attrs["pads"] = list(pads)
            if value is not None:
                attrs["value"] = float(value)
            inputs = [x]
        else:
            inputs = [x, b.const(np.array(pads, dtype=np.int64))]
            if value is not None or axes is not None:
                inputs.append(b.const(np.array(0.0 if value is None else value, np.float32))
                              if value is not None else "")
            if axes is not None:
                inputs.append(b.const(np.array(axes, dtype=np.int64)))
        y = b.relu(b.op("Pad", inputs, **attrs))
        return y, _padded(shape, pads, axes)
    return apply


def _padded(shape, pads, axes):
    axes = list(range(len(shape))) if axes is None else [a % len(shape) for a in axes]
    out = list(shape)
    for i, a in enumerate(axes):
        out[a] += pads[i] + pads[i + len(axes)]
    return tuple(out)


def _pad_case(name, opsets=(13,), reference=True, **kw):
    return OpCase(name, "Pad", lambda rng, o: conv_net(rng, o, (2, 4, 5), _pad(**kw)),
                  opsets=opsets, reference=reference)


CASES = [
    _case("reshape", "Reshape", _reshape_const),
    _case("reshape_shape", "Shape", _reshape_via_shape),
    _case("squeeze_unsqueeze_attr", "Squeeze", _squeeze_unsqueeze(False), opsets=(11,)),
    _case("unsqueeze_attr", "Unsqueeze", _squeeze_unsqueeze(False), opsets=(11,)),
    _case("squeeze_unsqueeze_input", "Squeeze", _squeeze_unsqueeze(True), opsets=(13,)),
    _case("unsqueeze_input", "Unsqueeze", _squeeze_unsqueeze(True), opsets=(13,)),
    _case("transpose", "Transpose", _transpose),
    _case("flatten", "Flatten", _relu, opsets=(9, 13)),
    _case("identity", "Identity", _identity_dropout_cast),
    _case("dropout", "Dropout", _identity_dropout_cast, opsets=(12,)),
    _case("cast", "Cast", _identity_dropout_cast, opsets=(13,)),
    _case("constant", "Constant", _constant),
    _pad_case("pad_constant_value", opsets=(11, 13), value=0.75),
    _pad_case("pad_reflect", mode="reflect", pads=(0, 0, 2, 1, 0, 0, 1, 3)),
    _pad_case("pad_edge", mode="edge", pads=(0, 0, 3, 0, 0, 0, 1, 2)),
    _pad_case("pad_attribute", opsets=(10,), how="attribute", value=-0.5),
    _pad_case("pad_attribute_reflect", opsets=(7,), how="attribute", mode="reflect"),
    # onnx.reference refuses negative pads (it slices with them): onnxruntime only
    _pad_case("pad_negative_crop", reference=False, value=0.25, pads=(0, 0, -1, 2, 0, 0, 1, -2)),
    _pad_case("pad_edge_crop", reference=False, mode="edge", pads=(0, 0, 2, -1, 0, 0, -1, 1)),
    _pad_case("pad_channels", pads=(0, 1, 0, 1, 0, 2, 1, 0), value=1.5),
    _pad_case("pad_axes", opsets=(18,), reference=False, pads=(1, -1, 2, 2), axes=(-1, 2),
              value=0.5),
    _pad_case("pad_wrap", opsets=(19,), mode="wrap", pads=(1, 3), axes=(3,)),
]

generate(CASES, globals())


# -- the index map under Pad ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_kernel_matches_numpy_and_its_transpose(mode):
    """forward = numpy.pad after the crop; backward_linear is its exact transpose (adjoint
    identity <A, P x + c> = <P^T A, x> + A . c), and its bits do not depend on the row split."""
    from shardbound.runtime.ops.layout import Pad

    pads = ((0, 0), (2, -1), (-1, 3)) if mode != "reflect" else ((1, 0), (2, 1), (0, 2))
    op = Pad("p", ["x"], [(3, 4, 5)], pads=pads, mode=mode,
             value=0.5 if mode == "constant" else 0.0, order="blocked")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 5, generator=g)
    kept = x.numpy()[:, :, max(-pads[1][0], 0):4 - max(-pads[1][1], 0),
                     max(-pads[2][0], 0):5 - max(-pads[2][1], 0)]
    widths = [(0, 0)] + [(max(b, 0), max(e, 0)) for b, e in pads]
    kwargs = {"constant_values": 0.5} if mode == "constant" else {}
    want = np.pad(kept, widths, mode=mode, **kwargs)
    assert np.array_equal(op.forward(x).numpy(), want)
    A = torch.randn(2, 6, *op.shape, generator=g, dtype=torch.float32)
    (A_in,), bias = op.backward_linear(A)
    lhs = (A.double() * op.forward(x).double().unsqueeze(1)).sum((2, 3, 4))
    rhs = (A_in.double() * x.double().unsqueeze(1)).sum((2, 3, 4))
    if bias is not None:
        rhs = rhs + bias.double()
    assert torch.allclose(lhs, rhs, atol=1e-4)
    for a, b in ((0, 1), (1, 4), (4, 6)):
        (part,), pbias = op.backward_linear(A[:, a:b].contiguous())
        assert torch.equal(part, A_in[:, a:b])
        assert (pbias is None) == (bias is None) and (bias is None or torch.equal(pbias, bias[:, a:b]))


def test_pad_tp_role_only_without_channel_padding():
    from shardbound.runtime.ops import NodeFacts, Pad

    spatial = NodeFacts(shape=(3, 6, 6), in_shapes=((3, 4, 4),), attrs={"pads": ((0, 0), (1, 1), (1, 1))})
    channels = NodeFacts(shape=(4, 4, 4), in_shapes=((3, 4, 4),), attrs={"pads": ((1, 0), (0, 0), (0, 0))})
    assert Pad.tp_roles_of(spatial) == ("elementwise",)
    assert Pad.tp_roles_of(channels) == ()


@pytest.mark.parametrize("pads,mode,message", [
    ([1, 0, 0, 0, 0, 0, 0, 0], "constant", "batch axis"),
    ([0, 0, 4, 0, 0, 0, 0, 0], "reflect", "exceed the axis length"),
    ([0, 0, -3, 0, 0, 0, -1, 0], "constant", "crop all"),
    ([0, 0, 1, 0], "constant", "2 entries per padded axis"),
])
def test_pad_errors_are_one_line(tmp_path, pads, mode, message):
    import onnx

    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.errors import ShardboundError
    from shardbound.passes.manager import PassOptions

    b = zoo.Builder(np.random.default_rng(0), (2, 4, 4), opset=13)
    h = b.op("Pad", ["x", b.const(np.array(pads, dtype=np.int64))], mode=mode, name="the_pad")
    graph = onnx.helper.make_graph(b.nodes + [onnx.helper.make_node("Relu", [h], ["y"])],
                                   "g", [onnx.helper.make_tensor_value_info(
                                       "x", onnx.TensorProto.FLOAT, [1, 2, 4, 4])],
                                   [onnx.helper.make_tensor_value_info(
                                       "y", onnx.TensorProto.FLOAT, ["n", "c", "h", "w"])],
                                   b.inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(ShardboundError, match=message) as err:
        compile_model(str(path), str(tmp_path / "out"), PassOptions())
    assert "\n" not in str(err.value) and "'the_pad'" in str(err.value)
