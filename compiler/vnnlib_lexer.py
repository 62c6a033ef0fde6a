"""Tokenizer and S-expression reader for VNN-LIB files.

Kept apart from :mod:`shardbound.compiler.vnnlib` so that the semantic layer (declarations,
DNF, normalisation) stays readable. Every node remembers the 1-based line it starts on,
because every user-facing error has to point at a line: a property file can be thousands of
lines long (mnistfc has ~2400), and "syntax error" without a location is useless there.
"""

from __future__ import annotations

import math
import re

from .errors import ShardboundError

# One regex pass over the whole text is far faster than a character loop in Python. Newlines
# are matched as their own token so the reader can count lines without re-scanning; other
# whitespace is skipped by finditer. Comments run from ';' to the end of the line.
_TOKEN = re.compile(r"\n|;[^\n]*|[()]|[^\s();]+")

# Real properties nest a handful of lists deep (assert / or / and / comparison / term); the
# parser and the DNF expansion recurse over the nesting, so a deeper file is refused here with
# a line number (a 1,000-deep one overflowed the stack: RecursionError).
MAX_DEPTH = 64

# Decimal numbers in every usual spelling: 3, -0.5, +2, .5, 5., 1e-3, 1.5E+2.
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


class Atom:
    """A symbol or number token, with the line it is on."""

    __slots__ = ("text", "line")

    def __init__(self, text: str, line: int):
        self.text = text
        self.line = line


class SList:
    """A parenthesised list; ``line`` is the line of its opening parenthesis."""

    __slots__ = ("items", "line")

    def __init__(self, line: int):
        self.items: list = []
        self.line = line


def fail(name: str, line: int, message: str) -> ShardboundError:
    """Build the one-line ``file:line: message`` error that the CLI prints verbatim."""
    return ShardboundError(f"{name}:{line}: {message}")


def read_sexprs(text: str, name: str) -> list:
    """Split ``text`` into its top-level S-expressions (``Atom`` / ``SList`` trees).

    Parenthesis balance is checked here, because later stages assume well-formed trees.
    An unclosed '(' is reported at the outermost still-open parenthesis: with one ')'
    missing, every later command nests inside the broken one, so the outermost open
    parenthesis is the command the user has to fix.
    """
    top: list = []
    stack: list[SList] = []
    items = top
    line = 1
    for match in _TOKEN.finditer(text):
        tok = match.group()
        first = tok[0]
        if first == "\n":
            line += 1
        elif first == ";":
            continue
        elif first == "(":
            node = SList(line)
            items.append(node)
            stack.append(node)
            items = node.items
            if len(stack) > MAX_DEPTH:
                raise fail(name, line, f"lists nested more than {MAX_DEPTH} deep; a VNN-LIB "
                           "property needs a handful of levels: simplify the formula")
        elif first == ")":
            if not stack:
                raise fail(name, line, "unexpected token ')' with no matching '('; "
                           "remove it or add the missing '('")
            stack.pop()
            items = stack[-1].items if stack else top
        else:
            items.append(Atom(tok, line))
    if stack:
        raise fail(name, stack[0].line, "unbalanced parentheses: this '(' is never closed; "
                   "add the missing ')'")
    return top


def looks_numeric(text: str) -> bool:
    """True for tokens that can only be meant as numbers (so a malformed one is a bad
    number, not an unknown variable)."""
    first = text[0]
    if first.isdigit() or first == ".":
        return True
    return first in "+-" and len(text) > 1 and (text[1].isdigit() or text[1] == ".")


def parse_number(atom: Atom, name: str) -> float:
    """Convert a numeric token to a finite float, or fail naming the token."""
    if not _NUMBER.fullmatch(atom.text):
        raise fail(name, atom.line, f"bad number '{atom.text}'; write a decimal such as "
                   "0.5, -2, 1e-3")
    value = float(atom.text)
    if not math.isfinite(value):
        raise fail(name, atom.line, f"number '{atom.text}' is out of range; use a finite "
                   "value")
    return value


def render(node, limit: int = 60) -> str:
    """Source-like text of a node for error messages, shortened to ``limit`` characters."""
    if isinstance(node, Atom):
        text = node.text
    else:
        text = "(" + " ".join(render(item, limit) for item in node.items) + ")"
    return text if len(text) <= limit else text[: limit - 3] + "..."
