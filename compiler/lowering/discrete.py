"""The discrete family: piecewise-constant functions of computed tensors
(runtime/ops/discrete.py: sound constant lines from an exact interval rule per op).

- Floor, Ceil, Round -> `floor`, `ceil`, `round`.
- Cast: to a float type, or from bool / a narrower integer type to a wider one, the values
  stay as they are (an alias: every tensor is carried as float32 values); to bool ->
  `cast_bool` (x != 0); to int8 / uint8 / int16 / uint16 / int32 / int64 -> `cast_int`
  (truncation toward zero, onnxruntime's out-of-range behaviour: see the kernel). uint32 and
  uint64 are refused (onnxruntime's results there follow no rule we could bound simply).
- Equal, Less, LessOrEqual, Greater, GreaterOrEqual -> `equal`, `less`, `less_or_equal`
  (Greater(a, b) is Less(b, a)); And, Or, Xor -> `and`, `or`, `xor`; either operand computed
  or constant, ONNX (numpy) broadcasting. A constant must be exact in float32 (integers up to
  2**24: larger ones would compare as their float32 roundings).
- Not -> `affine` 1 - x (exact: its input is a bool tensor, 0 or 1).
- ArgMax, ArgMin (axis, keepdims, select_last_index) -> `argmax`, `argmin` over a per-sample
  axis.
- OneHot with computed indices and constant depth and values -> `one_hot`.
- Where with a computed condition (the arithmetic family's Where hands it here) ->
  `where_select`.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from shardbound.compiler.context import sample_layout
from shardbound.compiler.lowering import register
from shardbound.compiler.lowering.movement import expand_to

_FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
_INTS = {TensorProto.INT8: "int8", TensorProto.UINT8: "uint8", TensorProto.INT16: "int16",
         TensorProto.UINT16: "uint16", TensorProto.INT32: "int32", TensorProto.INT64: "int64"}
_EXACT = 2 ** 24


def _source_dtype(tensor):
    """The numpy dtype ONNX gives the tensor, or None when shape inference left it open."""
    dtype = getattr(tensor, "dtype", None)
    try:
        return None if dtype is None else np.dtype(dtype)
    except TypeError:
        return None


def _unary(kind):
    def lower(ctx, node):
        ctx.emit(kind, [ctx.computed(node.inputs[0])], node.outputs[0])
    return lower


register("Floor", since=1)(_unary("floor"))
register("Ceil", since=1)(_unary("ceil"))
register("Round", since=11)(_unary("round"))


@register("Cast", since=1)
def lower_cast(ctx, node):
    to = node.attrs.get("to", TensorProto.FLOAT)
    to = TensorProto.DataType.Value(to.decode() if isinstance(to, bytes) else to) \
        if isinstance(to, (str, bytes)) else int(to)
    x = ctx.computed(node.inputs[0])
    src = _source_dtype(node.inputs[0])
    if to in _FLOATS or (src is not None and src.kind == "b"):
        ctx.alias(node.outputs[0], x)           # the values stay (bool is 0 / 1)
        return
    if to == TensorProto.BOOL:
        ctx.emit("cast_bool", [x], node.outputs[0])
        return
    if to not in _INTS:
        raise ctx.error(f"a cast of a computed tensor to {TensorProto.DataType.Name(to)} is "
                        "not supported; cast to a float type, bool, int8, uint8, int16, "
                        "uint16, int32 or int64")
    target = np.dtype(_INTS[to])
    if src is not None and src.kind in "iu":
        if np.can_cast(src, target, casting="safe"):
            ctx.alias(node.outputs[0], x)       # a wider integer type holds every value
            return
        ctx.emit("cast_int", [x], node.outputs[0], attrs={"to": _INTS[to], "source": "int"})
        return
    ctx.emit("cast_int", [x], node.outputs[0], attrs={"to": _INTS[to], "source": "float"})


# -- several operands -----------------------------------------------------------------------------
def _exact_constant(ctx, array, what):
    """A constant operand as float64 values that float32 holds exactly, or a one-line error."""
    a = np.asarray(array)
    if a.dtype.kind not in "biuf":
        raise ctx.error(f"{what} has type {a.dtype}; only numbers and bools are supported")
    values = a.astype(np.float64)
    if not np.all(np.isfinite(values)):
        raise ctx.error(f"{what} holds inf or nan; comparisons with it are not supported")
    if a.dtype.kind in "iu" and np.any(np.abs(values) > _EXACT) and not np.array_equal(
            values.astype(np.float32).astype(np.float64), values):
        raise ctx.error(f"{what} holds integers beyond 2**24 that float32 cannot hold exactly "
                        "(shardbound carries every value as float32)")
    return values


def lower_operands(ctx, node, kind, inputs, out_tensor):
    """Emit `kind` over the operands `inputs` (ONNX tensors, computed or constant, in the
    kernel's order), all broadcast to the output's ONNX shape."""
    values = [ctx.value(t) for t in inputs]
    shapes = [np.shape(v) if isinstance(v, np.ndarray) else v.full_shape for v in values]
    out = ctx.broadcast_shape(*shapes)
    if all(isinstance(v, np.ndarray) for v in values):
        raise ctx.error("every operand is constant; expected a computed one")
    shape, _ = sample_layout(out)
    computed, params, operands = [], {}, []
    for i, (t, v) in enumerate(zip(inputs, values)):
        if isinstance(v, np.ndarray):
            c = np.broadcast_to(_exact_constant(ctx, v, f"operand {i + 1} ({t.name!r})"), out)
            params[f"const{i}"] = np.ascontiguousarray(c.reshape(shape))
            operands.append("const")
        else:
            computed.append(ctx.canonical(expand_to(ctx, v, out)))
            operands.append("computed")
    return ctx.emit(kind, computed, out_tensor, params=params,
                    attrs={"operands": tuple(operands)})


def _binary(kind, swap=False):
    def lower(ctx, node):
        a, b = node.inputs[0], node.inputs[1]
        lower_operands(ctx, node, kind, [b, a] if swap else [a, b], node.outputs[0])
    return lower


for _op, _kind, _swap in (("Equal", "equal", False), ("Less", "less", False),
                          ("Greater", "less", True), ("And", "and", False),
                          ("Or", "or", False), ("Xor", "xor", False)):
    register(_op, since=7)(_binary(_kind, _swap))
register("LessOrEqual", since=12)(_binary("less_or_equal"))
register("GreaterOrEqual", since=12)(_binary("less_or_equal", swap=True))


@register("Not", since=1)
def lower_not(ctx, node):
    """1 - x: exact on a bool tensor (0 or 1), and linear, so CROWN keeps its correlations."""
    x = ctx.computed(node.inputs[0])
    ctx.emit("affine", [x], node.outputs[0],
             params={"scale": np.full(x.shape, -1.0, np.float32),
                     "shift": np.full(x.shape, 1.0, np.float32)})


def lower_where_computed(ctx, node):
    """Where whose condition depends on the input (the arithmetic family lowers the rest)."""
    lower_operands(ctx, node, "where_select", list(node.inputs[:3]), node.outputs[0])


# -- along an axis --------------------------------------------------------------------------------
def _sample_axis(ctx, x, axis, rank, what):
    """ONNX axis `axis` of a rank-`rank` tensor laid out like x, as a per-sample axis."""
    if not -rank <= axis < rank:
        raise ctx.error(f"{what} {axis} is out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    if x.batched:
        if axis == 0:
            raise ctx.error(f"{what} {axis} is the batch axis; only per-sample axes are "
                            "supported")
        return axis - 1
    return axis


def _arg(kind):
    def lower(ctx, node):
        x = ctx.computed(node.inputs[0])
        axis = _sample_axis(ctx, x, int(node.attrs.get("axis", 0)), len(x.full_shape), "axis")
        ctx.emit(kind, [x], node.outputs[0],
                 attrs={"axis": axis, "keepdims": bool(int(node.attrs.get("keepdims", 1))),
                        "select_last_index": bool(int(node.attrs.get("select_last_index", 0)))})
    return lower


register("ArgMax", since=1)(_arg("argmax"))
register("ArgMin", since=1)(_arg("argmin"))


@register("OneHot", since=9)
def lower_one_hot(ctx, node):
    x = ctx.computed(node.inputs[0], "indices")
    depth = np.asarray(ctx.const(node.inputs[1], "depth")).reshape(-1)
    values = np.asarray(ctx.const(node.inputs[2], "values")).reshape(-1)
    if depth.size != 1 or not float(depth[0]) >= 1 or float(depth[0]) != int(depth[0]):
        raise ctx.error(f"depth {depth.tolist()} must be one positive integer")
    if values.size != 2:
        raise ctx.error(f"values {values.tolist()} must hold two entries (off, on)")
    off, on = (float(v) for v in _exact_constant(ctx, values, "values"))
    rank = len(x.full_shape) + 1
    axis = int(node.attrs.get("axis", -1))
    axis = _sample_axis(ctx, x, axis, rank, "axis")
    ctx.emit("one_hot", [x], node.outputs[0],
             attrs={"axis": axis, "depth": int(depth[0]), "off": off, "on": on})
