"""The pooling family: `maxpool2d`, the max over each 2-D window of each channel (MaxPool,
GlobalMaxPool; compiler/lowering/pooling.py). Average pooling is linear and lowers to the
conv family's depthwise `conv2d`.

A window is a fixed set of input cells (kernel, strides, pads, dilations, ceil_mode), so the
windows of a channel are one index map (runtime/ops/index_map.py) from the plane's H*W cells
to its (Ho*Wo, kh*kw) window slots, the same for every channel; padded slots read nothing and
never win the max. CROWN's backward step puts each window's A-coefficients on its slots and
adds them onto the input cells with the map's fixed-order transpose, so cells shared by
overlapping windows get the same bits for any row split.

Relaxation of y = max_i x_i over one window, inputs x_i in [l_i, u_i] (see `window_lines`):
- exact when one input's lower bound is at least every other input's upper bound: y = x_j;
- lower line y >= sum_i w_i x_i + (1 - sum_i w_i) max_i l_i for any w >= 0 with sum w <= 1
  (max >= every convex combination of the x_i and of the constant max_i l_i <= max). CROWN
  puts w one-hot on the input with the largest lower bound; alpha-CROWN optimises w;
- upper line: with j the input with the largest upper bound and m = max(l_j, max_{i != j}
  u_i), y <= max(x_j, m) (every other input is at most m), and the convex max(x_j, m) lies
  under its chord over [l_j, u_j]: y <= m + (u_j - m) / (u_j - l_j) * (x_j - l_j). The chord
  is at most u_j on the whole box, so it is never looser than DeepPoly's (and auto_LiRPA's)
  constant max_i u_i, and it is below the line x_j + (m - l_j) too; with one other input
  fixed at 0 it is CROWN's ReLU upper line. It is y = x_j on exact windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops.base import Op, register_op
from shardbound.runtime.ops.index_map import IndexMap, MapCache


# -- window geometry (shared with the lowering) --------------------------------------------------
def pooled_size(n: int, k: int, s: int, begin: int, end: int, d: int, ceil_mode: bool) -> int:
    """Output length of one axis, as onnxruntime computes it: floor (or ceil) of
    (n + pads - d (k - 1) - 1) / s, + 1; in ceil mode a last window that would start in the
    end padding is dropped."""
    span = n + begin + end - d * (k - 1) - 1
    if span < 0:
        return 0
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= n + begin:
        out -= 1
    return out


def window_sources(in_hw, kernel, strides, pads, dilations, out_hw) -> np.ndarray:
    """(Ho*Wo, kh*kw) flat plane indices of each window's cells (row-major in the window),
    -1 where the cell lies in the padding. pads are (top, left, bottom, right)."""
    (H, W), (kh, kw), (sh, sw), (dh, dw), (Ho, Wo) = in_hw, kernel, strides, dilations, out_hw
    rows = np.arange(Ho)[:, None] * sh - pads[0] + np.arange(kh)[None, :] * dh    # (Ho, kh)
    cols = np.arange(Wo)[:, None] * sw - pads[1] + np.arange(kw)[None, :] * dw    # (Wo, kw)
    r = rows[:, None, :, None]
    c = cols[None, :, None, :]
    valid = (r >= 0) & (r < H) & (c >= 0) & (c < W)
    flat = np.where(valid, r * W + c, -1)                                          # (Ho, Wo, kh, kw)
    return flat.reshape(Ho * Wo, kh * kw)


# -- the relaxation of one window ---------------------------------------------------------------
@dataclass
class WindowLines:
    """Per window (B, C, L) and slot (B, C, L, K): the default lines and what alpha needs.
    lower: y >= sum_k low_slope x_k (one-hot on `argmax_lo`, sum 1, no intercept);
    upper: y <= sum_k up_slope x_k + up_icpt (the chord, or y = x_j on exact windows)."""

    exact: torch.Tensor          # bool (B, C, L)
    argmax_lo: torch.Tensor      # long (B, C, L)
    max_lo: torch.Tensor         # (B, C, L): max_i l_i, the lower line's constant
    low_slope: torch.Tensor      # (B, C, L, K)
    up_slope: torch.Tensor       # (B, C, L, K)
    up_icpt: torch.Tensor        # (B, C, L)


def window_lines(lo: torch.Tensor, hi: torch.Tensor, valid: torch.Tensor) -> WindowLines:
    """The relaxation of y = max over the valid slots of each window; lo, hi (..., K) are the
    slots' input bounds, `valid` (K-broadcastable bool) marks slots that are not padding
    (every window has one). The chord is computed in float64: its float32 slope, then the
    smallest intercept that puts the line above max(x_j, m) at both ends of [l_j, u_j]
    (hence on all of it), rounded up to float32."""
    neg = torch.tensor(float("-inf"), dtype=lo.dtype, device=lo.device)
    wlo, whi = torch.where(valid, lo, neg), torch.where(valid, hi, neg)
    K = wlo.shape[-1]
    slots = torch.arange(K, device=lo.device)
    max_lo, j_lo = wlo.max(dim=-1)
    others_hi = torch.where(slots == j_lo.unsqueeze(-1), neg, whi).amax(dim=-1)
    exact = max_lo >= others_hi
    max_hi, j_hi = whi.max(dim=-1)
    second_hi = torch.where(slots == j_hi.unsqueeze(-1), neg, whi).amax(dim=-1)
    l_j = torch.gather(wlo, -1, j_hi.unsqueeze(-1)).squeeze(-1)

    u64, l64 = max_hi.double(), l_j.double()
    m64 = torch.maximum(second_hi.double(), l64)
    width = torch.where(exact, torch.ones_like(u64), u64 - l64)
    s64 = torch.where(exact, torch.ones_like(u64), (u64 - m64) / width)
    slope = s64.to(lo.dtype)              # any float32 slope: the intercept makes it sound
    s = slope.double()
    icpt64 = torch.maximum(m64 - s * l64, u64 - s * u64)
    icpt = torch.where(exact, torch.zeros_like(max_hi), _round_up(icpt64, lo.dtype))

    j_up = torch.where(exact, j_lo, j_hi)
    slope = torch.where(exact, torch.ones_like(slope), slope)
    one_lo = (slots == j_lo.unsqueeze(-1)).to(lo.dtype)
    up_slope = (slots == j_up.unsqueeze(-1)).to(lo.dtype) * slope.unsqueeze(-1)
    return WindowLines(exact, j_lo, max_lo, one_lo, up_slope, icpt)


def _round_up(x64: torch.Tensor, dtype) -> torch.Tensor:
    """The smallest `dtype` value >= x64 (the cast rounds to nearest; step up where it fell)."""
    y = x64.to(dtype)
    return torch.where(y.double() < x64, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


@register_op
class MaxPool2d(Op):
    """Max pooling over 2-D windows of each channel (C, H, W) -> (C, Ho, Wo); pads are (top,
    left, bottom, right) and never win the max. alpha (B, C, Ho*Wo, kh*kw): the lower line's
    weights w per window slot (w >= 0, sum w <= 1)."""

    kind = "maxpool2d"
    relaxed = True
    backward_memory = "separate"
    tp_roles = ("elementwise",)
    has_alpha = True
    alpha_saved = (9.1, 9.1)        # measured: window weights and their normalisation

    @classmethod
    def summation_note(cls, facts, sums):
        k = math.prod(facts.attrs.get("kernel", (1, 1)))
        return (f"bias A.intercept over {sums(math.prod(facts.shape))}; alpha weight sums "
                f"over {sums(k)} per window")

    def setup(self, kernel=(1, 1), strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1),
              ceil_mode=0):
        self.kernel = tuple(int(k) for k in kernel)
        self.strides = tuple(int(s) for s in strides)
        self.pads = tuple(int(p) for p in pads)
        self.dilations = tuple(int(d) for d in dilations)
        self.ceil_mode = bool(ceil_mode)
        self._windows = MapCache(self._build_windows)

    # -- geometry, derived from the current shapes at first use (tp localises channels) ------
    def _out_hw(self, in_hw):
        pt, pl, pb, pr = self.pads
        return tuple(pooled_size(n, k, s, b, e, d, self.ceil_mode) for n, k, s, b, e, d in
                     zip(in_hw, self.kernel, self.strides, (pt, pl), (pb, pr), self.dilations))

    def _build_windows(self, in_hw) -> IndexMap:
        out_hw = self._out_hw(in_hw)
        if min(out_hw) <= 0:
            raise ValueError(f"no pooling window fits the {in_hw[0]}x{in_hw[1]} input")
        src = window_sources(in_hw, self.kernel, self.strides, self.pads, self.dilations, out_hw)
        if not (src >= 0).any(axis=1).all():
            raise ValueError("a pooling window covers only padding")
        return IndexMap(src, in_hw[0] * in_hw[1])

    def _map(self) -> IndexMap:
        return self._windows.get(tuple(self.in_shapes[0][1:]))

    def infer_shape(self):
        if len(self.in_shapes[0]) != 3:
            raise ValueError(f"2-D max pooling needs (C, H, W) samples, got {self.in_shapes[0]}")
        C, H, W = self.in_shapes[0]
        self._map()                         # checks that every window has a cell
        return (C, *self._out_hw((H, W)))

    def _slots(self, x: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """x (B, C, H, W) -> each window's slots (B, C, L, K); padding holds `fill`."""
        m = self._map()
        B, C = x.shape[:2]
        flat = m.gather(x.reshape(B, C, math.prod(x.shape[2:])), fill)   # C may be 0 (tp)
        return flat.reshape(B, C, *m.out_shape)

    def _valid(self, device) -> torch.Tensor:
        m = self._map()
        return m.sourced.to(device).reshape(m.out_shape)

    # -- forward and IBP -------------------------------------------------------------------------
    def forward(self, x):
        return self._slots(x).amax(dim=-1).reshape(x.shape[0], *self.shape)

    def ibp(self, b):
        return self.forward(b[0]), self.forward(b[1])

    # -- the relaxation --------------------------------------------------------------------------
    def _lines(self, in_bounds) -> WindowLines:
        lo, hi = in_bounds[0]
        return window_lines(self._slots(lo), self._slots(hi), self._valid(lo.device))

    def inexact_inputs(self, in_bounds):
        lo, hi = in_bounds[0]
        lines = self._lines(in_bounds)
        hit = (~lines.exact).unsqueeze(-1) & self._valid(lo.device)        # (B, C, L, K)
        m = self._map()
        B, C = lo.shape[:2]
        counts = m.scatter_add(hit.to(lo.dtype).reshape(B, C, math.prod(hit.shape[2:])))
        return [(counts > 0).reshape(lo.shape)]

    def alpha_init(self, in_bounds):
        return self._lines(in_bounds).low_slope.clone()

    def alpha_project_(self, alpha):
        """Onto {w >= 0, sum w <= 1, w = 0 on padding}: clamp to [0, 1], zero the padding
        slots, then scale down every window whose weights sum past 1."""
        alpha.clamp_(0, 1)
        alpha.mul_(self._valid(alpha.device).to(alpha.dtype))
        total = contract.sum_last(alpha, self.order)
        alpha.div_(total.clamp(min=1).unsqueeze(-1))

    def _lower_weights(self, lines: WindowLines, alpha, valid):
        """(lower slopes (B, S|1, C, L, K), 1 - their sum per window or None when it is 0)."""
        if alpha is None:
            return lines.low_slope.unsqueeze(1), None
        w = alpha.clamp(0, 1) * valid.to(alpha.dtype)
        w = w / contract.sum_last(w, self.order).clamp(min=1).unsqueeze(-1)
        exact = lines.exact.unsqueeze(1)
        w = torch.where(exact.unsqueeze(-1), lines.low_slope.unsqueeze(1), w)
        rest = 1 - contract.sum_last(w, self.order)
        return w, torch.where(exact, torch.zeros_like(rest), rest)

    # -- the CROWN step ----------------------------------------------------------------------------
    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        """`alpha` (the lower line's weights) shapes the lower-bound side; the upper side takes
        CROWN's default lines."""
        lines = self._lines(in_bounds)
        valid = self._valid(lA.device)
        w, rest = self._lower_weights(lines, alpha, valid)
        up_slope, up_icpt = lines.up_slope.unsqueeze(1), lines.up_icpt.unsqueeze(1)
        lA_in, l_bias = self._side(lA, (w, rest), (up_slope, up_icpt), lines.max_lo, lower=True)
        if uA is None:
            return [lA_in], [None], l_bias, None
        if alpha is not None:
            w, rest = self._lower_weights(lines, None, valid)
        uA_in, u_bias = self._side(uA, (w, rest), (up_slope, up_icpt), lines.max_lo, lower=False)
        return [lA_in], [uA_in], l_bias, u_bias

    def _side(self, A, low, up, max_lo, lower: bool):
        """A (B, S, C, Ho, Wo) -> (A over the input (B, S, C, H, W), bias (B, S)). On the
        lower side positive coefficients take the lower line and negative ones the upper line;
        on the upper side the other way round. Slot coefficients go to the input cells through
        the window map's fixed-order transpose; bias terms go through `_dot` in the program's
        order (the lower line's constant (1 - sum w) max l rides on A's side of the dot, so
        alpha-CROWN's gradient reaches w)."""
        B, S = self._rows(A)
        C, L = self.shape[0], self.shape[1] * self.shape[2]
        flat = A.reshape(B, S, C, L)
        pos = flat.clamp(min=0)
        neg = flat - pos
        (w, rest), (up_slope, up_icpt) = low, up
        on_low, on_up = (pos, neg) if lower else (neg, pos)
        slots = on_low.unsqueeze(-1) * w + on_up.unsqueeze(-1) * up_slope        # (B, S, C, L, K)
        m = self._map()
        A_in = m.scatter_add(slots.reshape(B, S, C, math.prod(slots.shape[3:]))).reshape(
            B, S, *self.in_shapes[0])
        bias = self._dot(on_up.reshape(B, S, C * L), up_icpt.reshape(B, 1, C * L))
        if rest is not None:
            bias = bias + self._dot((on_low * rest).reshape(B, S, C * L),
                                    max_lo.reshape(B, 1, C * L))
        return A_in, bias
