"""Branch and bound by input splitting, for low-dimensional inputs (ACAS Xu and the like).

Open domains (sub-boxes whose bounds do not yet refute every conjunction of the violation
region) are kept in one tensor stack and processed in batches, depth first (the last ones
pushed are taken first, which keeps the stack small). A domain is done when every conjunction
is refuted on it: some row has a CROWN lower bound above its threshold.

A taken domain is split in two and both children are bounded at once; only open children are
pushed, with their bounds. The input to split: the largest |A| * width (A: the lower-bound
A-matrix of the rows still open), unless that input is WIDTH_RATIO times narrower (relative to
the root box) than the widest one, which is then split instead. Measured on ACAS Xu: |A| *
width alone never splits an input the final lower bound has no linear term in, even when that
input's width causes all the relaxation slack (1_2/prop_1 stalled at 99.94% of the box);
greedy look-ahead (bound the children of every input, keep the best) fixes that but shaves
inputs that each help a little and stalls elsewhere (1_1/prop_3, 1_1/prop_5). The machinery
takes several candidates per domain (the split whose children's negative margins sum highest
wins); `_candidates` proposes one.

Children are bounded with their parent's intermediate bounds as a prior (kept per open
domain): bounds only tighten down the tree, and CROWN runs only for neurons still unstable
(ACAS Xu 1_1/prop_6 went from 56% of the box in 110 s to unsat in 12 s).

Everything is deterministic, and in a sharded run every rank takes the same branch, because
bounds are bitwise identical and the deadline is agreed with an all-reduce.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

BATCH = 512               # boxes bounded per step (verdict: fewer where they do not fit)
MAX_DOMAINS = 400_000
WIDTH_RATIO = 64         # see _candidates
KEPT_BOUNDS_BYTES = 1 << 30      # open domains keep their intermediate bounds: cap the total
# Every round attacks until this many domains are bounded, then one round per this many. One
# `attack` call (all of a round's attacked domains at once) costs about what bounding a few
# hundred ACAS Xu domains does: with one call per domain and round, attacks took 58% of
# 1_1/prop_5's input splitting. 1_9/prop_7 (sat) is found by an attack at 255 domains.
ATTACK_EVERY = 1024


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


def closeness(lb: torch.Tensor, d: np.ndarray, owner: np.ndarray, n_conj: int) -> torch.Tensor:
    """(B,) float64: the margin of the conjunction nearest to being feasible (its best row's
    lb - d); positive exactly when every conjunction is refuted."""
    margin = lb.double() - torch.from_numpy(d)
    per_conj = torch.full((lb.shape[0], n_conj), float("inf"), dtype=torch.float64)
    for j in range(n_conj):
        rows = torch.from_numpy(np.nonzero(owner == j)[0])
        if len(rows):
            per_conj[:, j] = margin[:, rows].max(dim=1).values
    return per_conj.min(dim=1).values


class DomainBounds:
    """Bounds batches of boxes: (done, closeness, split key) per box."""

    def __init__(self, network, C, d, owner, chunk: int = 1024, root_prior=None, certify=None,
                 vertex_check=None):
        self.network, self.C, self.d, self.owner = network, C, d, owner
        # certify(los, his) -> (b,) bool: --soundness real/float32, the boxes the rigorous
        # bounds prove (a box the float32 bounds prove but these do not stays open).
        self.certify = certify
        # vertex_check(points) -> index of a confirmed counterexample or None: the
        # bound-minimising vertex of every open box's rows is tried (`hit` keeps it).
        self.vertex_check = vertex_check
        self.hit = None
        self.root_prior = root_prior    # bounds known on the root box (its first call)
        self.n_conj = int(owner.max()) + 1
        self.chunk = chunk
        self.bounded = 0
        self.shapes = None      # (name, shape) of the intermediate bounds, in order

    def __call__(self, los: torch.Tensor, his: torch.Tensor, prior=None):
        """prior: (B, 2, neurons) intermediate bounds known to hold on each box (its
        parent's), or None. Returns (done, closeness, key, intermediate bounds) per box."""
        outs = [self._one(los[i:i + self.chunk], his[i:i + self.chunk],
                          None if prior is None else prior[i:i + self.chunk])
                for i in range(0, len(los), self.chunk)]
        return tuple(torch.cat(parts) for parts in zip(*outs))

    def _unflatten(self, flat, b):
        out, at = {}, 0
        for name, shape in self.shapes:
            size = math.prod(shape)
            out[name] = (flat[:, 0, at:at + size].reshape(b, *shape),
                         flat[:, 1, at:at + size].reshape(b, *shape))
            at += size
        return out

    def _one(self, los, his, prior):
        net = self.network
        b = len(los)
        shape = (b, *net.input_shape)
        dlo, dhi = los.reshape(shape).to(net.device), his.reshape(shape).to(net.device)
        if prior is not None:
            prior = self._unflatten(prior.to(net.device), b)
        elif self.root_prior is not None and b == 1:
            prior = self.root_prior
        with torch.no_grad():
            ibp, known = net.intermediate_bounds(dlo, dhi, prior=prior)
        if self.shapes is None:
            self.shapes = [(name, tuple(v[0].shape[1:])) for name, v in known.items()]
        flat = torch.stack([torch.cat([known[n][0].reshape(b, -1) for n, _ in self.shapes], 1),
                            torch.cat([known[n][1].reshape(b, -1) for n, _ in self.shapes], 1)],
                           dim=1).cpu()
        with torch.no_grad():
            grab = {}
            lb, _ = net.final_crown(ibp, known, dlo, dhi, self.C.to(net.device), input_A=grab,
                                    lower_only=True)
        lb, lA = lb.cpu(), grab["lA"].cpu().reshape(b, self.C.shape[0], -1)
        self.bounded += b
        refuted = refuted_conjunctions(lb, self.d, self.owner, self.n_conj)
        if self.certify is not None:
            claimed = refuted.all(dim=1)
            if bool(claimed.any()):
                ok = torch.zeros(b, dtype=torch.bool)
                ok[claimed] = self.certify(los[claimed], his[claimed])
                refuted[claimed & ~ok] = False          # not proved: open, every row
        open_rows = ~refuted[:, torch.from_numpy(self.owner)]                     # (b, R)
        if self.vertex_check is not None and self.hit is None and bool(open_rows.any()):
            verts = torch.where(lA > 0, los.unsqueeze(1), his.unsqueeze(1))[open_rows]
            i = self.vertex_check(verts)
            if i is not None:
                self.hit = verts[i]
        key = (lA.abs() * open_rows.unsqueeze(-1)).sum(dim=1) * (his - los)
        return refuted.all(dim=1), closeness(lb, self.d, self.owner, self.n_conj), key, flat


def _candidates(key, los, his, root_width):
    """(b, 1): the input with the largest |A| * width, unless it is WIDTH_RATIO times
    narrower (relative to the root box) than the widest input: then the widest."""
    rel = (his - los) / root_width.clamp(min=1e-30)
    by_key, widest = key.argmax(dim=1), rel.argmax(dim=1)
    rows = torch.arange(len(key))
    lopsided = rel[rows, by_key] * WIDTH_RATIO < rel[rows, widest]
    return torch.where(lopsided, widest, by_key).unsqueeze(1)


def input_split(network, C, d, owner, lo, hi, deadline: float, agree, is_violation,
                batch: int = BATCH, progress=None, attack=None, attack_domains: int = 4,
                root_prior=None, stop=None, certify=None,
                attack_every: int = ATTACK_EVERY) -> BabResult:
    """Prove or refute {x in [lo, hi]: some conjunction of C f(x) <= d} by input splitting.

    agree(flag) -> bool: the flag OR-ed over ranks (so every rank stops together).
    is_violation(x (N, n)) -> index of a confirmed counterexample row, or None.
    attack(los, his) -> a candidate point or None: one search (los, his: (k, n)) over the
    `attack_domains` open domains of a round whose bounds come closest to a violation (small
    domains make gradient attacks far more effective than on the whole box); every round
    until `attack_every` domains are bounded, then one round per `attack_every` domains
    (0: every round).
    `batch` is about the number of boxes bounded per step (children of all candidate splits).
    root_prior: intermediate bounds known on the whole box (every domain inherits them).
    stop() -> bool: the time budget, agreed over ranks (default: `deadline`, agreed with
    `agree`), asked before each round.
    """
    if stop is None:
        stop = lambda: agree(time.monotonic() > deadline)          # noqa: E731
    bound = DomainBounds(network, C, d, owner, root_prior=root_prior, certify=certify,
                         vertex_check=is_violation)
    los, his = lo.reshape(1, -1).clone(), hi.reshape(1, -1).clone()
    n = los.shape[1]
    root_width = (hi - lo).reshape(1, -1)
    done, close, key, kb = bound(los, his)
    if bound.hit is not None:
        return BabResult("sat", x=bound.hit, domains=bound.bounded)
    if bool(done[0]):
        return BabResult("unsat", domains=1, verified_fraction=1.0)
    max_domains = min(MAX_DOMAINS, KEPT_BOUNDS_BYTES // max(1, kb[0].numel() * 4))
    depth = torch.zeros(1, dtype=torch.float64)
    k = 1                    # candidates per domain (see _candidates)
    per_step = max(1, batch // (2 * k))
    verified, unresolved = 0.0, 0
    next_attack = 0
    start = time.monotonic()
    while len(los):
        if stop():
            return BabResult("timeout", domains=bound.bounded, verified_fraction=verified)
        if agree(len(los) > max_domains):    # max_domains is per rank in tp
            return BabResult("unknown", domains=bound.bounded, verified_fraction=verified,
                             reason=f"more than {max_domains} open domains")
        take = min(per_step, len(los))
        blo, bhi, bdepth, bclose, bkey, bkb = (t[-take:] for t in (los, his, depth, close, key, kb))
        los, his, depth, close, key, kb = (t[:-take] for t in (los, his, depth, close, key, kb))
        hit = is_violation((blo + bhi) / 2)
        if hit is not None:
            return BabResult("sat", x=((blo + bhi) / 2)[hit], domains=bound.bounded,
                             verified_fraction=verified)
        if attack is not None and attack_domains > 0 and bound.bounded >= next_attack:
            # One search over the most promising domains together (see attack.pgd): every
            # round until `attack_every` domains are bounded, then once per `attack_every`
            # domains (a work share, not the clock: the same rounds attack on every run
            # and rank).
            next_attack = bound.bounded + attack_every if bound.bounded >= attack_every else 0
            pick = torch.argsort(bclose, stable=True)[:attack_domains]
            x = attack(blo[pick], bhi[pick])
            if x is not None and is_violation(x.reshape(1, -1)) is not None:
                return BabResult("sat", x=x.reshape(-1), domains=bound.bounded,
                                 verified_fraction=verified)
        # Children of every candidate split: (take, k, 2, n).
        dims = _candidates(bkey, blo, bhi, root_width)                        # (take, k)
        rows = torch.arange(take).unsqueeze(1).expand(take, k)
        mid = (blo[rows, dims] + bhi[rows, dims]) / 2
        stuck = (mid <= blo[rows, dims]) | (mid >= bhi[rows, dims])          # float32 resolution
        clo = blo.unsqueeze(1).unsqueeze(1).repeat(1, k, 2, 1)
        chi = bhi.unsqueeze(1).unsqueeze(1).repeat(1, k, 2, 1)
        onehot = torch.nn.functional.one_hot(dims, n).bool()                 # (take, k, n)
        chi[:, :, 0] = torch.where(onehot, mid.unsqueeze(-1), chi[:, :, 0])
        clo[:, :, 1] = torch.where(onehot, mid.unsqueeze(-1), clo[:, :, 1])
        live = ~stuck
        c_done = torch.zeros(take, k, 2, dtype=torch.bool)
        c_close = torch.zeros(take, k, 2, dtype=torch.float64)
        c_key = torch.zeros(take, k, 2, n)
        c_kb = torch.zeros(take, k, 2, *bkb.shape[1:])
        if bool(live.any()):
            parent = bkb.unsqueeze(1).unsqueeze(1).expand(take, k, 2, *bkb.shape[1:])[live]
            dn, cl, ky, cb = bound(clo[live].reshape(-1, n), chi[live].reshape(-1, n),
                                   parent.reshape(-1, *bkb.shape[1:]))
            c_done[live], c_close[live] = dn.reshape(-1, 2), cl.reshape(-1, 2)
            c_key[live] = ky.reshape(-1, 2, n)
            c_kb[live] = cb.reshape(-1, 2, *bkb.shape[1:])
        if bound.hit is not None:
            return BabResult("sat", x=bound.hit, domains=bound.bounded,
                             verified_fraction=verified)
        value = c_close.clamp(max=0).sum(dim=2)                               # (take, k)
        value = torch.where(stuck, torch.full_like(value, -float("inf")), value)
        best = value.argmax(dim=1)
        splittable = live.any(dim=1)
        if not bool(splittable.all()):
            # Too narrow to split in float32 along any candidate: it can be neither proved
            # nor refuted here. Set it aside and go on, so that a counterexample elsewhere
            # can still be found.
            unresolved += int((~splittable).sum())
        sel = torch.nonzero(splittable).reshape(-1)
        pick = best[sel]
        n_done, n_lo, n_hi = c_done[sel, pick], clo[sel, pick], chi[sel, pick]   # (s, 2[, n])
        n_close, n_key, n_kb = c_close[sel, pick], c_key[sel, pick], c_kb[sel, pick]
        n_depth = (bdepth[sel] + 1).unsqueeze(1).expand(-1, 2)
        verified += float(torch.pow(0.5, n_depth[n_done]).sum())
        keep = ~n_done
        los = torch.cat([los, n_lo[keep]])
        his = torch.cat([his, n_hi[keep]])
        depth = torch.cat([depth, n_depth[keep]])
        close = torch.cat([close, n_close[keep]])
        key = torch.cat([key, n_key[keep]])
        kb = torch.cat([kb, n_kb[keep]])
        if progress is not None:
            progress(len(los), verified, time.monotonic() - start)
    if unresolved:
        return BabResult("unknown", domains=bound.bounded, verified_fraction=verified,
                         reason=f"{unresolved} domain(s) reached float32 resolution unresolved")
    return BabResult("unsat", domains=bound.bounded, verified_fraction=1.0)
