"""The pooling family: AveragePool and GlobalAveragePool (a depthwise `conv2d`, followed by a
divisor `affine` where padding is excluded from the count)."""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import register
from shardbound.compiler.lowering.conv import pads_2d, pair


def _average(ctx, node, x, kernel, strides, pads, count_include_pad):
    channels = x.shape[0]
    padded = any(pads)
    uniform = count_include_pad or not padded
    weight = np.full((channels, 1, *kernel), 1.0 / (kernel[0] * kernel[1]) if uniform else 1.0)
    attrs = {"strides": strides, "pads": pads, "dilations": (1, 1), "groups": channels}
    if uniform:
        ctx.emit("conv2d", [x], node.outputs[0], params={"weight": weight}, attrs=attrs)
        return
    summed = ctx.emit("conv2d", [x], None, params={"weight": weight}, attrs=attrs)
    # Count the in-image cells under each window: the same sum-pool applied to ones.
    H, W = x.shape[1:]
    ones = np.pad(np.ones((H, W)), ((pads[0], pads[2]), (pads[1], pads[3])))
    Ho, Wo = summed.shape[1:]
    counts = np.empty((Ho, Wo))
    for i in range(Ho):
        for j in range(Wo):
            r, c = i * strides[0], j * strides[1]
            counts[i, j] = ones[r:r + kernel[0], c:c + kernel[1]].sum()
    ctx.emit("affine", [summed], node.outputs[0],
             params={"scale": np.broadcast_to(1.0 / counts, (channels, Ho, Wo)).copy()})


@register("AveragePool", since=1)
def lower_average_pool(ctx, node):
    x = ctx.computed(node.inputs[0])
    if len(x.shape) != 3:
        raise ctx.error(f"only 2-D average pooling is supported (input {x.full_shape})")
    if int(node.attrs.get("ceil_mode", 0)):
        raise ctx.error("ceil_mode=1 is not supported; export with ceil_mode=False")
    kernel = pair(ctx, node, "kernel_shape", [])
    strides = pair(ctx, node, "strides", [1, 1])
    if tuple(node.attrs.get("dilations", (1, 1))) != (1, 1):
        raise ctx.error("dilated average pooling is not supported")
    pads = pads_2d(ctx, node, x.shape[1:], kernel, strides, (1, 1))
    _average(ctx, node, x, kernel, strides, pads, int(node.attrs.get("count_include_pad", 0)))


@register("GlobalAveragePool", since=1)
def lower_global_average_pool(ctx, node):
    x = ctx.computed(node.inputs[0])
    if len(x.shape) != 3:
        raise ctx.error(f"only 2-D global average pooling is supported (input {x.full_shape})")
    _average(ctx, node, x, tuple(x.shape[1:]), (1, 1), (0, 0, 0, 0), 1)
