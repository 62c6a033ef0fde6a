"""The linear family: `linear`, y = x @ W.T + b over the last axis (Gemm, MatMul with a
constant weight; compiler/lowering/linear.py)."""

from __future__ import annotations

import math

import numpy as np
import torch

from shardbound.runtime.numerics import contract, streaming
from shardbound.runtime.ops.base import Op, center_radius, per_feature, register_op


@register_op
class Linear(Op):
    """y = x @ W.T + b over the last axis; W is (N, K), contiguous (transB resolved at compile
    time so every mode multiplies the same layout)."""

    kind = "linear"
    param_roles = ("weight", "bias")
    streams_weight = True
    tp_roles = ("column", "row")
    mip_encoding = "affine"

    # -- what passes ask ------------------------------------------------------------------
    @classmethod
    def tp_channels(cls, facts, role):
        if role == "column" and len(facts.shape) == 1:
            return facts.shape[0]
        if role == "row" and len(facts.in_shapes[0]) == 1:
            return facts.param_shape("weight")[1]
        return None

    @classmethod
    def summation_note(cls, facts, sums):
        n_out, k = facts.param_shape("weight")
        text = f"fwd x.W^T over {sums(k)}; bwd A.W over {sums(n_out)}"
        if "bias" in facts.has_params:
            text += f"; bias A.b over {sums(n_out)}"
        return text

    @classmethod
    def absorb_affine_after(cls, facts, weight, bias, scale, shift):
        axis = len(facts.shape) - 1
        sv, tv = per_feature(scale, axis), per_feature(shift, axis)
        if sv is None or tv is None:
            return None
        return weight * sv[:, None], (np.zeros_like(sv) if bias is None else bias) * sv + tv

    @classmethod
    def absorb_affine_before(cls, facts, weight, bias, scale, shift):
        if len(facts.shape) != 1:
            return None
        b_new = (0 if bias is None else bias) + weight @ shift
        return weight * scale[None, :], np.broadcast_to(b_new, (weight.shape[0],))

    # -- kernels ------------------------------------------------------------------------------
    def _streamed(self, grad: bool = False):
        """The weight's fsdp shard when products should stream it block by block instead of
        gathering it whole (see runtime/numerics/streaming.py); None otherwise. With `grad`
        (a backward product that alpha-CROWN differentiates) any sharded matrix streams: the
        autograd graph would otherwise keep a whole gathered copy, which does not fall with P;
        streaming keeps nothing and gathers again for the gradient (bits unchanged)."""
        p = self.params.get("weight")
        if self.order == "fast" or p is None:
            return None
        if getattr(p, "streams", False):
            return p
        if grad and not isinstance(p, torch.Tensor) and len(p.shape) == 2:
            return p
        return None

    def _with_bias(self, y):
        b = self.param("bias")
        return y + b if b is not None else y

    def forward(self, x):
        stream = self._streamed()
        if stream is not None:
            return self._with_bias(streaming.forward_products(stream, [x], [False], self.order)[0])
        return self._with_bias(contract.matmul(x, self._weight(), self.order))

    def ibp(self, b):
        c, r = center_radius(*b)
        stream = self._streamed()
        if stream is not None:
            yc, yr = streaming.forward_products(stream, [c, r], [False, True], self.order)
        else:
            yc = contract.matmul(c, self._weight(), self.order)
            yr = contract.matmul(r, self.param("weight").abs(), self.order)
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
        stream = self._streamed(getattr(A, "requires_grad", False))
        if stream is not None:
            (A_in,) = streaming.backward_products(stream, [A], self.order)
        else:
            # A (..., N) @ W (N, K): contract over N with W.T as the (K, N) operand.
            A_in = contract.matmul(A, self._weight_t(), self.order)
        return [A_in], self._bias_term(A)

    def _weight_t(self):
        """W.T (K, N) as the backward product's operand: prepared once per program for a
        resident weight (an fsdp shard is gathered per use and freed, so it is transposed per
        use). `fast` multiplies by the transposed view; the ordered kernels read a contiguous
        copy (their bits are pinned for one operand layout)."""
        w = self.param("weight")
        if self.order == "fast":
            return w.t()
        if not isinstance(self.params.get("weight"), torch.Tensor):
            return w.t().contiguous()
        return self._prepared(w)[1]

    def _weight(self):
        """W (N, K) as the forward product's operand (prepared once, as `_weight_t`)."""
        w = self.param("weight")
        if self.order == "fast" or not isinstance(self.params.get("weight"), torch.Tensor):
            return w
        return self._prepared(w)[0]

    def _prepared(self, w):
        """(W, W.T) prepared for the ordered kernels, made on first use and kept while the
        weight tensor is unchanged (tp binding or a device move replaces it; an in-place edit
        bumps its version)."""
        def prepare():
            w_t = contract.prepare(w.t().contiguous(), self.order, w)
            return w_t.transposed(), w_t
        return self.memo("_prepared_memo").get((w,), prepare)

    def unit_backward(self, index, patches=False):
        """Rows `index` of the identity times W: the rows of W itself (and the bias entries),
        exactly what backward_linear gives for them, without the product."""
        if (type(self).backward_linear is not Linear.backward_linear
                or self._streamed() is not None):
            return None
        w = self.param("weight")
        N, K = w.shape
        lead = math.prod(self.in_shapes[0][:-1])
        out, pos = index % N, index // N
        if lead == 1:
            A = w.index_select(0, out)
        else:                           # a linear map along the last axis of a larger tensor
            A = w.new_zeros((len(index), lead, K))
            A[torch.arange(len(index), device=w.device), pos] = w.index_select(0, out)
        b = self.param("bias")
        bias = None if b is None else b.index_select(0, out).unsqueeze(0)
        return [A.reshape(1, len(index), *self.in_shapes[0])], bias

    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        stream = self._streamed(getattr(lA, "requires_grad", False)
                                or getattr(uA, "requires_grad", False))
        if stream is None or uA is None or uA is lA:
            return super().crown_backward(lA, uA, in_bounds, alpha)
        l_in, u_in = streaming.backward_products(stream, [lA, uA], self.order)
        return [l_in], [u_in], self._bias_term(lA), self._bias_term(uA)
