"""Bounds as results: the SHA-256 every bitwise claim is checked with, and the text table."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from shardbound.runtime.errors import ShardboundError


def bounds_sha256(lower: torch.Tensor, upper: torch.Tensor) -> str:
    """SHA-256 of the little-endian float32 bytes of lower followed by upper."""
    h = hashlib.sha256()
    for t in (lower, upper):
        h.update(np.ascontiguousarray(t.detach().cpu().numpy(), dtype="<f4").tobytes())
    return h.hexdigest()


def format_table(lower: torch.Tensor, upper: torch.Tensor) -> str:
    lo, hi = lower.reshape(-1).tolist(), upper.reshape(-1).tolist()
    width = len(str(len(lo) - 1))
    lines = [f"{'row':>{max(width, 3)}}  {'lower':>16}  {'upper':>16}"]
    for i, (a, b) in enumerate(zip(lo, hi)):
        lines.append(f"{i:>{max(width, 3)}}  {a:>16.9g}  {b:>16.9g}")
    return "\n".join(lines)


def write_output(path: str, text: str) -> None:
    """Write a result file; a failure is a user error naming the file."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise ShardboundError(f"{path}: cannot write the result ({e.strerror})") from None
