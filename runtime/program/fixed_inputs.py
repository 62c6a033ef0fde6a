"""The input values a program was compiled with folded in (plan.json "fixed_inputs").

Why: `shardbound verify` folds input elements that its property fixes (lower == upper) into
the model as constants when the model needs it (an index computed from the input;
compiler/fixed_inputs.py). The program then computes with those values whatever the box
says there: a box that does not fix them to the same values would get a silently wrong bound.
Every entry point (bounds, forward, verify) checks the box first and refuses it in one line.

A folded element holds the float32 nearest the property's value (what a float32 evaluation
of the model sees); the boxes the runtime bounds are rounded outward to float32, so a box
there may span the float32 neighbours of that value (one unit in the last place either
side), and nothing wider or elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch

from shardbound.runtime.errors import ShardboundError


class FixedInputs:
    """`indices` (flat input positions), `values` (the property's values, float64)."""

    def __init__(self, indices, values, where: str = "plan.json"):
        try:
            self.indices = np.asarray(indices, np.int64).reshape(-1)
            self.values = np.asarray(values, np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise ShardboundError(f"{where}: field 'fixed_inputs' must hold lists of numbers; "
                                  "recompile the model") from None
        if self.indices.shape != self.values.shape:
            raise ShardboundError(f"{where}: field 'fixed_inputs' has {self.indices.size} "
                                  f"indices for {self.values.size} values; recompile the model")
        folded = self.values.astype(np.float32)
        self.low = torch.from_numpy(np.nextafter(folded, np.float32(-np.inf)))
        self.high = torch.from_numpy(np.nextafter(folded, np.float32(np.inf)))
        self.index = torch.from_numpy(self.indices)

    @classmethod
    def from_plan(cls, plan: dict, where: str = "plan.json") -> "FixedInputs | None":
        raw = plan.get("fixed_inputs")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ShardboundError(f"{where}: field 'fixed_inputs' must be an object; "
                                  "recompile the model")
        return cls(raw.get("indices"), raw.get("values"), where)

    def _refuse(self, k: int, lo: float, hi: float, where: str) -> ShardboundError:
        i, v = int(self.indices[k]), float(self.values[k])
        got = f"{lo:.9g}" if lo == hi else f"[{lo:.9g}, {hi:.9g}]"
        return ShardboundError(
            f"{where}: input {i} is {got}, but this program was compiled for a property that "
            f"fixes it at {v:.9g} (one of {self.indices.size} input values folded in as "
            "constants); "
            "recompile it with this property (shardbound verify MODEL PROP)")

    def check_box(self, lower: torch.Tensor, upper: torch.Tensor, where: str = "box") -> None:
        """Refuse boxes (B, *input_shape) whose fixed elements leave the folded value's
        float32 neighbourhood."""
        if lower.shape[0] == 0:
            return
        B = lower.shape[0]
        idx = self.index.to(lower.device)
        lo = lower.reshape(B, -1).index_select(1, idx)
        hi = upper.reshape(B, -1).index_select(1, idx)
        ok = (lo >= self.low.to(lo.device)) & (hi <= self.high.to(hi.device))
        if not bool(ok.all()):
            b, k = (int(t) for t in (~ok).nonzero()[0])
            raise self._refuse(k, float(lo[b, k]), float(hi[b, k]), where)

    def check_case(self, lower: np.ndarray, upper: np.ndarray, where: str) -> None:
        """Refuse a property case (float64 bounds) that does not fix the elements to the
        compiled values exactly."""
        lo, hi = lower[self.indices], upper[self.indices]
        bad = np.flatnonzero((lo != self.values) | (hi != self.values))
        if bad.size:
            k = int(bad[0])
            raise self._refuse(k, float(lo[k]), float(hi[k]), where)
