"""Rigorous steps of the conv family: `conv2d` and `conv_transpose2d`, both as im2col matrix
products and their adjoint (conv_transpose2d, the flipped kernel's correlation or F.fold;
windowed rows: the same columns added tap by tap), so every element is a dot product of a
known number of terms (average pooling lowers to a
depthwise conv2d and is covered here too)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardbound.runtime.ops.conv import Conv2d, ConvTranspose2d, tap_range
from shardbound.runtime.rigorous.core import (TINY, WeightedStep, down, gamma, rigorous_step,
                                              rowdot, up)
from shardbound.runtime.rigorous.window import Win


DIRECT = {"Slow2d", "SlowDilated2d", "SlowTranspose2d", "SlowDilatedTranspose2d"}


def direct_backend(x, w, stride, padding, dilation, transposed, output_padding, groups) -> bool:
    """Whether torch computes this float64 convolution directly: im2col (or col2im) and a
    matrix product, each output a sum of its products (the backends in DIRECT; float64 on
    the CPU has no other). Anything else, or a torch without the query: False (the caller
    takes the F.fold route)."""
    try:
        got = torch._C._select_conv_backend(x, w, None, list(stride), list(padding),
                                            list(dilation), transposed, list(output_padding),
                                            groups, None)
    except (AttributeError, TypeError, RuntimeError):
        return False
    return getattr(got, "name", str(got).split(".")[-1]) in DIRECT


class ConvGeometry:
    """A convolution from a (C, *in_hw) grid with weight (Cout, C / G, kh, kw): `conv` and
    its adjoint `conv_back` (A may have fewer output rows / columns than the windows: the
    missing ones are zero)."""

    def __init__(self, in_hw, kernel_hw, strides, pads, dilations, groups):
        self.in_hw, self.kernel = tuple(in_hw), tuple(kernel_hw)
        self.strides, self.pads, self.dilations = strides, pads, dilations
        self.groups = groups
        pt, pl, pb, pr = pads
        self.padded = (in_hw[0] + pt + pb, in_hw[1] + pl + pr)
        self.blocks = tuple((n - d * (k - 1) - 1) // s + 1 for n, k, s, d in
                            zip(self.padded, self.kernel, strides, dilations))

    def conv(self, x, w):
        """x (N, C, *in_hw) -> (N, Cout, *blocks)."""
        pt, pl, pb, pr = self.pads
        cols = F.unfold(F.pad(x, (pl, pr, pt, pb)), self.kernel, dilation=self.dilations,
                        stride=self.strides).transpose(1, 2)            # (N, L, C*kh*kw)
        Cout = w.shape[0]
        G, k = self.groups, math.prod(w.shape[1:])
        og = Cout // G
        w2 = w.reshape(Cout, k)
        parts = [cols[..., g * k:(g + 1) * k] @ w2[g * og:(g + 1) * og].T for g in range(G)]
        y = torch.cat(parts, -1) if G > 1 else parts[0]                  # (N, L, Cout)
        return y.transpose(1, 2).reshape(x.shape[0], Cout, *self.blocks)

    def conv_back(self, A, w):
        """A (N, Cout, h, w) with h, w <= blocks -> (N, C, *in_hw): the adjoint. Every element
        is the sum of the products A[o] w[o -> c] over the windows and taps that read it, at
        most Cout kh kw of them (`fan_out`), in some order: what the error account charges
        (core.WeightedStep.back: any order), so the adjoint is computed by whichever of
        three routes rearranges less (`adjoint_route`); all three are products and sums
        of the same terms, not fast-convolution transforms (Winograd, FFT), which the
        account would not cover (`direct_backend` checks torch's choice)."""
        Lh, Lw = self.blocks
        if tuple(A.shape[2:]) != (Lh, Lw):
            A = F.pad(A, (0, Lw - A.shape[3], 0, Lh - A.shape[2]))
        route = self.adjoint_route(A, w)
        if route == "flip":
            return self._back_flipped(A, w)
        if route == "transpose":
            return self._back_transposed(A, w)
        return self._back_fold(A, w)

    def adjoint_route(self, A, w) -> str:
        """"flip" (stride 1: the correlation of A with the flipped, channel-swapped kernel;
        im2col of A's Cout channels) where Cout <= C, else "transpose" (conv_transpose2d:
        the im2col product, then col2im of C channels), "fold" (the same as "transpose",
        written out) where torch would not compute either directly. Fixed by the shapes."""
        C = w.shape[1] * self.groups
        if self.strides == (1, 1) and w.shape[0] <= C:
            wf = self._flipped(w)
            ok = direct_backend(A, wf, (1, 1), (0, 0), self.dilations, False, (0, 0),
                                self.groups)
            if ok:
                return "flip"
        ok = direct_backend(A, w, tuple(self.strides), (0, 0), self.dilations, True,
                            self._output_padding(), self.groups)
        return "transpose" if ok else "fold"

    def _flipped(self, w):
        """w (Cout, C / G, kh, kw) as the kernel (C, Cout / G, kh, kw) of the adjoint
        correlation: per group, channels swapped, taps reversed."""
        Cout, cin_g, kh, kw = w.shape
        G = self.groups
        og = Cout // G
        return (w.reshape(G, og, cin_g, kh, kw).transpose(1, 2)
                .reshape(G * cin_g, og, kh, kw).flip(-2, -1))

    def _output_padding(self):
        """conv_transpose2d's extra rows / columns that reach the padded grid's last
        positions (read by no window; less than the stride)."""
        return tuple(P - ((L - 1) * s + d * (k - 1) + 1) for P, L, s, d, k in
                     zip(self.padded, self.blocks, self.strides, self.dilations, self.kernel))

    def _back_flipped(self, A, w):
        (dh, dw), (kh, kw) = self.dilations, self.kernel
        pt, pl, pb, pr = self.pads
        eh, ew = dh * (kh - 1), dw * (kw - 1)
        Ap = F.pad(A, (ew - pl, ew - pr, eh - pt, eh - pb))     # negative: a crop
        return F.conv2d(Ap, self._flipped(w), dilation=self.dilations, groups=self.groups)

    def _back_transposed(self, A, w):
        out = F.conv_transpose2d(A, w, stride=self.strides, dilation=self.dilations,
                                 groups=self.groups, output_padding=self._output_padding())
        pt, pl = self.pads[0], self.pads[1]
        H, W = self.in_hw
        return out[:, :, pt:pt + H, pl:pl + W]

    def _back_fold(self, A, w):
        N, Cout = A.shape[:2]
        G, k = self.groups, math.prod(w.shape[1:])
        og = Cout // G
        A2 = A.reshape(N, Cout, -1).transpose(1, 2)                       # (N, L, Cout)
        w2 = w.reshape(Cout, k)
        parts = [A2[..., g * og:(g + 1) * og] @ w2[g * og:(g + 1) * og] for g in range(G)]
        cols = torch.cat(parts, -1) if G > 1 else parts[0]               # (N, L, C*k)
        out = F.fold(cols.transpose(1, 2), self.padded, self.kernel, dilation=self.dilations,
                     stride=self.strides)
        pt, pl = self.pads[0], self.pads[1]
        H, W = self.in_hw
        return out[:, :, pt:pt + H, pl:pl + W]

    def _span(self, axis, o, n):
        """Input positions (first, count) and the local fold's crop (start) that output
        positions o .. o + n - 1 read along `axis` (0: rows, 1: columns)."""
        s, d, k = self.strides[axis], self.dilations[axis], self.kernel[axis]
        pad, size = self.pads[axis], self.in_hw[axis]
        a = o * s - pad                                  # the first tap, unpadded
        b = (o + n - 1) * s - pad + d * (k - 1)          # the last tap
        first, last = max(a, 0), min(b, size - 1)
        return first, max(last - first + 1, 0), first - a, (n - 1) * s + d * (k - 1) + 1

    def in_window(self, box):
        y0, x0, h, w = box
        fy, ny = self._span(0, y0, h)[:2]
        fx, nx = self._span(1, x0, w)[:2]
        return fy, fx, ny, nx

    def conv_back_window(self, win: Win, w) -> Win:
        """The adjoint of a window of output positions: only its windows' taps, cropped to
        the input grid. The columns are the im2col product (each tap's contraction over
        the output channels), then each tap's column is added where it lands inside the
        crop, channels-last, taps in col2im's order from zero: every element the same sum
        as F.fold's and a crop, bit for bit, without F.fold's per-element loop (42% of
        TinyYOLO's rigorous CROWN) or its positions outside the crop. (Weights' columns in
        tap-major order would make the reads contiguous, but change the product's bits.)"""
        y0, x0, h, wd = win.box
        fy, ny, cy, _ = self._span(0, y0, h)
        fx, nx, cx, _ = self._span(1, x0, wd)
        A = win.t
        N, Cout = A.shape[:2]
        G, k = self.groups, math.prod(w.shape[1:])
        cin_g, (kh, kw) = w.shape[1], self.kernel
        og = Cout // G
        w2 = w.reshape(Cout, k)
        A2 = A.reshape(N, Cout, -1).transpose(1, 2)                       # (N, h*w, Cout)
        if og == 1 and G > 1:       # depthwise (average pooling): one product per column
            cols = (A2.unsqueeze(-1) * w2.reshape(1, 1, G, k))
        else:
            parts = [(A2[..., g * og:(g + 1) * og] @ w2[g * og:(g + 1) * og]) for g in range(G)]
            cols = torch.cat(parts, -1) if G > 1 else parts[0]
        cols = cols.reshape(N, h, wd, G, cin_g, kh, kw)
        out = A.new_zeros((N, ny, nx, G, cin_g))                          # channels-last
        (sh, sw), (dh, dw) = self.strides, self.dilations
        for i in range(kh):
            ys = tap_range(i * dh - cy, sh, h, ny)
            for j in range(kw):
                xs = tap_range(j * dw - cx, sw, wd, nx)
                if ys is None or xs is None:
                    continue
                (a, n_y, t0), (b, n_x, u0) = ys, xs
                out[:, t0:t0 + sh * (n_y - 1) + 1:sh, u0:u0 + sw * (n_x - 1) + 1:sw] += \
                    cols[:, a:a + n_y, b:b + n_x, :, :, i, j]
        return Win(out.reshape(N, ny, nx, G * cin_g).permute(0, 3, 1, 2).contiguous(), fy, fx)


class _ConvStep(WeightedStep):
    def load(self, op):
        super().load(op)
        self.groups = op.groups
        self.kh, self.kw = self.w.shape[2:]

    def bias_full(self):
        return None if self.b is None else self.b.reshape(-1, 1, 1)

    def row_elements(self):
        """The im2col columns: every window's taps over the input channels of a group."""
        return super().row_elements() + (math.prod(self.geom.blocks)
                                          * math.prod(self.w.shape[1:]) * self.groups)


@rigorous_step(Conv2d)
class Conv2dStep(_ConvStep):
    def load(self, op):
        super().load(op)
        self.geom = ConvGeometry(self.in_shapes[0][1:], (self.kh, self.kw), op.strides, op.pads,
                                 op.dilations, op.groups)
        self._wm = None

    # -- windowed rows (window.py) ----------------------------------------------------------
    def in_window(self, box):
        return [self.geom.in_window(box)]

    def window_cols(self, box):
        """The im2col columns of the window: every output position's taps."""
        return box[2] * box[3] * math.prod(self.w.shape[1:]) * self.groups

    def back_window(self, win, in_bounds, mags):
        """`back` for a window of rows: the same coefficients, charges and bias over the
        window's positions (the dense pass's terms outside it are exact zeros)."""
        B, S = win.t.shape[:2]
        C = self.shape[0]
        t = win.t.reshape(B * S, C, *win.t.shape[-2:])
        got = self.geom.conv_back_window(Win(t, win.y0, win.x0), self.w)
        L_in = Win(got.t.reshape(B, S, *got.t.shape[1:]), got.y0, got.x0)
        if self._wm is None or self._wm[0] is not mags[0]:
            wm = up(self.apply([mags[0].squeeze(1)], absolute=True)
                    * (1.0 + gamma(self.fan_in() + 1)))
            self._wm = (mags[0], wm)
        wm = win.crop(self._wm[1])
        flat = win.t.reshape(B, S, -1)
        La = flat.abs()
        n = La.shape[-1]
        charge = up(up(rowdot(La, wm.reshape(B, 1, -1)) * (1.0 + gamma(n + 1)) + n * TINY)
                    * gamma(self.fan_out() + 1))
        bias = None
        if self.b is not None:
            bv = self.b.reshape(-1, 1, 1).expand(C, *win.t.shape[-2:]).reshape(-1)
            bias = down(flat @ bv - (gamma(n + 1) * (La @ bv.abs()) + n * TINY))
        return [(L_in, charge)], bias

    def matmul(self, x, w):
        return self.geom.conv(x, w)

    def adjoint(self, L, w):
        return self.geom.conv_back(L, w)

    def fan_in(self):
        return math.prod(self.w.shape[1:])

    def fan_out(self):
        return (self.w.shape[0] // self.groups) * self.kh * self.kw


@rigorous_step(ConvTranspose2d)
class ConvTranspose2dStep(_ConvStep):
    """The adjoint of the convolution from this node's output grid to its input grid (the
    kernel's own construction): forward = that convolution's `conv_back`, backward = its
    `conv` cropped to the input grid (output_padding rows are reached by no input)."""

    def load(self, op):
        super().load(op)
        self.geom = ConvGeometry(self.shape[1:], (self.kh, self.kw), op.strides, op.pads,
                                 op.dilations, op.groups)

    def matmul(self, x, w):
        return self.geom.conv_back(x, w)

    def adjoint(self, L, w):
        H, W = self.in_shapes[0][1:]
        return self.geom.conv(L, w)[:, :, :H, :W]

    def fan_in(self):
        return (self.w.shape[0] // self.groups) * self.kh * self.kw

    def fan_out(self):
        return math.prod(self.w.shape[1:])
