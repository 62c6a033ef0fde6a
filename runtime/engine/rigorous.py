"""Bounds that are enclosures in exact arithmetic (`--soundness real`) or of the network as
any float32 program evaluates it (`--soundness float32`): the certificates behind `unsat`
in those modes.

The engine (network.py) bounds in float32 with round-to-nearest: fast and tight, but its
bounds can sit an ulp or so inside the true range (a minimum attained on a vertex comes out a
rounding above it), so a threshold equal to a value the network attains can be "proved".
Here every bound is checked again, in float64 with an explicit error account:

- Products. A contraction of n terms computed in floating point (any order, any BLAS, fused
  multiply-add or not) differs from the exact sum by at most gamma_n times the sum of the
  absolute products, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability, 3.1). Each
  backward step Lambda_in = Lambda W is computed in float64; the computed matrix is taken as
  the chosen coefficient, and the difference from the exact product, at most
  gamma_n |Lambda| |W| elementwise, times max |h| of the layer input (from the bounds of h) is
  subtracted from the bound. Bias terms and the concretisation over the box are dot products
  with the same allowance, then moved one ulp down (`torch.nextafter`).
- Relaxations. ReLU's upper line (s, t) with s = u / (u - l) rounded up (the denominator
  rounded down first) and t = -s l rounded up lies above the chord for every point of [l, u]
  in exact arithmetic; the lower lines (slope 0 or 1, no intercept) are exact.
- IBP is the same sums with the same allowance, each side moved one ulp outward.
- Input boxes: the float64 box of the property moved one float64 ulp outward (the decimal
  numbers of a VNN-LIB file are rounded when read).
- float32 mode: each affine node's float32 result differs from its exact value on the same
  float32 inputs by at most delta = gamma32_{K+1} (|W| |x| + |b|) per neuron (u = 2^-24;
  |x| <= max(|l|, |u|) of the layer input): an extra perturbation at every node, added to its
  IBP interval and charged in CROWN as |Lambda| . delta at the node's output. Elementwise
  arithmetic gets gamma32 of its own term count. ReLU and layout ops are exact in float32.

Covered ops: input, linear (Gemm / MatMul), conv2d, relu, affine, add, reshape, transpose.
Anything else is refused in one line (`check_covered`) rather than bounded without an
account. Everything is float64 on the CPU and deterministic (the same bits for the same
inputs); bounds are per box and per row, so batches and row chunks do not change them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardbound.runtime.errors import ShardboundError

SOUNDNESS = ("default", "real", "float32")
U64 = 2.0 ** -53
U32 = 2.0 ** -24
TINY = 1e-300            # per term: absolute allowance for underflow (flush to zero included)
ROW_CHUNK = 512          # intermediate rows bounded per backward pass
COVERED = ("input", "linear", "conv2d", "relu", "affine", "add", "reshape", "transpose")
_EXACT_VIEWS = ("reshape", "transpose")

_DT = torch.float64


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


def _rowdot(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum(a * v, -1) for a (B, S, n) and v (n,) or (B, 1, n), as a matrix product."""
    if v.dim() == 1:
        return a @ v
    return (a @ v.transpose(-1, -2)).squeeze(-1)


def dot_lower(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A lower bound, in exact arithmetic, of sum(a * v, -1) (a (B, S, n); v (n,), (B, 1, n)
    or a's shape)."""
    n = a.shape[-1]
    if v.dim() == 1 or (v.dim() == a.dim() and v.shape[-2] == 1):
        s, e = _rowdot(a, v), _rowdot(a.abs(), v.abs())
    else:
        p = a * v
        s, e = p.sum(-1), p.abs().sum(-1)
    return down(s - (gamma(n + 1) * e + n * TINY))


def absdot_upper(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An upper bound, in exact arithmetic, of sum(|a| * v, -1) for v >= 0 (shapes as
    `_rowdot`)."""
    n = a.shape[-1]
    return up(_rowdot(a.abs(), v) * (1.0 + gamma(n + 1)) + n * TINY)


def _nan_vacuous(lo, hi):
    lo = torch.where(torch.isnan(lo), torch.full_like(lo, -math.inf), lo)
    hi = torch.where(torch.isnan(hi), torch.full_like(hi, math.inf), hi)
    return lo, hi


def check_covered(network, soundness: str) -> None:
    """A one-line refusal naming the first node whose op the error account does not cover,
    and a model in tp mode (zone ops hold slices)."""
    if soundness not in SOUNDNESS:
        raise ShardboundError(f"--soundness must be one of {', '.join(SOUNDNESS)}, got "
                              f"{soundness!r}")
    if soundness == "default":
        return
    if getattr(network, "tp", None) is not None:
        raise ShardboundError(f"--soundness {soundness}: not available in tp mode yet; use "
                              "--mode single or fsdp")
    for n in network.nodes:
        if n.kind not in COVERED:
            raise ShardboundError(
                f"--soundness {soundness}: node '{n.name}' ({n.kind}) is not covered by the "
                f"rigorous error account yet (covered: {', '.join(COVERED)}); use "
                "--soundness default")


class _Node:
    """One node in float64 with its parameters, and the float32 rounding allowance."""

    def __init__(self, op):
        self.op = op
        self.name, self.kind, self.inputs = op.name, op.kind, op.inputs
        self.shape = op.shape
        self.in_shapes = op.in_shapes

        def get(role):
            p = op.param(role)
            return None if p is None else p.detach().to("cpu", _DT).clone()
        self.w = self.b = self.scale = self.shift = None
        if self.kind in ("linear", "conv2d"):
            self.w, self.b = get("weight"), get("bias")
            self.w_abs = self.w.abs()
        elif self.kind == "affine":
            self.scale, self.shift = get("scale"), get("shift")
        op.release()
        if self.kind == "conv2d":
            self.strides, self.pads = op.strides, op.pads
            self.dilations, self.groups = op.dilations, op.groups
        if self.kind == "add":
            self.coeffs = op.coeffs

    # -- conv as unfold + matmul (so the error bound is the dot product's) ---------------------
    def _unfold(self, x):
        pt, pl, pb, pr = self.pads
        xp = F.pad(x, (pl, pr, pt, pb))
        kh, kw = self.w.shape[2:]
        cols = F.unfold(xp, (kh, kw), dilation=self.dilations, stride=self.strides)
        return cols.transpose(1, 2), xp.shape[2:]                     # (N, L, C*kh*kw)

    def _conv(self, x, w):
        N = x.shape[0]
        Cout, cin_g, kh, kw = w.shape
        cols, _ = self._unfold(x)
        G = self.groups
        og = Cout // G
        w2 = w.reshape(Cout, cin_g * kh * kw)
        parts = [cols[..., g * cin_g * kh * kw:(g + 1) * cin_g * kh * kw] @ w2[g * og:(g + 1) * og].T
                 for g in range(G)]
        y = torch.cat(parts, -1) if G > 1 else parts[0]                  # (N, L, Cout)
        return y.transpose(1, 2).reshape(N, Cout, *self.shape[1:])

    def _conv_back(self, A, w):
        """A (N, Cout, Ho, Wo) -> (N, Cin, H, W): the adjoint, as matmul + fold."""
        N = A.shape[0]
        Cout, cin_g, kh, kw = w.shape
        G = self.groups
        og = Cout // G
        A2 = A.reshape(N, Cout, -1).transpose(1, 2)                       # (N, L, Cout)
        w2 = w.reshape(Cout, cin_g * kh * kw)
        parts = [A2[..., g * og:(g + 1) * og] @ w2[g * og:(g + 1) * og] for g in range(G)]
        cols = torch.cat(parts, -1) if G > 1 else parts[0]               # (N, L, Cin*k)
        pt, pl, pb, pr = self.pads
        H, W = self.in_shapes[0][1:]
        out = F.fold(cols.transpose(1, 2), (H + pt + pb, W + pl + pr), (kh, kw),
                     dilation=self.dilations, stride=self.strides)
        return out[:, :, pt:pt + H, pl:pl + W]

    def fan_in(self) -> int:
        if self.kind == "linear":
            return self.w.shape[1]
        if self.kind == "conv2d":
            return math.prod(self.w.shape[1:])
        return 1

    def fan_out(self) -> int:
        """Terms of one element of the backward product (Lambda W)."""
        if self.kind == "linear":
            return self.w.shape[0]
        if self.kind == "conv2d":
            return (self.w.shape[0] // self.groups) * self.w.shape[2] * self.w.shape[3]
        return 1

    # -- the exact map and its absolute value ----------------------------------------------------
    def apply(self, xs, absolute=False):
        """The op in float64 (absolute: |W| applied to xs, no bias): rounded, not rigorous."""
        k = self.kind
        if k == "linear":
            return xs[0] @ (self.w_abs if absolute else self.w).T
        if k == "conv2d":
            return self._conv(xs[0], self.w_abs if absolute else self.w)
        if k == "affine":
            x = xs[0]
            if self.scale is None:
                return x
            return x * (self.scale.abs() if absolute else self.scale)
        if k == "add":
            out = None
            for c, x in zip(self.coeffs, xs):
                t = x * (abs(c) if absolute else c)
                out = t if out is None else out + t
            return out
        if k in _EXACT_VIEWS:
            return self.op.forward(xs[0])
        raise AssertionError(k)

    def bias(self):
        if self.kind in ("linear",):
            return self.b
        if self.kind == "conv2d":
            return None if self.b is None else self.b.reshape(-1, 1, 1)
        if self.kind == "affine":
            return self.shift
        return None

    def forward(self, xs):
        if self.kind == "input":
            return xs[0]
        if self.kind == "relu":
            return xs[0].clamp(min=0)
        y = self.apply(xs)
        b = self.bias()
        return y if b is None else y + b

    def terms(self) -> int:
        """Terms of one output element's sum (products and bias), for gamma."""
        if self.kind == "add":
            return 2 * len(self.inputs)
        if self.kind == "affine":
            return 2
        return self.fan_in() + 1

    def f32_delta(self, mags):
        """Per output element: |float32 result - exact result| on the same inputs, any order
        and fused multiply-add (mags: max |input| per input)."""
        if self.kind in ("input", "relu") or self.kind in _EXACT_VIEWS:
            return None
        if self.kind == "add" and all(abs(c) == 1.0 for c in self.coeffs) and len(self.inputs) == 1:
            return None
        s = self.apply(mags, absolute=True)
        b = self.bias()
        if b is not None:
            s = s + b.abs()
        return up(s * (1.0 + gamma(self.terms() + 1)) * gamma(self.terms(), U32) + TINY)

    def ibp(self, bounds, float32: bool):
        """Rigorous interval of the output (of its float32 evaluation too in float32 mode)."""
        if self.kind == "relu":
            lo, hi = bounds[0]
            return lo.clamp(min=0), hi.clamp(min=0)
        if self.kind in _EXACT_VIEWS:
            lo, hi = bounds[0]
            return self.op.forward(lo), self.op.forward(hi)
        mags = [torch.maximum(lo.abs(), hi.abs()) for lo, hi in bounds]
        cs = [(lo + hi) / 2 for lo, hi in bounds]
        # center c and radius r rounded up: [lo, hi] within [c - r, c + r]
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
        return _nan_vacuous(lo, hi)

    def back(self, L, mags):
        """L (B, S, *shape) -> [(L_in, charge)] per input, bias lower bound (B, S) or None.
        L_in is the computed coefficient; charge (B, S) or None bounds the sum over the input
        of |exact L W - L_in| times max |input| (mags: (B, 1, *in_shape) per input). For a
        contraction that is gamma |L| (|W| m): one matrix-vector product, not a second
        matrix product."""
        B, S = L.shape[:2]
        k = self.kind
        if k in ("linear", "conv2d"):
            if k == "linear":
                L_in = L @ self.w
            else:
                flat = L.reshape(B * S, *self.shape)
                L_in = self._conv_back(flat, self.w).reshape(B, S, *self.in_shapes[0])
            wm = up(self.apply([mags[0].squeeze(1)], absolute=True)
                    * (1.0 + gamma(self.fan_in() + 1)))
            flat = L.reshape(B, S, -1)
            La = flat.abs()
            n = La.shape[-1]
            charge = up(up(_rowdot(La, wm.reshape(B, 1, -1)) * (1.0 + gamma(n + 1)) + n * TINY)
                        * gamma(self.fan_out() + 1))
            bias = None
            b = self.bias()
            if b is not None:
                bv = b.expand(self.shape).reshape(-1)
                bias = down(flat @ bv - (gamma(n + 1) * (La @ bv.abs()) + n * TINY))
            return [(L_in, charge)], bias
        if k == "affine":
            if self.scale is None:
                L_in, charge = L, None
            else:
                L_in = L * self.scale
                charge = _product_charge(L_in, mags[0])
            bias = None
            if self.shift is not None:
                bias = dot_lower(L.reshape(B, S, -1), self.shift.expand(self.shape).reshape(-1))
            return [(L_in, charge)], bias
        if k == "add":
            out = []
            for c, m in zip(self.coeffs, mags):
                if abs(c) == 1.0:
                    out.append((L * c, None))
                else:
                    L_in = L * c
                    out.append((L_in, _product_charge(L_in, m)))
            return out, None
        if k in _EXACT_VIEWS:
            (L_in,), _ = self.op.backward_linear(L)
            return [(L_in, None)], None
        raise AssertionError(k)


def _product_charge(L_in, m):
    """sum |L x - fl(L x)| m over an elementwise product's elements: u |L_in| . m."""
    B, S = L_in.shape[:2]
    return up(absdot_upper(L_in.reshape(B, S, -1), m.reshape(m.shape[0], 1, -1)) * (1.01 * U64))


def relu_lines(lo, hi):
    """(lower slope, upper slope, upper intercept) of ReLU over [lo, hi], each sound in exact
    arithmetic for every point of the interval (the lower line has no intercept)."""
    zero, one = torch.zeros_like(lo), torch.ones_like(lo)
    active, inactive = lo >= 0, hi <= 0
    unstable = ~(active | inactive)
    s_low = torch.where(active, one, torch.where(inactive, zero, (hi > -lo).to(lo.dtype)))
    width = down(hi - lo)
    s = up(hi / torch.where(unstable, width, one))
    t = up(s * (-lo))
    # Infinite ends: relu <= max(0, hi) (flat line) or relu <= z - lo (slope 1).
    s = torch.where(torch.isinf(lo) & unstable, zero, s)
    t = torch.where(torch.isinf(lo) & unstable, hi.clamp(min=0), t)
    s = torch.where(torch.isinf(hi) & unstable, one, s)
    t = torch.where(torch.isinf(hi) & unstable, up(-lo), t)
    s_up = torch.where(active, one, torch.where(inactive, zero, s))
    t_up = torch.where(unstable, t, zero)
    return s_low, s_up, t_up


class RigorousBounds:
    """Rigorous IBP + CROWN of a compiled network (see the module docstring)."""

    def __init__(self, network, soundness: str):
        check_covered(network, soundness)
        self.float32 = soundness == "float32"
        self.nodes = [_Node(op) for op in network.nodes]
        self.by_name = {n.name: n for n in self.nodes}
        self.input = self.nodes[0]
        self.output = self.by_name[network.output.name]
        self.input_shape = network.input_shape
        consumers = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                consumers[i].append(n)
        # CROWN tightens the inputs of ReLUs (not a first affine layer: IBP is exact there)
        self.crown_nodes = {n.inputs[0] for n in self.nodes if n.kind == "relu"
                            and self.by_name[n.inputs[0]].inputs
                            and any(self.by_name[i].kind != "input"
                                    for i in self.by_name[n.inputs[0]].inputs)}

    # -- concrete ------------------------------------------------------------------------------
    def forward64(self, x: torch.Tensor) -> torch.Tensor:
        """The network in float64 at x (B, n) flattened: (B, n_out) (rounded, not rigorous: the
        float64 confirmation of a counterexample)."""
        values = {}
        x = x.to(_DT).reshape(-1, *self.input_shape)
        for n in self.nodes:
            values[n.name] = n.forward([values[i] for i in n.inputs] if n.inputs else [x])
        return values[self.output.name].reshape(x.shape[0], -1)

    @staticmethod
    def outward(lower, upper):
        lo = torch.as_tensor(lower, dtype=_DT)
        hi = torch.as_tensor(upper, dtype=_DT)
        return down(lo), up(hi)

    # -- bounds --------------------------------------------------------------------------------
    def _backward(self, target: str, L0: torch.Tensor, bounds, lo, hi) -> torch.Tensor:
        """A rigorous lower bound (B, S) of L0 . value(target) over the boxes."""
        B, S = L0.shape[:2]
        acc = {target: L0}
        c = torch.zeros(B, S, dtype=_DT)
        order = [n for n in self.nodes]
        stop = order.index(self.by_name[target])
        mags = {}

        def mag(name):
            if name not in mags:
                l, h = bounds[name]
                mags[name] = torch.maximum(l.abs(), h.abs()).unsqueeze(1)
            return mags[name]

        def give(name, L_in, charge):
            nonlocal c
            if charge is not None:
                c = down(c - torch.nan_to_num(charge, nan=math.inf))
            if name in acc:
                total = acc[name] + L_in
                c = down(c - torch.nan_to_num(_product_charge(total, mag(name)), nan=math.inf))
                acc[name] = total
            else:
                acc[name] = L_in

        for n in reversed(order[:stop + 1]):
            L = acc.pop(n.name, None)
            if L is None:
                continue
            if n.kind == "input":
                flatL = L.reshape(B, S, -1)
                xl = lo.reshape(B, 1, -1)
                xh = hi.reshape(B, 1, -1)
                sel = torch.where(flatL >= 0, xl, xh)
                c = down(c + dot_lower(flatL, sel))
                continue
            if self.float32:
                delta = self._delta[n.name]
                if delta is not None:
                    c = down(c - absdot_upper(L.reshape(B, S, -1), delta.reshape(B, 1, -1)))
            if n.kind == "relu":
                zl, zh = bounds[n.inputs[0]]
                s_low, s_up, t_up = relu_lines(zl, zh)
                # positive coefficients take the lower line (slope 0 or 1: exact products,
                # no intercept), negative ones the upper line (rounded products: charged)
                Ln = L.clamp(max=0)
                L_in = (L - Ln) * s_low.unsqueeze(1) + Ln * s_up.unsqueeze(1)
                Lna = (-Ln).reshape(B, S, -1)
                k = Lna.shape[-1]
                tv = t_up.reshape(t_up.shape[0], 1, -1)
                c = down(c - up(_rowdot(Lna, tv) * (1.0 + gamma(k + 1)) + k * TINY))
                sm = up(s_up.unsqueeze(1) * mag(n.inputs[0])).reshape(B, 1, -1)
                charge = up(up(_rowdot(Lna, sm) * (1.0 + gamma(k + 1)) + k * TINY)
                            * (1.01 * U64))
                give(n.inputs[0], L_in, charge)
                continue
            parts, bias = n.back(L, [mag(i) for i in n.inputs])
            if bias is not None:
                c = down(c + bias)
            for name, (L_in, charge) in zip(n.inputs, parts):
                give(name, L_in, charge)
        return torch.nan_to_num(c, nan=-math.inf)

    def _node_bounds(self, n, bounds, lo, hi):
        """CROWN lower and upper bounds of the neurons of n that are unstable (l < 0 < u in
        some box), the rest kept."""
        l, h = bounds[n.name]
        B = l.shape[0]
        fl, fh = l.reshape(B, -1), h.reshape(B, -1)
        idx = torch.nonzero(((fl < 0) & (fh > 0)).any(dim=0)).reshape(-1)
        if len(idx) == 0:
            return l, h
        M = fl.shape[1]
        new_l, new_h = fl.clone(), fh.clone()
        for at in range(0, len(idx), ROW_CHUNK):
            rows = idx[at:at + ROW_CHUNK]
            eye = torch.zeros(len(rows), M, dtype=_DT)
            eye[torch.arange(len(rows)), rows] = 1.0
            L0 = torch.cat([eye, -eye]).unsqueeze(0).expand(B, -1, -1).reshape(B, 2 * len(rows),
                                                                               *n.shape)
            c = self._backward(n.name, L0, bounds, lo, hi)
            new_l[:, rows] = torch.maximum(new_l[:, rows], c[:, :len(rows)])
            new_h[:, rows] = torch.minimum(new_h[:, rows], -c[:, len(rows):])
        return new_l.reshape(l.shape), new_h.reshape(h.shape)

    def all_bounds(self, lo, hi, splits=None):
        """Rigorous bounds of every node over the boxes lo, hi (B, n) float64 (already
        outward), with ReLU split assumptions applied (name of a ReLU input -> int8 (B, *shape))."""
        B = lo.shape[0]
        bounds = {}
        self._delta = {}
        for n in self.nodes:
            if n.kind == "input":
                bounds[n.name] = (lo.reshape(B, *n.shape), hi.reshape(B, *n.shape))
                self._delta[n.name] = None
                continue
            ins = [bounds[i] for i in n.inputs]
            bounds[n.name] = n.ibp(ins, self.float32)
            if self.float32:
                mags = [torch.maximum(a.abs(), b.abs()) for a, b in ins]
                self._delta[n.name] = n.f32_delta(mags)
            if n.name in self.crown_nodes:
                bounds[n.name] = self._node_bounds(n, bounds, lo, hi)
            if splits is not None and n.name in splits:
                s = splits[n.name].to("cpu")
                l, h = bounds[n.name]
                bounds[n.name] = (torch.where(s > 0, l.clamp(min=0), l),
                                  torch.where(s < 0, h.clamp(max=0), h))
        return bounds

    def spec_lower(self, lo, hi, C, splits=None) -> torch.Tensor:
        """(B, S) rigorous lower bounds of C . f(x) (C (S, n_out) float64) over each box;
        +inf for a box that the split assumptions leave empty."""
        lo = lo.to(_DT).reshape(lo.shape[0], -1)
        hi = hi.to(_DT).reshape(hi.shape[0], -1)
        B = lo.shape[0]
        C = torch.as_tensor(C, dtype=_DT)
        with torch.no_grad():
            bounds = self.all_bounds(lo, hi, splits)
            L0 = C.unsqueeze(0).expand(B, -1, -1).reshape(B, C.shape[0], *self.output.shape)
            lb = self._backward(self.output.name, L0, bounds, lo, hi)
            ol, oh = bounds[self.output.name]
            sel = torch.where(C.unsqueeze(0) >= 0, ol.reshape(B, 1, -1), oh.reshape(B, 1, -1))
            lb = torch.maximum(lb, dot_lower(C.unsqueeze(0).expand(B, -1, -1), sel))
            empty = torch.zeros(B, dtype=torch.bool)
            for l, h in bounds.values():
                empty |= (l > h).reshape(B, -1).any(dim=1)
        return torch.where(empty.unsqueeze(1), torch.full_like(lb, math.inf), lb)

    def refuted(self, lo, hi, C, d, owner, n_conj, splits=None) -> torch.Tensor:
        """(B,) bool: every conjunction has a row whose rigorous lower bound is > d."""
        from shardbound.runtime.verification.input_split import refuted_conjunctions

        import numpy as np

        lb = self.spec_lower(lo, hi, C, splits)
        # d as read is the float64 nearest a decimal: compare with the next float64 above it
        d_up = np.nextafter(np.asarray(d, np.float64), np.inf)
        return refuted_conjunctions(lb, d_up, owner, n_conj).all(dim=1)


def to_float32_outward(lo64: torch.Tensor, hi64: torch.Tensor):
    """float64 bounds as the float32 bounds that contain them."""
    lo, hi = lo64.float(), hi64.float()
    lo = torch.where(lo.double() > lo64, torch.nextafter(lo, torch.full_like(lo, -math.inf)), lo)
    hi = torch.where(hi.double() < hi64, torch.nextafter(hi, torch.full_like(hi, math.inf)), hi)
    return lo, hi


def rigorous_box_bounds(verifier, lower, upper, soundness: str, lb, ub):
    """`run --box --soundness real|float32`: the rigorous bounds of every output (float32,
    rounded outward), intersected with nothing from the float32 engine (lb, ub give the
    result's shape)."""
    rig = RigorousBounds(verifier.network, soundness)
    lo = torch.as_tensor(lower, dtype=_DT).reshape(-1, math.prod(verifier.input_shape))
    hi = torch.as_tensor(upper, dtype=_DT).reshape(-1, math.prod(verifier.input_shape))
    lo, hi = rig.outward(lo, hi)
    eye = torch.eye(math.prod(verifier.output_shape), dtype=_DT)
    l64 = rig.spec_lower(lo, hi, eye)
    h64 = -rig.spec_lower(lo, hi, -eye)
    l32, h32 = to_float32_outward(l64, h64)
    return l32.reshape(lb.shape), h32.reshape(ub.shape)
