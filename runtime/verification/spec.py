"""Properties as the runtime sees them: input boxes and disjunctions of linear output
constraints (the VNN-LIB violation region), in plain JSON so a generated program can read them.

A property is violated by x iff for some case, x lies in the case's box and for some
conjunction of that case every row holds: C @ f(x) <= d. Proving a case (unsat) means refuting
every conjunction: for each, some row with C_i f(x) > d_i for all x in the box.
"""

from __future__ import annotations

import json
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
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ShardboundError(f"{path}: cannot read the spec ({e})") from None
    if data.get("format") != SPEC_FORMAT:
        raise ShardboundError(f"{path}: not a shardbound spec file")
    cases = tuple(SpecCase(np.asarray(c["lower"], np.float64), np.asarray(c["upper"], np.float64),
                           tuple(Conjunction(np.asarray(k["C"], np.float64).reshape(-1, data["num_outputs"]),
                                             np.asarray(k["d"], np.float64))
                                 for k in c["conjunctions"]))
                  for c in data["cases"])
    return Spec(data["source"], data["num_inputs"], data["num_outputs"], cases)


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
