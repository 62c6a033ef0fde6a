"""The error account every rigorous step shares, the step interface, and the registry.

Numerics (Higham, Accuracy and Stability, 3.1): a contraction of n terms computed in floating
point (any order, any BLAS, fused multiply-add or not) differs from the exact sum by at most
gamma_n times the sum of the absolute products, gamma_n = n u / (1 - n u). `down` / `up`
move a rounded result one ulp outward, which bounds the exact value of the one rounded
operation that made it. Everything is float64 on the CPU (u = 2^-53).

A step (`Step`) is one node's rigorous semantics, declared per kernel class: `@rigorous_step
(KernelClass, ...)` in the rigorous module of the kernel's family (runtime/rigorous/<family>.py,
named as runtime/ops/<family>.py), found through the kernel's MRO, so a subclass inherits its
family's step unless it declares its own. A kernel without a step is refused in one line by
`check_covered` (no bound without an account). Adding an op's rigorous step touches only its
family's module here (and its tests).
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.errors import ShardboundError

U64 = 2.0 ** -53
U32 = 2.0 ** -24
TINY = 1e-300            # per term: absolute allowance for underflow (flush to zero included)
DT = torch.float64

STEPS: dict[type, type] = {}


def gamma(n: int, u: float = U64) -> float:
    """gamma_n, inflated by 1% for the rounding of the error terms themselves."""
    nu = max(int(n), 1) * u
    if nu >= 0.01:
        raise ShardboundError(f"--soundness: a contraction of {n} terms is too long for the "
                              "float64 error account; use --soundness default")
    return 1.01 * nu / (1.0 - nu)


def down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, -math.inf))


def up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, math.inf))


def rowdot(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum(a * v, -1) for a (B, S, n) and v (n,) or (B, 1, n), as a matrix product."""
    if v.dim() == 1:
        return a @ v
    return (a @ v.transpose(-1, -2)).squeeze(-1)


def dot_lower(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A lower bound, in exact arithmetic, of sum(a * v, -1) (a (B, S, n); v (n,), (B, 1, n)
    or a's shape)."""
    n = a.shape[-1]
    if v.dim() == 1 or (v.dim() == a.dim() and v.shape[-2] == 1):
        s, e = rowdot(a, v), rowdot(a.abs(), v.abs())
    else:
        p = a * v
        s, e = p.sum(-1), p.abs().sum(-1)
    return down(s - (gamma(n + 1) * e + n * TINY))


def box_lower(a: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """A lower bound, in exact arithmetic, of min over the boxes [lo, hi] (B, n) of a . x
    (a (B, S, n)): a . c - |a| . r for a centre c and a radius r rounded up so that c -+ r
    holds the box, two matrix-vector products per box (not the vertex a would pick, an
    elementwise select and product of a's size), at most a few ulps of |a| . |x| looser."""
    B = a.shape[0]
    c = (lo + hi) / 2
    r = up(torch.maximum(hi - c, c - lo))
    return down(dot_lower(a, c.reshape(B, 1, -1)) - absdot_upper(a, r.reshape(B, 1, -1)))


def absdot_upper(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An upper bound, in exact arithmetic, of sum(|a| * v, -1) for v >= 0 (shapes as
    `rowdot`)."""
    n = a.shape[-1]
    return up(rowdot(a.abs(), v) * (1.0 + gamma(n + 1)) + n * TINY)


def product_charge(L_in: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """sum |L x - fl(L x)| m over an elementwise product's elements: u |L_in| . m (also the
    charge of one rounded addition per element)."""
    B, S = L_in.shape[:2]
    return up(absdot_upper(L_in.reshape(B, S, -1), m.reshape(m.shape[0], 1, -1)) * (1.01 * U64))


class RowAccount:
    """One rigorous backward walk's running state, shared by the dense walk
    (RigorousBounds._backward) and the windowed one (window.backward): the coefficients
    arriving at each node (`acc`), the constant `c` of the lower bound (rounded down after
    every change) and the magnitudes max(|l|, |h|) that product charges read (`mags`: a dict
    the caller may keep across walks). `add(a, b, name)` sums two holders of one node's
    coefficients: tensors, or windows (`.t`, `.crop`)."""

    def __init__(self, target, L0, c, bounds, mags, add):
        self.acc, self.c, self.bounds, self.mags, self._add = {target: L0}, c, bounds, mags, add

    def mag(self, name, win=None):
        if name not in self.mags:
            lv, hv = self.bounds[name]
            self.mags[name] = torch.maximum(lv.abs(), hv.abs()).unsqueeze(1)
        m = self.mags[name]
        return m if win is None else win.crop(m)

    def gain(self, x):
        """c + x, rounded down."""
        self.c = down(self.c + x)

    def charge(self, x):
        """c - x, rounded down (a NaN charge takes everything)."""
        if x is not None:
            self.c = down(self.c - torch.nan_to_num(x, nan=math.inf))

    def give(self, name, L_in, charge):
        """L_in arrives at node `name` with its charge; a sum of two arrivals is charged one
        rounded addition per element."""
        self.charge(charge)
        if name in self.acc:
            total = self._add(self.acc[name], L_in, name)
            if isinstance(total, torch.Tensor):
                self.charge(product_charge(total, self.mag(name)))
            else:
                self.charge(product_charge(total.t, self.mag(name, total)))
            self.acc[name] = total
        else:
            self.acc[name] = L_in


def nan_vacuous(lo, hi):
    lo = torch.where(torch.isnan(lo), torch.full_like(lo, -math.inf), lo)
    hi = torch.where(torch.isnan(hi), torch.full_like(hi, math.inf), hi)
    return lo, hi


def to_float32_outward(lo64: torch.Tensor, hi64: torch.Tensor):
    """float64 bounds as the float32 bounds that contain them."""
    lo, hi = lo64.float(), hi64.float()
    lo = torch.where(lo.double() > lo64, torch.nextafter(lo, torch.full_like(lo, -math.inf)), lo)
    hi = torch.where(hi.double() < hi64, torch.nextafter(hi, torch.full_like(hi, math.inf)), hi)
    return lo, hi


def param64(op, role: str):
    p = op.param(role)
    return None if p is None else p.detach().to("cpu", DT).clone()


class Step:
    """One node's rigorous semantics (float64; bounds (B, *shape); A-matrices (B, S, *shape)).

    - `forward(xs)`: the op in float64 (rounded, not rigorous: the float64 confirmation of
      a counterexample).
    - `ibp(bounds, float32)`: an interval holding the exact output over the input intervals
      (and, in float32 mode, every float32 evaluation of it on float32 inputs in them).
    - `f32_delta(mags, out)`: per output element, a bound on |float32 result - exact result|
      on the same inputs (mags: max |input| per input; out: the node's bounds), or None when
      float32 evaluates the op exactly.
    - `back(L, in_bounds, mags, alpha)`: ([(L_in, charge)] per input, bias or None). L_in is
      the computed coefficient of the input, charge (B, S) or None bounds sum |exact - L_in|
      times max |input|, bias (B, S) is a lower bound of the constant term; so
      L . y >= sum L_in . x_in - charges + bias for every point of the input bounds.
      `alpha`: the engine's optimised relaxation parameters (B, S, ...), any feasible value.
    - `float32`: True in float32 mode (for a step whose lines depend on it, as `back` is
      not told).
    - `box`: "view" (the output is the input's elements, each at most once: a box stays a
      box) or "affine" (an affine map: IBP of a box is exact); None otherwise. Nodes that are
      a box or an affine map of one need no CROWN bounds.
    """

    box: str | None = None
    float32 = False     # the mode, set by the engine (RigorousBounds) for steps that read it

    def __init__(self, op):
        self.op = op
        self.name, self.inputs = op.name, op.inputs
        self.shape, self.in_shapes = op.shape, op.in_shapes
        self.load(op)
        op.release()

    def load(self, op) -> None:
        """Copy what the step needs from the kernel (parameters as float64)."""

    def forward(self, xs):
        raise NotImplementedError

    def ibp(self, bounds, float32: bool):
        raise NotImplementedError

    def f32_delta(self, mags, out):
        return None

    def back(self, L, in_bounds, mags, alpha=None):
        raise NotImplementedError

    def row_elements(self) -> int:
        """float64 elements one A-matrix row needs through this step (its largest
        temporary): the engine sizes its row chunks by the largest."""
        return math.prod(self.shape) + sum(math.prod(s) for s in self.in_shapes)


def rigorous_step(*kernels):
    """Declare `cls` the rigorous step of these kernel classes (and their subclasses that
    declare none of their own)."""
    def register(cls):
        for k in kernels:
            if k in STEPS:
                raise TypeError(f"{k.__name__} has two rigorous steps ({STEPS[k].__name__} and "
                                f"{cls.__name__})")
            STEPS[k] = cls
        return cls
    return register


def step_class(op) -> type | None:
    """The step declared for the op's kernel class (or a kernel class itself) or its nearest
    base; None: not covered."""
    for k in (op if isinstance(op, type) else type(op)).__mro__:
        if k in STEPS:
            return STEPS[k]
    return None


class LinearMapStep(Step):
    """An affine map y = M(x) + b, given by `apply(xs, absolute)` (M, or |M| applied to
    non-negative xs, in float64), `bias()` (broadcast to the output or None) and `terms()`
    (terms of one output element's sum, bias included): IBP and the float32 allowance
    follow from them."""

    box = "affine"

    def apply(self, xs, absolute=False):
        raise NotImplementedError

    def bias(self):
        return None

    def terms(self) -> int:
        raise NotImplementedError

    def forward(self, xs):
        y = self.apply(xs)
        b = self.bias()
        return y if b is None else y + b

    def f32_delta(self, mags, out=None):
        """gamma32 of the terms times the sum of their magnitudes (any order, any FMA)."""
        s = self.apply(mags, absolute=True)
        b = self.bias()
        if b is not None:
            s = s + b.abs()
        return up(s * (1.0 + gamma(self.terms() + 1)) * gamma(self.terms(), U32) + TINY)

    def ibp(self, bounds, float32: bool):
        """Center and radius (rounded up, so [lo, hi] lies within c -+ r), each map's rounding
        allowed for by 2 gamma over the magnitudes, each side moved one ulp outward."""
        mags = [torch.maximum(lo.abs(), hi.abs()) for lo, hi in bounds]
        cs = [(lo + hi) / 2 for lo, hi in bounds]
        rs = [up(torch.maximum(hi - c, c - lo)) for (lo, hi), c in zip(bounds, cs)]
        yc = self.apply(cs)
        yr = self.apply(rs, absolute=True)
        b = self.bias()
        err_terms = self.apply(mags, absolute=True)
        if b is not None:
            yc = yc + b
            err_terms = err_terms + b.abs()
        allowance = up(err_terms * 2 * gamma(2 * self.terms() + 2) + TINY)
        if float32:
            allowance = up(allowance + self.f32_delta(mags))
        lo = down(down(yc - yr) - allowance)
        hi = up(up(yc + yr) + allowance)
        return nan_vacuous(lo, hi)


class WeightedStep(LinearMapStep):
    """A layer y = W x + b whose backward product L W is a contraction of `fan_out()` terms
    per element and whose forward one of `fan_in()`: `matmul(x, w)` and `adjoint(L, w)`
    (B*S rows) are all a subclass gives."""

    def load(self, op):
        self.w, self.b = param64(op, "weight"), param64(op, "bias")
        self.w_abs = self.w.abs()

    def matmul(self, x, w):
        raise NotImplementedError

    def adjoint(self, L, w):
        raise NotImplementedError

    def bias_full(self):
        """The bias broadcast to the output shape, or None."""
        raise NotImplementedError

    def fan_in(self) -> int:
        raise NotImplementedError

    def fan_out(self) -> int:
        raise NotImplementedError

    def apply(self, xs, absolute=False):
        return self.matmul(xs[0], self.w_abs if absolute else self.w)

    def bias(self):
        return self.bias_full()

    def terms(self):
        return self.fan_in() + 1

    def _weighted_mags(self, m):
        """|W| m, rounded up, for the input magnitudes m (B, 1, *in_shape): one forward
        product, kept for the next row chunk that brings the same tensor (engine.py shares a
        node's magnitudes across its chunks)."""
        held = getattr(self, "_wm_held", None)
        if held is not None and held[0] is m:
            return held[1]
        wm = up(self.apply([m.squeeze(1)], absolute=True) * (1.0 + gamma(self.fan_in() + 1)))
        self._wm_held = (m, wm)
        return wm

    def back(self, L, in_bounds, mags, alpha=None):
        """The computed L W is the chosen coefficient; its distance from the exact product is
        at most gamma |L| |W| elementwise, charged as gamma |L| . (|W| m): one matrix-vector
        product, not a second matrix product."""
        B, S = L.shape[:2]
        L_in = self.adjoint(L.reshape(B * S, *self.shape), self.w).reshape(B, S,
                                                                           *self.in_shapes[0])
        wm = self._weighted_mags(mags[0])
        flat = L.reshape(B, S, -1)
        La = flat.abs()
        n = La.shape[-1]
        charge = up(up(rowdot(La, wm.reshape(B, 1, -1)) * (1.0 + gamma(n + 1)) + n * TINY)
                    * gamma(self.fan_out() + 1))
        bias = None
        b = self.bias_full()
        if b is not None:
            bv = b.expand(self.shape).reshape(-1)
            bias = down(flat @ bv - (gamma(n + 1) * (La @ bv.abs()) + n * TINY))
        return [(L_in, charge)], bias
