"""Windowed rows: the rigorous CROWN of a grid node's neurons with each A-matrix held only over
the part of every (C, H, W) grid it can reach (issue 17).

A row that starts at one neuron of a 52 x 52 conv node is zero outside the neuron's receptive
field at every node before it (a 7 x 7 or 9 x 9 window on TinyYOLO's first stage), yet a dense
backward pass carries, multiplies and folds the whole grid: 9 rows per chunk under the 256 MiB
row budget, hours of float64 convolutions per node. Here the rows of a chunk are the inexact
neurons of one spatial tile, and the coefficients at a grid node are a `Win`: a dense tensor
over rows [y0, y0 + h) and columns [x0, x0 + w), zero elsewhere. Nothing changes in the error
account: every step computes the same products over the same nonzero terms (a window leaves
out only exact zeros), so each sum has at most as many terms as the dense pass charges for,
and its charges and bias lower bounds are the dense ones restricted to where the row is
nonzero (a dot product over fewer terms, with the gamma of the terms it has).

A step covers windows by declaring `window = "elementwise"` (its backward step reads only the
elements under the row: input bounds and magnitudes are cropped and its own `back` runs), or
by giving `back_window` and `in_window` (conv2d: the adjoint over the window's taps only);
any other step gets the row as a dense tensor (the window padded with zeros), so a network
with uncovered ops is still bounded, only without the saving past them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardbound.runtime.rigorous.core import DT, RowAccount, absdot_upper, dot_lower


def is_grid(shape) -> bool:
    return len(shape) == 3


class Win:
    """Coefficients (B, S, C, h, w) of a (C, H, W) node at offset (y0, x0): zero outside."""

    __slots__ = ("t", "y0", "x0")

    def __init__(self, t, y0, x0):
        self.t, self.y0, self.x0 = t, y0, x0

    @property
    def box(self):
        return (self.y0, self.x0, self.t.shape[-2], self.t.shape[-1])

    def crop(self, x):
        """x (..., H, W) restricted to the window."""
        y0, x0, h, w = self.box
        return x[..., y0:y0 + h, x0:x0 + w]

    def dense(self, shape):
        _, H, W = shape
        y0, x0, h, w = self.box
        if (h, w) == (H, W):
            return self.t
        return F.pad(self.t, (x0, W - x0 - w, y0, H - y0 - h))

    def widened(self, y0, x0, h, w):
        """The same coefficients over a window containing this one."""
        a, b, hh, ww = self.box
        if (a, b, hh, ww) == (y0, x0, h, w):
            return self.t
        return F.pad(self.t, (b - x0, x0 + w - b - ww, a - y0, y0 + h - a - hh))


def union(boxes):
    y0 = min(b[0] for b in boxes)
    x0 = min(b[1] for b in boxes)
    y1 = max(b[0] + b[2] for b in boxes)
    x1 = max(b[1] + b[3] for b in boxes)
    return y0, x0, y1 - y0, x1 - x0


def add(a, b, shape):
    """The sum of two coefficient holders of one node (Win or dense tensors)."""
    if isinstance(a, Win) and isinstance(b, Win):
        box = union([a.box, b.box])
        return Win(a.widened(*box) + b.widened(*box), box[0], box[1])
    da = a.dense(shape) if isinstance(a, Win) else a
    db = b.dense(shape) if isinstance(b, Win) else b
    return da + db


def in_windows(step, box):
    """The windows of each input a row over `box` of the step's output reaches (None: the
    whole input)."""
    how = getattr(step, "window", None)
    if how == "elementwise" and all(tuple(s) == tuple(step.shape) for s in step.in_shapes):
        return [box for _ in step.inputs]
    if hasattr(step, "in_window"):
        return step.in_window(box)
    return [None for _ in step.inputs]


def reach(rig, target: str, box):
    """node -> the window (or None: all of it) rows over `box` of `target` reach."""
    wins = {target: box}
    stop = rig.nodes.index(rig.by_name[target])
    for n in reversed(rig.nodes[:stop + 1]):
        if n.name not in wins or not n.inputs:
            continue
        b = wins[n.name]
        ins = [None] * len(n.inputs) if b is None else in_windows(n, b)
        for name, ib in zip(n.inputs, ins):
            shape = rig.by_name[name].shape
            if ib is None or not is_grid(shape):
                wins[name] = None
            elif name not in wins:
                wins[name] = ib
            elif wins[name] is not None:
                wins[name] = union([wins[name], ib])
    return wins


def row_elements(rig, wins) -> int:
    """float64 elements one row needs at its largest step (as `Step.row_elements`)."""
    def elems(name):
        n = rig.by_name[name]
        b = wins.get(name)
        return math.prod(n.shape) if b is None else n.shape[0] * b[2] * b[3]
    most = 1
    for name in wins:
        n = rig.by_name[name]
        total = elems(name) + sum(elems(i) if i in wins else math.prod(rig.by_name[i].shape)
                                  for i in n.inputs)
        if hasattr(n, "window_cols") and wins[name] is not None:
            total += n.window_cols(wins[name])
        elif wins[name] is None:
            total = max(total, n.row_elements())
        most = max(most, total)
    return most


def backward(rig, target: str, L0: Win, bounds, lo, hi, alphas=None) -> torch.Tensor:
    """`RigorousBounds._backward` (no betas) with windowed rows: a rigorous lower bound (B, S)
    of L0 . value(target) over the boxes (`alphas`: node -> (B, S, ...), the relaxations'
    parameters; an elementwise step's are cropped with the row when they are per element)."""
    B, S = L0.t.shape[:2]
    # rig._window_mags: what the walks of one node's rows share (magnitudes, by node name;
    # an elementwise step's per-element lines, by (name, "lines")); earlier nodes' bounds
    # do not change while a node's rows are bounded
    walk = RowAccount(target, L0, torch.zeros(B, S, dtype=DT), bounds, rig._window_mags,
                      lambda a, b, name: add(a, b, rig.by_name[name].shape))
    mag = walk.mag
    stop = rig.nodes.index(rig.by_name[target])
    for n in reversed(rig.nodes[:stop + 1]):
        L = walk.acc.pop(n.name, None)
        if L is None:
            continue
        win = L if isinstance(L, Win) else None
        if not n.inputs:
            if win is not None:
                lv, hv = (win.crop(v.reshape(B, *n.shape)) for v in (lo, hi))
                flatL = win.t.reshape(B, S, -1)
            else:
                lv, hv, flatL = lo, hi, L.reshape(B, S, -1)
            sel = torch.where(flatL >= 0, lv.reshape(B, 1, -1), hv.reshape(B, 1, -1))
            walk.gain(dot_lower(flatL, sel))
            continue
        if rig.float32:
            delta = rig._delta[n.name]
            if delta is not None:
                dv = delta if win is None else win.crop(delta)
                t = L if win is None else win.t
                walk.charge(absdot_upper(t.reshape(B, S, -1), dv.reshape(B, 1, -1)))
        how = getattr(n, "window", None)
        alpha = None if alphas is None else alphas.get(n.name)
        if alpha is not None and win is not None and not (
                how == "elementwise" and tuple(alpha.shape[-3:]) == tuple(n.shape)):
            L, win = win.dense(n.shape), None         # parameters not per element: dense
        if win is not None and how == "elementwise" and all(
                tuple(s) == tuple(n.shape) for s in n.in_shapes):
            mags = [mag(i, win) for i in n.inputs]
            a = None if alpha is None else win.crop(alpha)
            if hasattr(n, "back_lines"):        # per-element lines: once per node, cropped
                key = (n.name, "lines")
                if key not in rig._window_mags:
                    rig._window_mags[key] = n.full_lines(bounds[n.inputs[0]])
                lines = [win.crop(t) for t in rig._window_mags[key]]
                parts, bias = n.back_lines(win.t, lines, mags, a)
            else:
                ins = [tuple(win.crop(v) for v in bounds[i]) for i in n.inputs]
                parts, bias = n.back(win.t, ins, mags, a)
            parts = [(Win(L_in, win.y0, win.x0), charge) for L_in, charge in parts]
        elif win is not None and hasattr(n, "back_window"):
            parts, bias = n.back_window(win, [bounds[i] for i in n.inputs],
                                        [mag(i) for i in n.inputs])
        else:
            dense = L if win is None else win.dense(n.shape)
            parts, bias = n.back(dense, [bounds[i] for i in n.inputs],
                                 [mag(i) for i in n.inputs], alpha)
            parts = [(_as_window(L_in, rig.by_name[i].shape), charge)
                     for i, (L_in, charge) in zip(n.inputs, parts)]
        if bias is not None:
            walk.gain(bias)
        for name, (L_in, charge) in zip(n.inputs, parts):
            if L_in is not None:
                walk.give(name, L_in, charge)
    return torch.nan_to_num(walk.c, nan=-math.inf)


def _as_window(L_in, shape):
    if L_in is None or not is_grid(shape):
        return L_in
    return Win(L_in, 0, 0)


def tiles(idx: torch.Tensor, shape, t: int, payload: torch.Tensor | None = None):
    """The flat neuron indices idx of a (C, H, W) node grouped by t x t spatial tile: [(box,
    payload's entries of the tile's neurons)] (payload: idx itself unless given), tile by
    tile, by index within a tile (deterministic)."""
    C, H, W = shape
    payload = idx if payload is None else payload
    nx = (W + t - 1) // t
    key = (((idx % (H * W)) // W) // t) * nx + (idx % W) // t
    order = torch.argsort(key * (C * H * W) + idx)
    payload, key = payload[order], key[order]
    uniq, counts = torch.unique_consecutive(key, return_counts=True)
    out, at = [], 0
    for k, cnt in zip(uniq.tolist(), counts.tolist()):
        ty, tx = (k // nx) * t, (k % nx) * t
        out.append(((ty, tx, min(t, H - ty), min(t, W - tx)), payload[at:at + cnt]))
        at += cnt
    return out
