"""Rigorous steps of the movement family: `move` (Slice, Gather, Concat, Split, Tile,
nearest Resize / Upsample, DepthToSpace, ...: an index map with constants) and `resample`
(linear and cubic Resize: interpolation matrices)."""

from __future__ import annotations

from shardbound.runtime.ops.movement import Move, Resample
from shardbound.runtime.rigorous.core import (DT, TINY, LinearMapStep, gamma, rigorous_step,
                                              rowdot, up)
from shardbound.runtime.rigorous.layout import IndexMapStep


@rigorous_step(Move)
class MoveStep(IndexMapStep):
    def fill_of(self, op):
        f = op.param("fill")
        return None if f is None else f.detach().reshape(-1).to("cpu", DT).clone()


@rigorous_step(Resample)
class ResampleStep(LinearMapStep):
    """Linear / cubic Resize: one interpolation matrix per resized axis (the kernel's float32
    matrices: the compiled network's weights), contracted axis after axis. The composed
    rounding of k stages is within gamma of the summed lengths times |M| |x| (forward) or
    |L| |M| (backward), charged as for a layer."""

    def load(self, op):
        self.axes = op.axes
        self.mats = [m.to(DT) for m, _, _ in op._matrices("cpu")]

    def _along(self, x, lead, transpose=False, absolute=False):
        pairs = list(zip(self.axes, self.mats))
        for axis, m in (reversed(pairs) if transpose else pairs):
            m = m.abs() if absolute else m
            d = axis + lead
            x = (x.movedim(d, -1) @ (m if transpose else m.T)).movedim(-1, d)
        return x

    def apply(self, xs, absolute=False):
        return self._along(xs[0], 1, absolute=absolute)

    def terms(self):
        return sum(m.shape[1] for m in self.mats) + 1

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        L_in = self._along(L, 2, transpose=True)
        wm = up(self.apply([mags[0].squeeze(1)], absolute=True) * (1.0 + gamma(self.terms() + 1)))
        La = L.reshape(B, S, -1).abs()
        n = La.shape[-1]
        fan_out = sum(m.shape[0] for m in self.mats)
        charge = up(up(rowdot(La, wm.reshape(B, 1, -1)) * (1.0 + gamma(n + 1)) + n * TINY)
                    * gamma(fan_out + 1))
        return [(L_in, charge)], None
