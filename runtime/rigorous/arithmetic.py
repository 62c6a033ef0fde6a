"""Rigorous steps of the arithmetic family: `affine` (y = x * scale + shift: folded
BatchNorm, input normalisation, Mul / Div / Sub by constants) and `add` (sum_i c_i x_i)."""

from __future__ import annotations

from shardbound.runtime.ops.arithmetic import Add, Affine
from shardbound.runtime.rigorous.core import (LinearMapStep, dot_lower, param64, product_charge,
                                              rigorous_step)


@rigorous_step(Affine)
class AffineStep(LinearMapStep):
    def load(self, op):
        self.scale, self.shift = param64(op, "scale"), param64(op, "shift")

    def apply(self, xs, absolute=False):
        x = xs[0]
        if self.scale is None:
            return x
        return x * (self.scale.abs() if absolute else self.scale)

    def bias(self):
        return self.shift

    def terms(self):
        return 2

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        if self.scale is None:
            L_in, charge = L, None
        else:
            L_in = L * self.scale
            charge = product_charge(L_in, mags[0])
        bias = None
        if self.shift is not None:
            bias = dot_lower(L.reshape(B, S, -1), self.shift.expand(self.shape).reshape(-1))
        return [(L_in, charge)], bias


@rigorous_step(Add)
class AddStep(LinearMapStep):
    window = "elementwise"

    def load(self, op):
        self.coeffs = op.coeffs

    def apply(self, xs, absolute=False):
        out = None
        for c, x in zip(self.coeffs, xs):
            t = x * (abs(c) if absolute else c)
            out = t if out is None else out + t
        return out

    def terms(self):
        return 2 * len(self.inputs)

    def f32_delta(self, mags, out=None):
        if len(self.inputs) == 1 and all(abs(c) == 1.0 for c in self.coeffs):
            return None
        return super().f32_delta(mags, out)

    def back(self, L, in_bounds, mags, alpha=None):
        out = []
        for c, m in zip(self.coeffs, mags):
            if abs(c) == 1.0:
                out.append((L * c, None))
            else:
                L_in = L * c
                out.append((L_in, product_charge(L_in, m)))
        return out, None
