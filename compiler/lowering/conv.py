"""The conv family: Conv (1-D and 2-D, grouped, any padding, auto_pad) -> `conv2d`, and
ConvTranspose (1-D and 2-D: pads, strides, output_padding, output_shape, groups, dilations,
auto_pad) -> `conv_transpose2d`. A 1-D op runs as the 2-D kernel over a unit height axis
(reshape views on either side). The padding and pair helpers here are shared with the
pooling family."""

from __future__ import annotations

from shardbound.compiler.lowering import register


def _auto_pad(node) -> str:
    auto = node.attrs.get("auto_pad", "NOTSET")
    return auto.decode() if isinstance(auto, bytes) else str(auto)


def pads_nd(ctx, node, in_sizes, kernel, strides, dilations):
    """(begins, ends) per spatial axis from `pads` or `auto_pad` (Conv and pooling)."""
    dims = len(in_sizes)
    auto = _auto_pad(node)
    if auto in ("NOTSET", ""):
        p = [int(v) for v in node.attrs.get("pads", [0] * 2 * dims)]
        if len(p) != 2 * dims:
            raise ctx.error(f"pads {p} must have {2 * dims} entries for a {dims}-D op")
        return p[:dims], p[dims:]
    if auto == "VALID":
        return [0] * dims, [0] * dims
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, k, s, d in zip(in_sizes, kernel, strides, dilations):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small, big = total // 2, total - total // 2
            begin.append(small if auto == "SAME_UPPER" else big)
            end.append(big if auto == "SAME_UPPER" else small)
        return begin, end
    raise ctx.error(f"auto_pad {auto!r} is not supported")


def pads_2d(ctx, node, in_hw, kernel, strides, dilations):
    """(top, left, bottom, right) from `pads` or `auto_pad`."""
    begin, end = pads_nd(ctx, node, in_hw, kernel, strides, dilations)
    return (begin[0], begin[1], end[0], end[1])


def ints(ctx, node, key, default, dims):
    v = [int(x) for x in node.attrs.get(key, default)]
    if len(v) != dims:
        raise ctx.error(f"{key} {v} must have {dims} entries for a {dims}-D op")
    return v


def pair(ctx, node, key, default):
    return tuple(ints(ctx, node, key, default, 2))


def _spatial(ctx, node, x, W, op):
    """(dims, spatial sizes) of a 1-D or 2-D conv-like op, or a one-line error."""
    ctx.need_batched(x, op)
    dims = len(x.shape) - 1
    if dims not in (1, 2) or W.ndim != dims + 2:
        raise ctx.error(f"only 1-D and 2-D {op} is supported (input {x.full_shape}, weight "
                        f"{W.shape})")
    if "kernel_shape" in node.attrs and tuple(int(k) for k in node.attrs["kernel_shape"]) \
            != tuple(W.shape[2:]):
        raise ctx.error(f"kernel_shape {node.attrs['kernel_shape']} does not match weight {W.shape}")
    return dims, list(x.shape[1:])


def _as_2d(ctx, x, dims):
    """A 1-D (C, L) input as (C, 1, L): a view."""
    return x if dims == 2 else ctx.reshaped(x, (1, x.shape[0], 1, x.shape[1]), None)


def _finish(ctx, y, dims, out_tensor):
    if dims == 2:
        ctx.alias(out_tensor, y)
    else:
        ctx.reshaped(y, (1, y.shape[0], y.shape[2]), out_tensor)


def _bias(ctx, node):
    b_in = ctx.optional_input(node, 2)
    return ctx.const(b_in, "bias") if b_in is not None else None


@register("Conv", since=1)
def lower_conv(ctx, node):
    x = ctx.computed(node.inputs[0])
    W = ctx.const(node.inputs[1], "weight")
    dims, sizes = _spatial(ctx, node, x, W, "convolution")
    group = int(node.attrs.get("group", 1))
    if W.shape[1] * group != x.shape[0]:
        raise ctx.error(f"weight {W.shape} with group {group} does not match {x.shape[0]} input channels")
    strides = ints(ctx, node, "strides", [1] * dims, dims)
    dilations = ints(ctx, node, "dilations", [1] * dims, dims)
    begin, end = pads_nd(ctx, node, sizes, list(W.shape[2:]), strides, dilations)
    if dims == 1:
        W = W[:, :, None, :]
        strides, dilations, begin, end = [1, *strides], [1, *dilations], [0, *begin], [0, *end]
    y = ctx.emit("conv2d", [_as_2d(ctx, x, dims)], params={"weight": W, "bias": _bias(ctx, node)},
                 attrs={"strides": tuple(strides), "pads": (begin[0], begin[1], end[0], end[1]),
                        "dilations": tuple(dilations), "groups": group})
    _finish(ctx, y, dims, node.outputs[0])


@register("ConvTranspose", since=1)
def lower_conv_transpose(ctx, node):
    x = ctx.computed(node.inputs[0])
    W = ctx.const(node.inputs[1], "weight")
    dims, sizes = _spatial(ctx, node, x, W, "transposed convolution")
    group = int(node.attrs.get("group", 1))
    if W.shape[0] != x.shape[0] or x.shape[0] % group:
        raise ctx.error(f"weight {W.shape} with group {group} does not match {x.shape[0]} input "
                        "channels (ConvTranspose weights are (C_in, C_out / group, ...))")
    strides = ints(ctx, node, "strides", [1] * dims, dims)
    dilations = ints(ctx, node, "dilations", [1] * dims, dims)
    out_pad = ints(ctx, node, "output_padding", [0] * dims, dims)
    kernel = list(W.shape[2:])
    full = [s * (n - 1) + op + (k - 1) * d + 1
            for n, s, op, k, d in zip(sizes, strides, out_pad, kernel, dilations)]
    auto = _auto_pad(node)
    if "output_shape" in node.attrs or auto in ("SAME_UPPER", "SAME_LOWER"):
        # The pads that give the wanted output: the total split as ONNX says (SAME_UPPER:
        # the smaller half first; otherwise the larger half first).
        if "output_shape" in node.attrs:
            target = [int(v) for v in node.attrs["output_shape"]][-dims:]
        else:
            target = [n * s for n, s in zip(sizes, strides)]
        total = [f - t for f, t in zip(full, target)]
        if min(total) < 0:
            raise ctx.error(f"output_shape {target} is larger than the full output {full}")
        small, big = [t // 2 for t in total], [t - t // 2 for t in total]
        begin, end = (small, big) if auto == "SAME_UPPER" else (big, small)
    elif auto == "VALID":
        begin, end = [0] * dims, [0] * dims
    elif auto in ("NOTSET", ""):
        begin, end = pads_nd(ctx, node, sizes, kernel, strides, dilations)
    else:
        raise ctx.error(f"auto_pad {auto!r} is not supported")
    if any(op >= s for op, s in zip(out_pad, strides)):
        raise ctx.error(f"output_padding {out_pad} must be smaller than the strides {strides}")
    if any(f - b - e <= 0 for f, b, e in zip(full, begin, end)):
        raise ctx.error(f"pads {begin + end} leave no output (full output {full})")
    if dims == 1:
        W = W[:, :, None, :]
        strides, dilations, begin, end = [1, *strides], [1, *dilations], [0, *begin], [0, *end]
        out_pad = [0, *out_pad]
    y = ctx.emit("conv_transpose2d", [_as_2d(ctx, x, dims)],
                 params={"weight": W, "bias": _bias(ctx, node)},
                 attrs={"strides": tuple(strides), "pads": (begin[0], begin[1], end[0], end[1]),
                        "dilations": tuple(dilations), "groups": group,
                        "output_padding": tuple(out_pad)})
    _finish(ctx, y, dims, node.outputs[0])

