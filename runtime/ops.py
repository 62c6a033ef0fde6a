"""Bound kernels: one class per IR op kind, each with a concrete forward, IBP and a CROWN step.

Shapes are per sample: a runtime tensor has shape (B, *shape) where B counts boxes. A CROWN
A-matrix flowing into a node has shape (B, S, *node.shape): S rows (spec rows or neurons whose
bounds are being computed). `crown_backward` maps the lower and upper A-matrices of a node to
those of its inputs and returns the bias terms the node adds; linear ops share one code path
for both sides (and compute it once while both sides are still the same tensor).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from shardbound.runtime import contract, streaming

Bounds = tuple[torch.Tensor, torch.Tensor]


class Op:
    """Base class. Subclasses set `kind` and implement forward, ibp and backward_linear (or
    crown_backward for non-linear ops)."""

    kind = "op"
    param_roles: tuple[str, ...] = ()

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

    # -- the three semantics -------------------------------------------------------------
    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def ibp(self, *bounds: Bounds) -> Bounds:
        raise NotImplementedError

    def backward_linear(self, A: torch.Tensor) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """A (B, S, *shape) -> (A for each input, bias (B, S) or None)."""
        raise NotImplementedError

    def crown_backward(self, lA: torch.Tensor, uA: torch.Tensor,
                       in_bounds: Sequence[Bounds | None], alpha=None):
        """Default for linear ops: the same map on both sides (`alpha` is for ReLUs)."""
        l_in, l_bias = self.backward_linear(lA)
        if uA is None:
            return l_in, [None] * len(l_in), l_bias, None
        if uA is lA:
            return l_in, l_in, l_bias, l_bias
        u_in, u_bias = self.backward_linear(uA)
        return l_in, u_in, l_bias, u_bias

    # -- helpers -------------------------------------------------------------------------
    def _dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """sum(a * b, -1) over this node's own elements (bias terms of the backward pass); tp
        zone nodes, which hold a slice of those elements, finish it across ranks."""
        return contract.dot_last(a, b, self.order)

    def _rows(self, A: torch.Tensor) -> tuple[int, int]:
        return A.shape[0], A.shape[1]


def _center_radius(lo: torch.Tensor, hi: torch.Tensor) -> Bounds:
    return (hi + lo) / 2, (hi - lo) / 2


class Input(Op):
    """The network input; bounds are the box itself."""

    kind = "input"

    def infer_shape(self):
        return self.in_shapes[0]

    def forward(self, x):
        return x

    def ibp(self, b):
        return b


class Linear(Op):
    """y = x @ W.T + b over the last axis; W is (N, K), contiguous (transB resolved at compile
    time so every mode multiplies the same layout)."""

    kind = "linear"
    param_roles = ("weight", "bias")

    def _streamed(self):
        """The weight's fsdp shard when products should stream it block by block instead of
        gathering it whole (see runtime/streaming.py); None otherwise."""
        p = self.params.get("weight")
        if self.order != "fast" and getattr(p, "streams", False):
            return p
        return None

    def _with_bias(self, y):
        b = self.param("bias")
        return y + b if b is not None else y

    def forward(self, x):
        stream = self._streamed()
        if stream is not None:
            return self._with_bias(streaming.forward_products(stream, [x], [False], self.order)[0])
        return self._with_bias(contract.matmul(x, self.param("weight"), self.order))

    def ibp(self, b):
        c, r = _center_radius(*b)
        stream = self._streamed()
        if stream is not None:
            yc, yr = streaming.forward_products(stream, [c, r], [False, True], self.order)
        else:
            w = self.param("weight")
            yc = contract.matmul(c, w, self.order)
            yr = contract.matmul(r, w.abs(), self.order)
        yc = self._with_bias(yc)
        return yc - yr, yc + yr

    def _bias_term(self, A):
        """A . b summed down to (B, S)."""
        b = self.param("bias")
        if b is None:
            return None
        bias = self._dot(A, b)
        while bias.dim() > 2:
            bias = contract.sum_last(bias, self.order)
        return bias

    def backward_linear(self, A):
        stream = self._streamed()
        if stream is not None:
            (A_in,) = streaming.backward_products(stream, [A], self.order)
        else:
            # A (..., N) @ W (N, K): contract over N with W.T as the (K, N) operand.
            A_in = contract.matmul(A, self.param("weight").t().contiguous(), self.order)
        return [A_in], self._bias_term(A)

    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        stream = self._streamed()
        if stream is None or uA is None or uA is lA:
            return super().crown_backward(lA, uA, in_bounds, alpha)
        l_in, u_in = streaming.backward_products(stream, [lA, uA], self.order)
        return [l_in], [u_in], self._bias_term(lA), self._bias_term(uA)


class Conv2d(Op):
    """2-D convolution (NCHW per sample: (C, H, W)); pads are (top, left, bottom, right)."""

    kind = "conv2d"
    param_roles = ("weight", "bias")

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
        y = self._group_matmul(cols, w.reshape(Cout, -1), w.shape[1] * kh * kw)
        y = y.transpose(1, 2).reshape(x_padded.shape[0], Cout, Ho, Wo)
        return y + b.reshape(1, -1, 1, 1) if b is not None else y.contiguous()

    def _out_hw(self, x_padded, w):
        kh, kw = w.shape[2:]
        (sh, sw), (dh, dw) = self.strides, self.dilations
        H, W = x_padded.shape[2:]
        return (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1

    def forward(self, x):
        return self._conv(x, self.param("weight"))

    def ibp(self, b):
        c, r = _center_radius(*b)
        yc = self._conv(c, self.param("weight"))
        yr = self._conv(r, self.param("weight").abs(), with_bias=False)
        return yc - yr, yc + yr

    def backward_linear(self, A):
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
            A_pad = F.conv_transpose2d(flat, w, None, self.strides, 0, out_pad, self.groups,
                                       self.dilations)
        else:
            A_pad = self._backward_im2col(flat, w, (Hp, Wp))
        A_in = A_pad[:, :, pt:pt + H, pl:pl + W].contiguous().reshape(B, S, C_in, H, W)
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


    def _backward_im2col(self, A_flat, w, padded_hw):
        """The transpose of _conv_im2col: A (N, Cout, Ho, Wo) -> (N, C_in, Hp, Wp); the
        contraction over Cout goes through the kernels, the scatter-add of patches is F.fold."""
        N, Cout = A_flat.shape[:2]
        kh, kw = w.shape[2:]
        G = self.groups
        L = A_flat.shape[2] * A_flat.shape[3]
        A_cols = A_flat.reshape(N, Cout, L).transpose(1, 2).contiguous()    # (N, L, Cout)
        out_per_group = Cout // G
        parts = []
        for g in range(G):
            wg = w[g * out_per_group:(g + 1) * out_per_group].reshape(
                out_per_group, w.shape[1] * kh * kw)        # explicit: a tp rank may hold none
            parts.append(self._cout_product(
                A_cols[..., g * out_per_group:(g + 1) * out_per_group].contiguous(),
                wg.t().contiguous()))                                      # (N, L, cin_g*kh*kw)
        cols = parts[0] if G == 1 else torch.cat(parts, dim=-1)
        cols = cols.transpose(1, 2).contiguous()                            # (N, C_in*kh*kw, L)
        return F.fold(cols, padded_hw, (kh, kw), dilation=self.dilations, stride=self.strides)


class Affine(Op):
    """y = x * scale + shift, elementwise with constants broadcast to the sample shape (folded
    BatchNorm, input normalisation, Mul/Div/Sub/Neg by constants, average-pool divisors)."""

    kind = "affine"
    param_roles = ("scale", "shift")

    def forward(self, x):
        s, t = self.param("scale"), self.param("shift")
        y = x * s if s is not None else x
        return y + t if t is not None else y

    def ibp(self, b):
        lo, hi = b
        s = self.param("scale")
        if s is not None:
            a, c = lo * s, hi * s
            lo, hi = torch.minimum(a, c), torch.maximum(a, c)
        t = self.param("shift")
        if t is not None:
            lo, hi = lo + t, hi + t
        return lo, hi

    def backward_linear(self, A):
        B, S = self._rows(A)
        s, t = self.param("scale"), self.param("shift")
        A_in = A * s if s is not None else A
        bias = None
        if t is not None:
            full = t.expand(self.shape).reshape(-1)
            bias = self._dot(A.reshape(B, S, full.numel()), full)
        return [A_in], bias


class Add(Op):
    """y = sum_i coeffs[i] * x_i over computed tensors of one shape (residual Add, Sub)."""

    kind = "add"

    def setup(self, coeffs=(1.0, 1.0)):
        self.coeffs = tuple(float(c) for c in coeffs)
        if len(self.coeffs) != len(self.inputs):
            raise TypeError("add needs one coefficient per input")

    def forward(self, *xs):
        y = None
        for c, x in zip(self.coeffs, xs):
            term = x if c == 1.0 else x * c
            y = term if y is None else y + term
        return y

    def ibp(self, *bounds):
        lo = hi = None
        for c, (l, u) in zip(self.coeffs, bounds):
            tl, tu = (l * c, u * c) if c >= 0 else (u * c, l * c)
            lo = tl if lo is None else lo + tl
            hi = tu if hi is None else hi + tu
        return lo, hi

    def backward_linear(self, A):
        return [A if c == 1.0 else A * c for c in self.coeffs], None


class Reshape(Op):
    """A pure layout change; the element order (row-major) is kept."""

    kind = "reshape"

    def setup(self, target=()):
        self.target = tuple(int(d) for d in target)

    def forward(self, x):
        return x.reshape(x.shape[0], *self.target)

    def ibp(self, b):
        return self.forward(b[0]), self.forward(b[1])

    def backward_linear(self, A):
        B, S = self._rows(A)
        return [A.reshape(B, S, *self.in_shapes[0])], None


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


class Relu(Op):
    """CROWN relaxation: upper line through (l, 0) and (u, u); lower slope 1 where u > -l,
    else 0 (and exact on stable neurons)."""

    kind = "relu"

    def forward(self, x):
        return torch.clamp(x, min=0)

    def ibp(self, b):
        return torch.clamp(b[0], min=0), torch.clamp(b[1], min=0)

    @staticmethod
    def relaxation(lo: torch.Tensor, hi: torch.Tensor):
        """(lower slope, upper slope, upper intercept) elementwise, sound for lo <= x <= hi."""
        active = lo >= 0
        inactive = hi <= 0
        unstable = ~(active | inactive)
        denom = torch.where(unstable, hi - lo, torch.ones_like(hi))
        up_slope = torch.where(unstable, hi / denom, active.to(hi.dtype))
        up_icpt = torch.where(unstable, -lo * hi / denom, torch.zeros_like(hi))
        low_slope = torch.where(unstable, (hi > -lo).to(hi.dtype), active.to(hi.dtype))
        return low_slope, up_slope, up_icpt

    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        """`alpha` (B, S, *shape) in [0, 1], when given, replaces the lower slope of unstable
        neurons on the lower-bound side (alpha-CROWN); any slope in [0, 1] is sound."""
        lo, hi = in_bounds[0]
        low_slope, up_slope, up_icpt = self.relaxation(lo, hi)
        B, S = self._rows(lA)
        # Broadcast the per-box relaxation over the S rows.
        low_slope, up_slope, up_icpt = (t.unsqueeze(1) for t in (low_slope, up_slope, up_icpt))
        l_low = low_slope
        if alpha is not None:
            unstable = ((lo < 0) & (hi > 0)).unsqueeze(1)
            l_low = torch.where(unstable, alpha.clamp(0, 1), low_slope)
        icpt_flat = up_icpt.reshape(up_icpt.shape[0], 1, -1)

        def side(A, pos_slope, neg_slope, pos_bias: bool):
            # pos * pos_slope + neg * neg_slope, with neg = A - pos: one clamp, fewer passes.
            pos = A.clamp(min=0)
            A_in = A * neg_slope + pos * (pos_slope - neg_slope)
            coef = pos if pos_bias else A - pos
            bias = self._dot(coef.reshape(B, S, icpt_flat.shape[-1]), icpt_flat)
            return A_in, bias

        # Lower bound: positive coefficients take the lower line, negative the upper line.
        lA_in, l_bias = side(lA, l_low, up_slope, pos_bias=False)
        if uA is None:                      # lower bound only
            return [lA_in], [None], l_bias, None
        uA_in, u_bias = side(uA, up_slope, low_slope, pos_bias=True)
        return [lA_in], [uA_in], l_bias, u_bias


OP_TYPES: dict[str, Callable[..., Op]] = {
    cls.kind: cls for cls in (Input, Linear, Conv2d, Affine, Add, Reshape, Transpose, Relu)
}
