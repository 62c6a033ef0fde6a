"""Turn untrusted ONNX names into legal, unique Python identifiers.

ONNX node and tensor names can hold anything: quotes, newlines, Python code. Nothing from them
may reach a generated program except through `Namespace.name` (identifiers) or as an escaped
literal in a comment (`comment_text`).
"""

from __future__ import annotations

import json
import keyword
import re

_NOT_IDENT = re.compile(r"[^0-9A-Za-z_]+")
_MAX_LEN = 48


class Namespace:
    """Hands out unique identifiers; the same request order always gives the same names."""

    def __init__(self, reserved=()):
        self._taken = set(reserved)

    def name(self, raw: str, fallback: str = "v") -> str:
        base = _NOT_IDENT.sub("_", raw).strip("_").lower()[:_MAX_LEN] or fallback
        if base[0].isdigit():
            base = f"{fallback}_{base}"
        if keyword.iskeyword(base) or keyword.issoftkeyword(base) or base.startswith("__"):
            base = f"{fallback}_{base}"
        candidate, k = base, 1
        while candidate in self._taken:
            k += 1
            candidate = f"{base}_{k}"
        self._taken.add(candidate)
        return candidate


def comment_text(raw: str, limit: int = 80) -> str:
    """An untrusted string as a one-line, ASCII, quoted literal fit for a comment."""
    text = json.dumps(str(raw), ensure_ascii=True)
    return text if len(text) <= limit else text[: limit - 4] + '..."'


def is_identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name) and name.isascii()
