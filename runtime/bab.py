"""Branch and bound by input splitting, for low-dimensional inputs (ACAS Xu and the like).

Domains are sub-boxes kept in one tensor stack and processed in batches, depth first (the last
ones pushed are taken first, which keeps the stack small). A domain is done when every
conjunction of the violation region is refuted on it: some row has a CROWN lower bound above
its threshold. Otherwise its centre is tried as a counterexample and it is split in two along
the input whose width times |A| (the lower-bound A-matrix of the rows still open) is largest.
Everything is deterministic, and in a sharded run every rank takes the same branch, because
bounds are bitwise identical and the deadline is agreed with an all-reduce.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

MAX_DOMAINS = 400_000


@dataclass
class BabResult:
    verdict: str                    # "unsat", "sat", "timeout", "unknown"
    x: torch.Tensor | None = None   # a candidate counterexample (flattened), for "sat"
    domains: int = 0                # domains bounded
    verified_fraction: float = 0.0
    reason: str = ""


def refuted_conjunctions(lb: torch.Tensor, d: np.ndarray, owner: np.ndarray, n_conj: int):
    """(B, J) bool: conjunction j is refuted on a box when one of its rows has lb > d."""
    margin = lb.double() - torch.from_numpy(d)
    out = torch.zeros(lb.shape[0], n_conj, dtype=torch.bool)
    for j in range(n_conj):
        rows = torch.from_numpy(np.nonzero(owner == j)[0])
        if len(rows):
            out[:, j] = (margin[:, rows] > 0).any(dim=1)
    return out


def _attack_closest(lb, d, owner, n_conj, olo, ohi, attack, count):
    """Attack the open domains whose best conjunction is nearest to being feasible."""
    margin = lb.double() - torch.from_numpy(d)                       # (b, R)
    per_conj = torch.full((lb.shape[0], n_conj), float("inf"), dtype=torch.float64)
    for j in range(n_conj):
        rows = torch.from_numpy(np.nonzero(owner == j)[0])
        if len(rows):
            per_conj[:, j] = margin[:, rows].max(dim=1).values
    closeness = per_conj.min(dim=1).values                           # lower: more promising
    for i in torch.argsort(closeness)[:count].tolist():
        x = attack(olo[i], ohi[i])
        if x is not None:
            return x
    return None


def input_split(network, C, d, owner, lo, hi, deadline: float, agree, is_violation,
                batch: int = 512, progress=None, attack=None, attack_domains: int = 4
                ) -> BabResult:
    """Prove or refute {x in [lo, hi]: some conjunction of C f(x) <= d} by input splitting.

    agree(flag) -> bool: the flag OR-ed over ranks (so every rank stops together).
    is_violation(x (N, n)) -> index of a confirmed counterexample row, or None.
    attack(lo, hi) -> a candidate point or None: run on the `attack_domains` open domains of
    each batch whose bounds come closest to a violation (small domains make gradient
    attacks far more effective than on the whole box).
    """
    n_conj = int(owner.max()) + 1
    los, his = lo.reshape(1, -1).clone(), hi.reshape(1, -1).clone()
    depth = torch.zeros(1, dtype=torch.float64)
    verified, bounded, unresolved = 0.0, 0, 0
    start = time.monotonic()
    while len(los):
        if agree(time.monotonic() > deadline):
            return BabResult("timeout", domains=bounded, verified_fraction=verified)
        if len(los) > MAX_DOMAINS:
            return BabResult("unknown", domains=bounded, verified_fraction=verified,
                             reason=f"more than {MAX_DOMAINS} open domains")
        take = min(batch, len(los))
        blo, bhi, bdepth = los[-take:], his[-take:], depth[-take:]
        los, his, depth = los[:-take], his[:-take], depth[:-take]
        shape = (take, *network.input_shape)
        dev = network.device
        dlo, dhi = blo.reshape(shape).to(dev), bhi.reshape(shape).to(dev)
        with torch.no_grad():
            ibp, known = network.intermediate_bounds(dlo, dhi)
            grab = {}
            lb, _ = network.final_crown(ibp, known, dlo, dhi, C.to(dev), input_A=grab,
                                        lower_only=True)
        lb, grab["lA"] = lb.cpu(), grab["lA"].cpu()
        bounded += take
        refuted = refuted_conjunctions(lb, d, owner, n_conj)
        done = refuted.all(dim=1)
        verified += float(torch.pow(0.5, bdepth[done]).sum())
        open_ = ~done
        if progress is not None:
            progress(len(los) + 2 * int(open_.sum()), verified, time.monotonic() - start)
        if not open_.any():
            continue
        olo, ohi, odepth = blo[open_], bhi[open_], bdepth[open_]
        hit = is_violation((olo + ohi) / 2)
        if hit is not None:
            return BabResult("sat", x=((olo + ohi) / 2)[hit], domains=bounded,
                             verified_fraction=verified)
        if attack is not None:
            x = _attack_closest(lb[open_], d, owner, n_conj, olo, ohi, attack, attack_domains)
            if x is not None and is_violation(x.reshape(1, -1)) is not None:
                return BabResult("sat", x=x.reshape(-1), domains=bounded,
                                 verified_fraction=verified)
        still_open_rows = ~refuted[open_][:, torch.from_numpy(owner)]          # (b, R)
        lA = grab["lA"].reshape(take, C.shape[0], -1)[open_]                   # (b, R, n)
        score = (lA.abs() * still_open_rows.unsqueeze(-1)).sum(dim=1) * (ohi - olo)
        dim = score.argmax(dim=1)
        rows = torch.arange(len(dim))
        mid = (olo[rows, dim] + ohi[rows, dim]) / 2
        stuck = (mid <= olo[rows, dim]) | (mid >= ohi[rows, dim])
        if bool(stuck.any()):
            # Too narrow to split in float32: it can be neither proved nor refuted here. Set it
            # aside and go on, so that a counterexample elsewhere can still be found.
            unresolved += int(stuck.sum())
            keep = ~stuck
            olo, ohi, odepth, dim, mid = olo[keep], ohi[keep], odepth[keep], dim[keep], mid[keep]
            rows = torch.arange(len(dim))
        left_hi, right_lo = ohi.clone(), olo.clone()
        left_hi[rows, dim] = mid
        right_lo[rows, dim] = mid
        los = torch.cat([los, olo, right_lo])
        his = torch.cat([his, left_hi, ohi])
        depth = torch.cat([depth, odepth + 1, odepth + 1])
    if unresolved:
        return BabResult("unknown", domains=bounded, verified_fraction=verified,
                         reason=f"{unresolved} domain(s) reached float32 resolution unresolved")
    return BabResult("unsat", domains=bounded, verified_fraction=1.0)
