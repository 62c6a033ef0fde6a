"""Conv (2-D), BatchNormalization (inference, as a per-channel `affine` that canonicalize folds
into the conv before it) and AveragePool / GlobalAveragePool (a depthwise `conv2d`, followed by
a divisor `affine` where padding is excluded from the count)."""

from __future__ import annotations

import numpy as np

from shardbound.compiler.lowering import register


def _pads(ctx, node, in_hw, kernel, strides, dilations):
    """(top, left, bottom, right) from `pads` or `auto_pad`."""
    auto = node.attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("NOTSET", ""):
        p = [int(v) for v in node.attrs.get("pads", [0, 0, 0, 0])]
        if len(p) != 4:
            raise ctx.error(f"pads {p} must have 4 entries for a 2-D op")
        return (p[0], p[1], p[2], p[3])
    if auto == "VALID":
        return (0, 0, 0, 0)
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, k, s, d in zip(in_hw, kernel, strides, dilations):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small, big = total // 2, total - total // 2
            begin.append(small if auto == "SAME_UPPER" else big)
            end.append(big if auto == "SAME_UPPER" else small)
        return (begin[0], begin[1], end[0], end[1])
    raise ctx.error(f"auto_pad {auto!r} is not supported")


def _pair(ctx, node, key, default):
    v = [int(x) for x in node.attrs.get(key, default)]
    if len(v) != 2:
        raise ctx.error(f"{key} {v} must have 2 entries (only 2-D is supported)")
    return tuple(v)


@register("Conv", since=1)
def lower_conv(ctx, node):
    x = ctx.computed(node.inputs[0])
    W = ctx.const(node.inputs[1], "weight")
    if W.ndim != 4 or len(x.shape) != 3:
        raise ctx.error(f"only 2-D convolution is supported (input {x.full_shape}, weight {W.shape})")
    group = int(node.attrs.get("group", 1))
    if W.shape[1] * group != x.shape[0]:
        raise ctx.error(f"weight {W.shape} with group {group} does not match {x.shape[0]} input channels")
    strides = _pair(ctx, node, "strides", [1, 1])
    dilations = _pair(ctx, node, "dilations", [1, 1])
    kernel = tuple(W.shape[2:])
    if "kernel_shape" in node.attrs and tuple(int(k) for k in node.attrs["kernel_shape"]) != kernel:
        raise ctx.error(f"kernel_shape {node.attrs['kernel_shape']} does not match weight {W.shape}")
    pads = _pads(ctx, node, x.shape[1:], kernel, strides, dilations)
    b_in = ctx.optional_input(node, 2)
    bias = ctx.const(b_in, "bias") if b_in is not None else None
    ctx.emit("conv2d", [x], node.outputs[0], params={"weight": W, "bias": bias},
             attrs={"strides": strides, "pads": pads, "dilations": dilations, "groups": group})


@register("BatchNormalization", since=1)
def lower_batchnorm(ctx, node):
    if int(node.attrs.get("training_mode", 0)):
        raise ctx.error("BatchNormalization in training mode; export the model in eval mode")
    if len(node.outputs) > 1 and any(o.outputs for o in node.outputs[1:]):
        raise ctx.error("BatchNormalization's running statistics outputs are used; not supported")
    x = ctx.computed(node.inputs[0])
    gamma, beta, mean, var = (ctx.const(node.inputs[i], what).astype(np.float64) for i, what in
                              ((1, "scale"), (2, "bias"), (3, "mean"), (4, "var")))
    eps = float(node.attrs.get("epsilon", 1e-5))
    scale = gamma / np.sqrt(var + eps)
    shift = beta - mean * scale
    per_channel = (x.shape[0],) + (1,) * (len(x.shape) - 1)
    ctx.emit("affine", [x], node.outputs[0],
             params={"scale": scale.reshape(per_channel), "shift": shift.reshape(per_channel)})


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
    kernel = _pair(ctx, node, "kernel_shape", [])
    strides = _pair(ctx, node, "strides", [1, 1])
    if tuple(node.attrs.get("dilations", (1, 1))) != (1, 1):
        raise ctx.error("dilated average pooling is not supported")
    pads = _pads(ctx, node, x.shape[1:], kernel, strides, (1, 1))
    _average(ctx, node, x, kernel, strides, pads, int(node.attrs.get("count_include_pad", 0)))


@register("GlobalAveragePool", since=1)
def lower_global_average_pool(ctx, node):
    x = ctx.computed(node.inputs[0])
    if len(x.shape) != 3:
        raise ctx.error(f"only 2-D global average pooling is supported (input {x.full_shape})")
    _average(ctx, node, x, tuple(x.shape[1:]), (1, 1), (0, 0, 0, 0), 1)
