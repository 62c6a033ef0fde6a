"""Shape arithmetic the kernels need on every call, without torch.broadcast_shapes.

torch.broadcast_shapes goes through torch._refs, whose first call imports sympy and
torch.fx's symbolic shapes: 0.4-1.2 s in every fresh process (each rank of a job, each CLI
run under `--summation blocked`), and ~100 us of Python-side checks on every later call.
"""

from __future__ import annotations

import torch


def broadcast_shape(*shapes) -> torch.Size:
    """The broadcast of `shapes` (numpy / torch rules); ValueError when they do not broadcast."""
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        for i, n in enumerate(shape, rank - len(shape)):
            n = int(n)
            if n != 1:
                if out[i] not in (1, n):
                    raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
                out[i] = n
    return torch.Size(out)
