"""What an op handler sees while lowering one ONNX node: values, constants, and `emit`.

Every ONNX tensor is either a constant (a numpy array: initializers, Constant outputs, folded
subgraphs) or `Computed` (it depends on the network input and is produced by an IR node).
Handlers read ONNX axes in the model's full shapes and emit IR nodes whose shapes are per
sample; output shapes come from the runtime op itself, so the IR and the kernels can never
disagree.

The batch axis. The ONNX model runs one sample (batch 1); the bound program runs B boxes, so
every IR tensor is (B, *shape) with `shape` the sample's. A computed ONNX tensor whose shape
starts with the batch axis is `batched` (its ONNX shape is (1, *shape)). Exporters also move
that size-1 axis (a Transpose (1, N) -> (N, 1), Flatten on axis 2 of (1, C, H, W) -> (C, HW),
Squeeze of axis 0, a Gather of element 0 on it): at batch 1 those are per-sample layout
changes of the same elements, so the result is the tensor itself with no batch axis
(`batched` False: its ONNX shape is its sample shape). This is sound because the model's
semantics is a function of one sample; it is general because every handler reads ONNX axes
through `full_shape`, whichever layout a tensor has. A new tensor is batched exactly when its
ONNX shape has rank >= 2 and a leading 1 (`sample_layout`), so equal ONNX shapes have equal
sample shapes. Ops that need a real batch axis (Conv, pooling) say so when it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import numpy as np
import torch

from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.ir import Node
from shardbound.compiler.naming import Namespace
from shardbound.runtime.ops import OP_TYPES


@dataclass(frozen=True)
class Computed:
    node: str
    shape: tuple[int, ...]          # per sample
    batched: bool = True            # the ONNX tensor is (1, *shape); else it is `shape`

    @property
    def full_shape(self) -> tuple[int, ...]:
        return (1, *self.shape) if self.batched else tuple(self.shape)


def sample_layout(full) -> tuple[tuple[int, ...], bool]:
    """(sample shape, batched) of a new computed tensor whose ONNX shape is `full` (see the
    module docstring)."""
    full = tuple(int(d) for d in full)
    if len(full) >= 2 and full[0] == 1:
        return full[1:], True
    return full, False


class LoweringContext:
    def __init__(self, source: str, opset: int, max_elements: int = 1 << 26):
        self.source = source
        self.opset = opset
        self.max_elements = int(max_elements)
        self.values: dict[str, Computed | np.ndarray] = {}
        self.nodes: list[Node] = []
        self.tensors: dict[str, np.ndarray] = {}
        self.names = Namespace()
        self.onnx_node = None       # the node being lowered (for messages)
        self.graph_outputs: set[str] = set()    # names of the model's output tensors

    # -- messages ------------------------------------------------------------------------------
    def where(self) -> str:
        n = self.onnx_node
        if n is None:
            return self.source
        label = n.name or (n.outputs[0].name if n.outputs else "?")
        return f"{self.source}: node {label!r} ({n.op}, opset {self.opset})"

    def error(self, message: str) -> ShardboundError:
        return ShardboundError(f"{self.where()}: {message}")

    def check_size(self, shape, what: str) -> None:
        """Refuse a tensor of more than max_elements elements, before it is built where the
        shape is known (a symbolic or unknown shape passes: it is checked once built)."""
        if shape is None:
            return
        dims = [d for d in shape]
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
            return
        count = 1
        for d in dims:
            count *= max(int(d), 0)
        if count > self.max_elements:
            raise self.error(f"{what} has {count} elements (shape {list(map(int, dims))}), "
                             f"more than the limit of {self.max_elements}; pass "
                             f"--max-elements {count} to compile it anyway")

    # -- reading inputs ------------------------------------------------------------------------
    def value(self, tensor) -> Computed | np.ndarray:
        if tensor is None or getattr(tensor, "name", "") == "":
            raise self.error("a required input is missing")
        if tensor.name not in self.values:
            raise self.error(f"input {tensor.name!r} is neither computed nor constant")
        return self.values[tensor.name]

    def is_const(self, tensor) -> bool:
        return isinstance(self.value(tensor), np.ndarray)

    def const(self, tensor, what: str) -> np.ndarray:
        v = self.value(tensor)
        if not isinstance(v, np.ndarray):
            raise self.error(f"{what} ({tensor.name!r}) must be a constant, but it depends on the "
                             f"network input; this op is only supported with a constant {what}")
        return v

    def computed(self, tensor, what: str = "input") -> Computed:
        v = self.value(tensor)
        if isinstance(v, np.ndarray):
            raise self.error(f"{what} ({tensor.name!r}) is constant; expected a computed tensor")
        return v

    def used(self, tensor) -> bool:
        """Whether a node output is read by another node or is a model output (a handler
        need not lower the unused outputs of a multi-output op)."""
        return bool(getattr(tensor, "outputs", None)) or tensor.name in self.graph_outputs

    def optional_input(self, node, i: int):
        if len(node.inputs) > i and node.inputs[i].name != "":
            return node.inputs[i]
        return None

    # -- producing outputs ---------------------------------------------------------------------
    def set_const(self, tensor, array: np.ndarray) -> None:
        array = np.asarray(array)
        self.check_size(array.shape, f"constant {tensor.name!r}")
        self.values[tensor.name] = array

    def alias(self, tensor, value: Computed | np.ndarray) -> None:
        self.values[tensor.name] = value

    def emit(self, kind: str, inputs: list[Computed], out_tensor=None, params=None, attrs=None,
             hint: str = "", batched: bool | None = None) -> Computed:
        """Add an IR node; its output shape comes from running the runtime op on zeros. The
        output keeps the first input's layout (batched or not) unless `batched` says."""
        params = {k: v for k, v in (params or {}).items() if v is not None}
        attrs = dict(attrs or {})
        onnx_name = ""
        if self.onnx_node is not None:
            onnx_name = self.onnx_node.name or (self.onnx_node.outputs[0].name
                                                if self.onnx_node.outputs else "")
        name = self.names.name(hint or onnx_name or kind, fallback=kind)
        keys = []
        for role, array in sorted(params.items()):
            key = f"{name}.{role}"
            value = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
            if not np.isfinite(value).all():
                raise self.error(f"its {role} holds non-finite values (inf or nan) after "
                                 "conversion to float32; bounds through it would be meaningless")
            self.tensors[key] = value
            keys.append((role, key))
        try:
            op = OP_TYPES[kind](name, [i.node for i in inputs], [i.shape for i in inputs],
                                params={r: torch.from_numpy(self.tensors[k]) for r, k in keys},
                                **attrs)
        except (RuntimeError, ValueError, IndexError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise self.error(f"shapes do not fit this op ({first})") from None
        self.check_size(op.shape, "its output")
        origin = f"{self.onnx_node.op} {onnx_name!r}" if self.onnx_node is not None else kind
        self.nodes.append(Node(name=name, op=kind, inputs=tuple(i.node for i in inputs),
                               shape=op.shape, params=tuple(keys),
                               attrs=tuple(sorted(attrs.items())), origin=origin))
        if batched is None:
            batched = inputs[0].batched if inputs else True
        value = Computed(name, op.shape, batched)
        if out_tensor is not None:
            self.values[out_tensor.name] = value
        return value

    # -- axes and broadcasting -----------------------------------------------------------------
    def sample_constant(self, array: np.ndarray, x: Computed, what: str) -> np.ndarray:
        """A constant that broadcasts against x's full shape, as a per-sample array (a
        constant that would grow x is the caller's to expand x for: see `broadcast_shape`)."""
        array = np.asarray(array, dtype=np.float32)
        full = x.full_shape
        out_shape = self.broadcast_shape(full, array.shape, what=what)
        if out_shape != full:
            raise self.error(f"{what} of shape {array.shape} would grow the tensor {full} to "
                             f"{out_shape}; only constants that broadcast into it are supported")
        if array.ndim < len(full):
            array = array.reshape((1,) * (len(full) - array.ndim) + array.shape)
        return np.ascontiguousarray(array[0] if x.batched else array)

    def broadcast_shape(self, *shapes, what: str = "the operands") -> tuple[int, ...]:
        """The ONNX (numpy) broadcast of full shapes, or a one-line error."""
        try:
            return tuple(int(d) for d in np.broadcast_shapes(*(tuple(s) for s in shapes)))
        except ValueError:
            raise self.error(f"{what} of shapes {[tuple(s) for s in shapes]} do not broadcast "
                             "together") from None

    def reshaped(self, x: Computed, full_out: tuple[int, ...], out_tensor, why: str = "",
                 ) -> Computed:
        """x's elements, in order, as the ONNX shape `full_out`: an alias when the sample
        shape stays, else a reshape (a view). The batch axis may come or go (see the module
        docstring)."""
        full_out = tuple(int(d) for d in full_out)
        if math.prod(full_out) != math.prod(x.full_shape):
            raise self.error(f"{why or 'a reshape'} of {x.full_shape} into {full_out} changes "
                             "the number of elements")
        shape, batched = sample_layout(full_out)
        if shape == tuple(x.shape):
            value = Computed(x.node, shape, batched)
            if out_tensor is not None:
                self.alias(out_tensor, value)
            return value
        return self.emit("reshape", [x], out_tensor, attrs={"target": shape}, batched=batched)

    def canonical(self, x: Computed) -> Computed:
        """x in the layout `sample_layout` gives its ONNX shape (multi-input ops compare
        sample shapes)."""
        shape, batched = sample_layout(x.full_shape)
        if shape == tuple(x.shape) and batched == x.batched:
            return x
        return self.reshaped(x, x.full_shape, None)

    def need_batched(self, x: Computed, what: str) -> None:
        """A one-line error unless x has the batch axis first (convolutions and pools)."""
        if not x.batched:
            raise self.error(f"{what} needs the batch axis (size 1) first, but its input "
                             f"{x.full_shape} has none (an earlier op moved it)")


def torch_dtype_ok(dtype) -> bool:
    return np.dtype(dtype).kind == "f"
