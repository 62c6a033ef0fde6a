"""Kernels' memos (runtime/ops/memo.py) follow their source tensors: an in-place edit of a
bound or a weight gives the result a fresh kernel computes, never the stale one."""
from __future__ import annotations

import torch

from shardbound.runtime.ops.linear import Linear
from shardbound.runtime.ops.memo import LastValueMemo, tensor_key
from shardbound.runtime.ops.softmax import Softmax


def test_memo_recomputes_after_an_in_place_write_only():
    calls = []
    t = torch.zeros(3)
    memo = LastValueMemo()
    for _ in range(2):
        memo.get((t,), lambda: calls.append(1) or t.sum().item())
    assert len(calls) == 1
    t.add_(1.0)
    assert memo.get((t,), lambda: calls.append(1) or t.sum().item()) == 3.0
    assert len(calls) == 2
    assert tensor_key(t[1:]) != tensor_key(t[:2])          # same storage, another view
    with torch.inference_mode():
        frozen = torch.ones(2)
    assert tensor_key(frozen) != tensor_key(frozen)        # no version counter: never reused


def test_softmax_lines_follow_bounds_edited_in_place():
    torch.manual_seed(0)
    lo = torch.randn(1, 2, 4)
    hi = lo + torch.rand(1, 2, 4)
    A = torch.randn(1, 3, 2, 4)
    op = Softmax("s", ["x"], [(2, 4)], order="blocked")
    op.crown_backward(A, A, [(lo, hi)])
    hi.sub_(0.5 * (hi - lo))                               # a tighter box, same tensors
    fresh = Softmax("s", ["x"], [(2, 4)], order="blocked")
    got, want = op.crown_backward(A, A, [(lo, hi)]), fresh.crown_backward(A, A, [(lo, hi)])
    for g, w in zip(got, want):
        g, w = (g[0], w[0]) if isinstance(g, list) else (g, w)
        assert torch.equal(g, w)


def test_linear_weight_edited_in_place_is_prepared_again():
    torch.manual_seed(1)
    w, b = torch.randn(3, 5), torch.randn(3)
    op = Linear("fc", ["x"], [(5,)], params={"weight": w, "bias": b}, order="blocked")
    A = torch.randn(1, 2, 3)
    before = op.backward_linear(A)
    w.mul_(2.0)
    fresh = Linear("fc", ["x"], [(5,)], params={"weight": w.clone(), "bias": b}, order="blocked")
    after, want = op.backward_linear(A), fresh.backward_linear(A)
    assert not torch.equal(_first(before), _first(after))
    assert torch.equal(_first(after), _first(want))


def _first(result):
    while isinstance(result, (list, tuple)):
        result = result[0]
    return result
