"""Entry points that work whatever autograd mode the caller is in.

A user may call a compiled verifier under `torch.inference_mode()`, as PyTorch recommends for
evaluation. Bound computation needs what that mode takes away: alpha-CROWN and the attacks
differentiate, and the kernels' memos (runtime/ops/memo.py) read version counters, which
inference tensors lack ("Inference tensors do not track version counter"). So the public
entry points leave inference mode for their own work and copy any inference tensor they are
given into an ordinary one (a copy of the box: small next to the bound computation).
"""
from __future__ import annotations

import functools

import torch


def ordinary(value):
    """`value`, or an ordinary copy of it when it is an inference tensor (call this outside
    inference mode: a clone made inside it is an inference tensor again)."""
    if isinstance(value, torch.Tensor) and value.is_inference():
        return value.clone()
    return value


def outside_inference_mode(fn):
    """Run `fn` with inference mode off and its tensor arguments made ordinary."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False):
            return fn(*(ordinary(a) for a in args),
                      **{k: ordinary(v) for k, v in kwargs.items()})
    return wrapper
