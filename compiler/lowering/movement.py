"""The movement family: ops that move elements, lowered to one `move` node each (an index map
built from steps, runtime/ops/movement.py) -- Concat, Slice, Split, Gather, GatherElements,
ScatterND, Expand, Tile, DepthToSpace, SpaceToDepth, nearest Resize / Upsample -- and linear / cubic
Resize / Upsample (`resample`: one interpolation matrix per resized axis).

Steps act on ONNX shapes: each input is viewed with its batch axis (a unit axis in front,
`expand_front`) and the result is put back into the layout its ONNX shape gets
(compiler/context.py: a move may take the size-1 batch axis elsewhere). Indices, sizes and
scales are resolved here, at compile time, against the ONNX shapes (negative and clamped
Slice indices, negative Gather indices); a move that keeps every element in order is a view.
"""

from __future__ import annotations

import math

import numpy as np

from shardbound.compiler.context import sample_layout
from shardbound.compiler.lowering import register
from shardbound.runtime.ops.movement import (MAX_LITERAL_INDICES, _source_array,
                                             interpolation_matrix, nearest_sources)


def emit_move(ctx, inputs, steps, out_full, out_tensor=None, fill=None, indices=None):
    """A `move` node over `inputs` whose `steps` act on their ONNX shapes and give the ONNX
    shape `out_full`; `fill` (ONNX-shaped, float) holds the constants where no element
    lands, `indices` a large index tensor of a take step given as None."""
    shape, batched = sample_layout(out_full)
    if math.prod(shape) == 0:
        raise ctx.error(f"its output {tuple(out_full)} has no elements; bounds of an empty "
                        "tensor mean nothing")
    front = tuple(1 if x.batched else 0 for x in inputs)
    steps = [tuple(s) for s in steps] + ([("squeeze", (0,))] if batched else [])
    try:
        source = _source_array([x.shape for x in inputs], front, steps, indices)
    except (ValueError, IndexError) as e:
        raise ctx.error(f"shapes do not fit this op ({e})") from None
    if source.shape != shape:
        raise ctx.error(f"internal: the move gives {source.shape}, ONNX says {tuple(out_full)}")
    has_fill = fill is not None and bool(np.any(np.asarray(fill) != 0))
    if (len(inputs) == 1 and not has_fill and source.size == math.prod(inputs[0].shape)
            and np.array_equal(source.reshape(-1), np.arange(source.size))):
        return ctx.reshaped(inputs[0], out_full, out_tensor)      # the same elements in order
    params = {}
    if has_fill:
        params["fill"] = np.asarray(fill, dtype=np.float64).reshape(shape)
    if indices is not None:
        params["indices"] = np.asarray(indices, dtype=np.float64)
    attrs = {"steps": _literal(steps)}
    if any(front):
        attrs["expand_front"] = front
    return ctx.emit("move", list(inputs), out_tensor, params=params, attrs=attrs,
                    batched=batched)


def _literal(value):
    """Steps as plain Python values (numpy scalars and arrays become ints, floats, tuples)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(_literal(v) for v in value)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return value


def _axis(ctx, axis, rank, what="axis"):
    axis = int(axis)
    if not -rank <= axis < rank:
        raise ctx.error(f"{what} {axis} is out of range for a rank-{rank} tensor")
    return axis % rank


def _ints(ctx, node, i, what):
    t = ctx.optional_input(node, i)
    return None if t is None else [int(v) for v in np.asarray(ctx.const(t, what)).reshape(-1)]


def _unique_inputs(values):
    """(distinct computed inputs, position of each value among them)."""
    distinct, where = [], []
    for v in values:
        if v not in distinct:
            distinct.append(v)
        where.append(distinct.index(v))
    return distinct, where


# -- Concat ---------------------------------------------------------------------------------------
@register("Concat", since=4)
def lower_concat(ctx, node):
    """Computed and constant operands on any axis (constants become the move's fill)."""
    values = [ctx.value(t) for t in node.inputs if t.name]
    shapes = [v.shape if isinstance(v, np.ndarray) else v.full_shape for v in values]
    rank = len(shapes[0])
    axis = _axis(ctx, node.attrs.get("axis", 1), rank)
    for s in shapes:
        if len(s) != rank or any(a != b for k, (a, b) in enumerate(zip(s, shapes[0])) if k != axis):
            raise ctx.error(f"operands of shapes {shapes} do not concatenate on axis {axis}")
    computed = [v for v in values if not isinstance(v, np.ndarray)]
    distinct, where = _unique_inputs(computed)
    pieces, fills, k = [], [], 0
    for v, s in zip(values, shapes):
        if s[axis] == 0:
            if not isinstance(v, np.ndarray):
                k += 1
            continue
        if isinstance(v, np.ndarray):
            pieces.append(-int(s[axis]))
            fills.append(np.asarray(v, dtype=np.float64))
        else:
            pieces.append(where[k])
            fills.append(np.zeros(s))
            k += 1
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    emit_move(ctx, distinct, [("concat", axis, tuple(pieces))], out, node.outputs[0],
              fill=np.concatenate(fills, axis=axis))


# -- Slice and Split -------------------------------------------------------------------------------
def slice_range(n: int, start: int, end: int, step: int) -> tuple[int, int, int]:
    """ONNX Slice's indices on an axis of length n, resolved: (start, stop, step) such that the
    elements are range(start, stop, step) (stop -1: down to element 0)."""
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    if step > 0:
        return min(max(start, 0), n), min(max(end, 0), n), step
    return min(max(start, 0), n - 1), min(max(end, -1), n - 1), step


def _slice(ctx, node, starts, ends, axes, steps):
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    rank = len(full)
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ctx.error(f"starts {starts}, ends {ends}, axes {axes} and steps {steps} differ "
                        "in length")
    axes = [_axis(ctx, a, rank) for a in axes]
    if len(set(axes)) != len(axes):
        raise ctx.error(f"axes {axes} repeat an axis")
    out, moves = list(full), []
    for a, b, e, s in zip(axes, starts, ends, steps):
        if s == 0:
            raise ctx.error("a slice step of 0 is not allowed")
        r = slice_range(full[a], b, e, s)
        out[a] = len(range(*r))
        if r != (0, full[a], 1):
            moves.append(("range", a, *r))
    emit_move(ctx, [x], moves, out, node.outputs[0])


@register("Slice", since=1)
def lower_slice_1(ctx, node):
    """Opsets 1-9: starts, ends and axes are attributes."""
    a = node.attrs
    axes = [int(v) for v in a["axes"]] if "axes" in a else None
    _slice(ctx, node, [int(v) for v in a.get("starts", [])], [int(v) for v in a.get("ends", [])],
           axes, None)


@register("Slice", since=10)
def lower_slice_10(ctx, node):
    """Opset 10 on: starts, ends, axes and steps are (constant) inputs."""
    _slice(ctx, node, _ints(ctx, node, 1, "starts"), _ints(ctx, node, 2, "ends"),
           _ints(ctx, node, 3, "axes"), _ints(ctx, node, 4, "steps"))


def _split(ctx, node, sizes):
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    axis = _axis(ctx, node.attrs.get("axis", 0), len(full))
    n = full[axis]
    outputs = [t for t in node.outputs]
    if sizes is None:
        count = int(node.attrs.get("num_outputs", len(outputs)))
        if count != len(outputs):
            raise ctx.error(f"num_outputs {count} but {len(outputs)} outputs")
        if "num_outputs" in node.attrs:
            chunk = -(-n // count)
            sizes = [min(chunk, n - i * chunk) for i in range(count)]
        else:
            if n % count:
                raise ctx.error(f"axis {axis} of length {n} does not split into {count} equal parts")
            sizes = [n // count] * count
    if len(sizes) != len(outputs) or sum(sizes) != n or min(sizes) < 0:
        raise ctx.error(f"split sizes {sizes} do not cover axis {axis} of length {n} with "
                        f"{len(outputs)} outputs")
    start = 0
    for t, size in zip(outputs, sizes):
        if t.name and ctx.used(t):
            out = list(full)
            out[axis] = size
            emit_move(ctx, [x], [("range", axis, start, start + size, 1)], out, t)
        start += size


@register("Split", since=2)
def lower_split_2(ctx, node):
    """Opsets 2-12: the `split` attribute (or equal parts)."""
    split = node.attrs.get("split")
    _split(ctx, node, None if split is None else [int(s) for s in split])


@register("Split", since=13)
def lower_split_13(ctx, node):
    """Opsets 13-17: the sizes are an optional input."""
    _split(ctx, node, _ints(ctx, node, 1, "split"))


@register("Split", since=18)
def lower_split_18(ctx, node):
    """Opset 18 on: an optional sizes input, or `num_outputs` (the last part may be smaller)."""
    _split(ctx, node, _ints(ctx, node, 1, "split"))


# -- Gather and GatherElements ---------------------------------------------------------------------
def _indices(ctx, node, n):
    """The constant indices (negative ones resolved against n) as int64."""
    t = node.inputs[1]
    if not ctx.is_const(t):
        raise ctx.error("its indices depend on the network input: the output is then a "
                        "piecewise-constant choice that has no linear bound; only constant "
                        "indices are supported")
    idx = np.asarray(ctx.const(t, "indices")).astype(np.int64)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise ctx.error(f"indices {idx.min()}..{idx.max()} are out of range for an axis of "
                        f"length {n}")
    return np.where(idx < 0, idx + n, idx)


def _take_step(ctx, name, axis, idx):
    """(step, indices parameter or None): small index tensors are literals in the step."""
    if idx.size <= MAX_LITERAL_INDICES:
        return (name, axis, tuple(int(i) for i in idx.reshape(-1)), idx.shape), None
    if idx.max(initial=0) >= 2 ** 24:
        raise ctx.error("indices past 2^24 are not supported")
    return (name, axis, None, idx.shape), idx


@register("Gather", since=1)
def lower_gather(ctx, node):
    if ctx.is_const(node.inputs[0]):
        raise ctx.error("it gathers from a constant with indices that depend on the network "
                        "input (a piecewise-constant choice); only constant indices into a "
                        "computed tensor are supported")
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    axis = _axis(ctx, node.attrs.get("axis", 0), len(full))
    idx = _indices(ctx, node, full[axis])
    step, big = _take_step(ctx, "take", axis, idx)
    out = (*full[:axis], *idx.shape, *full[axis + 1:])
    emit_move(ctx, [x], [step], out, node.outputs[0], indices=big)


@register("GatherElements", since=11)
def lower_gather_elements(ctx, node):
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    axis = _axis(ctx, node.attrs.get("axis", 0), len(full))
    idx = _indices(ctx, node, full[axis])
    if idx.ndim != len(full):
        raise ctx.error(f"indices of rank {idx.ndim} for data of rank {len(full)}")
    step, big = _take_step(ctx, "take_along", axis, idx)
    emit_move(ctx, [x], [step], idx.shape, node.outputs[0], indices=big)


@register("ScatterND", since=11)
def lower_scatter_nd(ctx, node):
    """Constant indices: data with the indexed slices replaced by updates (a later index tuple
    wins, as onnxruntime does). Data and updates may each be computed or constant (constants
    are the fill); the move reads them as one flat source through a `take`."""
    if node.attrs.get("reduction", "none") != "none":
        raise ctx.error(f"reduction {node.attrs['reduction']!r} is not supported (only 'none')")
    data, updates = ctx.value(node.inputs[0]), ctx.value(node.inputs[2])
    idx = np.asarray(ctx.const(node.inputs[1], "indices"), dtype=np.int64)
    full = data.shape if isinstance(data, np.ndarray) else data.full_shape
    k = idx.shape[-1] if idx.ndim else 0
    want = (*idx.shape[:-1], *full[k:])
    got = updates.shape if isinstance(updates, np.ndarray) else updates.full_shape
    if idx.ndim < 1 or k > len(full) or tuple(got) != tuple(want):
        raise ctx.error(f"indices {idx.shape} and updates {tuple(got)} do not fit data "
                        f"{tuple(full)} (updates must be {want})")
    bounds = np.asarray(full[:k], dtype=np.int64)
    tuples = idx.reshape(-1, k)
    if ((tuples < -bounds) | (tuples >= bounds)).any():
        raise ctx.error(f"an index of {idx.shape} is out of range for data {tuple(full)}")
    n_d = math.prod(full)
    pos = np.arange(n_d, dtype=np.int64).reshape(full)
    block = math.prod(full[k:])
    upd = n_d + np.arange(math.prod(want), dtype=np.int64).reshape(-1, block)
    for j, t in enumerate(tuples % np.maximum(bounds, 1)):
        pos[tuple(t)] = upd[j].reshape(full[k:])
    inputs, pieces, fills = [], [], []
    for v in (data, updates):
        n = math.prod(v.shape if isinstance(v, np.ndarray) else v.full_shape)
        if isinstance(v, np.ndarray):
            pieces.append(-n)
            fills.append(np.asarray(v, dtype=np.float64).reshape(-1))
        else:
            pieces.append(len(inputs))
            inputs.append(ctx.reshaped(v, (n,), None, "ScatterND"))
            fills.append(np.zeros(n))
    fill = np.concatenate(fills)[pos.reshape(-1)].reshape(full)
    step, big = _take_step(ctx, "take", 0, pos.reshape(-1))
    emit_move(ctx, inputs, [("concat", 0, tuple(pieces)), step, ("reshape", tuple(full))], full,
              node.outputs[0], fill=fill, indices=big)


# -- Expand, Tile, DepthToSpace, SpaceToDepth ------------------------------------------------------
def expand_to(ctx, x, out_full, out_tensor=None):
    """x broadcast to the ONNX shape `out_full` (x itself when it has that shape already)."""
    out_full = tuple(int(d) for d in out_full)
    if out_full == x.full_shape:
        if out_tensor is not None:
            ctx.alias(out_tensor, x)
        return x
    target = ctx.broadcast_shape(x.full_shape, out_full, what="the tensor and the target")
    if target != out_full:
        raise ctx.error(f"{x.full_shape} does not broadcast to {out_full}")
    return emit_move(ctx, [x], [("expand", out_full)], out_full, out_tensor)


@register("Expand", since=8)
def lower_expand(ctx, node):
    x = ctx.computed(node.inputs[0])
    shape = [int(d) for d in np.asarray(ctx.const(node.inputs[1], "shape")).reshape(-1)]
    out = ctx.broadcast_shape(x.full_shape, shape, what="Expand's input and shape")
    if out == x.full_shape:
        ctx.alias(node.outputs[0], x)
        return
    # The step keeps ONNX's own shape (1 where an axis is kept), so a kept channel axis stays
    # free of its length (a tp zone can hold a channel slice of the node).
    emit_move(ctx, [x], [("expand", tuple(shape))], out, node.outputs[0])


@register("Tile", since=6)
def lower_tile(ctx, node):
    x = ctx.computed(node.inputs[0])
    repeats = [int(r) for r in np.asarray(ctx.const(node.inputs[1], "repeats")).reshape(-1)]
    full = x.full_shape
    if len(repeats) != len(full) or min(repeats, default=1) < 0:
        raise ctx.error(f"repeats {repeats} must be one non-negative count per axis of {full}")
    out = tuple(d * r for d, r in zip(full, repeats))
    emit_move(ctx, [x], [("tile", tuple(repeats))], out, node.outputs[0])


def _rank4(ctx, x, op):
    if len(x.full_shape) != 4:
        raise ctx.error(f"{op} needs a rank-4 (N, C, H, W) input, got {x.full_shape}")
    return x.full_shape


@register("DepthToSpace", since=1)
def lower_depth_to_space(ctx, node):
    x = ctx.computed(node.inputs[0])
    n, c, h, w = _rank4(ctx, x, "DepthToSpace")
    b = int(node.attrs["blocksize"])
    mode = node.attrs.get("mode", "DCR")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in ("DCR", "CRD") or b < 1 or c % (b * b):
        raise ctx.error(f"mode {mode!r} with blocksize {b} does not fit {c} channels")
    emit_move(ctx, [x], [("depth_to_space", b, mode)], (n, c // (b * b), h * b, w * b),
              node.outputs[0])


@register("SpaceToDepth", since=1)
def lower_space_to_depth(ctx, node):
    x = ctx.computed(node.inputs[0])
    n, c, h, w = _rank4(ctx, x, "SpaceToDepth")
    b = int(node.attrs["blocksize"])
    if b < 1 or h % b or w % b:
        raise ctx.error(f"blocksize {b} does not divide the spatial size {h}x{w}")
    emit_move(ctx, [x], [("space_to_depth", b)], (n, c * b * b, h // b, w // b), node.outputs[0])


# -- Resize and Upsample ---------------------------------------------------------------------------
def _text(node, key, default):
    v = node.attrs.get(key, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def _resize(ctx, node, scales=None, sizes=None, coordinates="half_pixel",
            rounding="round_prefer_floor", axes=None):
    """Resize x to `sizes` or by `scales` (over `axes` or every axis of the ONNX shape)."""
    x = ctx.computed(node.inputs[0])
    full = x.full_shape
    rank = len(full)
    mode = _text(node, "mode", "nearest")
    mode = {"bilinear": "linear", "trilinear": "linear"}.get(mode, mode)
    if mode not in ("nearest", "linear", "cubic"):
        raise ctx.error(f"resize mode {mode!r} is not supported (nearest, linear, cubic)")
    if coordinates == "tf_crop_and_resize":
        raise ctx.error("coordinate_transformation_mode tf_crop_and_resize is not supported")
    if int(node.attrs.get("antialias", 0)) and mode != "nearest":
        raise ctx.error("antialias is not supported")
    axes = list(range(rank)) if axes is None else [_axis(ctx, a, rank) for a in axes]
    given = sizes if sizes is not None else scales
    if given is None or len(given) != len(axes):
        raise ctx.error(f"it needs one scale or size per resized axis ({len(axes)}), got {given}")
    policy = _text(node, "keep_aspect_ratio_policy", "stretch")
    per_axis = {}
    if sizes is not None:
        ratios = [int(s) / full[a] for a, s in zip(axes, sizes)]
        if policy in ("not_larger", "not_smaller"):
            r = min(ratios) if policy == "not_larger" else max(ratios)
            per_axis = {a: (int(math.floor(full[a] * r + 0.5)), r) for a in axes}
        else:
            per_axis = {a: (int(s), float(s) / full[a]) for a, s in zip(axes, sizes)}
    else:
        per_axis = {a: (int(math.floor(full[a] * float(s))), float(s)) for a, s in zip(axes, scales)}
    out = list(full)
    work = []
    for a in axes:
        n_out, scale = per_axis[a]
        if n_out <= 0 or scale <= 0:
            raise ctx.error(f"axis {a} of length {full[a]} resizes to {n_out}")
        out[a] = n_out
        if n_out == full[a] and scale == 1.0:
            continue        # onnxruntime leaves such an axis alone in every coordinate mode
        if mode == "nearest":
            src = nearest_sources(full[a], n_out, scale, coordinates, rounding)
            identity = n_out == full[a] and np.array_equal(src, np.arange(n_out))
        else:
            M = interpolation_matrix(full[a], n_out, scale, coordinates, mode,
                                     float(node.attrs.get("cubic_coeff_a", -0.75)),
                                     bool(node.attrs.get("exclude_outside", 0)))
            identity = n_out == full[a] and np.array_equal(M, np.eye(n_out))
        if not identity:
            work.append((a, n_out, scale))
    if mode == "nearest":
        steps = [("resize_nearest", a, n, s, coordinates, rounding) for a, n, s in work]
        emit_move(ctx, [x], steps, out, node.outputs[0])
        return
    lead = 1 if x.batched else 0
    if not work:
        ctx.alias(node.outputs[0], x)
        return
    if any(a < lead for a, _, _ in work):
        raise ctx.error(f"{mode} resizing of the batch axis is not supported")
    ctx.emit("resample", [x], node.outputs[0],
             attrs={"axes": tuple(a - lead for a, _, _ in work),
                    "sizes": tuple(n for _, n, _ in work),
                    "scales": tuple(s for _, _, s in work), "coordinates": coordinates,
                    "mode": mode, "cubic_a": float(node.attrs.get("cubic_coeff_a", -0.75)),
                    "exclude_outside": bool(node.attrs.get("exclude_outside", 0))})


def _floats(ctx, node, i, what):
    t = ctx.optional_input(node, i)
    if t is None:
        return None
    v = np.asarray(ctx.const(t, what), dtype=np.float64).reshape(-1)
    return None if v.size == 0 else [float(s) for s in v]


@register("Upsample", since=7)
def lower_upsample_7(ctx, node):
    """Opsets 7-8: the `scales` attribute; asymmetric coordinates, nearest rounds down."""
    _resize(ctx, node, scales=[float(s) for s in node.attrs.get("scales", [])],
            coordinates="asymmetric", rounding="floor")


@register("Upsample", since=9)
def lower_upsample_9(ctx, node):
    """Opset 9: the scales are an input."""
    _resize(ctx, node, scales=_floats(ctx, node, 1, "scales"), coordinates="asymmetric",
            rounding="floor")


@register("Resize", since=10)
def lower_resize_10(ctx, node):
    """Opset 10: scales input, Upsample's coordinates (asymmetric, nearest rounds down)."""
    _resize(ctx, node, scales=_floats(ctx, node, 1, "scales"), coordinates="asymmetric",
            rounding="floor")


def _resize_inputs(ctx, node, axes=None):
    scales = _floats(ctx, node, 2, "scales")
    sizes_in = _ints(ctx, node, 3, "sizes")
    sizes = sizes_in if sizes_in else None
    _resize(ctx, node, scales=None if sizes else scales, sizes=sizes,
            coordinates=_text(node, "coordinate_transformation_mode", "half_pixel"),
            rounding=_text(node, "nearest_mode", "round_prefer_floor"), axes=axes)


@register("Resize", since=11)
def lower_resize_11(ctx, node):
    """Opsets 11-17: roi, scales, sizes inputs; coordinate_transformation_mode, nearest_mode,
    cubic_coeff_a, exclude_outside."""
    _resize_inputs(ctx, node)


@register("Resize", since=18)
def lower_resize_18(ctx, node):
    """Opset 18 on: the `axes` and `keep_aspect_ratio_policy` attributes (19 adds the
    half_pixel_symmetric coordinates); antialias only for nearest (where it does nothing)."""
    axes = node.attrs.get("axes")
    _resize_inputs(ctx, node, None if axes is None else [int(a) for a in axes])
