"""VNN-LIB 2.0 properties, read into the same normal form as VNN-LIB 1.0.

A 2.0 file (the format of VNN-COMP 2026; grammar: the VNN-LIB standard's `grammar.cf`) starts
with ``(vnnlib-version <2.0>)``, declares its network(s) with typed, shaped tensors and
asserts over tensor elements::

    (vnnlib-version <2.0>)
    (declare-network f
        (declare-input  X float32 [1,5])
        (declare-output Y float32 [5]))
    (assert (and (>= X[0,0] -0.3) (<= X[0,0] 0.6)))
    (assert (<= Y[1] Y[0]))

It differs from 1.0 only in how variables are named and declared, so this parser is the 1.0
parser (:class:`shardbound.compiler.vnnlib._Parser`: formulas, linear terms, DNF, boxes and
output rows) with 2.0 declarations and element references: ``X[i,j]`` is position
``ravel((i, j), shape)`` of the flattened input (row-major, as the network's input tensor is
flattened), a scalar tensor (shape ``[]``) is written ``X``. Comparisons are binary and
equality is ``==``; ``!=`` is refused (its violation set is not a union of boxes and
half-spaces we could bound). The file is read by content: the caller
(:func:`shardbound.compiler.vnnlib.parse_vnnlib_text`) sends it here when the first command
is ``vnnlib-version``.

Why not the PyPI `vnnlib` package (the standard's own bindings): measured with 1.0.2
(`bench/vnnlib2_pkg.py`) it is 5-20x faster, but its `compat.transform` turns ACAS Xu
prop_6 (an `or` of two input boxes next to an `or` of output rows) into an unbounded box
holding the rows plus the two boxes with no output constraint, which would make every output
a violation; parse time is not what a verify run waits for (tens of ms for mnistfc).

Not supported yet, each a one-line error naming the line: several networks (equivalence and
monotonicity properties: ``equal-to`` / ``isomorphic-to``, or two ``declare-network``),
several input or output tensors, ``declare-hidden`` (constraints on inner nodes).
"""

from __future__ import annotations

import math
import re

from .vnnlib import _Parser, _product
from .vnnlib_lexer import Atom, SList, render

_VERSION = re.compile(r"<(\d+)\.(\d+)>")
_ELEMENT = re.compile(r"([A-Za-z][A-Za-z0-9_]*)(?:\[([^\[\]]*)\])?")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_INDEX = re.compile(r"0|[1-9][0-9]*")
# Element types a bound of a float network can be stated in; integer and boolean tensors
# cannot be the input of a network we bound.
_REAL_TYPES = {"real", "float16", "float32", "float64", "bfloat16", "float8e4m3fn",
               "float8e5m2", "float8e4m3fnuz", "float8e5m2fnuz", "float4e2m1"}
_IGNORED = ("check-sat", "exit", "get-model", "set-info", "set-option")


class Parser2(_Parser):
    """The 1.0 parser with VNN-LIB 2.0 declarations and element references."""

    COMPARISONS = ("<=", "<", ">=", ">", "==")
    EQUAL = "=="

    def __init__(self, name: str):
        super().__init__(name)
        # tensor name -> (kind "X"/"Y", shape, line of its declaration)
        self.tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
        self.network: str | None = None

    # ---- top level -------------------------------------------------------------------
    def parse_commands(self, commands: list):
        self._version(commands[0])
        asserts = []
        for node in commands[1:]:
            if isinstance(node, Atom):
                raise self.error(node.line, f"unexpected token '{node.text}' outside any "
                                 "command; wrap it in (assert ...) or remove it")
            head = self._head(node, "command")
            if head == "declare-network":
                self._network(node)
            elif head == "assert":
                if len(node.items) != 2:
                    raise self.error(node.line, f"'assert' takes exactly one formula, got "
                                     f"{len(node.items) - 1} in {render(node)}")
                asserts.append(node.items[1])
            elif head == "vnnlib-version":
                raise self.error(node.line, "a second (vnnlib-version ...); give the "
                                 "version once, as the first command")
            elif head not in _IGNORED:
                raise self.error(node.line, f"unsupported command '{head}'; VNN-LIB 2.0 "
                                 "uses declare-network and assert")
        if self.network is None:
            raise self.error(commands[0].line, "no (declare-network ...) in this VNN-LIB "
                             "2.0 file; declare the network's input and output")
        terms = _product([self._formula(self._joined(node)) for node in asserts], self)
        return self._build(terms)

    def _version(self, node: SList) -> None:
        items = node.items
        match = (_VERSION.fullmatch(items[1].text)
                 if len(items) == 2 and isinstance(items[1], Atom) else None)
        if not match:
            raise self.error(node.line, f"malformed version {render(node)}; write "
                             "(vnnlib-version <2.0>)")
        if int(match.group(1)) != 2:
            raise self.error(node.line, f"VNN-LIB version {items[1].text} is not supported; "
                             "shardbound reads 1.0 (no version line) and 2.x")

    # ---- declarations ----------------------------------------------------------------
    def _network(self, node: SList) -> None:
        items = node.items
        if len(items) < 2 or not isinstance(items[1], Atom) or not _NAME.fullmatch(
                items[1].text):
            raise self.error(node.line, f"malformed network declaration {render(node)}; "
                             "write (declare-network NAME (declare-input ...) "
                             "(declare-output ...))")
        name = items[1].text
        if self.network is not None:
            raise self.error(node.line, f"a second network '{name}' (after "
                             f"'{self.network}'): properties over several networks "
                             "(equivalence, monotonicity) are not supported yet")
        self.network = name
        counts = {"X": 0, "Y": 0}
        for decl in items[2:]:
            if not isinstance(decl, SList):
                raise self.error(decl.line, f"unexpected '{render(decl)}' in network "
                                 f"'{name}'; expected (declare-input ...) or "
                                 "(declare-output ...)")
            head = self._head(decl, "declaration")
            if head in ("declare-input", "declare-output"):
                kind = "X" if head == "declare-input" else "Y"
                counts[kind] += 1
                if counts[kind] > 1:
                    role = "input" if kind == "X" else "output"
                    raise self.error(decl.line, f"network '{name}' declares a second "
                                     f"{role} tensor; shardbound verifies networks with one "
                                     f"input and one output")
                self._tensor(decl, kind)
            elif head == "declare-hidden":
                raise self.error(decl.line, "constraints on hidden nodes (declare-hidden) "
                                 "are not supported yet; constrain inputs and outputs")
            elif head in ("equal-to", "isomorphic-to"):
                raise self.error(decl.line, f"({head} ...) relates two networks; properties "
                                 "over several networks are not supported yet")
            else:
                raise self.error(decl.line, f"unsupported '{head}' in network '{name}'; "
                                 "use declare-input and declare-output")
        for kind, role in (("X", "input"), ("Y", "output")):
            if counts[kind] == 0:
                raise self.error(node.line, f"network '{name}' declares no {role}; add "
                                 f"(declare-{role} {kind} float32 [N])")

    def _tensor(self, decl: SList, kind: str) -> None:
        """(declare-input NAME TYPE [d0,d1,...] ["onnx name"]); the shape may be spaced."""
        items = decl.items
        if len(items) < 4 or not all(isinstance(i, Atom) for i in items[1:]):
            raise self.error(decl.line, f"malformed declaration {render(decl)}; write "
                             f"({items[0].text} X float32 [1,5])")
        var, dtype = items[1], items[2]
        rest = [a.text for a in items[3:]]
        quoted = next((i for i, text in enumerate(rest) if text.startswith('"')), len(rest))
        rest = rest[:quoted]        # an optional "onnx name" follows; it is not checked
        if not _NAME.fullmatch(var.text):
            raise self.error(var.line, f"bad tensor name '{var.text}'; names start with a "
                             "letter")
        if dtype.text.lower() not in _REAL_TYPES:
            raise self.error(dtype.line, f"element type '{dtype.text}' of {var.text} is not "
                             "a real or floating-point type; shardbound bounds float networks")
        shape = self._shape("".join(rest), var.text, decl.line)
        if var.text in self.tensors:
            first = self.tensors[var.text][2]
            raise self.error(var.line, f"tensor '{var.text}' is declared twice (first on "
                             f"line {first}); rename one")
        self.tensors[var.text] = (kind, shape, decl.line)
        self.sizes[kind] = math.prod(shape)

    def _shape(self, text: str, var: str, line: int) -> tuple[int, ...]:
        if not (text.startswith("[") and text.endswith("]")):
            raise self.error(line, f"bad shape '{text}' for {var}; write [d0,d1,...] (or [] "
                             "for a scalar)")
        body = text[1:-1]
        dims = body.split(",") if body else []
        if not all(_INDEX.fullmatch(d) and int(d) > 0 for d in dims):
            raise self.error(line, f"bad shape '{text}' for {var}; dimensions are positive "
                             "integers")
        return tuple(int(d) for d in dims)

    # ---- element references ------------------------------------------------------------
    def _joined(self, node):
        """The tree with element references re-joined where whitespace split them: `X [0]`
        and `X[0, 1]` are the lexer's atoms `X` `[0]` and `X[0,` `1]`."""
        if isinstance(node, Atom):
            return node
        out = SList(node.line)
        for item in node.items:
            if isinstance(item, SList):
                out.items.append(self._joined(item))
                continue
            prev = out.items[-1] if out.items else None
            if isinstance(prev, Atom) and (prev.text.count("[") > prev.text.count("]")
                                           or (item.text.startswith("[")
                                               and prev.text in self.tensors)):
                out.items[-1] = Atom(prev.text + item.text, prev.line)
            else:
                out.items.append(item)
        return out

    def _variable(self, atom: Atom) -> tuple[str, int]:
        match = _ELEMENT.fullmatch(atom.text)
        decl = self.tensors.get(match.group(1)) if match else None
        if decl is None:
            raise self.error(atom.line, f"unknown variable '{atom.text}'; refer to an element "
                             "of a declared tensor, as X[0,3] (declared in declare-network)")
        kind, shape, _ = decl
        name, body = match.group(1), match.group(2)
        if body is None:
            if shape:
                raise self.error(atom.line, f"'{name}' is a tensor of shape "
                                 f"{list(shape)}; refer to one element, as "
                                 f"{name}[{','.join('0' * len(shape))}]")
            return kind, 0
        index = body.split(",") if body else []
        if not all(_INDEX.fullmatch(i) for i in index) or len(index) != len(shape):
            raise self.error(atom.line, f"bad index in '{atom.text}': {name} has shape "
                             f"{list(shape)}, so give {len(shape)} integer(s) in [...]")
        flat = 0
        for i, d in zip(index, shape):
            if int(i) >= d:
                raise self.error(atom.line, f"index out of range in '{atom.text}': {name} "
                                 f"has shape {list(shape)}")
            flat = flat * d + int(i)
        return kind, flat

    def _formula(self, node) -> list:
        if isinstance(node, SList) and node.items and isinstance(node.items[0], Atom):
            op = node.items[0].text
            if op == "!=":
                raise self.error(node.line, f"'!=' in {render(node)} is not supported (its "
                                 "set is not closed); write the two strict sides with or")
            if op == "=":
                raise self.error(node.line, f"'=' in {render(node)}: VNN-LIB 2.0 writes "
                                 "equality as '=='")
            if op in self.COMPARISONS and len(node.items) != 3:
                raise self.error(node.line, f"'{op}' compares exactly two terms in VNN-LIB "
                                 f"2.0, got {len(node.items) - 1} in {render(node)}")
        return super()._formula(node)

    # ---- messages ----------------------------------------------------------------------
    def _input(self) -> tuple[str, tuple[int, ...], int]:
        return next((n, s, line) for n, (k, s, line) in self.tensors.items() if k == "X")

    def _input_label(self, index: int) -> str:
        name, shape, _ = self._input()
        if not shape:
            return name
        digits = []
        for d in reversed(shape):
            digits.append(index % d)
            index //= d
        return f"{name}[{','.join(str(i) for i in reversed(digits))}]"

    def _input_line(self, index: int) -> int:
        return self._input()[2]
