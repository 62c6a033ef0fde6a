"""The conv family: `conv2d`, 2-D convolution over (C, H, W) per sample, grouped or not (Conv;
AveragePool and GlobalAveragePool are lowered to a depthwise conv2d, see
compiler/lowering/pooling.py). Under `blocked` and `exact` the contraction runs as im2col +
ordered matmul so that it follows the program's summation order."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops.base import Op, center_radius, per_feature, register_op
from shardbound.runtime.ops.patches import Patches


CHANNELS_LAST_MIN = 32     # channels from which the fast dense conv backward goes channels-last
IM2COL_CHUNK = 1 << 20      # elements of a blocked/exact conv backward's im2col columns at a time


@register_op
class Conv2d(Op):
    """2-D convolution (NCHW per sample: (C, H, W)); pads are (top, left, bottom, right)."""

    kind = "conv2d"
    param_roles = ("weight", "bias")
    tp_roles = ("column", "row")
    alpha_saves_weight = True       # measured: the im2col kernel keeps its weight matrix

    # -- what passes ask ------------------------------------------------------------------
    @classmethod
    def tp_channels(cls, facts, role):
        if facts.attrs.get("groups", 1) != 1:
            return None
        if role == "column" and len(facts.shape) == 3:
            return facts.shape[0]
        if role == "row" and len(facts.in_shapes[0]) == 3:
            return facts.param_shape("weight")[1]
        return None

    @classmethod
    def summation_note(cls, facts, sums):
        w = facts.param_shape("weight")
        groups = facts.attrs.get("groups", 1)
        how = "conv library" if sums.order == "fast" else f"im2col, {groups} group(s)"
        return f"fwd {how} over {sums(w[1] * w[2] * w[3])}; bwd over {sums(w[0] // groups)}"

    @classmethod
    def absorb_affine_after(cls, facts, weight, bias, scale, shift):
        sv, tv = per_feature(scale, 0), per_feature(shift, 0)
        if sv is None or tv is None:
            return None
        b = np.zeros_like(sv) if bias is None else bias
        return weight * sv[:, None, None, None], b * sv + tv

    @classmethod
    def absorb_affine_before(cls, facts, weight, bias, scale, shift):
        """Input normalisation into the conv: per input channel, and a shift only without
        zero padding (padding happens after the affine)."""
        sv, tv = per_feature(scale, 0), per_feature(shift, 0)
        if sv is None or tv is None or facts.attrs.get("groups", 1) != 1:
            return None
        if any(facts.attrs.get("pads", (0, 0, 0, 0))) and np.any(tv != 0):
            return None
        b_new = (0 if bias is None else bias) + np.einsum("ochw,c->o", weight, tv)
        return weight * sv[None, :, None, None], np.broadcast_to(b_new, (weight.shape[0],))

    # -- kernels ------------------------------------------------------------------------------

    def setup(self, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), groups=1):
        self.strides = tuple(strides)
        self.pads = tuple(pads)
        self.dilations = tuple(dilations)
        self.groups = int(groups)

    def _conv(self, x, w, with_bias=True):
        pt, pl, pb, pr = self.pads
        b = self.param("bias") if with_bias else None
        if self.order != "fast":
            return self._conv_im2col(F.pad(x, (pl, pr, pt, pb)), w, b)
        if (pt, pl) == (pb, pr):
            padding = (pt, pl)
        else:
            x = F.pad(x, (pl, pr, pt, pb))
            padding = (0, 0)
        return F.conv2d(x, w, b, self.strides, padding, self.dilations, self.groups)

    def _group_matmul(self, cols, w2, in_per_group: int):
        """cols (N, L, G*in_per_group) @ per-group weights w2 (Cout, in_per_group) -> (N, L, Cout),
        every product through the contraction kernels (fixed summation order)."""
        G = self.groups
        out_per_group = w2.shape[0] // G
        parts = [contract.matmul(cols[..., g * in_per_group:(g + 1) * in_per_group].contiguous(),
                                 w2[g * out_per_group:(g + 1) * out_per_group].contiguous(),
                                 self.order) for g in range(G)]
        return parts[0] if G == 1 else torch.cat(parts, dim=-1)

    def _conv_im2col(self, x_padded, w, b):
        """Convolution as unfold + matmul: the contraction over C_in*kh*kw then follows the
        program's summation order instead of the convolution library's."""
        Cout = w.shape[0]
        kh, kw = w.shape[2:]
        Ho, Wo = self._out_hw(x_padded, w)
        cols = F.unfold(x_padded, (kh, kw), dilation=self.dilations, stride=self.strides)
        cols = cols.transpose(1, 2).contiguous()                        # (B, L, C*kh*kw)
        y = self._group_matmul(cols, w.reshape(Cout, w.shape[1] * kh * kw), w.shape[1] * kh * kw)
        y = y.transpose(1, 2).reshape(x_padded.shape[0], Cout, Ho, Wo)
        return y + b.reshape(1, b.numel(), 1, 1) if b is not None else y.contiguous()

    def _out_hw(self, x_padded, w):
        kh, kw = w.shape[2:]
        (sh, sw), (dh, dw) = self.strides, self.dilations
        H, W = x_padded.shape[2:]
        return (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1

    def forward(self, x):
        return self._conv(x, self.param("weight"))

    def ibp(self, b):
        c, r = center_radius(*b)
        yc = self._conv(c, self.param("weight"))
        yr = self._conv(r, self.param("weight").abs(), with_bias=False)
        return yc - yr, yc + yr

    @property
    def accepts_patches(self) -> bool:
        """The kernel's own backward step takes patches (tp's zone convolutions, whose
        contractions are reduced across ranks, take dense rows)."""
        return (type(self).backward_linear is Conv2d.backward_linear
                and type(self)._cout_product is Conv2d._cout_product)

    def backward_linear(self, A):
        if isinstance(A, Patches):
            return self._backward_patches(A)
        B, S = self._rows(A)
        w = self.param("weight")
        C_in, H, W = self.in_shapes[0]
        pt, pl, pb, pr = self.pads
        Hp, Wp = H + pt + pb, W + pl + pr
        Ho, Wo = self.shape[1:]
        kh, kw = w.shape[2:]
        (sh, sw), (dh, dw) = self.strides, self.dilations
        flat = A.reshape(B * S, *self.shape)
        if self.order == "fast" and self._transposed_conv_ok:
            out_pad = (Hp - ((Ho - 1) * sh + dh * (kh - 1) + 1),
                       Wp - ((Wo - 1) * sw + dw * (kw - 1) + 1))
            # Wide layers (>= CHANNELS_LAST_MIN channels both sides) go through the conv
            # library's channels-last kernel (measured 1.2-2x faster on the bench CNN's
            # 64 -> 32 step, slower on narrow ones); symmetric pads are the library's own
            # padding argument (no crop copy).
            if min(self.shape[0], C_in) >= CHANNELS_LAST_MIN:
                flat = flat.contiguous(memory_format=torch.channels_last)
            symmetric = (pt, pl) == (pb, pr)
            A_in = F.conv_transpose2d(flat, w, None, self.strides, (pt, pl) if symmetric else 0,
                                      out_pad, self.groups, self.dilations)
            if not symmetric:
                A_in = A_in[:, :, pt:pt + H, pl:pl + W]
            A_in = A_in.contiguous().reshape(B, S, C_in, H, W)
        else:           # scattered straight into the unpadded input (padding dropped)
            A_in = self._ordered_transpose(flat, w, (H, W), (pt, pl)).contiguous().reshape(
                B, S, C_in, H, W)
        b = self.param("bias")
        bias = None
        if b is not None:
            per_channel = contract.sum_last(A.reshape(B, S, self.shape[0], Ho * Wo), self.order)
            bias = self._channel_dot(per_channel, b)
        return [A_in], bias

    # Hooks for tp's column conv, whose contractions over output channels are Partial.
    _transposed_conv_ok = True      # the fast backward may use conv_transpose2d

    def _cout_product(self, A_cols, w_t):
        """A_cols (N, L, Cout) @ w_t.T: the backward contraction over output channels."""
        return contract.matmul(A_cols, w_t, self.order)

    def _channel_dot(self, per_channel, b):
        """The bias term: per-channel sums of A against the bias, over output channels."""
        return contract.dot_last(per_channel, b, self.order)


    def _ordered_transpose(self, A_flat, w, out_hw, offset=(0, 0)):
        """`_backward_im2col`, under autograd through `_OrderedTransposedConv` (its gradient
        in closed form) where this kernel's own product runs (tp's column conv, whose
        products are reduced across ranks, keeps autograd's)."""
        if (torch.is_grad_enabled() and A_flat.requires_grad
                and type(self)._cout_product is Conv2d._cout_product):
            return _OrderedTransposedConv.apply(A_flat, w, self, tuple(out_hw), tuple(offset))
        return self._backward_im2col(A_flat, w, out_hw, offset)

    def _im2col_gradient(self, grad, w, A_shape, out_hw, offset):
        """The gradient of `_backward_im2col` w.r.t. its A (N, Cout, Ho, Wo) from `grad`
        (N, C_in, *out_hw): each kernel tap's columns gathered from the grid (the adjoint of
        the scatter-add: copies, no sums), channel-major as autograd of the differentiated
        layout had them, then contracted over C_in*kh*kw with the weight in the program's
        order: the kernel call autograd's `_OrderedMatmul` backward made, on the same
        values (autograd's tap-by-tap slice gradients only added zeros), so the same bits,
        without autograd's full-size zero tensor and add per tap."""
        N, Cout, Ho, Wo = A_shape
        kh, kw = w.shape[2:]
        G, C_in = self.groups, w.shape[1] * self.groups
        cin_g, out_per_group = w.shape[1], Cout // G
        L = Ho * Wo
        grad = grad.contiguous()
        out = grad.new_empty((N, L, Cout))
        step = max(1, IM2COL_CHUNK // max(1, L * self._contracted_channels(C_in) * kh * kw))
        weights = self._group_weights_cm(w)
        for n0 in range(0, N, step):
            g = grad[n0:n0 + step]
            cols = g.new_zeros((g.shape[0], Ho, Wo, C_in, kh, kw))
            for i, j, src, dst in self._taps(kh, kw, Ho, Wo, out_hw, offset):
                cols[(slice(None), *src, slice(None), i, j)] = \
                    g[(slice(None), slice(None), *dst)].permute(0, 2, 3, 1)
            cols = cols.reshape(g.shape[0], L, C_in * kh * kw)
            for gi, wg in enumerate(weights):
                part = cols[..., gi * cin_g * kh * kw:(gi + 1) * cin_g * kh * kw].contiguous()
                out[n0:n0 + step, :, gi * out_per_group:(gi + 1) * out_per_group] = \
                    self._cin_product(part, wg, kh * kw)
        return out.transpose(1, 2).reshape(N, Cout, Ho, Wo)

    # Hooks for tp's row conv, whose gradient contraction over input channels is Partial.
    def _contracted_channels(self, C_in: int) -> int:
        """The input channels the gradient's contraction spans (its chunks of rows follow
        them: tp's row conv, holding a slice, chunks as the whole layer so that every rank
        joins the same reductions)."""
        return C_in

    def _cin_product(self, cols, w_rows, taps: int):
        """cols (N, L, C_in*taps) @ w_rows.T, channel-major: the gradient's contraction over
        input channels and kernel taps."""
        return contract.matmul(cols, w_rows, self.order)

    def _group_weights_cm(self, w):
        """Per group, its weights (out_per_group, cin_g*kh*kw) channel-major, contiguous: the
        operand of `_im2col_gradient`'s product (the transpose of `_group_weights_t`'s
        channel-major one), made once per program for a resident weight."""
        def rows():
            G = self.groups
            out_per_group = w.shape[0] // G
            per_row = math.prod(w.shape[1:])        # explicit: a tp rank may hold none
            return [w[g * out_per_group:(g + 1) * out_per_group].reshape(
                        out_per_group, per_row).contiguous() for g in range(G)]
        if not isinstance(self.params.get("weight"), torch.Tensor):
            return rows()
        return self.memo("_weights_rows_memo").get((w,), rows)

    def _backward_im2col(self, A_flat, w, out_hw, offset=(0, 0)):
        """The transpose of _conv_im2col: A (N, Cout, Ho, Wo) -> (N, C_in, *out_hw), the
        padded input grid shifted by `offset` (the pads: the unpadded input); the contraction
        over Cout goes through the kernels, then the scatter-add of the kernel taps
        (`_scatter_taps`)."""
        N, Cout, Ho, Wo = A_flat.shape
        kh, kw = w.shape[2:]
        G = self.groups
        L = A_flat.shape[2] * A_flat.shape[3]
        # cols holds C_in*kh*kw values per position (9x the input for a 3x3 kernel): in
        # chunks of rows it stays small (the ResNet's blocked peak was one 190 MB cols).
        # Rows are independent under every order, so the bits are those of one call; tp's
        # column conv (whose products are reduced across ranks) keeps one call.
        step = max(1, IM2COL_CHUNK // max(1, L * w.shape[1] * G * kh * kw))
        if step < N and type(self)._cout_product is Conv2d._cout_product:
            out = A_flat.new_empty((N, w.shape[1] * G, *out_hw))
            for n0 in range(0, N, step):
                out[n0:n0 + step] = self._backward_im2col(A_flat[n0:n0 + step], w, out_hw,
                                                          offset)
            return out
        A_cols = A_flat.reshape(N, Cout, L).transpose(1, 2).contiguous()    # (N, L, Cout)
        out_per_group = Cout // G
        # Taps-major columns where nothing is differentiated: a product's column changes
        # none of its bits, but a gradient contracts over the columns, and alpha-CROWN's
        # (single mode's and tp's row conv, split on channels) is over channel-major ones.
        taps_major = not (torch.is_grad_enabled() and A_flat.requires_grad)
        parts = []
        for g, wg_t in enumerate(self._group_weights_t(w, taps_major)):
            parts.append(self._cout_product(
                A_cols[..., g * out_per_group:(g + 1) * out_per_group].contiguous(),
                wg_t))                                  # (N, L, kh*kw*cin_g) or (cin_g*kh*kw)
        cols = parts[0] if G == 1 else torch.cat(parts, dim=-1)
        if not taps_major:
            return self._scatter_taps_channel_major(cols.reshape(N, Ho, Wo, -1, kh, kw),
                                                    out_hw, offset)
        return self._scatter_taps(cols.reshape(N, Ho, Wo, G, kh, kw, -1), out_hw, offset)

    def _scatter_taps_channel_major(self, cols, out_hw, offset=(0, 0)):
        """`_scatter_taps` of cols (N, Ho, Wo, C_in, kh, kw) (the differentiated layout)
        into (N, C_in, *out_hw): the same adds in the same order."""
        N, Ho, Wo, C_in, kh, kw = cols.shape
        out = cols.new_zeros((N, C_in, *out_hw))
        for i, j, src, dst in self._taps(kh, kw, Ho, Wo, out_hw, offset):
            out[(slice(None), slice(None), *dst)] += cols[(slice(None), *src, slice(None), i,
                                                           j)].permute(0, 3, 1, 2)
        return out

    def _taps(self, kh, kw, Ho, Wo, out_hw, offset):
        """(i, j, source (rows, cols) slices of the output grid, destination (rows, cols)
        slices of the input grid) per kernel tap that lands inside `out_hw` from `offset`
        on, in col2im's order ((i, j) row-major): what both tap scatters add."""
        (sh, sw), (dh, dw) = self.strides, self.dilations
        for i in range(kh):
            ys = tap_range(i * dh - offset[0], sh, Ho, out_hw[0])
            for j in range(kw):
                xs = tap_range(j * dw - offset[1], sw, Wo, out_hw[1])
                if ys is None or xs is None:
                    continue
                (y0, ny, t0), (x0, nx, u0) = ys, xs
                rows = slice(t0, t0 + sh * (ny - 1) + 1, sh)
                cols = slice(u0, u0 + sw * (nx - 1) + 1, sw)
                yield i, j, (slice(y0, y0 + ny), slice(x0, x0 + nx)), (rows, cols)

    def _scatter_taps(self, cols, out_hw, offset=(0, 0)):
        """F.fold of cols (N, Ho, Wo, G, kh, kw, cin_g) into the padded grid, kept only on
        (N, C_in, *out_hw) from `offset` on: one strided add per kernel tap, taps in col2im's
        order ((i, j) row-major), so every pixel adds the same terms in the same order from
        the same zero (the bits of F.fold and a crop, without its per-element loop). The
        adds run channels-last (each position's channels contiguous on both sides: the
        per-tap reads were strided by the taps before, 3-4x slower) and the result is that
        grid viewed as (N, C_in, H, W); the layout changes no sum."""
        N, Ho, Wo, G, kh, kw, cin_g = cols.shape
        out = cols.new_zeros((N, *out_hw, G * cin_g))
        grid = out.view(N, *out_hw, G, cin_g)
        for i, j, src, dst in self._taps(kh, kw, Ho, Wo, out_hw, offset):
            grid[(slice(None), *dst)] += cols[(slice(None), *src, slice(None), i, j)]
        return out.permute(0, 3, 1, 2)

    def _group_weights_t(self, w, taps_major=True):
        """Per group, its weights transposed, (kh*kw*cin_g, out_per_group) taps outer and
        channels inner (the order `_scatter_taps` reads; which column a product lands in
        changes none of its bits) or (cin_g*kh*kw, out_per_group) (`taps_major` False: the
        order gradients contract over), contiguous: the backward product's operands, made
        once per program for a resident weight (an fsdp shard is gathered per use, so it is
        transposed per use)."""
        def transposed():
            G, kh, kw = self.groups, *w.shape[2:]
            out_per_group = w.shape[0] // G
            order = (2, 3, 1, 0) if taps_major else (1, 2, 3, 0)
            return [w[g * out_per_group:(g + 1) * out_per_group].permute(*order).reshape(
                        w.shape[1] * kh * kw, out_per_group)  # explicit: a tp rank may hold none
                    .contiguous() for g in range(G)]
        if not isinstance(self.params.get("weight"), torch.Tensor):
            return transposed()
        return self.memo("_weights_t_memo" if taps_major else "_weights_cm_memo").get(
            (w,), transposed)

    def _backward_patches(self, A: Patches):
        """The backward step on rows in patches form: the transposed convolution of each
        window (the same per-position products and scatter-add as the dense rows), whose
        corner moves to the input grid; the bias term sums each channel over the window
        (`fast`) or over the dense rows (ordered summations: the dense bits)."""
        if A.dirty:                 # its outside entries would spread into the grid
            A = A.masked(in_place=True)
        B, S = self._rows(A)
        w = self.param("weight")
        C_in = self.in_shapes[0][0]
        Cout, kh, kw = w.shape[0], *w.shape[2:]
        (sh, sw), (dh, dw) = self.strides, self.dilations
        ph, pw = A.window
        size = ((ph - 1) * sh + dh * (kh - 1) + 1, (pw - 1) * sw + dw * (kw - 1) + 1)
        flat = A.values.reshape(B * S, Cout, ph, pw)
        if self.order == "fast":
            out = F.conv_transpose2d(flat, w, None, self.strides, 0, 0, self.groups,
                                     self.dilations)
        else:
            out = self._ordered_transpose(flat.contiguous(), w, size).contiguous()
        origin = A.origin * torch.tensor([sh, sw], device=A.origin.device) \
            - torch.tensor(self.pads[:2], device=A.origin.device)
        # What the scatter put outside the grid stays (dirty): an elementwise step or the box
        # terms meet zeros there (their lines / the box are gathered as zeros), and a conv
        # step masks it first (above).
        A_in = Patches(out.reshape(B, S, C_in, *size), origin, self.in_shapes[0], dirty=True)
        if A_in.covers_grid():
            A_in = A_in.to_dense()
        b = self.param("bias")
        bias = None
        if b is not None:
            if self.order == "fast":
                per_channel = A.values.sum(dim=(-2, -1))
            else:
                Ho, Wo = self.shape[1:]
                per_channel = A.channel_sums(self.order)
                if per_channel is None:
                    per_channel = A.dense_map(lambda rows: contract.sum_last(
                        rows.reshape(B, rows.shape[1], Cout, Ho * Wo), self.order))
            bias = self._channel_dot(per_channel, b)
        return [A_in], bias

    def unit_backward(self, index, patches=False):
        """The unit rows e_index through the transposed convolution, in closed form: each row
        is its output channel's kernel placed at the row's receptive field (the padding
        cropped), exactly what backward_linear gives for it, without the transposed
        convolution; the bias term is the channel's bias. With `patches`, the rows come as
        their receptive fields (patches.py)."""
        if not self.accepts_patches:
            return None
        w = self.param("weight")
        Cout, cin_g, kh, kw = w.shape
        C_in, H, W = self.in_shapes[0]
        Ho, Wo = self.shape[1:]
        pt, pl, pb, pr = self.pads
        (sh, sw), (dh, dw) = self.strides, self.dilations
        k, dev = len(index), w.device
        o, y, x = index // (Ho * Wo), (index // Wo) % Ho, index % Wo
        group = o // (Cout // self.groups)
        b = self.param("bias")
        bias = None if b is None else b.index_select(0, o).unsqueeze(0)
        rows = torch.arange(k, device=dev).reshape(k, 1, 1, 1)
        chans = ((group * cin_g).reshape(k, 1, 1, 1)
                 + torch.arange(cin_g, device=dev).reshape(1, -1, 1, 1))
        taps_y = dh * torch.arange(kh, device=dev).reshape(1, 1, -1, 1)
        taps_x = dw * torch.arange(kw, device=dev).reshape(1, 1, 1, -1)
        if patches:                     # the window: the kernel's (dilated) footprint
            window = torch.zeros((k, C_in, dh * (kh - 1) + 1, dw * (kw - 1) + 1),
                                 dtype=w.dtype, device=dev)
            window[rows, chans, taps_y, taps_x] = w.index_select(0, o)
            origin = torch.stack([y * sh - pt, x * sw - pl], dim=1)
            A = Patches(window.unsqueeze(0), origin, self.in_shapes[0]).masked(in_place=True)
            return [A.to_dense() if A.covers_grid() else A], bias
        A = w.new_zeros((k, C_in, H + pt + pb, W + pl + pr))
        ys = (y * sh).reshape(k, 1, 1, 1) + taps_y
        xs = (x * sw).reshape(k, 1, 1, 1) + taps_x
        A[rows, chans, ys, xs] = w.index_select(0, o)
        A = A[:, :, pt:pt + H, pl:pl + W].contiguous()
        return [A.reshape(1, k, C_in, H, W)], bias


class _OrderedTransposedConv(torch.autograd.Function):
    """`Conv2d._backward_im2col` of a differentiated A (full alpha-CROWN's conv passes under
    the ordered summations): the forward is the undifferentiated kernel (taps-major
    columns, the same bits: a product's column changes none of them), the gradient
    `Conv2d._im2col_gradient` (the weight needs none)."""

    @staticmethod
    def forward(ctx, A_flat, w, conv, out_hw, offset):
        ctx.save_for_backward(w)
        ctx.conv, ctx.A_shape, ctx.out_hw, ctx.offset = conv, A_flat.shape, out_hw, offset
        return conv._backward_im2col(A_flat, w, out_hw, offset)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return (ctx.conv._im2col_gradient(grad, w, ctx.A_shape, ctx.out_hw, ctx.offset),
                None, None, None, None)


def tap_range(shift: int, stride: int, n: int, size: int):
    """Output positions y in [0, n) whose tap lands at t = y * stride + shift in [0, size):
    (first y, count, first t), or None when none does."""
    first = max(0, -(shift // stride) if shift < 0 else 0)
    while first * stride + shift < 0:
        first += 1
    last = min(n - 1, (size - 1 - shift) // stride) if size - 1 - shift >= 0 else -1
    if last < first:
        return None
    return first, last - first + 1, first * stride + shift


@register_op
class ConvTranspose2d(Op):
    """2-D transposed convolution (ConvTranspose), weight (C_in, C_out / groups, kh, kw).

    It is the adjoint of the convolution that maps its output shape back to its input shape
    with the same weight, strides, pads, dilations and groups (output_padding only adds
    output rows and columns that no input reaches): the forward pass is that convolution's
    CROWN step (im2col products over input channels + F.fold of the patches under
    blocked/exact, conv_transpose2d under fast), and the CROWN step is that convolution's
    forward pass (im2col + ordered matmul). Both follow the summation order as Conv2d's do."""

    kind = "conv_transpose2d"
    param_roles = ("weight", "bias")

    def setup(self, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), groups=1,
              output_padding=(0, 0)):
        self.strides = tuple(int(s) for s in strides)
        self.pads = tuple(int(p) for p in pads)
        self.dilations = tuple(int(d) for d in dilations)
        self.groups = int(groups)
        self.output_padding = tuple(int(p) for p in output_padding)

    @classmethod
    def summation_note(cls, facts, sums):
        w = facts.param_shape("weight")
        groups = facts.attrs.get("groups", 1)
        text = (f"fwd over {sums(w[0] // groups)} (+ overlapping patches added by fold); "
                f"bwd im2col over {sums(w[1] * w[2] * w[3])}")
        if "bias" in facts.has_params:
            text += f"; bias A.b over {sums(w[1] * groups)}"
        return text

    @classmethod
    def absorb_affine_after(cls, facts, weight, bias, scale, shift):
        sv, tv = per_feature(scale, 0), per_feature(shift, 0)
        if sv is None or tv is None:
            return None
        G = facts.attrs.get("groups", 1)
        cin, cout_g = weight.shape[:2]
        w = weight.reshape(G, cin // G, cout_g, *weight.shape[2:]) * \
            sv.reshape(G, 1, cout_g, 1, 1)
        b = np.zeros_like(sv) if bias is None else bias
        return w.reshape(weight.shape), b * sv + tv

    def infer_shape(self):
        cin, H, W = self.in_shapes[0]
        w = self.params["weight"]
        kh, kw = w.shape[2:]
        (sh, sw), (dh, dw) = self.strides, self.dilations
        pt, pl, pb, pr = self.pads
        Ho = (H - 1) * sh + dh * (kh - 1) + 1 + self.output_padding[0] - pt - pb
        Wo = (W - 1) * sw + dw * (kw - 1) + 1 + self.output_padding[1] - pl - pr
        return (w.shape[1] * self.groups, Ho, Wo)

    def _adjoint(self, weight) -> Conv2d:
        """The convolution from this node's output shape to its input shape."""
        return Conv2d(self.name, self.inputs, [self.shape], shape=self.in_shapes[0],
                      params={"weight": weight}, order=self.order, strides=self.strides,
                      pads=self.pads, dilations=self.dilations, groups=self.groups)

    def _transposed(self, x, weight, with_bias=True):
        (y,), _ = self._adjoint(weight).backward_linear(x.unsqueeze(1))
        y = y[:, 0]
        b = self.param("bias") if with_bias else None
        return y + b.reshape(1, b.shape[0], 1, 1) if b is not None else y

    def forward(self, x):
        return self._transposed(x, self.param("weight"))

    def ibp(self, b):
        c, r = center_radius(*b)
        w = self.param("weight")
        yc = self._transposed(c, w)
        yr = self._transposed(r, w.abs(), with_bias=False)
        return yc - yr, yc + yr

    def backward_linear(self, A):
        B, S = self._rows(A)
        adjoint = self._adjoint(self.param("weight"))
        C_in, H, W = self.in_shapes[0]
        A_in = adjoint._conv(A.reshape(B * S, *self.shape), adjoint.param("weight"),
                             with_bias=False)[:, :, :H, :W]
        A_in = A_in.contiguous().reshape(B, S, C_in, H, W)
        b = self.param("bias")
        bias = None
        if b is not None:
            Cout, Ho, Wo = self.shape
            per_channel = contract.sum_last(A.reshape(B, S, Cout, Ho * Wo), self.order)
            bias = contract.dot_last(per_channel, b, self.order)
        return [A_in], bias
