"""A-matrix rows in patches form: CROWN rows over a (C, H, W) node that are nonzero only in a
window of its spatial grid.

A backward pass that starts from one neuron of a convolutional node (an intermediate bound)
touches, at every earlier spatial node, only that neuron's receptive field: a dense row of
C*H*W entries is mostly zeros, and the transposed convolution of a dense A-matrix spends
almost all its work on them. Here each row keeps its window only: `values` (B, S, C, ph, pw)
and the window's top-left corner per row, `origin` (S, 2), in the node's grid. A window may
reach past the grid's edges (padding); the entries there are kept at zero. All rows of one
pass share the window size (they started alike and went through the same ops).

Ops that declare the trait `accepts_patches` step patches to patches (a convolution's window
grows by its kernel, an elementwise relaxation gathers its lines at the windows, a residual
`add` scales them); the engine turns patches into dense rows (`to_dense`) before any other op,
and when a window has grown to cover the grid.

Bits: the values inside a window are computed by the same per-element operations as the dense
rows' (a convolution's per-position contraction is the same vector product; the transposed
convolution's scatter-add meets the same terms in the same order, the dense rows' other terms
being zeros), so under the ordered summations (`blocked`, `exact`) every sum over a node's
elements -- bias terms, the concretisation, a convolution's per-channel sums -- is taken over
the dense rows (`to_dense`, transiently): the bounds keep the dense bits. `fast` sums over the
windows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardbound.runtime.ops.memo import LastValueMemo


DENSE_CHUNK = 1 << 20      # elements of dense rows made at a time for an ordered sum
FEW_CHANNELS = 4           # to_dense by whole windows up to this many (boxes x channels)


def _support_plans(vec: torch.Tensor, node_shape):
    """Per box of `vec` (over a (C, H, W) node), the support-dot plan of its nonzeros and
    their (channel, row, column); None where a box's vector is mostly nonzero (the dense
    rows cost no more then) or not float32."""
    from shardbound.runtime.numerics import support_dot

    C, H, W = node_shape
    K = C * H * W
    v = vec.reshape(-1, K)
    if v.dtype != torch.float32:
        return None
    plans = []
    for row in v:
        support = row.nonzero()[:, 0]
        if len(support) > K // 4:
            return None
        plans.append((support_dot.Plan(row[support], support, K),
                      (support // (H * W), (support // W) % H, support % W)))
    return plans


_SUPPORT_PLANS = LastValueMemo()     # the intercepts of one CROWN step, met by every chunk


class Patches:
    """Rows of an A-matrix over a (C, H, W) node, each nonzero only in its window."""

    def __init__(self, values: torch.Tensor, origin: torch.Tensor, node_shape,
                 dirty: bool = False):
        self.values = values                    # (B, S, C, ph, pw)
        self.origin = origin                    # (S, 2) long: (row, column) of the corner
        self.node_shape = tuple(int(d) for d in node_shape)
        # `dirty`: the entries outside the grid hold what a conv step scattered there, not
        # zeros; `values` is then a buffer of this pass's own (masked in place when needed).
        self.dirty = dirty

    # -- what the engine and the ledger ask of an A-matrix --------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The dense shape these rows stand for: (B, S, C, H, W)."""
        return (*self.values.shape[:2], *self.node_shape)

    @property
    def window(self) -> tuple[int, int]:
        return tuple(self.values.shape[-2:])

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def device(self):
        return self.values.device

    @property
    def requires_grad(self) -> bool:
        return self.values.requires_grad

    def untyped_storage(self):
        """The values' storage (the ledger counts what is held, not the dense size)."""
        return self.values.untyped_storage()

    def with_values(self, values: torch.Tensor, origin=None, node_shape=None,
                    dirty: bool | None = None) -> "Patches":
        return Patches(values, self.origin if origin is None else origin,
                       self.node_shape if node_shape is None else node_shape,
                       self.dirty if dirty is None else dirty)

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def unit(cls, index: torch.Tensor, node_shape, dtype=torch.float32, device=None):
        """The unit rows e_index (flat neuron indices) of a (C, H, W) node: 1x1 windows."""
        C, H, W = node_shape
        k = len(index)
        index = index.to(device)
        values = torch.zeros((1, k, C, 1, 1), dtype=dtype, device=device)
        values[0, torch.arange(k, device=device), index // (H * W), 0, 0] = 1
        return cls(values, torch.stack([(index // W) % H, index % W], dim=1), node_shape)

    @classmethod
    def from_dense(cls, A: torch.Tensor, node_shape, max_share: float = 0.25,
                   also: torch.Tensor | None = None) -> "Patches | None":
        """Dense rows (B, S, C, H, W) whose nonzeros (over every box and channel; those of
        `also`, the other side's rows, too) lie in a small window per row, as patches with
        those windows, inside the grid; None where a window would exceed `max_share` of the
        grid. Rows that reach a conv node dense although each is local (a spec or a Softmax
        over a transposed node: every row of carvana's per-pixel Softmax touches one pixel)
        then cross the convolutions as windows. The values are the dense entries, copied."""
        C, H, W = node_shape
        if A.dim() != 5 or tuple(A.shape[2:]) != (C, H, W) or A.shape[1] == 0:
            return None
        nz = (A != 0).any(dim=2).any(dim=0)                     # (S, H, W)
        if also is not None:
            nz |= (also != 0).any(dim=2).any(dim=0)
        rows, cols = nz.any(dim=2), nz.any(dim=1)               # (S, H), (S, W)
        hs = torch.arange(H, device=A.device)
        ws = torch.arange(W, device=A.device)
        top = torch.where(rows, hs, H).min(dim=1).values
        bottom = torch.where(rows, hs, -1).max(dim=1).values
        left = torch.where(cols, ws, W).min(dim=1).values
        right = torch.where(cols, ws, -1).max(dim=1).values
        ph = max(1, int((bottom - top + 1).max()))
        pw = max(1, int((right - left + 1).max()))
        if ph * pw > max_share * H * W:
            return None
        # corners moved up / left where a window would pass the far edge (an empty row: 0)
        oy = torch.minimum(top.clamp(max=H - 1), torch.tensor(H - ph, device=A.device))
        ox = torch.minimum(left.clamp(max=W - 1), torch.tensor(W - pw, device=A.device))
        origin = torch.stack([oy, ox], dim=1)
        return cls(cls.windows_of(A, origin, (ph, pw)), origin, node_shape)

    @staticmethod
    def windows_of(A: torch.Tensor, origin: torch.Tensor, window) -> torch.Tensor:
        """(B, S, C, ph, pw): each row of dense `A` (B, S, C, H, W) at its window (inside)."""
        ph, pw = window
        views = A.unfold(3, ph, 1).unfold(4, pw, 1)             # (B, S, C, H', W', ph, pw)
        rows = torch.arange(origin.shape[0], device=origin.device)
        return views[:, rows, :, origin[:, 0], origin[:, 1]].transpose(0, 1).contiguous()

    # -- geometry -------------------------------------------------------------------------------
    def _coords(self):
        """Grid rows (S, ph) and columns (S, pw) of every window position."""
        ph, pw = self.window
        dev = self.origin.device
        return (self.origin[:, :1] + torch.arange(ph, device=dev),
                self.origin[:, 1:] + torch.arange(pw, device=dev))

    def inside(self) -> torch.Tensor:
        """Bool (S, ph, pw): the window positions inside the grid."""
        ys, xs = self._coords()
        H, W = self.node_shape[1:]
        return ((ys >= 0) & (ys < H))[:, :, None] & ((xs >= 0) & (xs < W))[:, None, :]

    def _margins(self):
        ys, xs = self._coords()
        H, W = self.node_shape[1:]
        S = self.origin.shape[0]
        if S == 0:
            return ys, xs, 0, 0, 0, 0
        top, left = max(0, -int(ys.min())), max(0, -int(xs.min()))
        bottom, right = max(0, int(ys.max()) - H + 1), max(0, int(xs.max()) - W + 1)
        return ys, xs, top, bottom, left, right

    def covers_grid(self) -> bool:
        """Whether a window is as large as the grid (dense rows are then no bigger)."""
        ph, pw = self.window
        H, W = self.node_shape[1:]
        return ph * pw >= H * W

    def masked(self, in_place: bool = False) -> "Patches":
        """Entries outside the grid set to zero (after a step that filled them); `in_place`
        when the caller owns the values (a fresh step output: no copy of the window)."""
        if not any(self._margins()[2:]):         # every window inside: from the corners alone
            self.dirty = False
            return self
        keep = self.inside()
        v = self.values
        if in_place and not _differentiable(v):
            v.masked_fill_(~keep[None, :, None], 0)
            self.dirty = False
            return self
        return self.with_values(torch.where(keep[None, :, None], v, torch.zeros((), dtype=v.dtype,
                                                                                device=v.device)),
                                dirty=False)

    # -- conversions --------------------------------------------------------------------------
    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """A per-sample tensor over the node ((Bt, C, H, W), (Bt, 1, C, H, W) or anything that
        broadcasts to it) at every row's window: (Bt, S, C, ph, pw), zeros outside the grid."""
        return self.gather_many([t])[0]

    def gather_many(self, tensors, table: "WindowTable | None" = None) -> list[torch.Tensor]:
        """`gather` of several tensors at once (one indexing pass over all of them). With
        `table` (`window_table` of these tensors at a superset of these rows: the rows of a
        CROWN step cut into chunks) the windows are picked from it instead of being copied
        out again per chunk; the values are the same."""
        if table is not None:
            ys, xs = self.origin[:, 0] + table.top, self.origin[:, 1] + table.left
            return list(table.windows.index_select(1, ys * table.width + xs).split(table.sizes))
        t, sizes = self._stacked(tensors)
        ph, pw = self.window
        _, _, top, bottom, left, right = self._margins()
        if top or bottom or left or right:
            t = F.pad(t, (left, right, top, bottom))
        # Every window of the (padded) grid as a view, then the rows' windows picked out, laid
        # out as the values are ((Bt, S, C, ph, pw) contiguous: the products with the values
        # that follow run at memory speed; a transposed gather made them 3-4x slower). Where
        # there are more rows than grid positions (rows of several channels share a window),
        # the windows are copied out once per position and the rows pick theirs by index.
        views = t.unfold(2, ph, 1).unfold(3, pw, 1).permute(0, 2, 3, 1, 4, 5)
        Bt, Hq, Wq = views.shape[:3]
        ys, xs = self.origin[:, 0] + top, self.origin[:, 1] + left
        if self.origin.shape[0] > Hq * Wq:
            per_position = views.reshape(Bt, Hq * Wq, *views.shape[3:])
            g = per_position.index_select(1, ys * Wq + xs)
        else:
            g = views[:, ys, xs]                                   # (Bt, S, C, ph, pw)
        return list(g.split(sizes))

    def window_table(self, tensors) -> "WindowTable | None":
        """The windows at every grid position that some row's corner reaches, of `tensors`
        stacked as `gather_many` stacks them, copied out once (Bt, positions, C, ph, pw):
        what `gather_many(table=)` picks from for any subset of these rows. None where rows
        do not outnumber positions (`gather_many` then indexes the view directly, no copy)."""
        ph, pw = self.window
        _, _, top, bottom, left, right = self._margins()
        H, W = self.node_shape[1:]
        Hq, Wq = H + top + bottom - ph + 1, W + left + right - pw + 1
        if self.origin.shape[0] <= Hq * Wq:
            return None
        t, sizes = self._stacked(tensors)
        if top or bottom or left or right:
            t = F.pad(t, (left, right, top, bottom))
        views = t.unfold(2, ph, 1).unfold(3, pw, 1).permute(0, 2, 3, 1, 4, 5)
        return WindowTable(views.reshape(views.shape[0], Hq * Wq, *views.shape[3:]),
                           sizes, top, left, Wq)

    def _stacked(self, tensors):
        """The tensors as one (Bt, C, H, W) stack (and each one's share of Bt)."""
        C, H, W = self.node_shape
        parts = []
        for t in tensors:
            t = torch.as_tensor(t, dtype=self.dtype, device=self.device)
            t = t.reshape((1,) * max(0, 5 - t.dim()) + tuple(t.shape))
            if t.dim() != 5 or t.shape[1] != 1:
                raise ValueError(f"cannot gather a tensor of shape {tuple(t.shape)} at patches")
            parts.append(t.expand(t.shape[0], 1, C, H, W)[:, 0])
        sizes = [p.shape[0] for p in parts]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), sizes

    def to_dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows as a dense (B, S, C, H, W) tensor (zeros outside the windows); under
        autograd through `_DenseRows` (the gradient is the dense gradient at the windows).
        `out` (not under autograd): written there instead of a new tensor."""
        if _differentiable(self.values):
            return _DenseRows.apply(self.values, self)
        return self._to_dense(out)

    def window_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of `to_dense` w.r.t. the values: `grad` (B, S, C, H, W) at each row's
        window, zeros outside the grid (copies only: every window entry is one grid entry
        of its own row)."""
        ph, pw = self.window
        _, _, top, bottom, left, right = self._margins()
        if top or bottom or left or right:
            grad = F.pad(grad, (left, right, top, bottom))
        views = grad.unfold(3, ph, 1).unfold(4, pw, 1)         # (B, S, C, H', W', ph, pw)
        rows = torch.arange(self.origin.shape[0], device=self.origin.device)
        picked = views[:, rows, :, self.origin[:, 0] + top, self.origin[:, 1] + left]
        return picked.transpose(0, 1).contiguous()             # (B, S, C, ph, pw)

    def _to_dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense rows, written into `out` ((B, S, C, H, W), any contents) when given."""
        B, S, C, ph, pw = self.values.shape
        H, W = self.node_shape[1:]
        if B * C <= FEW_CHANNELS:
            return self._to_dense_by_window(out)
        ys, xs = self._coords()
        if out is None:
            out = self.values.new_zeros((B, S, C, H, W))
        else:
            out.zero_()
        keep = self.inside()                                       # (S, ph, pw)
        rows = torch.arange(S, device=self.origin.device)[:, None, None].expand(S, ph, pw)
        ys, xs = ys[:, :, None].expand(S, ph, pw), xs[:, None, :].expand(S, ph, pw)
        # windows lie inside the grid apart from zero entries: write the inside ones only
        out.permute(1, 3, 4, 0, 2)[rows[keep], ys[keep], xs[keep]] = \
            self.values.permute(1, 3, 4, 0, 2)[keep]
        return out

    def _to_dense_by_window(self, dest: torch.Tensor | None = None) -> torch.Tensor:
        """`to_dense` writing each row's window whole into a grid padded by the windows'
        reach, then cropped: one index per row instead of one per window position (5x
        faster on the input's 3 channels, where the per-position indexing dominated). The
        entries outside the grid are zeros, so the crop keeps the same values."""
        B, S, C, ph, pw = self.values.shape
        H, W = self.node_shape[1:]
        _, _, top, bottom, left, right = self._margins()
        out = self.values.new_zeros((B, S, C, H + top + bottom, W + left + right))
        views = out.unfold(3, ph, 1).unfold(4, pw, 1)          # (B, S, C, H', W', ph, pw)
        rows = torch.arange(S, device=self.origin.device)
        views[:, rows, :, self.origin[:, 0] + top, self.origin[:, 1] + left] = \
            self.values.transpose(0, 1)
        if top or bottom or left or right:
            out = out[:, :, :, top:top + H, left:left + W]
        if dest is None:
            return out.contiguous()
        return dest.copy_(out)

    def dense_map(self, fn, chunk_elements: int = DENSE_CHUNK, dense: bool = True
                  ) -> torch.Tensor:
        """cat over row chunks of fn(dense rows (B, s, C, H, W)) along dim 1: a sum over the
        node's elements in the dense rows' order without holding all dense rows at once
        (every kernel's rows are independent, so chunking changes no bit). `dense` False:
        fn gets each chunk's rows as patches (it makes their dense rows where it wants)."""
        S = self.values.shape[1]
        step = max(1, chunk_elements // max(1, math.prod(self.node_shape)))
        make = Patches.to_dense if dense else (lambda p: p)
        if step >= S:
            return fn(make(self))
        parts = [fn(make(Patches(self.values[:, s0:s0 + step], self.origin[s0:s0 + step],
                                 self.node_shape))) for s0 in range(0, S, step)]
        return torch.cat(parts, dim=1)

    def support_dot(self, vec: torch.Tensor, order: str) -> "torch.Tensor | None":
        """(B, S): the ordered ``dot_last`` of the dense rows with `vec` (one per box or one
        for all, (Bv, 1, C, H, W) or anything of C*H*W per box) in the dense rows' bits,
        from the windows' entries at vec's nonzeros alone (`numerics/support_dot.py`: a
        ReLU's intercepts are zero on its stable neurons). None where that does not apply
        (not `blocked`, no pinned BLAS, a block with an unmeasured chain split, a vector
        that is mostly nonzero, non-finite rows, gradients): the caller takes the dense
        rows then."""
        from shardbound.runtime.numerics import support_dot

        B, S, C, ph, pw = self.values.shape
        K = math.prod(self.node_shape)
        if order != "blocked" or not support_dot.works(self.device) or \
                not support_dot.supported(K) or _differentiable(self.values, vec):
            return None
        plans = _SUPPORT_PLANS.get((vec,), lambda: _support_plans(vec, self.node_shape))
        if plans is None or len(plans) not in (1, B) or \
                not math.isfinite(float(self.values.sum())):    # inf * 0 is nan densely
            return None
        out = self.values.new_empty((B, S))
        # A support entry (c, y, x) sits in row s's window at flat (c*ph + y-oy)*pw + x-ox =
        # (c*ph + y)*pw + x - (oy*pw + ox): one subtraction per entry; inside the window
        # where the row's window rows and columns (S, H) / (S, W) masks both hold (1.4x
        # faster than the per-entry comparisons; the same columns)
        H, W = self.node_shape[1:]
        oy, ox = self.origin[:, :1], self.origin[:, 1:]
        ry, rx = (torch.arange(n, device=oy.device)[None] for n in (H, W))
        rows_in, cols_in = (ry >= oy) & (ry < oy + ph), (rx >= ox) & (rx < ox + pw)
        for b in range(B):
            plan, (c, y, x) = plans[b % len(plans)]
            inside = rows_in[:, y] & cols_in[:, x]                                  # (S, n)
            idx = (((c * ph + y) * pw + x)[None] - (oy * pw + ox)).clamp_(0, C * ph * pw - 1)
            cols = torch.gather(self.values[b].reshape(S, C * ph * pw), 1, idx)
            out[b] = plan.dot(cols.masked_fill_(~inside, 0))
        return out

    def channel_sums(self, order: str) -> "torch.Tensor | None":
        """(B, S, C): each channel's sum over the grid (a convolution's bias term), in the
        bits of the ordered sum over the dense rows (``sum_last`` of each channel's plane),
        from the windows alone: every plane sum is a blocked dot with ones, whose FMA
        chains skip the zeros outside the window (`numerics/support_dot.py`), so each chain
        is the GEMM of the window entries that fall in its range of the plane. None where
        that does not apply (not `blocked`, no pinned BLAS, windows longer than one chain,
        an unmeasured chain split, non-finite rows, gradients) or where the dense rows
        are as cheap (large windows)."""
        from shardbound.runtime.numerics import support_dot

        B, S, C, ph, pw = self.values.shape
        H, W = self.node_shape[1:]
        K, n = H * W, ph * pw
        if order != "blocked" or not support_dot.works(self.device):   # (sets the model)
            return None
        L = support_dot.num_chains(K)
        # measured: 4x faster than the dense rows for 3x3 windows on a 16x16 grid, 1.3x for
        # 7x7, slower for 9x9 (two-chain model: each chain copies the window entries once):
        # windows up to K / (2 L) entries (the one-chain model: 11x11 on 16x16; bench cnn
        # blocked CROWN 0.29 -> 0.24 s against the two-chain model's K / (4 blocks))
        if n > min(support_dot.ONE_CHAIN_MAX, K // (2 * L)) \
                or not support_dot.supported(K) or _differentiable(self.values) \
                or not math.isfinite(float(self.values.sum())):     # inf * 0 is nan densely
            return None
        ys, xs = self._coords()
        inside = self.inside().reshape(S, n)
        chain = support_dot.grid_chain((ys[:, :, None] * W + xs[:, None, :]).reshape(S, n), K)
        chain = torch.where(inside, chain, -1)                     # (S, n): -1 outside
        vec = self.values.new_zeros((L, support_dot.MIN_ROWS, n))
        vec[:, 0] = 1
        flat = self.values.reshape(B * S * C, n)
        zero = torch.zeros((), dtype=flat.dtype)

        if L == 1 and not self.dirty:
            # one chain (a one-block plane, one-chain model): the entries outside the grid
            # are zeros in clean rows, and a zero changes no chain, so the rows are the chain
            return support_dot.chain_sums(lambda a, b: flat[a:b].unsqueeze(0), vec,
                                          B * S * C).reshape(B, S, C)

        def chains(a, b):        # rows (b, s, c) flattened; a chunk's entries by chain
            owner = chain.index_select(0, torch.div(torch.arange(a, b, device=chain.device), C,
                                                    rounding_mode="floor") % S)
            rows = flat[a:b]
            return torch.stack([torch.where(owner == lvl, rows, zero) for lvl in range(L)])
        return support_dot.chain_sums(chains, vec, B * S * C).reshape(B, S, C)

    def flat(self) -> torch.Tensor:
        """(B, S, C*ph*pw): the values as rows (for sums over the windows, `fast`)."""
        B, S = self.values.shape[:2]
        return self.values.reshape(B, S, -1)

    # -- arithmetic the engine and the linear ops use -----------------------------------------
    def __mul__(self, c):
        if isinstance(c, (int, float)):
            return self.with_values(self.values * c)
        return NotImplemented

    __rmul__ = __mul__

    def __add__(self, other):
        if isinstance(other, torch.Tensor):
            return self.to_dense() + other
        if not isinstance(other, Patches) or other.node_shape != self.node_shape:
            return NotImplemented
        if self.window == other.window and torch.equal(self.origin, other.origin):
            return self.with_values(self.values + other.values,
                                    dirty=self.dirty or other.dirty)
        shift = other.origin - self.origin
        if shift.shape[0] == 0 or not bool((shift == shift[:1]).all()):
            return self.to_dense() + other.to_dense()   # windows not at one offset per row
        dy, dx = (int(d) for d in shift[0])
        (ph, pw), (qh, qw) = self.window, other.window
        y0, x0 = min(0, dy), min(0, dx)
        h, w = max(ph, dy + qh) - y0, max(pw, dx + qw) - x0
        # one padded tensor, `other` added into its part of it (not both padded then summed:
        # two fewer temporaries of the grown window). Bits are the padded sum's: outside
        # other's part the sum is a + 0, which turns a -0 into +0, so those strips get + 0.
        total = F.pad(self.values, (-x0, w - pw + x0, -y0, h - ph + y0))
        if _differentiable(self.values, other.values):
            total = total + F.pad(other.values, (dx - x0, w - qw - dx + x0,
                                                 dy - y0, h - qh - dy + y0))
        else:
            r0, c0 = dy - y0, dx - x0
            total[..., r0:r0 + qh, c0:c0 + qw] += other.values
            for strip in (total[..., :r0, :], total[..., r0 + qh:, :],
                          total[..., r0:r0 + qh, :c0], total[..., r0:r0 + qh, c0 + qw:]):
                if strip.numel():
                    strip += 0.0
        out = Patches(total, self.origin + torch.tensor([y0, x0], device=self.origin.device),
                      self.node_shape, self.dirty or other.dirty)
        return out.to_dense() if out.covers_grid() else out

    def __radd__(self, other):
        if isinstance(other, torch.Tensor):
            return other + self.to_dense()
        return NotImplemented


class _DenseRows(torch.autograd.Function):
    """`Patches.to_dense` of differentiated values: the forward is the undifferentiated
    scatter, the gradient `Patches.window_gradient` (autograd of the window-by-window write
    into an unfolded view went through the view's full (B, S, C, H', W', ph, pw) size: 49x
    the dense rows for 7x7 windows)."""

    @staticmethod
    def forward(ctx, values, patches):
        ctx.patches = frame(patches.origin, patches.window, patches.node_shape, values.dtype,
                            values.device)          # the geometry, not the values
        return patches.with_values(values)._to_dense()

    @staticmethod
    def backward(ctx, grad):
        return ctx.patches.window_gradient(grad), None


class WindowAlpha:
    """Relaxation parameters of rows in patches form laid out as the rows' values are,
    (B, S, C, ph, pw) at each row's window (full alpha-CROWN's per-start-node alphas in
    single mode: runtime/engine/full_alpha.py). A dense layout (B, S, C, H, W) would force the
    rows dense at the op, and a parameter outside a row's window changes nothing (the row
    is zero there). The engine wraps the tensor so that the op knows its layout."""

    def __init__(self, values: torch.Tensor):
        self.values = values


class SparseAlpha:
    """Relaxation parameters of some input neurons only: `values` (B, S, k) of the flat input
    indices `index` (k,) (full alpha-CROWN: the neurons inexact in some box; a parameter of a
    neuron whose relaxation is exact changes nothing). Only for ops whose alpha moves nothing
    but the lower line's slope (`alpha_slope_only`)."""

    def __init__(self, values: torch.Tensor, index: torch.Tensor):
        self.values, self.index = values, index


def frame(origin: torch.Tensor, window, node_shape, dtype=torch.float32, device=None
          ) -> "Patches":
    """Patches with these rows' windows and no values (zero boxes): what `gather` needs to
    lay a tensor over the node out at the windows."""
    ph, pw = window
    values = torch.empty((0, origin.shape[0], node_shape[0], ph, pw), dtype=dtype,
                         device=device)
    return Patches(values, origin, node_shape)


class WindowTable:
    """`Patches.window_table`'s result: windows per grid position, and how to index them."""

    def __init__(self, windows, sizes, top, left, width):
        self.windows, self.sizes = windows, sizes
        self.top, self.left, self.width = top, left, width


def _differentiable(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def as_patches(node_shape, lA, uA, local: list):
    """Dense rows at a (C, H, W) node as patches where every row is local to a window
    (`Patches.from_dense`, both sides on the same windows), else as they are and `local[0]`
    False for the rest of the pass (windows only grow towards the input): carvana's
    per-pixel Softmax rows crossed its convolutions dense (`Network._propagate`)."""
    if isinstance(lA, Patches) or isinstance(uA, Patches) or not isinstance(
            lA, torch.Tensor) or lA.requires_grad or lA.dim() != 5 or (
            isinstance(uA, torch.Tensor) and uA.requires_grad):
        return lA, uA
    P = Patches.from_dense(lA, node_shape, also=None if (uA is None or uA is lA) else uA)
    if P is None:
        local[0] = False
        return lA, uA
    if uA is lA or uA is None:
        return P, (P if uA is lA else None)
    return P, P.with_values(Patches.windows_of(uA, P.origin, P.window))


def dense(A):
    """A as a dense tensor (patches turned dense; anything else as it is)."""
    return A.to_dense() if isinstance(A, Patches) else A


def numel(A) -> int:
    return math.prod(A.shape)
