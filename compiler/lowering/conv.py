"""The conv family: Conv (2-D, grouped, any padding, auto_pad) -> `conv2d`. The padding and
pair helpers here are shared with the pooling family."""

from __future__ import annotations

from shardbound.compiler.lowering import register


def pads_2d(ctx, node, in_hw, kernel, strides, dilations):
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


def pair(ctx, node, key, default):
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
    strides = pair(ctx, node, "strides", [1, 1])
    dilations = pair(ctx, node, "dilations", [1, 1])
    kernel = tuple(W.shape[2:])
    if "kernel_shape" in node.attrs and tuple(int(k) for k in node.attrs["kernel_shape"]) != kernel:
        raise ctx.error(f"kernel_shape {node.attrs['kernel_shape']} does not match weight {W.shape}")
    pads = pads_2d(ctx, node, x.shape[1:], kernel, strides, dilations)
    b_in = ctx.optional_input(node, 2)
    bias = ctx.const(b_in, "bias") if b_in is not None else None
    ctx.emit("conv2d", [x], node.outputs[0], params={"weight": W, "bias": bias},
             attrs={"strides": strides, "pads": pads, "dilations": dilations, "groups": group})
