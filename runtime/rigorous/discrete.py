"""Rigorous step of the discrete family (runtime/ops/discrete.py: Floor, Ceil, Round, casts,
comparisons, logic, Where with a computed condition, ArgMax / ArgMin, OneHot).

Each kernel's interval rule is a set computation on closed intervals: it holds the value of
the function at every point of [lo, hi] and only compares, truncates, rounds to an integer or
selects bounds (no rounded arithmetic on two bounds), so evaluated on float64 bounds it is
exact: floor(hi) where hi is an integer is hi itself, a tie of Round at hi is rounded by the
same rule, a comparison with an end on the threshold counts both outcomes, and Where keeps the
hull while its condition can be 0 or not. In real mode the input bounds enclose the exact
value, so the rule's [lo, hi] encloses the exact output. In float32 mode they enclose every
float32 evaluation of the input too (each earlier node's float32 error is accounted), so a
floor or a comparison whose input rounds across a jump is within the rule; what float32 adds
is the rounding of the integer result to float32 (a cast to int32 of 2^30 + 1, stored as a
float32): every rule's output is rounded outward to float32 (in real mode too, where it only
widens by less than a float32 ulp).

CROWN: constant lines (slope 0), the rule's lo / hi: the inputs get no coefficients and the
constant is a dot product of L with lo where L >= 0 and hi where L < 0 (0 * inf = 0),
rounded down with its gamma allowance.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.discrete import Discrete
from shardbound.runtime.rigorous.core import (DT, Step, dot_lower, nan_vacuous, rigorous_step,
                                              to_float32_outward)


def _outward32(lo, hi):
    l32, h32 = to_float32_outward(lo, hi)
    return l32.to(DT), h32.to(DT)


@rigorous_step(Discrete)
class DiscreteStep(Step):
    window = "elementwise"      # elementwise kernels without constants (see `load`)

    def load(self, op):
        self.consts = {i: op.param(f"const{i}").detach().to("cpu", DT).clone()
                       for i, what in enumerate(op.operands) if what != "computed"}
        if self.consts:         # a window would crop the inputs' bounds, not the constants
            self.window = None

    def _operands(self, given, as_bounds: bool):
        out, k = [], 0
        for i, what in enumerate(self.op.operands):
            if what == "computed":
                out.append(given[k])
                k += 1
            else:
                c = self.consts[i]
                out.append((c, c) if as_bounds else c)
        return out

    def forward(self, xs):
        with torch.no_grad():
            return self.op.evaluate(*self._operands([x.to(DT) for x in xs], False)).to(DT)

    def _rule(self, bounds):
        bounds = [(lo.to(DT), hi.to(DT)) for lo, hi in bounds]
        with torch.no_grad():
            lo, hi = self.op.interval(*self._operands(bounds, True))
        return nan_vacuous(*_outward32(lo.to(DT), hi.to(DT)))

    def ibp(self, bounds, float32):
        return self._rule(bounds)

    def f32_delta(self, mags, out):
        return None         # the rule's output is rounded outward to float32 already

    def inexact_inputs(self, in_bounds):
        """The kernel's own rule (discrete.py) with this step's float64 constants: the
        elements of a computed input that reach an output element not fixed under the bounds
        given (missing bounds: unbounded) and are not a point themselves."""
        ref = next((b[0] for b in in_bounds if b is not None), None)
        if ref is None:
            return [None] * len(in_bounds)
        full = [b if b is not None else (torch.full((ref.shape[0], *s), -math.inf, dtype=DT),
                                         torch.full((ref.shape[0], *s), math.inf, dtype=DT))
                for b, s in zip(in_bounds, self.in_shapes)]
        lo, hi = self._rule(full)
        unfixed = lo < hi
        return [None if b is None else self.op.spread(unfixed, i) & (b[0] < b[1])
                for i, b in enumerate(in_bounds)]

    def back(self, L, in_bounds, mags, alpha=None):
        B, S = L.shape[:2]
        lo, hi = self._rule(in_bounds)
        flat = L.reshape(B, S, -1)
        pick = torch.where(flat >= 0, lo.reshape(B, 1, -1), hi.reshape(B, 1, -1))
        pick = torch.where(flat == 0, torch.zeros_like(pick), pick)       # 0 * inf = 0
        return [], dot_lower(flat, pick)
