"""The movement family: `move`, every op that only moves elements (or puts constants among
them), as one kernel over an index map (runtime/ops/index_map.py).

Concat, Slice, Split, Gather, GatherElements (constant indices), Expand, Tile, Transpose
across the batch axis, DepthToSpace, SpaceToDepth, nearest-neighbour Resize / Upsample
(compiler/lowering/movement.py) are all "output element i reads input element source[i], or
is the constant fill[i]". A `move` node does not store that map: it stores the *steps* that
produce it, in the op's own terms (attributes rendered as literals in program.py: "take
indices 2..9 of axis 1", "concatenate the inputs on axis 0", "transpose (0, 2, 1)"), and
builds the map on first use by running the steps on numpy arrays of source indices. The map
is rebuilt when the shapes change (tp localises the channel count of zone ops after
construction), so steps never mention a channel count unless they change it.

Several inputs (Concat of computed tensors) are one flat source: input k's elements follow
input k-1's. Constants (Concat with constant operands) are source -1 with their values in the
`fill` parameter (the output's shape, zero where an element is sourced); the CROWN bias term
is then A . fill. Large constant index tensors (Gather / GatherElements with more than
`MAX_LITERAL_INDICES` indices) live in the `indices` parameter (float32, exact below 2^24)
instead of in program.py.

Forward and IBP gather (bounds move with their elements, so IBP is exact); the CROWN step is
the transpose, which sums the readers of each source in a fixed order (index_map.py): bits do
not depend on the rows of A, their split over ranks, or threads.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops.base import Op, register_op
from shardbound.runtime.ops.index_map import IndexMap, MapCache

MAX_LITERAL_INDICES = 64


# -- steps: functions of numpy arrays of source indices (-1: a constant) ------------------------
def _concat(arrays, axis, pieces):
    """Inputs (and constant blocks: a piece -n is n constant slots) joined on `axis`."""
    like = arrays[0]
    parts = []
    for p in pieces:
        if p >= 0:
            parts.append(arrays[p])
        else:
            shape = list(like.shape)
            shape[axis] = -p
            parts.append(np.full(shape, -1, dtype=np.int64))
    return np.concatenate(parts, axis=axis)


def _take_range(a, axis, start, stop, step):
    """Elements start, start + step, ... (before stop) of `axis`: Slice after its indices are
    resolved, which is why stop may be -1 (a negative step down to element 0)."""
    index = np.arange(start, stop, step)
    if index.size and (index.min() < 0 or index.max() >= a.shape[axis]):
        raise ValueError(f"range({start}, {stop}, {step}) leaves axis {axis} of length "
                         f"{a.shape[axis]}")
    return np.take(a, index, axis=axis)


def _take(a, axis, indices, ishape):
    """Gather: the indices (non-negative) of `axis`, shaped `ishape` in place of the axis."""
    index = np.asarray(indices, dtype=np.int64).reshape(ishape)
    if index.size and index.max() >= a.shape[axis]:
        raise ValueError(f"index {index.max()} out of range for axis {axis} of length "
                         f"{a.shape[axis]}")
    return np.take(a, index, axis=axis)


def _take_along(a, axis, indices, ishape):
    """GatherElements: out[i] = a[i with its `axis` coordinate replaced by indices[i]]."""
    index = np.asarray(indices, dtype=np.int64).reshape(ishape)
    if index.ndim != a.ndim or any(i > n for k, (i, n) in enumerate(zip(index.shape, a.shape))
                                   if k != axis):
        raise ValueError(f"indices of shape {index.shape} do not fit data of shape {a.shape}")
    if index.size and index.max() >= a.shape[axis]:
        raise ValueError(f"index {index.max()} out of range for axis {axis}")
    grid = list(np.indices(index.shape, sparse=True))
    grid[axis] = index
    return a[tuple(grid)]


def _expand(a, shape):
    return np.broadcast_to(a, np.broadcast_shapes(a.shape, tuple(shape)))


def _resize_nearest(a, axis, out_len, scale, coordinates, rounding):
    return np.take(a, nearest_sources(a.shape[axis], out_len, scale, coordinates, rounding),
                   axis=axis)


def _depth_to_space(a, block, mode):
    n, c, h, w = a.shape
    if c % (block * block):
        raise ValueError(f"{c} channels are not a multiple of blocksize^2 = {block * block}")
    if mode == "DCR":
        t = a.reshape(n, block, block, c // block ** 2, h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = a.reshape(n, c // block ** 2, block, block, h, w).transpose(0, 1, 4, 2, 5, 3)
    return t.reshape(n, c // block ** 2, h * block, w * block)


def _space_to_depth(a, block):
    n, c, h, w = a.shape
    if h % block or w % block:
        raise ValueError(f"spatial size {h}x{w} is not a multiple of blocksize {block}")
    t = a.reshape(n, c, h // block, block, w // block, block).transpose(0, 3, 5, 1, 2, 4)
    return t.reshape(n, c * block * block, h // block, w // block)


STEPS = {
    "squeeze": lambda a, axes: np.squeeze(a, axis=tuple(axes)),
    "unsqueeze": lambda a, axes: np.expand_dims(a, tuple(axes)),
    "reshape": lambda a, shape: a.reshape(tuple(shape)),
    "transpose": lambda a, perm: a.transpose(tuple(perm)),
    "range": _take_range,
    "take": _take,
    "take_along": _take_along,
    "expand": _expand,
    "tile": lambda a, repeats: np.tile(a, tuple(repeats)),
    "resize_nearest": _resize_nearest,
    "depth_to_space": _depth_to_space,
    "space_to_depth": _space_to_depth,
}


def run_steps(arrays, steps, indices=None):
    """The steps applied to the inputs' source-index arrays; a leading ("concat", axis,
    pieces) joins several inputs, every other step acts on one array. `indices` replaces an
    index list given as None (the op's `indices` parameter)."""
    steps = list(steps)
    if steps and steps[0][0] == "concat":
        _, axis, pieces = steps.pop(0)
        a = _concat(arrays, axis, pieces)
    elif len(arrays) == 1:
        a = arrays[0]
    else:
        raise ValueError(f"{len(arrays)} inputs need a leading concat step")
    for step in steps:
        name, args = step[0], list(step[1:])
        if name in ("take", "take_along") and args[1] is None:
            args[1] = indices
        if name not in STEPS:
            raise ValueError(f"unknown movement step {name!r}")
        a = STEPS[name](a, *args)
    return a


# -- Resize's coordinate transformations (shared with the linear resize kernel) ------------------
def source_coordinates(in_len: int, out_len: int, scale: float, mode: str) -> np.ndarray:
    """Where each output index of one resized axis samples the input (float64), per ONNX
    Resize's coordinate_transformation_mode (before any rounding or clamping)."""
    x = np.arange(out_len, dtype=np.float64)
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adjustment = out_len / (scale * in_len)
        return in_len / 2 * (1 - adjustment) + (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_len > 1 else np.zeros(out_len)
    if mode == "align_corners":
        return x * (in_len - 1) / (out_len - 1) if out_len > 1 else np.zeros(out_len)
    if mode == "asymmetric":
        return x / scale
    if mode == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    raise ValueError(f"coordinate transformation {mode!r} is not supported")


def nearest_sources(in_len: int, out_len: int, scale: float, mode: str, rounding: str):
    """The input index each output of a nearest-mode resized axis copies."""
    x = source_coordinates(in_len, out_len, scale, mode)
    floor = np.floor(x)
    frac = x - floor
    if rounding == "round_prefer_floor":
        idx = np.where(frac > 0.5, floor + 1, floor)
    elif rounding == "round_prefer_ceil":
        idx = np.where(frac >= 0.5, floor + 1, floor)
    elif rounding == "floor":
        idx = floor
    elif rounding == "ceil":
        idx = np.ceil(x)
    else:
        raise ValueError(f"nearest_mode {rounding!r} is not supported")
    return np.clip(idx, 0, in_len - 1).astype(np.int64)


# -- the kernel -----------------------------------------------------------------------------------
@register_op
class Move(Op):
    """y = the inputs' elements moved by `steps` (see the module docstring), with constants
    from `fill` where no input element lands. `expand_front[k]` unit axes are put in front of
    input k before the steps (the lowering's way to let steps use ONNX axes, batch axis
    included). Exact in IBP and CROWN. A tp zone can hold a channel slice of a move that acts
    on each channel alone with the same map (`tp_roles_of` checks it on the node's shapes)."""

    kind = "move"
    param_roles = ("fill", "indices")
    tp_roles = ("elementwise",)

    def setup(self, steps=(), expand_front=()):
        self.steps = tuple(tuple(s) for s in steps)
        self.expand_front = tuple(int(v) for v in expand_front) or (0,) * len(self.inputs)
        if len(self.expand_front) != len(self.inputs):
            raise ValueError(f"expand_front has {len(self.expand_front)} entries for "
                             f"{len(self.inputs)} inputs")
        self._maps = MapCache(self._build_map)

    # -- what passes ask ------------------------------------------------------------------
    @classmethod
    def tp_roles_of(cls, facts):
        """Elementwise in a zone when, on these shapes and on one (and no) channel, the map
        sends channel c of the output to channel c of the input the same way for every c."""
        if (len(facts.in_shapes) != 1 or len(facts.in_shapes[0]) < 2
                or "indices" in facts.has_params):
            return ()
        steps = facts.attrs.get("steps", ())
        front = tuple(facts.attrs.get("expand_front", ())) or (0,)
        in_shape = tuple(facts.in_shapes[0])
        try:
            maps = {c: _source_array([(c, *in_shape[1:])], front, steps)
                    for c in (in_shape[0], 1, 0)}
        except (ValueError, IndexError):
            return ()
        full, one = maps[in_shape[0]], maps[1]
        C, X = in_shape[0], math.prod(in_shape[1:])
        if (full.ndim < 2 or full.shape[0] != C or one.shape != (1, *full.shape[1:])
                or maps[0].shape != (0, *full.shape[1:])):
            return ()
        per_channel = one.reshape(1, -1)
        offsets = (np.arange(C) * X)[:, None]
        expected = np.where(per_channel >= 0, per_channel + offsets, -1)
        if not np.array_equal(full.reshape(C, -1), expected):
            return ()
        return cls.tp_roles

    @classmethod
    def summation_note(cls, facts, sums):
        if "fill" not in facts.has_params:
            return None
        return f"bias A.fill over {sums(math.prod(facts.shape))}"

    # -- the map --------------------------------------------------------------------------
    def _build_map(self, in_shapes):
        indices = None
        if self.params.get("indices") is not None:
            indices = self.param("indices").detach().cpu().numpy().astype(np.int64)
        source = _source_array(in_shapes, self.expand_front, self.steps, indices)
        return IndexMap(source, sum(math.prod(s) for s in in_shapes))

    def _map(self) -> IndexMap:
        return self._maps.get(self.in_shapes)

    def infer_shape(self):
        return self._map().out_shape

    def _fill(self, like):
        f = self.param("fill")
        return None if f is None else f.reshape(-1).to(like.device, like.dtype)

    # -- the three semantics --------------------------------------------------------------
    def forward(self, *xs):
        m = self._map()
        B = xs[0].shape[0]
        flat = [x.reshape(B, math.prod(x.shape[1:])) for x in xs]   # explicit: 0 channels
        source = flat[0] if len(flat) == 1 else torch.cat(flat, dim=-1)
        return m.gather(source, fill=self._fill(source)).reshape(B, *m.out_shape)

    def ibp(self, *bounds):
        return (self.forward(*(b[0] for b in bounds)), self.forward(*(b[1] for b in bounds)))

    def backward_linear(self, A):
        B, S = self._rows(A)
        m = self._map()
        flat = A.reshape(B, S, m.n_out)
        back = m.scatter_add(flat)
        sizes = [math.prod(s) for s in self.in_shapes]
        parts = back.split(sizes, dim=-1) if len(sizes) > 1 else (back,)
        A_in = [p.reshape(B, S, *s) for p, s in zip(parts, self.in_shapes)]
        fill = self._fill(A)
        return A_in, (None if fill is None else self._dot(flat, fill))


def _source_array(in_shapes, expand_front, steps, indices=None) -> np.ndarray:
    """The source-index array of a move on these input shapes (see Move)."""
    arrays, offset = [], 0
    for shape, front in zip(in_shapes, expand_front):
        n = math.prod(shape)
        a = np.arange(offset, offset + n, dtype=np.int64).reshape(shape)
        arrays.append(a.reshape((1,) * front + tuple(shape)))
        offset += n
    # (np.ascontiguousarray would make a 0-d result, a Gather of one element, 1-d)
    return np.array(run_steps(arrays, steps, indices), order="C", copy=True)


# -- linear and cubic Resize: a weighted map, one interpolation matrix per resized axis -------------
def interpolation_matrix(in_len: int, out_len: int, scale: float, coordinates: str,
                         mode: str = "linear", cubic_a: float = -0.75,
                         exclude_outside: bool = False) -> np.ndarray:
    """(out_len, in_len) float64: row o holds the weights output o gives the input elements of
    one axis under ONNX Resize (linear: the two neighbours of the source coordinate, clamped
    into the axis; cubic: four, with edge padding, or renormalised inside the axis when
    `exclude_outside`)."""
    x = source_coordinates(in_len, out_len, scale, coordinates)
    M = np.zeros((out_len, in_len), dtype=np.float64)
    rows = np.arange(out_len)
    if mode == "linear":
        x = np.clip(x, 0, in_len - 1)
        i0 = np.floor(x).astype(np.int64)
        i1 = np.minimum(i0 + 1, in_len - 1)
        w = x - i0
        np.add.at(M, (rows, i0), 1 - w)
        np.add.at(M, (rows, i1), w)
        return M
    if mode != "cubic":
        raise ValueError(f"resize mode {mode!r} is not a weighted map")
    floor = np.floor(x)
    t = x - floor
    A = cubic_a
    taps = [((A * (t + 1) - 5 * A) * (t + 1) + 8 * A) * (t + 1) - 4 * A,
            ((A + 2) * t - (A + 3)) * t * t + 1,
            ((A + 2) * (1 - t) - (A + 3)) * (1 - t) * (1 - t) + 1,
            ((A * (2 - t) - 5 * A) * (2 - t) + 8 * A) * (2 - t) - 4 * A]
    weights = np.stack(taps, axis=1)                                      # (out, 4)
    index = floor[:, None].astype(np.int64) + np.arange(-1, 3)[None, :]
    if exclude_outside:
        weights = np.where((index < 0) | (index >= in_len), 0.0, weights)
        weights = weights / weights.sum(axis=1, keepdims=True)
    np.add.at(M, (np.repeat(rows, 4), np.clip(index, 0, in_len - 1).reshape(-1)),
              weights.reshape(-1))
    return M


@register_op
class Resample(Op):
    """Linear (bilinear, trilinear) or cubic Resize: along each resized sample axis, y = M x
    with an interpolation matrix M computed from the attributes (interpolation_matrix), not
    stored. Each axis is a contraction over its input length through numerics/contract.py, so
    it follows the summation order; IBP is exact (center M c, radius |M| r: |M_H (x) M_W| =
    |M_H| (x) |M_W|), CROWN's step is the transpose. Axis 0 is never resized by a node that
    can sit in a tp zone."""

    kind = "resample"
    tp_roles = ("elementwise",)

    def setup(self, axes=(), sizes=(), scales=(), coordinates="half_pixel", mode="linear",
              cubic_a=-0.75, exclude_outside=False):
        self.axes = tuple(int(a) for a in axes)
        self.sizes = tuple(int(s) for s in sizes)
        self.scales = tuple(float(s) for s in scales)
        if not len(self.axes) == len(self.sizes) == len(self.scales):
            raise ValueError("resample needs one size and one scale per axis")
        self.coordinates, self.mode = str(coordinates), str(mode)
        self.cubic_a, self.exclude_outside = float(cubic_a), bool(exclude_outside)
        self._key, self._mats = None, None

    @classmethod
    def tp_roles_of(cls, facts):
        if len(facts.in_shapes[0]) < 2 or 0 in facts.attrs.get("axes", ()):
            return ()
        return cls.tp_roles

    @classmethod
    def summation_note(cls, facts, sums):
        parts = [f"axis {a}: fwd over {sums(facts.in_shapes[0][a])}, bwd over {sums(n)}"
                 for a, n in zip(facts.attrs.get("axes", ()), facts.attrs.get("sizes", ()))]
        return "; ".join(parts) or None

    def infer_shape(self):
        shape = list(self.in_shapes[0])
        for a, n in zip(self.axes, self.sizes):
            shape[a] = n
        return tuple(shape)

    def _matrices(self, device):
        """Per axis (M (out, in), |M|, M^T (in, out)) as contiguous float32 tensors."""
        key = (self.in_shapes, str(device))
        if self._key != key:
            mats = []
            for a, n, s in zip(self.axes, self.sizes, self.scales):
                M = torch.from_numpy(interpolation_matrix(
                    self.in_shapes[0][a], n, s, self.coordinates, self.mode, self.cubic_a,
                    self.exclude_outside).astype(np.float32)).to(device)
                mats.append((M, M.abs(), M.t().contiguous()))
            self._key, self._mats = key, mats
        return self._mats

    def _along(self, x, lead: int, which: int, reverse: bool = False):
        """x contracted along every resized axis (`lead` leading dims before the sample axes)
        with matrix `which` of each (0: M, forward; 1: |M|; 2: M^T, backward)."""
        mats = self._matrices(x.device)
        pairs = list(zip(self.axes, mats))
        for axis, m in (reversed(pairs) if reverse else pairs):
            d = axis + lead
            moved = x.movedim(d, -1).contiguous()
            if moved.numel() == 0:      # a tp rank without channels: no sum, but stay on the
                y = torch.matmul(moved, m[which].t())      # autograd path (collectives)
            else:
                y = contract.matmul(moved, m[which], self.order)
            x = y.movedim(-1, d)
        return x.contiguous()

    def forward(self, x):
        return self._along(x, 1, 0)

    def ibp(self, b):
        c, r = (b[1] + b[0]) / 2, (b[1] - b[0]) / 2
        yc, yr = self._along(c, 1, 0), self._along(r, 1, 1)
        return yc - yr, yc + yr

    def backward_linear(self, A):
        return [self._along(A, 2, 2, reverse=True)], None
