"""What every bound kernel is: the `Op` base class, its declared traits, and the registry.

An op is one IR node kind with three semantics -- a concrete forward pass, interval bound
propagation (IBP) and a CROWN backward step -- over per-sample shapes: a runtime tensor is
(B, *shape) where B counts boxes, and an A-matrix flowing into a node is (B, S, *node.shape)
with S rows (spec rows, or neurons whose bounds are being computed).

The rest of the system never asks an op for its name: the passes, the memory model, the
optimisers and branch and bound read the traits declared here as class attributes (and the
class methods that describe a node from its shapes). Adding an op is one class in its family's
module, registered with `@register_op`; nothing else changes.

Traits (defaults in `Op`):
- `relaxed`: the backward step needs bounds on the op's inputs (a linear relaxation over
  [l, u]); the bound plan asks for them. Ops that are not relaxed are exact linear maps.
- `is_view`: the output holds the input's elements in the same order (a reshape): no new
  memory, and A-matrices going back are views.
- `backward_memory`: what a backward step leaves alive per input: "view" (a view of the
  incoming A), "shared" (one new tensor, shared by the lower and upper side when they came in
  shared: linear maps), "separate" (lower and upper differ from here on: relaxations).
- `streams_weight`: under fsdp with a row-invariant order, a large weight streams in blocks
  instead of being gathered whole (runtime/numerics/streaming.py; the memory model's gather).
- `tp_roles`: what the op can be in a tp zone: "column" / "row" (a layer split on its output /
  input channels) and "elementwise" (acts on each channel alone, so a zone can hold a channel
  slice of it); `tp_roles_of(facts)` refines it per node, `tp_channels(facts, role)` says how
  many channels the node splits in that role.
- `has_alpha`, `splittable`: optimisable and splittable relaxations (see `relaxation.py`).
- `interval_splittable`: branch and bound may split the op's input interval at a point
  inside it (`split_point(lo, hi)`), each child relaxing the op on its half
  (`interval_slack(lo, hi)` scores the split); for smooth functions, whose relaxation tightens
  with a narrower interval rather than becoming exact on a side of 0.
- `pointwise_affine`: y = x * scale + shift elementwise (canonicalize merges these and folds
  them into the layers around them through `absorb_affine_after` / `absorb_affine_before`).
- `mip_encoding`: how a mixed-integer program can state the op exactly (the MILP stage of
  verify, runtime/verification/milp.py): "affine" (y = W x + b on a 1-D input: the weight
  and bias params), "relu" (max(x, 0): one binary per unstable neuron), "view" (is_view ops:
  the same values); None: the op cannot be encoded and the stage is skipped.
- `accepts_patches`: the backward step takes (and gives) A-matrices in patches form (rows
  nonzero only in a window of a (C, H, W) grid: runtime/ops/patches.py); the engine turns
  patches dense before any op that does not declare it.
- `alpha_saved`: for the memory model of alpha-CROWN (runtime/accounting/alpha_model.py),
  how many A-matrix-sized tensors the backward step saves for the gradient, in units of
  B x S x its inputs' elements, (when the incoming A-matrix has no gradient, when it has);
  `alpha_per_element`: how many alpha values an optimisable op holds per input element;
  `alpha_saves_weight`: the step also keeps its (gathered) weight for the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops.memo import LastValueMemo

Bounds = tuple[torch.Tensor, torch.Tensor]

OP_TYPES: dict[str, type] = {}


def register_op(cls):
    """Make `cls` the kernel of IR op `cls.kind`; a second registration of a kind is a bug
    caught at import, not a silent override."""
    kind = cls.__dict__.get("kind")
    if not kind or kind == "op":
        raise TypeError(f"{cls.__name__} must declare its own `kind` to be registered")
    if kind in OP_TYPES:
        raise TypeError(f"op kind {kind!r} is registered twice ({OP_TYPES[kind].__name__} and "
                        f"{cls.__name__})")
    OP_TYPES[kind] = cls
    return cls


@dataclass(frozen=True)
class NodeFacts:
    """What a compiler pass knows about one IR node, in the kernels' terms: per-sample shapes,
    parameter shapes by role, and attributes. Class-level trait methods take this."""

    shape: tuple[int, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    param_shapes: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)
    has_params: frozenset = frozenset()

    def param_shape(self, role: str) -> tuple[int, ...] | None:
        return self.param_shapes.get(role)


SumText = Callable[[int], str]      # length -> "K (n blocks, pair tree)" and the like


class Op:
    """Base class. Subclasses set `kind`, implement forward, ibp and backward_linear (or
    crown_backward for relaxed ops), and declare their traits."""

    kind = "op"
    param_roles: tuple[str, ...] = ()

    is_input = False
    relaxed = False
    is_view = False
    backward_memory = "shared"
    streams_weight = False
    tp_roles: tuple[str, ...] = ()
    has_alpha = False
    splittable = False
    interval_splittable = False
    pointwise_affine = False
    mip_encoding: str | None = None
    accepts_patches = False         # the backward step takes A in patches form (patches.py)
    alpha_saved = (0.0, 0.25)       # autograd's saved A-sized tensors (alpha_model.py)
    alpha_per_element = 1           # optimised values per input element (has_alpha ops)
    alpha_saves_weight = False      # the step keeps its weight for the gradient (alpha_model)

    def __init__(self, name: str, inputs: Sequence[str], in_shapes: Sequence[Sequence[int]],
                 shape: Sequence[int] | None = None, params: dict | None = None,
                 order: str = "fast", **attrs):
        self.name = name
        self.inputs = tuple(inputs)
        self.in_shapes = tuple(tuple(int(d) for d in s) for s in in_shapes)
        self.params = dict(params or {})
        self._gathered: dict[str, torch.Tensor] = {}
        self.order = order
        self.attrs = attrs
        self.setup(**attrs)
        self.shape = tuple(int(d) for d in shape) if shape is not None else self.infer_shape()

    def setup(self, **attrs) -> None:
        if attrs:
            raise TypeError(f"{self.kind} takes no attributes, got {sorted(attrs)}")

    def memo(self, slot: str) -> LastValueMemo:
        """The node's memo named `slot` (memo.py: recomputed when its source tensors change,
        in place included), made on first use."""
        found = self.__dict__.get(slot)
        if found is None:
            found = self.__dict__[slot] = LastValueMemo()
        return found

    # -- traits that depend on the node ---------------------------------------------------------
    @property
    def is_linear(self) -> bool:
        """An exact linear (affine) map of its inputs: IBP and CROWN lose nothing here."""
        return not self.relaxed

    @classmethod
    def tp_roles_of(cls, facts: NodeFacts) -> tuple[str, ...]:
        """The tp roles this node can play (the class's unless its attributes rule one out)."""
        return cls.tp_roles

    @classmethod
    def tp_channels(cls, facts: NodeFacts, role: str) -> int | None:
        """"column": the output channels a zone splits; "row": the input channels the layer
        takes split; None when this node cannot play the role."""
        return None

    # -- canonicalize: folding an elementwise affine (scale, shift of the full per-sample
    # shape, float64 numpy) into this layer's weight and bias, or None when it cannot ------
    @classmethod
    def absorb_affine_after(cls, facts: NodeFacts, weight, bias, scale, shift):
        return None

    @classmethod
    def absorb_affine_before(cls, facts: NodeFacts, weight, bias, scale, shift):
        return None

    @classmethod
    def summation_note(cls, facts: NodeFacts, sums: SumText) -> str | None:
        """Which contractions the node performs, over which lengths (the summation_order
        pass's notes); None when it performs none."""
        return None

    # -- parameters -------------------------------------------------------------------------------
    def param(self, role: str) -> torch.Tensor | None:
        """The whole parameter; an fsdp shard is gathered on first use and kept until
        `release` (the engine calls it when the node is done)."""
        p = self.params.get(role)
        if p is None or isinstance(p, torch.Tensor):
            return p
        full = self._gathered.get(role)
        if full is None:
            full = self._gathered[role] = p.gather()
        return full

    def release(self) -> None:
        """Free gathered parameters (fsdp's free point: right after the node's last use)."""
        for role, full in self._gathered.items():
            self.params[role].release(full)
        self._gathered.clear()

    def infer_shape(self) -> tuple[int, ...]:
        with torch.no_grad():
            xs = [torch.zeros((1, *s)) for s in self.in_shapes]
            return tuple(self.forward(*xs).shape[1:])

    # -- the three semantics ------------------------------------------------------------------
    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def ibp(self, *bounds: Bounds) -> Bounds:
        raise NotImplementedError

    def backward_linear(self, A: torch.Tensor) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """A (B, S, *shape) -> (A for each input, bias (B, S) or None)."""
        raise NotImplementedError

    def crown_backward(self, lA: torch.Tensor, uA: torch.Tensor | None,
                       in_bounds: Sequence[Bounds | None], alpha=None):
        """(lower A per input, upper A per input, lower bias, upper bias). Default for linear
        ops: the same map on both sides, computed once while both sides are one tensor. An
        input whose lower and upper A are both None gets a zero A-matrix (the discrete
        family's constant lines): the engine propagates nothing towards it."""
        l_in, l_bias = self.backward_linear(lA)
        if uA is None:
            return l_in, [None] * len(l_in), l_bias, None
        if uA is lA:
            return l_in, l_in, l_bias, l_bias
        u_in, u_bias = self.backward_linear(uA)
        return l_in, u_in, l_bias, u_bias

    def unit_backward(self, index: torch.Tensor, patches: bool = False):
        """The backward step of the unit rows e_index (the neurons `index`, flat, of this
        node's output), in closed form: (A per input, each (1, len(index), *in_shape) or None
        for an input the rows do not reach; bias (1, len(index)) or None), bitwise what
        `backward_linear` gives for those rows, without building them; with `patches`, an A
        may come in patches form. None: no closed form (the engine then propagates the unit
        rows through `crown_backward`)."""
        return None

    # -- helpers ------------------------------------------------------------------------------
    def _dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """sum(a * b, -1) over this node's own elements (bias terms of the backward pass); tp
        zone nodes, which hold a slice of those elements, finish it across ranks."""
        return contract.dot_last(a, b, self.order)

    def _rows(self, A: torch.Tensor) -> tuple[int, int]:
        return A.shape[0], A.shape[1]


def center_radius(lo: torch.Tensor, hi: torch.Tensor) -> Bounds:
    return (hi + lo) / 2, (hi - lo) / 2


def per_feature(full, axis: int):
    """The vector v with `full` == v broadcast along `axis` (numpy), or None when `full`
    varies along another axis too (then it is not a per-feature scale or shift)."""
    import numpy as np

    moved = np.moveaxis(full, axis, 0).reshape(full.shape[axis], -1)
    if moved.size and not np.all(moved == moved[:, :1]):
        return None
    return moved[:, 0]
