"""A kernel's memory of the last thing it computed from some tensors, and when it is stale.

Kernels keep a few derived tensors between calls: a weight transposed once per program, a
softmax node's lines met again by every backward pass of one bound computation. Such a memo is
only right while its source tensors hold the same values. Object identity alone does not say
that: a bound or a weight changed in place (a user editing an imported verifier's parameters,
a future in-place tightening) is still the same object. The key below adds the tensor's
version counter, which PyTorch bumps on every in-place write, and the view geometry; the memo
holds its sources, so their storage cannot be freed and reused under the same address.
"""
from __future__ import annotations

from typing import Callable

import torch


def tensor_key(*tensors: torch.Tensor | None) -> tuple:
    """What identifies the current value of each tensor without reading it (no object
    identity: a fresh view of the same bounds, as each CROWN step makes, is the same value;
    a memo holds its sources, so their storage is not reused meanwhile). An inference
    tensor (made under torch.inference_mode) has no version counter: its key is a fresh
    object, equal to nothing, so what depends on it is recomputed every time."""
    return tuple(None if t is None else object() if t.is_inference() else
                 (t.data_ptr(), tuple(t.shape), t.stride(), t.storage_offset(), t._version,
                  t.dtype, t.device)
                 for t in tensors)


class LastValueMemo:
    """compute() for the most recent sources only: one entry, replaced when they change."""

    __slots__ = ("_key", "_sources", "_value")

    def __init__(self):
        self._key, self._sources, self._value = None, None, None

    def get(self, sources: tuple, compute: Callable[[], object]):
        key = tensor_key(*sources)
        if self._key != key:
            self._value = compute()
            self._key, self._sources = key, sources
        return self._value

    def clear(self) -> None:
        self._key, self._sources, self._value = None, None, None
