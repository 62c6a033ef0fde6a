"""The pooling family: AveragePool and GlobalAveragePool (a depthwise `conv2d`, followed by a
divisor `affine` where padding is excluded from the count), MaxPool and GlobalMaxPool (the
`maxpool2d` kernel, runtime/ops/pooling.py)."""

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


# -- max pooling --------------------------------------------------------------------------------
def _max_pool(ctx, node, dilations_and_ceil: bool):
    """MaxPool at every opset: 2-D only; pads, auto_pad (the conv family's rule), and from
    opset 10 dilations and ceil_mode. The optional Indices output (opset 8+) is refused when
    anything reads it."""
    from shardbound.runtime.ops.pooling import pooled_size, window_sources

    x = ctx.computed(node.inputs[0])
    if len(x.shape) != 3:
        raise ctx.error(f"only 2-D max pooling is supported (input {x.full_shape})")
    if len(node.outputs) > 1 and node.outputs[1].name and node.outputs[1].outputs:
        raise ctx.error("the MaxPool Indices output is used; only the pooled values are "
                        "supported (export without return_indices)")
    kernel = pair(ctx, node, "kernel_shape", [])
    strides = pair(ctx, node, "strides", [1, 1])
    dilations = pair(ctx, node, "dilations", [1, 1]) if dilations_and_ceil else (1, 1)
    ceil_mode = int(node.attrs.get("ceil_mode", 0)) if dilations_and_ceil else 0
    if min(kernel) < 1 or min(strides) < 1 or min(dilations) < 1:
        raise ctx.error(f"kernel {kernel}, strides {strides} and dilations {dilations} must be "
                        "positive")
    auto = node.attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto.startswith("SAME") and dilations != (1, 1):
        # The spec pads for the dilated extent; onnxruntime pads for the undilated kernel.
        raise ctx.error(f"auto_pad {auto} with dilations {list(dilations)}: onnxruntime and the "
                        "ONNX spec disagree on the padding; export with explicit pads")
    pads = pads_2d(ctx, node, x.shape[1:], kernel, strides, dilations)
    if min(pads) < 0:
        raise ctx.error(f"pads {list(pads)} must not be negative")
    out_hw = tuple(pooled_size(n, k, s, b, e, d, bool(ceil_mode)) for n, k, s, b, e, d in
                   zip(x.shape[1:], kernel, strides, pads[:2], pads[2:], dilations))
    if min(out_hw) <= 0:
        raise ctx.error(f"no {kernel[0]}x{kernel[1]} window (dilations {list(dilations)}) fits "
                        f"the {x.shape[1]}x{x.shape[2]} input with pads {list(pads)}")
    src = window_sources(x.shape[1:], kernel, strides, pads, dilations, out_hw)
    if not (src >= 0).any(axis=1).all():
        raise ctx.error(f"pads {list(pads)} leave a pooling window with only padding cells; "
                        "use smaller pads")
    _emit_max_pool(ctx, node, x, kernel, strides, pads, dilations, ceil_mode)


def _emit_max_pool(ctx, node, x, kernel, strides, pads, dilations, ceil_mode):
    ctx.emit("maxpool2d", [x], node.outputs[0],
             attrs={"kernel": tuple(kernel), "strides": tuple(strides), "pads": tuple(pads),
                    "dilations": tuple(dilations), "ceil_mode": int(ceil_mode)})


@register("MaxPool", since=1)
def lower_max_pool_1(ctx, node):
    """Opset 1: kernel, strides, pads, auto_pad; one output."""
    _max_pool(ctx, node, dilations_and_ceil=False)


@register("MaxPool", since=8)
def lower_max_pool_8(ctx, node):
    """Opset 8: an optional Indices output (and storage_order, which only shapes it)."""
    _max_pool(ctx, node, dilations_and_ceil=False)


@register("MaxPool", since=10)
def lower_max_pool_10(ctx, node):
    """Opset 10 on (11, 12, 22 change only the docs and types): dilations and ceil_mode."""
    _max_pool(ctx, node, dilations_and_ceil=True)


@register("GlobalMaxPool", since=1)
def lower_global_max_pool(ctx, node):
    x = ctx.computed(node.inputs[0])
    if len(x.shape) != 3:
        raise ctx.error(f"only 2-D global max pooling is supported (input {x.full_shape})")
    _emit_max_pool(ctx, node, x, tuple(x.shape[1:]), (1, 1), (0, 0, 0, 0), (1, 1), 0)
