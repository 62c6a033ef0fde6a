"""Builders shared by the conv-shaped op tests: a conv in front (so the op sees computed
channels) and a Flatten + Gemm behind."""

from __future__ import annotations

import numpy as np

import zoo


def conv_net(rng, opset, input_shape, apply, channels=3, outputs=3, pre_conv=True):
    """x (C, H, W) -> apply -> [Conv 3x3 pad 1 -> apply] -> Flatten -> Gemm. `apply(b, x,
    shape) -> (tensor, shape)`: the op under test, on the input and behind a conv."""
    b = zoo.Builder(rng, input_shape, opset=opset)
    h, shape = apply(b, "x", (1, *input_shape))
    if pre_conv:
        c_in = shape[1]
        w = b.weight(channels, c_in, 3, 3)
        h = b.op("Conv", [h, b.const(w), b.const(rng.normal(0, 0.1, (channels,)))],
                 pads=[1, 1, 1, 1])
        h, shape = apply(b, h, (1, channels, *shape[2:]))
    h = b.op("Flatten", [h], axis=1)
    return b.build(b.gemm(h, int(np.prod(shape[1:])), outputs)), tuple(input_shape)
