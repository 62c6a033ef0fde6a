"""Input boxes and spec matrices from users: checked here, with errors that name the field."""

from __future__ import annotations

import json
import math

import torch

from shardbound.runtime.errors import ShardboundError

MAX_NESTING = 16        # list depth of a box field: (B, C, H, W) needs 4


def number_problem(value) -> str | None:
    """What keeps `value` from being a number or (nested) lists of numbers, or None. JSON
    true/false are not numbers (torch read them as 1 and 0), and nesting is bounded (a
    1,000-deep list overflowed the stack). Iterative, so any input gets an answer."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, list):
            if depth >= MAX_NESTING:
                return f"is nested more than {MAX_NESTING} lists deep; give a flat list"
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            shown = json.dumps(v)[:30] if isinstance(v, (str, bool, type(None))) else \
                type(v).__name__
            return f"holds {shown}, which is not a number; give numbers only"
    return None


def as_boxes(lower, upper, input_shape, where: str = "box") -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(lower, upper) as float32 (B, *input_shape) tensors, and whether the caller passed a
    single box (so results can be returned without the batch axis).

    Accepted forms: flattened (n,), shaped input_shape, or batched (B, n) / (B, *input_shape).
    """
    n = math.prod(input_shape)
    out = []
    single = False
    for field, value in (("lower", lower), ("upper", upper)):
        problem = number_problem(value) if isinstance(value, list) else None
        if problem:
            raise ShardboundError(f"{where}: {field!r} {problem}")
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
    except RecursionError:
        raise ShardboundError(f"{path}: nested too deeply; a box file is "
                              '{"lower": [...], "upper": [...]}') from None
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ShardboundError(f"{path}: not valid JSON ({first})") from None
    if not isinstance(data, dict) or "lower" not in data or "upper" not in data:
        raise ShardboundError(f'{path}: expected an object {{"lower": [...], "upper": [...]}}')
    return data["lower"], data["upper"]
