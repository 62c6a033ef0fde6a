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
    """Write a result file whole or not at all (a temporary file in the same folder, then
    renamed over it: a process stopped while writing never leaves half a result); a failure
    is a user error naming the file."""
    import os
    import stat

    try:
        special = not stat.S_ISREG(os.stat(path).st_mode) and not os.path.isdir(path)
    except OSError:
        special = False
    if special:             # /dev/stdout, a pipe: write straight through
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            return
        except OSError as e:
            raise ShardboundError(f"{path}: cannot write the result ({e.strerror})") from None
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        why = e.strerror or type(e).__name__
        if os.path.isdir(path):
            why = "it is a directory"
        raise ShardboundError(f"{path}: cannot write the result ({why}); choose a writable "
                              "file") from None
