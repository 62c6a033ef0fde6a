"""The pooling family (compiler/lowering/pooling.py; AveragePool lowers to a depthwise conv2d
of the conv family, plus a divisor affine where padding is not counted)."""

from __future__ import annotations

from conv_helpers import conv_net
from harness import OpCase, generate


def _pool(op, **attrs):
    def apply(b, x, shape):
        y = b.op(op, [x], **attrs)
        return y, _pooled(shape, attrs, op)
    return apply


def _pooled(shape, attrs, op):
    n, c, H, W = shape
    if op.startswith("Global"):
        return (n, c, 1, 1)
    kh, kw = attrs["kernel_shape"]
    sh, sw = attrs.get("strides", [1, 1])
    pt, pl, pb, pr = attrs.get("pads", [0, 0, 0, 0])
    return (n, c, (H + pt + pb - kh) // sh + 1, (W + pl + pr - kw) // sw + 1)


def _case(name, op="AveragePool", opsets=(11,), **attrs):
    return OpCase(name, op, lambda rng, o: conv_net(rng, o, (2, 7, 7), _pool(op, **attrs)),
                  opsets=opsets)


CASES = [
    _case("avgpool_stride", kernel_shape=[2, 2], strides=[2, 2]),
    _case("avgpool_pads_excluded", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
          count_include_pad=0),
    _case("avgpool_pads_included", kernel_shape=[3, 2], strides=[1, 2], pads=[1, 0, 1, 1],
          count_include_pad=1),
    _case("global_avgpool", op="GlobalAveragePool"),
]

generate(CASES, globals())
