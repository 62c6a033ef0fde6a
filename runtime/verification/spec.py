"""Properties as the runtime sees them: input boxes and disjunctions of linear output
constraints (the VNN-LIB violation region), in plain JSON so a generated program can read them.

A property is violated by x iff for some case, x lies in the case's box and for some
conjunction of that case every row holds: C @ f(x) <= d. Proving a case (unsat) means refuting
every conjunction: for each, some row with C_i f(x) > d_i for all x in the box.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from shardbound.runtime.errors import ShardboundError

SPEC_FORMAT = "shardbound-spec/1"


@dataclass(frozen=True)
class Conjunction:
    C: np.ndarray          # (k, num_outputs) float64
    d: np.ndarray          # (k,) float64


@dataclass(frozen=True)
class SpecCase:
    lower: np.ndarray      # (num_inputs,) float64
    upper: np.ndarray
    conjunctions: tuple[Conjunction, ...]

    def stacked(self) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """(C (R, m) float32, d (R,) float64, owner (R,) conjunction index) of all rows."""
        m = self.conjunctions[0].C.shape[1] if self.conjunctions else 0
        rows = [c.C for c in self.conjunctions] or [np.zeros((0, m))]
        C = np.concatenate(rows, axis=0)
        d = np.concatenate([c.d for c in self.conjunctions] or [np.zeros(0)])
        owner = np.concatenate([np.full(len(c.d), j) for j, c in enumerate(self.conjunctions)]
                               or [np.zeros(0, dtype=int)]).astype(int)
        return torch.tensor(C, dtype=torch.float32), d, owner


@dataclass(frozen=True)
class Spec:
    source: str
    num_inputs: int
    num_outputs: int
    cases: tuple[SpecCase, ...]

    def to_json(self) -> str:
        return json.dumps({
            "format": SPEC_FORMAT, "source": self.source, "num_inputs": self.num_inputs,
            "num_outputs": self.num_outputs,
            "cases": [{"lower": c.lower.tolist(), "upper": c.upper.tolist(),
                       "conjunctions": [{"C": k.C.tolist(), "d": k.d.tolist()}
                                        for k in c.conjunctions]} for c in self.cases]})


def spec_from_property(prop) -> Spec:
    """From the compiler's parsed VNN-LIB Property (shardbound.compiler.vnnlib)."""
    import os

    cases = tuple(SpecCase(np.asarray(c.lower, np.float64), np.asarray(c.upper, np.float64),
                           tuple(Conjunction(np.asarray(k.C, np.float64), np.asarray(k.d, np.float64))
                                 for k in c.disjuncts))
                  for c in prop.cases)
    return Spec(os.path.basename(prop.path), prop.num_inputs, prop.num_outputs, cases)


def read_spec(path: str) -> Spec:
    """A spec file (written by `shardbound verify`, or by hand for `program.py --verify`);
    every malformed part is a one-line error naming the field."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except RecursionError:
        raise ShardboundError(f"{path}: nested too deeply to be a spec file") from None
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ShardboundError(f"{path}: cannot read the spec ({first})") from None
    if not isinstance(data, dict) or data.get("format") != SPEC_FORMAT:
        raise ShardboundError(f"{path}: not a shardbound spec file")

    def bad(field, what):
        return ShardboundError(f"{path}: field {field!r} {what}; write the spec with "
                               "`shardbound verify` (or see runtime/verification/spec.py)")

    counts = {}
    for field in ("num_inputs", "num_outputs"):
        v = data.get(field)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise bad(field, "must be a positive integer")
        counts[field] = v
    n_in, n_out = counts["num_inputs"], counts["num_outputs"]
    source = data.get("source", os.path.basename(path))
    if not isinstance(source, str):
        raise bad("source", "must be a string")
    raw = data.get("cases")
    if not isinstance(raw, list) or not raw:
        raise bad("cases", "must be a non-empty list")
    cases = []
    for i, c in enumerate(raw):
        if not isinstance(c, dict):
            raise bad(f"cases[{i}]", "must be an object")
        lo = _vector(c.get("lower"), n_in, lambda w: bad(f"cases[{i}].lower", w))
        hi = _vector(c.get("upper"), n_in, lambda w: bad(f"cases[{i}].upper", w))
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()) or (lo > hi).any():
            raise bad(f"cases[{i}]", "must have finite bounds with lower <= upper")
        conj = c.get("conjunctions")
        if not isinstance(conj, list):
            raise bad(f"cases[{i}].conjunctions", "must be a list")
        ks = []
        for j, k in enumerate(conj):
            where = f"cases[{i}].conjunctions[{j}]"
            if not isinstance(k, dict):
                raise bad(where, "must be an object with 'C' and 'd'")
            d = _vector(k.get("d"), None, lambda w: bad(f"{where}.d", w))
            C = _vector(k.get("C"), None, lambda w: bad(f"{where}.C", w))
            if C.size != len(d) * n_out:
                raise bad(f"{where}.C", f"must hold {len(d)} rows of {n_out} numbers")
            ks.append(Conjunction(C.reshape(len(d), n_out), d))
        cases.append(SpecCase(lo, hi, tuple(ks)))
    return Spec(source, n_in, n_out, tuple(cases))


def _vector(value, n, bad) -> np.ndarray:
    """A float64 array from a (nested) JSON list of numbers; `n` elements if given."""
    from shardbound.runtime.program.boxes import number_problem

    if not isinstance(value, list):
        raise bad("must be a list of numbers")
    problem = number_problem(value)
    if problem:
        raise bad(problem)
    try:
        arr = np.asarray(value, dtype=np.float64).reshape(-1)
    except ValueError:
        raise bad("must be a regular list of numbers") from None
    if n is not None and arr.size != n:
        raise bad(f"must hold {n} numbers, not {arr.size}")
    if not np.isfinite(arr).all():
        raise bad("must hold finite numbers")
    return arr


def outward_box(lower: np.ndarray, upper: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest float32 box that contains the float64 box (rounded outward): bounding a
    box rounded to nearest could miss inputs of the real property."""
    lo = lower.astype(np.float32)
    hi = upper.astype(np.float32)
    lo = np.where(lo.astype(np.float64) > lower, np.nextafter(lo, np.float32(-np.inf)), lo)
    hi = np.where(hi.astype(np.float64) < upper, np.nextafter(hi, np.float32(np.inf)), hi)
    return torch.from_numpy(lo.astype(np.float32)), torch.from_numpy(hi.astype(np.float32))


def inside_box(x: torch.Tensor, lower: np.ndarray, upper: np.ndarray) -> torch.Tensor:
    """float32 points moved (by at most one ulp) to lie inside the float64 box."""
    v = x.detach().double().numpy()
    v = np.clip(v, lower, upper)
    f = v.astype(np.float32)
    f = np.where(f.astype(np.float64) < lower, np.nextafter(f, np.float32(np.inf)), f)
    f = np.where(f.astype(np.float64) > upper, np.nextafter(f, np.float32(-np.inf)), f)
    return torch.from_numpy(f.astype(np.float32))


def violated_conjunctions(y: torch.Tensor, case: SpecCase) -> list[int]:
    """Indices of the conjunctions that y (one output, float32) satisfies, checked in float64."""
    yv = y.detach().double().reshape(-1).numpy()
    return [j for j, k in enumerate(case.conjunctions) if np.all(k.C @ yv <= k.d)]
