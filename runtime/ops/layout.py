"""The layout family: the network `input`, `reshape` (same elements, same order, another
shape: a view), `transpose` (a permutation of the sample axes) and `pad` (data movement
through an index map, runtime/ops/index_map.py). Lowered from Flatten, Reshape, Squeeze,
Unsqueeze, Transpose and Pad (compiler/lowering/layout.py)."""

from __future__ import annotations

import math

from shardbound.runtime.ops.base import Op, register_op


@register_op
class Input(Op):
    """The network input; bounds are the box itself."""

    kind = "input"
    is_input = True

    @classmethod
    def summation_note(cls, facts, sums):
        return f"concretize A.center and |A|.radius over {sums(math.prod(facts.shape))}"

    def infer_shape(self):
        return self.in_shapes[0]

    def forward(self, x):
        return x

    def ibp(self, b):
        return b


@register_op
class Reshape(Op):
    """A pure layout change; the element order (row-major) is kept."""

    kind = "reshape"
    is_view = True
    mip_encoding = "view"
    backward_memory = "view"

    def setup(self, target=()):
        self.target = tuple(int(d) for d in target)

    def forward(self, x):
        return x.reshape(x.shape[0], *self.target)

    def ibp(self, b):
        return self.forward(b[0]), self.forward(b[1])

    def backward_linear(self, A):
        B, S = self._rows(A)
        return [A.reshape(B, S, *self.in_shapes[0])], None


@register_op
class Transpose(Op):
    """A permutation of the sample axes (the batch axis stays first)."""

    kind = "transpose"

    def setup(self, perm=()):
        self.perm = tuple(int(p) for p in perm)

    def forward(self, x):
        return x.permute(0, *(p + 1 for p in self.perm)).contiguous()

    def ibp(self, b):
        return self.forward(b[0]), self.forward(b[1])

    def backward_linear(self, A):
        inverse = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inverse[p] = i
        return [A.permute(0, 1, *(p + 2 for p in inverse)).contiguous()], None


# -- data movement through index maps (runtime/ops/index_map.py) --------------------------------
PAD_MODES = ("constant", "reflect", "edge", "wrap")


def pad_axis_source(n: int, begin: int, end: int, mode: str):
    """Source indices (numpy, -1 = the constant) of one padded axis of length n: negative pads
    crop first, then the cropped axis is padded (onnxruntime's order: reflect and edge read
    the cropped data). Raises ValueError for what the op cannot mean."""
    import numpy as np

    if n == 0 and begin == end == 0:    # a tp rank that holds no channels
        return np.arange(0)
    lo, hi = max(-begin, 0), n - max(-end, 0)
    if hi <= lo:
        raise ValueError(f"pads ({begin}, {end}) crop all {n} elements of an axis")
    kept = np.arange(lo, hi)
    b, e = max(begin, 0), max(end, 0)
    if mode == "constant":
        return np.pad(kept, (b, e), constant_values=-1)
    if mode == "reflect" and max(b, e) > len(kept) - 1:
        raise ValueError(f"reflect pads ({b}, {e}) exceed the axis length {len(kept)} minus 1")
    if mode not in PAD_MODES:
        raise ValueError(f"pad mode {mode!r} is not one of {', '.join(PAD_MODES)}")
    return np.pad(kept, (b, e), mode=mode)


@register_op
class Pad(Op):
    """Padding per sample axis: `pads` is ((begin, end), ...) per axis (negative crops),
    `mode` constant (fill `value`), reflect, edge or wrap. Every mode is a linear map: outputs
    read fixed sources (reflect/edge/wrap: several outputs may share one) or hold the
    constant, so IBP and CROWN are exact. Acts on each channel alone unless it pads the
    channel axis (axis 0), so a tp zone can hold a channel slice of it."""

    kind = "pad"
    tp_roles = ("elementwise",)

    @classmethod
    def tp_roles_of(cls, facts):
        pads = facts.attrs.get("pads", ())
        if len(facts.in_shapes[0]) < 2 or (pads and tuple(pads[0]) != (0, 0)):
            return ()
        return cls.tp_roles

    @classmethod
    def summation_note(cls, facts, sums):
        if facts.attrs.get("mode", "constant") != "constant" or not facts.attrs.get("value"):
            return None
        return f"bias A.value over {sums(math.prod(facts.shape))}"

    def setup(self, pads=(), mode="constant", value=0.0):
        from shardbound.runtime.ops.index_map import MapCache

        self.pads = tuple((int(b), int(e)) for b, e in pads)
        self.mode = str(mode)
        self.value = float(value)
        self._maps = MapCache(self._build_map)
        # Decided from the attributes alone, never from the (tp-local) shapes, so that every
        # rank joins the same bias reductions.
        self.has_fill = (self.mode == "constant" and self.value != 0.0
                         and any(b > 0 or e > 0 for b, e in self.pads))

    def _build_map(self, in_shape):
        from shardbound.runtime.ops.index_map import IndexMap

        if len(self.pads) != len(in_shape):
            raise ValueError(f"{len(self.pads)} pad pairs for a rank-{len(in_shape)} sample")
        sources = [pad_axis_source(n, b, e, self.mode) for n, (b, e) in zip(in_shape, self.pads)]
        return IndexMap.from_axes(in_shape, sources, fill=self.value)

    def _map(self):
        return self._maps.get(self.in_shapes[0])

    def infer_shape(self):
        return self._map().out_shape

    def forward(self, x):
        m = self._map()
        return m.gather(x.reshape(x.shape[0], math.prod(x.shape[1:]))).reshape(x.shape[0], *m.out_shape)

    def ibp(self, b):
        return self.forward(b[0]), self.forward(b[1])

    def backward_linear(self, A):
        B, S = self._rows(A)
        m = self._map()
        flat = A.reshape(B, S, m.n_out)
        A_in = m.scatter_add(flat).reshape(B, S, *self.in_shapes[0])
        bias = self._dot(flat, m.fill.to(A.device, A.dtype)) if self.has_fill else None
        return [A_in], bias
