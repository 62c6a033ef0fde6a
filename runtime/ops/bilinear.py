"""The bilinear family: products of two computed tensors (Mul x * y, MatMul X @ Y where both
operands depend on the input: attention scores Q K^T, softmax(...) V, gating).

Each scalar product term x * y with x in [xl, xu], y in [yl, yu] is bounded by McCormick's
planes, the tangent planes of x * y at the box's corners (xc, yc):

    x * y  =  yc x + xc y - xc yc  +  (x - xc)(y - yc),

and (x - xc)(y - yc) >= 0 at the corners (xl, yl) and (xu, yu) (lower planes), <= 0 at
(xl, yu) and (xu, yl) (upper planes), for every point of the box. In the backward step a
coefficient of the A-matrix that needs a lower bound of its term (positive on the lower-bound
side, negative on the upper) takes a convex combination of the two lower planes, the others of
the two upper planes (any combination is sound); both operands get A-matrices:

    A_x = sum over corners of W_c @ yc^T,  A_y = sum of xc^T @ W_c,  bias = -sum <W_c, xc @ yc>

where W_c is the part of A given to corner c. The combination weights are per output element
and spec row, so every contraction stays a matrix product; they are alpha-CROWN's parameters
(alpha in [0, 1]^2 per output: the share of the (xl, yl) lower plane and of the (xl, yu) upper
plane), starting at 1 (those planes alone; measured a little tighter than 1/2 on the ViT).

Infinite input bounds (an operand's interval leaves a domain upstream) have no plane: their
corners are replaced by 0 and every row whose A touches an output that depends on them gets
the vacuous bias (-inf on the lower side, +inf on the upper), so 0 * inf never turns a row
that does not depend on them into NaN. A bias that overflows float32 is made vacuous the
same way. IBP multiplies the four corners (0 times an infinite bound is 0: the value is
finite) and, for MatMul, adds the smallest / largest corner of each term over K through the
node's summation order.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.numerics import contract
from shardbound.runtime.ops.base import Op, register_op

# The default share of the first plane of each pair, (xl, yl) and (xl, yu): measured on the
# tiny ViT (tests/zoo.py vit_tiny, CROWN, radius 0.005 / 0.02 / 0.05), 1 gives mean widths
# 0.007707 / 0.031169 / 0.079885, 1/2 0.007709 / 0.031201 / 0.080097, 0 0.007711 / 0.031242 /
# 0.080503; 1 also halves the products (the other plane drops out).
_START = 1.0


def _times(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b with 0 * inf = 0 (interval corners: a zero factor makes the product 0)."""
    p = a * b
    return torch.where((a == 0) | (b == 0), torch.zeros_like(p), p)


def _total(ws):
    """The sum of a list of tensors, None when it is empty."""
    out = None
    for w in ws:
        out = w if out is None else out + w
    return out


class _Product(Op):
    """The McCormick relaxation shared by `product` (elementwise) and `matmul_xy` (batched
    matrix product). Subclasses give the three contractions of the backward step and IBP."""

    relaxed = True
    backward_memory = "separate"
    has_alpha = True

    # -- what subclasses give -------------------------------------------------------------------
    def _a_times_y(self, W, Yc):
        """(B, S, *out) with corner values of y (B', *y) -> the x-side coefficients (B, S, *x)."""
        raise NotImplementedError

    def _x_times_a(self, Xc, W):
        """corner values of x (B', *x) with (B, S, *out) -> the y-side coefficients (B, S, *y)."""
        raise NotImplementedError

    def _corner_product(self, Xc, Yc):
        """(B', *out): the product of two corner tensors."""
        raise NotImplementedError

    def _touched(self, bad_x, bad_y):
        """Bool (B', *out): the outputs that depend on an element flagged in bad_x or bad_y."""
        raise NotImplementedError

    # -- alpha ----------------------------------------------------------------------------------
    def alpha_init(self, in_bounds):
        B = in_bounds[0][0].shape[0] if in_bounds[0] is not None else 1
        return torch.full((B, 2, *self.shape), _START)

    def alpha_project_(self, alpha):
        alpha.clamp_(0, 1)

    def inexact_inputs(self, in_bounds):
        return [None if b is None else b[0] < b[1] for b in in_bounds]

    # -- the CROWN step -------------------------------------------------------------------------
    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        (xl, xu), (yl, yu) = in_bounds
        bad_x = ~(torch.isfinite(xl) & torch.isfinite(xu))
        bad_y = ~(torch.isfinite(yl) & torch.isfinite(yu))
        zero = torch.zeros((), dtype=xl.dtype, device=xl.device)
        corners = (torch.where(bad_x, zero, xl), torch.where(bad_x, zero, xu),
                   torch.where(bad_y, zero, yl), torch.where(bad_y, zero, yu))
        touched = self._touched(bad_x, bad_y) if bool(bad_x.any() or bad_y.any()) else None
        if alpha is not None:
            t_low, t_up = alpha[:, :, 0], alpha[:, :, 1]
        else:
            t_low = t_up = _START
        lx, ly, lb = self._side(lA, True, corners, t_low, t_up, touched)
        if uA is None:
            return [lx, ly], [None, None], lb, None
        ux, uy, ub = self._side(uA, False, corners, _START, _START, touched)
        return [lx, ly], [ux, uy], lb, ub

    def _side(self, A, lower_side: bool, corners, t_low, t_up, touched):
        """One side's A-matrices for x and y and its bias: coefficients that need a lower
        bound of their term take the lower planes (share t_low on (xl, yl)), the others the
        upper planes (share t_up on (xl, yu))."""
        xl, xu, yl, yu = corners
        pos = A.clamp(min=0)
        neg = A - pos
        below, above = (pos, neg) if lower_side else (neg, pos)
        # (weight, x corner, y corner) per plane; a share of exactly 0 or 1 drops a plane
        planes = []
        for w, t, first, second in ((below, t_low, (xl, yl), (xu, yu)),
                                    (above, t_up, (xl, yu), (xu, yl))):
            if isinstance(t, float) and t in (0.0, 1.0):
                planes.append((w, *(first if t == 1.0 else second)))
            else:
                planes += [(w * t, *first), (w * (1 - t), *second)]
        A_x = A_y = None
        for y_corner in (yl, yu):
            w = _total([p[0] for p in planes if p[2] is y_corner])
            if w is not None:
                term = self._a_times_y(w, y_corner)
                A_x = term if A_x is None else A_x + term
        for x_corner in (xl, xu):
            w = _total([p[0] for p in planes if p[1] is x_corner])
            if w is not None:
                term = self._x_times_a(x_corner, w)
                A_y = term if A_y is None else A_y + term
        B, S = self._rows(A)
        weights = torch.cat([w.reshape(B, S, -1) for w, _, _ in planes], dim=-1)
        prods = torch.cat([self._corner_product(a, b).reshape(a.shape[0], 1, -1)
                           for _, a, b in planes], dim=-1)
        bias = -self._dot(weights, prods)
        vacuous = -math.inf if lower_side else math.inf
        bad = ~torch.isfinite(bias)         # overflow, or a row that met 0 * inf
        if touched is not None:
            hit = (A != 0) & touched.unsqueeze(1)
            bad = bad | hit.reshape(B, S, -1).any(dim=-1)
        bias = torch.where(bad, torch.full_like(bias, vacuous), bias)
        return A_x, A_y, bias


@register_op
class Product(_Product):
    """y = a * b elementwise, both computed, of one shape (the lowering broadcasts)."""

    kind = "product"

    @classmethod
    def summation_note(cls, facts, sums):
        return f"bias W.(xc yc) over {sums(4 * math.prod(facts.shape))}"

    def forward(self, x, y):
        return x * y

    def ibp(self, bx, by):
        c = [_times(a, b) for a in bx for b in by]
        return (torch.minimum(torch.minimum(c[0], c[1]), torch.minimum(c[2], c[3])),
                torch.maximum(torch.maximum(c[0], c[1]), torch.maximum(c[2], c[3])))

    def _a_times_y(self, W, Yc):
        return W * Yc.unsqueeze(1)

    def _x_times_a(self, Xc, W):
        return Xc.unsqueeze(1) * W

    def _corner_product(self, Xc, Yc):
        return Xc * Yc

    def _touched(self, bad_x, bad_y):
        return bad_x | bad_y


@register_op
class MatmulXY(_Product):
    """Z = X @ Y over per-sample shapes X (G, M, K), Y (G, K, N) -> Z (G, M, N), both
    computed (the lowering brings ONNX MatMul's broadcasting and 1-D operands to this form).
    Every product goes through the summation order, one (M, K) x (K, N) matrix per box and
    group (rows of the A-matrices are independent, so fsdp row shards keep the bits)."""

    kind = "matmul_xy"

    def infer_shape(self):
        (g, m, k), (g2, k2, n) = self.in_shapes
        if g != g2 or k != k2:
            raise ValueError(f"matmul of {self.in_shapes[0]} and {self.in_shapes[1]}")
        return (g, m, n)

    @classmethod
    def summation_note(cls, facts, sums):
        (g, m, k), (_, _, n) = facts.in_shapes
        return (f"fwd X.Y over {sums(k)}; bwd A.Y^T over {sums(n)}, X^T.A over {sums(m)}; "
                f"bias over {sums(4 * g * m * n)}")

    # -- products per (box, group) in the node's order --------------------------------------------
    def _groups(self, left, right, fn):
        """Stack fn(left[b, g], right[b', g]) over boxes b (right broadcast when it has one)
        and groups g."""
        B = max(left.shape[0], right.shape[0])
        G = self.in_shapes[0][0]
        out = [torch.stack([fn(left[min(b, left.shape[0] - 1), g],
                               right[min(b, right.shape[0] - 1), g]) for g in range(G)])
               for b in range(B)]
        return torch.stack(out)

    def forward(self, x, y):
        """Under the ordered sums each output is the ordered sum of its K float32 products,
        (a sum_last: one kernel call per chunk of samples, whatever the batch: attacks and
        sampling forward thousands of points); `fast` is torch.matmul."""
        if self.order == "fast":
            return torch.matmul(x, y)
        yt = y.transpose(-1, -2)
        step = max(1, (1 << 22) // max(1, math.prod(self.shape) * x.shape[-1]))
        parts = [contract.sum_last((x[i:i + step].unsqueeze(-2) * yt[i:i + step].unsqueeze(-3)
                                    ).contiguous(), self.order)
                 for i in range(0, x.shape[0], step)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def ibp(self, bx, by):
        (xl, xu), (yl, yu) = bx, by
        c = [_times(a.unsqueeze(-1), b.unsqueeze(-3)) for a in (xl, xu) for b in (yl, yu)]
        lo = torch.minimum(torch.minimum(c[0], c[1]), torch.minimum(c[2], c[3]))
        hi = torch.maximum(torch.maximum(c[0], c[1]), torch.maximum(c[2], c[3]))
        # (B, G, M, K, N) -> sums over K
        return (contract.sum_last(lo.transpose(-1, -2).contiguous(), self.order),
                contract.sum_last(hi.transpose(-1, -2).contiguous(), self.order))

    def _a_times_y(self, W, Yc):
        # W (B, S, G, M, N), Yc (B', G, K, N) -> (B, S, G, M, K): per (b, g), W (S*M, N) Yc^T
        B, S, G, M, N = W.shape
        K = Yc.shape[-2]
        def one(b, g):
            return contract.matmul(W[b, :, g].reshape(S * M, N), Yc[min(b, Yc.shape[0] - 1), g],
                                   self.order).reshape(S, M, K)
        return torch.stack([torch.stack([one(b, g) for g in range(G)], dim=1)
                            for b in range(B)])

    def _x_times_a(self, Xc, W):
        # Xc (B', G, M, K), W (B, S, G, M, N) -> (B, S, G, K, N): per (b, g), (W^T (S*N, M)) Xc
        B, S, G, M, N = W.shape
        K = Xc.shape[-1]
        def one(b, g):
            rows = W[b, :, g].transpose(-1, -2).reshape(S * N, M)
            xt = Xc[min(b, Xc.shape[0] - 1), g].t().contiguous()        # (K, M)
            return contract.matmul(rows, xt, self.order).reshape(S, N, K).transpose(-1, -2)
        return torch.stack([torch.stack([one(b, g) for g in range(G)], dim=1)
                            for b in range(B)])

    def _corner_product(self, Xc, Yc):
        return self._groups(Xc, Yc, lambda X, Y: contract.matmul(X, Y.t().contiguous(),
                                                                 self.order))

    def _touched(self, bad_x, bad_y):
        # output (m, n) depends on row m of X and column n of Y
        return bad_x.any(dim=-1).unsqueeze(-1) | bad_y.any(dim=-2).unsqueeze(-2)
