"""What an op handler sees while lowering one ONNX node: values, constants, and `emit`.

Every ONNX tensor is either a constant (a numpy array: initializers, Constant outputs, folded
subgraphs) or `Computed` (it depends on the network input and is produced by an IR node).
Handlers read ONNX axes in the model's full shapes (batch axis first, size 1) and emit IR nodes
whose shapes are per sample; output shapes come from the runtime op itself, so the IR and the
kernels can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def full_shape(self) -> tuple[int, ...]:
        return (1, *self.shape)


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
             hint: str = "") -> Computed:
        """Add an IR node; its output shape comes from running the runtime op on zeros."""
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
        value = Computed(name, op.shape)
        if out_tensor is not None:
            self.values[out_tensor.name] = value
        return value

    # -- axes and broadcasting -----------------------------------------------------------------
    def sample_constant(self, array: np.ndarray, x: Computed, what: str) -> np.ndarray:
        """A constant that broadcasts against x's full shape, as a per-sample array."""
        array = np.asarray(array, dtype=np.float32)
        full = x.full_shape
        try:
            out_shape = np.broadcast_shapes(array.shape, full)
        except ValueError:
            raise self.error(f"{what} of shape {array.shape} does not broadcast to {full}") from None
        if out_shape != full:
            raise self.error(f"{what} of shape {array.shape} would grow the tensor {full} to "
                             f"{out_shape}; only constants that broadcast into it are supported")
        if array.ndim < len(full):
            array = array.reshape((1,) * (len(full) - array.ndim) + array.shape)
        return np.ascontiguousarray(array[0])

    def reshaped(self, x: Computed, full_out: tuple[int, ...], out_tensor, why: str) -> None:
        """Emit a reshape to `full_out` (a full ONNX shape); the batch axis must stay first."""
        full_out = tuple(int(d) for d in full_out)
        if not full_out or full_out[0] != 1:
            raise self.error(f"{why} gives shape {full_out}, which moves the batch axis (size 1) "
                             "away from the front; only per-sample layout changes are supported")
        if full_out[1:] == x.shape:
            self.alias(out_tensor, x)
            return
        self.emit("reshape", [x], out_tensor, attrs={"target": full_out[1:]})


def torch_dtype_ok(dtype) -> bool:
    return np.dtype(dtype).kind == "f"
