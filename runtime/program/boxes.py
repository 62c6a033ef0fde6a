"""Input boxes and spec matrices from users: checked here, with errors that name the field."""

from __future__ import annotations

import json
import math

import torch

from shardbound.runtime.errors import ShardboundError




def as_boxes(lower, upper, input_shape, where: str = "box") -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(lower, upper) as float32 (B, *input_shape) tensors, and whether the caller passed a
    single box (so results can be returned without the batch axis).

    Accepted forms: flattened (n,), shaped input_shape, or batched (B, n) / (B, *input_shape).
    """
    n = math.prod(input_shape)
    out = []
    single = False
    for field, value in (("lower", lower), ("upper", upper)):
        try:
            t = torch.as_tensor(value, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise ShardboundError(f"{where}: {field!r} must be a list of numbers") from None
        if t.numel() == n and (t.dim() <= 1 or tuple(t.shape) == tuple(input_shape)):
            single = True
            t = t.reshape(1, *input_shape)
        elif t.dim() >= 2 and math.prod(t.shape[1:]) == n:
            t = t.reshape(t.shape[0], *input_shape)
        else:
            raise ShardboundError(
                f"{where}: {field!r} has {t.numel()} values (shape {tuple(t.shape)}); the model "
                f"input {tuple(input_shape)} needs {n} per box")
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t.reshape(-1))).nonzero()[0])
            raise ShardboundError(f"{where}: {field!r}[{bad}] is not a finite number")
        out.append(t.contiguous())
    lo, hi = out
    if lo.shape != hi.shape:
        raise ShardboundError(f"{where}: 'lower' and 'upper' hold different numbers of boxes")
    bad = (lo > hi).reshape(-1).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ShardboundError(f"{where}: lower[{i}] = {lo.reshape(-1)[i].item():.9g} is greater "
                              f"than upper[{i}] = {hi.reshape(-1)[i].item():.9g}")
    return lo, hi, single


def read_box_file(path: str) -> tuple[list, list]:
    """A BOX.json file: {"lower": [...], "upper": [...]}."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ShardboundError(f"{path}: no such box file") from None
    except IsADirectoryError:
        raise ShardboundError(f"{path}: is a directory, not a box file") from None
    except (OSError, ValueError) as e:
        raise ShardboundError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or "lower" not in data or "upper" not in data:
        raise ShardboundError(f'{path}: expected an object {{"lower": [...], "upper": [...]}}')
    return data["lower"], data["upper"]
