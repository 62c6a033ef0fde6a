"""VNN-LIB property parser (1.0 here; 2.0 in vnnlib2.py, chosen by content).

A VNN-LIB file describes the *violation* region of a property: the inputs X and outputs Y
that together form a counterexample. We read it into a normal form that a bound-propagation
verifier can use directly:

    violated  <=>  exists case:  lower <= x <= upper  and  exists conjunction: C @ f(x) <= d

Why this shape: input constraints in VNN-COMP files are always boxes (possibly several, via
a top-level ``or``), which is what interval / linear bound propagation starts from; output
constraints are linear, and writing every one of them as ``c . y <= d`` means a verifier
needs exactly one check (an upper bound of ``c . y - d`` that is negative refutes the row).

We wrote our own reader because the PyPI ``vnnlib`` package reads only VNN-LIB 2.0. A file
whose first command is ``(vnnlib-version <2.x>)`` is VNN-LIB 2.0 and is read by
:mod:`shardbound.compiler.vnnlib2` (a subclass of this parser: the same formulas, DNF and
normal form, so a 2.0 file and its 1.0 twin give the same boxes and rows).

Normalisation conventions:
  * ``(<= a b)`` and ``(< a b)`` become ``a - b <= 0``; ``(>= a b)`` / ``(> a b)`` become
    ``b - a <= 0``. Strict inequalities are treated as non-strict (the boundary has measure
    zero and floating-point verification cannot tell the difference anyway). ``(= a b)``
    gives both rows, and chains such as ``(<= a b c)`` give one row per adjacent pair.
  * The file is the conjunction of its asserts; that formula is expanded to disjunctive
    normal form, each term's X-constraints become a box and its Y-constraints one
    ``Conjunction``; terms with the same box are grouped into one ``Case``, in file order.
  * Terms whose box is empty (some lower > upper) can never be violated and are dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ShardboundError
from .vnnlib_lexer import Atom, SList, fail, looks_numeric, parse_number, read_sexprs, render

__all__ = ["Conjunction", "Case", "Property", "parse_vnnlib", "parse_vnnlib_text"]

_VAR_NAME = re.compile(r"([XY])_(0|[1-9][0-9]*)")
_COMPARISONS = ("<=", "<", ">=", ">", "=")
_IGNORED_COMMANDS = ("check-sat", "exit", "get-model", "set-logic", "set-info", "set-option")
# DNF expansion is exponential in nested and-of-or; real benchmarks stay tiny, so a large
# count means a malformed or adversarial file and we stop instead of exhausting memory.
_MAX_TERMS = 100_000


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class Conjunction:
    """The output set {y : C @ y <= d}; C is (k, num_outputs), d is (k,), both float64.
    k == 0 means "no output constraint": every output is a violation."""

    C: np.ndarray
    d: np.ndarray

    def is_satisfied(self, y, tol: float = 0.0):
        """Whether y (shape (n,) or a batch (..., n)) lies in this set, allowing ``tol``
        slack per row (useful when checking a counterexample computed in float32)."""
        y = np.asarray(y, dtype=np.float64)
        ok = np.all(y @ self.C.T <= self.d + tol, axis=-1)
        return bool(ok) if y.ndim == 1 else ok


@dataclass(frozen=True, eq=False)
class Case:
    """One input box together with the disjunction of output sets that violate the
    property for inputs in that box."""

    lower: np.ndarray
    upper: np.ndarray
    disjuncts: tuple[Conjunction, ...]

    def contains_input(self, x, tol: float = 0.0) -> bool:
        x = np.asarray(x, dtype=np.float64)
        return bool(np.all(x >= self.lower - tol) and np.all(x <= self.upper + tol))

    def output_violates(self, y, tol: float = 0.0) -> bool:
        """True when y satisfies at least one disjunct, i.e. is a violating output."""
        return any(conj.is_satisfied(y, tol) for conj in self.disjuncts)


@dataclass(frozen=True, eq=False)
class Property:
    """A parsed VNN-LIB file. ``cases`` is never empty and every box is finite."""

    path: str
    num_inputs: int
    num_outputs: int
    cases: tuple[Case, ...]

    def violates_output(self, case_index: int, y, tol: float = 0.0) -> bool:
        return self.cases[case_index].output_violates(y, tol)

    def holds_for_output(self, case_index: int, y, tol: float = 0.0) -> bool:
        """True when output y (for an input in that case's box) is *not* a violation."""
        return not self.violates_output(case_index, y, tol)

    def is_counterexample(self, x, y, tol: float = 0.0) -> bool:
        """Whether the pair (x, y = f(x)) violates the property."""
        return any(case.contains_input(x, tol) and case.output_violates(y, tol)
                   for case in self.cases)


def parse_vnnlib(path) -> Property:
    """Parse a VNN-LIB 1.0 or 2.0 file; errors are ShardboundError naming ``path`` and a line."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ShardboundError(f"{name}: not a text file (byte {exc.object[exc.start]:#04x} at "
                              f"offset {exc.start} is not UTF-8); a VNN-LIB property is plain "
                              "text: check that this is the .vnnlib file, uncompressed") from None
    except OSError as exc:
        raise ShardboundError(f"{name}: cannot read property file ({exc}); check the path")
    return parse_vnnlib_text(text, name)


def parse_vnnlib_text(text: str, name: str = "<string>") -> Property:
    """Parse VNN-LIB source held in memory (1.0, or 2.0 when the first command is
    ``(vnnlib-version ...)``); ``name`` is used in error messages."""
    commands = read_sexprs(text, name)
    if commands and isinstance(commands[0], SList) and commands[0].items \
            and isinstance(commands[0].items[0], Atom) \
            and commands[0].items[0].text == "vnnlib-version":
        from .vnnlib2 import Parser2

        return Parser2(name).parse_commands(commands)
    return _Parser(name).parse_commands(commands)


class _Parser:
    """One-shot parser state: declarations and the file name used in every error."""

    COMPARISONS = _COMPARISONS
    EQUAL = "="            # VNN-LIB 2.0 spells it "=="

    def __init__(self, name: str):
        self.name = name
        self.decls: dict[str, tuple[str, int, int]] = {}  # name -> (kind, index, line)
        self.sizes = {"X": 0, "Y": 0}

    def error(self, line: int, message: str) -> ShardboundError:
        return fail(self.name, line, message)

    # ---- top level -------------------------------------------------------------------
    def parse(self, text: str) -> Property:
        return self.parse_commands(read_sexprs(text, self.name))

    def parse_commands(self, commands: list) -> Property:
        asserts = []
        # Declarations are collected first so that the order of declare/assert does not
        # matter; undeclared names are still caught when the asserts are read.
        for node in commands:
            if isinstance(node, Atom):
                raise self.error(node.line, f"unexpected token '{node.text}' outside any "
                                 "command; wrap it in (assert ...) or remove it")
            head = self._head(node, "command")
            if head == "declare-const":
                self._declare(node)
            elif head == "assert":
                if len(node.items) != 2:
                    raise self.error(node.line, f"'assert' takes exactly one formula, got "
                                     f"{len(node.items) - 1} in {render(node)}")
                asserts.append(node.items[1])
            elif head not in _IGNORED_COMMANDS:
                raise self.error(node.line, f"unsupported command '{head}'; VNN-LIB 1.0 "
                                 "uses only declare-const and assert")
        self._check_declarations()
        terms = _product([self._formula(node) for node in asserts], self)
        return self._build(terms)

    def _head(self, node: SList, what: str) -> str:
        if not node.items:
            raise self.error(node.line, f"empty list '()' where a {what} was expected; "
                             "remove it")
        head = node.items[0]
        if not isinstance(head, Atom):
            raise self.error(node.line, f"expected an operator name at the start of "
                             f"{render(node)}, got '{render(head)}'")
        return head.text

    def _declare(self, node: SList) -> None:
        items = node.items
        if len(items) != 3 or not all(isinstance(item, Atom) for item in items):
            raise self.error(node.line, f"malformed declaration {render(node)}; write "
                             "(declare-const X_0 Real)")
        var, sort = items[1], items[2]
        if sort.text != "Real":
            raise self.error(sort.line, f"unsupported sort '{sort.text}' for {var.text}; "
                             "VNN-LIB variables are declared Real")
        match = _VAR_NAME.fullmatch(var.text)
        if not match:
            raise self.error(var.line, f"unknown variable name '{var.text}'; declare inputs "
                             "as X_<i> and outputs as Y_<j>")
        if var.text in self.decls:
            first = self.decls[var.text][2]
            raise self.error(var.line, f"variable '{var.text}' is declared twice (first on "
                             f"line {first}); remove one declaration")
        kind, index = match.group(1), int(match.group(2))
        self.decls[var.text] = (kind, index, var.line)
        self.sizes[kind] = max(self.sizes[kind], index + 1)

    def _check_declarations(self) -> None:
        """Indices must be dense from 0, because they are positions in the network's
        flattened input and output tensors."""
        for kind, role in (("X", "input"), ("Y", "output")):
            if self.sizes[kind] == 0:
                raise self.error(1, f"no {role} variables declared; add "
                                 f"(declare-const {kind}_0 Real) and the rest")
            indices = {idx: line for k, idx, line in self.decls.values() if k == kind}
            if len(indices) != self.sizes[kind]:
                gap = min(set(range(self.sizes[kind])) - indices.keys())
                after = min(idx for idx in indices if idx > gap)
                raise self.error(indices[after], f"{kind}_{after} is declared but "
                                 f"{kind}_{gap} is not; {role} indices must run from 0 "
                                 "without gaps: declare the missing one or renumber")

    # ---- formulas -> DNF -------------------------------------------------------------
    # A DNF is a list of terms; a term is a list of constraint tuples:
    #   ("L", i, value, line) / ("U", i, value, line): lower / upper bound on X_i
    #   ("Y", {j: coef}, rhs): sum coef * Y_j <= rhs
    # [] is "false" and [[]] is "true".
    def _formula(self, node) -> list:
        if isinstance(node, Atom):
            if node.text in ("true", "false"):
                return [[]] if node.text == "true" else []
            raise self.error(node.line, f"expected a constraint such as (<= X_0 1), got "
                             f"'{node.text}'")
        op = self._head(node, "constraint")
        args = node.items[1:]
        if op == "and":
            return _product([self._formula(arg) for arg in args], self)
        if op == "or":
            if not args:
                raise self.error(node.line, "empty (or) is always false; give it at least "
                                 "one alternative")
            return [term for arg in args for term in self._formula(arg)]
        if op in self.COMPARISONS:
            if len(args) < 2:
                raise self.error(node.line, f"'{op}' needs two operands, got {len(args)} "
                                 f"in {render(node)}")
            terms = [self._term(arg) for arg in args]
            atoms: list = []
            for left, right in zip(terms, terms[1:]):
                pairs = [(left, right)] if op in ("<=", "<") else [(right, left)]
                if op == self.EQUAL:
                    pairs.append((left, right))
                for small, big in pairs:
                    atom = self._constraint(small, big, node)
                    if atom is False:
                        return []
                    if atom is not True:
                        atoms.append(atom)
            return [atoms]
        raise self.error(node.line, f"unsupported operator '{op}' in {render(node)}; use "
                         "<=, >=, <, >, and, or")

    def _constraint(self, small, big, node):
        """Normalise ``small <= big`` to an input bound or an output row (or a constant)."""
        coefs = dict(small[0])
        for key, value in big[0].items():
            coefs[key] = coefs.get(key, 0.0) - value
        coefs = {key: value for key, value in coefs.items() if value != 0.0}
        rhs = big[1] - small[1]
        if not coefs:
            return 0.0 <= rhs
        kinds = {key[0] for key in coefs}
        if len(kinds) == 2:
            raise self.error(node.line, f"constraint {render(node)} mixes inputs and "
                             "outputs; VNN-LIB 1.0 constrains X and Y separately")
        if "X" in kinds:
            if len(coefs) != 1:
                raise self.error(node.line, f"input constraint {render(node)} involves "
                                 "several X variables; only bounds on one X_i are supported")
            ((_, index), coef), = coefs.items()
            return ("U" if coef > 0 else "L", index, rhs / coef, node.line)
        return ("Y", {key[1]: value for key, value in coefs.items()}, rhs)

    # ---- linear terms ----------------------------------------------------------------
    def _term(self, node) -> tuple[dict, float]:
        """Evaluate a term to (coefficients by (kind, index), constant)."""
        if isinstance(node, Atom):
            if looks_numeric(node.text):
                return {}, parse_number(node, self.name)
            return {self._variable(node): 1.0}, 0.0
        op = self._head(node, "term")
        args = [self._term(arg) for arg in node.items[1:]]
        if op in ("+", "-", "*") and not args:
            raise self.error(node.line, f"'{op}' needs at least one operand in "
                             f"{render(node)}")
        if op == "+" or (op == "-" and len(args) > 1):
            coefs, const = dict(args[0][0]), args[0][1]
            sign = 1.0 if op == "+" else -1.0
            for other, other_const in args[1:]:
                for key, value in other.items():
                    coefs[key] = coefs.get(key, 0.0) + sign * value
                const += sign * other_const
            return coefs, const
        if op == "-":
            return {key: -value for key, value in args[0][0].items()}, -args[0][1]
        if op == "*":
            scale, linear = 1.0, None
            for term in args:
                if not term[0]:
                    scale *= term[1]
                elif linear is None:
                    linear = term
                else:
                    raise self.error(node.line, f"non-linear term {render(node)}; only "
                                     "products of a number and a variable are supported")
            if linear is None:
                return {}, scale
            return {key: scale * value for key, value in linear[0].items()}, scale * linear[1]
        raise self.error(node.line, f"unsupported operator '{op}' in term {render(node)}; "
                         "use +, -, * with a number")

    def _variable(self, atom: Atom) -> tuple[str, int]:
        decl = self.decls.get(atom.text)
        if decl is not None:
            return decl[0], decl[1]
        if _VAR_NAME.fullmatch(atom.text):
            raise self.error(atom.line, f"undeclared variable '{atom.text}'; add "
                             f"(declare-const {atom.text} Real) or fix the index")
        raise self.error(atom.line, f"unknown variable '{atom.text}'; inputs are X_<i> and "
                         "outputs Y_<j>, declared with declare-const")

    # ---- DNF -> Property -------------------------------------------------------------
    def _build(self, terms: list) -> Property:
        n_in, n_out = self.sizes["X"], self.sizes["Y"]
        groups: dict[tuple, tuple] = {}
        inf = float("inf")
        empty = None  # (index, lower, upper, line) of the first empty box, for the error
        for number, term in enumerate(terms, 1):
            lower, upper, rows = [-inf] * n_in, [inf] * n_in, []
            lines = [0] * n_in  # line of the latest tightening bound, for diagnostics
            for atom in term:
                tag = atom[0]
                if tag == "U":
                    if atom[2] < upper[atom[1]]:
                        upper[atom[1]], lines[atom[1]] = atom[2], atom[3]
                elif tag == "L":
                    if atom[2] > lower[atom[1]]:
                        lower[atom[1]], lines[atom[1]] = atom[2], atom[3]
                else:
                    rows.append(atom)
            self._check_box(lower, upper, number if len(terms) > 1 else None)
            bad = [i for i in range(n_in) if lower[i] > upper[i]]
            if bad:  # empty box: this alternative can never be violated
                empty = empty or (bad[0], lower[bad[0]], upper[bad[0]], lines[bad[0]])
                continue
            C = np.zeros((len(rows), n_out))
            d = np.empty(len(rows))
            for r, (_, coefs, rhs) in enumerate(rows):
                for j, value in coefs.items():
                    C[r, j] = value
                d[r] = rhs
            key = (tuple(lower), tuple(upper))
            if key not in groups:
                groups[key] = (lower, upper, [])
            groups[key][2].append(Conjunction(_readonly(C), _readonly(d)))
        if not groups and empty:
            index, lo, hi, line = empty
            raise self.error(line, f"input box is empty: X_{index} has lower bound {lo!r} "
                             f"above upper bound {hi!r}, so the property can never be "
                             "violated; check the bounds")
        if not groups:
            raise self.error(1, "the constraints can never be satisfied (an alternative "
                             "is false everywhere); check the and/or structure")
        cases = tuple(Case(_readonly(np.array(lo, dtype=np.float64)),
                           _readonly(np.array(hi, dtype=np.float64)), tuple(conjs))
                      for lo, hi, conjs in groups.values())
        return Property(self.name, n_in, n_out, cases)

    def _check_box(self, lower: list, upper: list, number) -> None:
        """Every input needs finite bounds: verification propagates bounds from the box,
        and an unbounded input would silently make every bound infinite."""
        where = f" in alternative {number} of the input constraints" if number else ""
        for side, values, op in (("lower", lower, ">="), ("upper", upper, "<=")):
            for index, value in enumerate(values):
                if value in (float("inf"), -float("inf")):
                    var, line = self._input_label(index), self._input_line(index)
                    raise self.error(line, f"input {var} has no {side} bound{where}; add "
                                     f"(assert ({op} {var} <value>))")


    def _input_label(self, index: int) -> str:
        """How the file names input `index` (flattened position), for messages."""
        return f"X_{index}"

    def _input_line(self, index: int) -> int:
        return self.decls[f"X_{index}"][2]


def _product(dnfs: list, parser: _Parser) -> list:
    """Conjunction of DNFs. Single-term factors (plain asserts, the common case: mnistfc
    has 1568 of them) are appended in place instead of re-copying every term, which keeps
    parsing linear in file size. Term lists are always freshly built, so in-place
    extension never aliases another formula's term."""
    result: list = [[]]
    for dnf in dnfs:
        if len(dnf) == 1:
            for term in result:
                term.extend(dnf[0])
        else:
            result = [term + other for term in result for other in dnf]
            if len(result) > _MAX_TERMS:
                raise parser.error(1, f"the property expands to more than {_MAX_TERMS} "
                                   "disjuncts; simplify its and/or nesting")
    return result
