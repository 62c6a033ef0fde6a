"""Branch and bound by splitting relaxed neurons, for inputs too large to split (MNIST and the
like). Every op that declares itself `splittable` (ReLU and the other kinks at 0) takes part by
the sign of its input, and every op that declares itself `interval_splittable` (the smooth
functions: sigmoid, tanh, gelu, exp, sin, ...) by its input interval (GenBaB-style, Shi et al.
2024): a split of neuron z_j on [l, u] at the op's `split_point` p gives the children z_j <= p
and z_j >= p, recorded as their intermediate bounds of z_j ([l, p] and [p, u]: the prior each
domain carries, which `Network.intermediate_bounds` intersects in before any later node is
bounded), so each child relaxes the op on its half. A neuron may be split again and again.

A domain is the input box together with sign assumptions on some inexact neurons of
splittable ops (active: the op's input >= 0, inactive: <= 0). Bounding a domain clamps the assumed neurons'
intermediate bounds at 0 before any later layer is bounded (`Network.intermediate_bounds`
with `splits`), so every relaxation is valid on the sub-domain where the assumptions hold;
the two children of a split cover their parent, so proving every leaf proves the box. A
clamp that leaves lower > upper shows the sub-domain empty: proved. Domains still open after
CROWN get beta-CROWN bounds (`runtime/engine/beta.py`: the split constraints enter through optimised
multipliers). A leaf with no unstable neuron left but an open bound is set aside as
unresolved, never counted as proved.

Branching (runtime/verification/branching.py): filtered smart branching, BaBSR's candidates
judged by a one-step bound of both children. Every
open domain also proposes counterexamples: per open spec row, the box vertex that minimises
that row's linear lower bound (beta-CROWN's where it ran); the caller confirms them with a
plain forward pass; the most violated domains also get a split-respecting attack
(runtime/verification/falsify.py).

Children keep their parent's intermediate bounds as a prior: CROWN then runs only for the
neurons still unstable under them (measured: 27x more domains per second on mnistfc 256x2),
and their parent's optimised alphas as beta-CROWN's start (`WarmAlphas`).

Open domains are per-ReLU int8 assumption tensors, taken in batches (`batch_for_memory`)
most violated first (the parent's margin; ties: the older position). Deterministic: no
randomness, ties break towards the lowest neuron index; what depends on the clock (the
attacks' time share, the final pass) is agreed over ranks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from shardbound.runtime.verification.bab_state import BabState, Rows, WarmAlphas, tightened
from shardbound.runtime.verification.batch_memory import batch_for_memory, memory_figure
from shardbound.runtime.verification.certificate import (carried_dict, certified, cut_dict,
                                                         down32, no_cuts)
from shardbound.runtime.verification.falsify import attack_domains as _attack_domains
from shardbound.runtime.verification.branching import (fsb_choice, interval_children,
                                                       interval_split_ops, slack_scores,
                                                       split_ops)
from shardbound.runtime.verification.input_split import closeness, refuted_conjunctions
from shardbound.runtime.verification.row_pairs import crown_pairs, optimise_pairs
from shardbound.runtime.engine.beta import DEFAULT_ITERATIONS, beta_crown

MAX_DOMAINS = 50_000      # each keeps its parent's intermediate bounds: ~8 bytes a neuron
ATTACK_DOMAINS = 2        # open domains per round attacked by `split_pgd` (the most violated)
ATTACK_SHARE = 0.15       # of branch and bound's time, at most, spent in those attacks
FSB_CANDIDATES = 3        # filtered smart branching: BaBSR's top k, judged by a one-step bound
KEPT_ALPHA_BYTES = 256 << 20   # the warm-start alphas of open domains (see WarmAlphas)
BETA_KEY = "beta:"       # warm starts keep each split node's betas under this prefix
FINAL_SHARE = 0.1         # the last share of the budget goes to the final falsification pass


@dataclass
class ReluBabResult:
    verdict: str                    # "unsat", "sat", "timeout", "unknown"
    x: torch.Tensor | None = None   # a candidate counterexample (flattened), for "sat"
    domains: int = 0                # domains bounded
    verified_fraction: float = 0.0  # proved share of the tree (each leaf weighs 2^-depth)
    reason: str = ""
    state: BabState | None = None   # the open tree, on "timeout" when asked (`keep_state`)


def _flat_bounds(bounds, names, b) -> torch.Tensor:
    """(b, 2, neurons) on the CPU: the lower and upper bounds of `names`, flattened in order."""
    return torch.stack([torch.cat([bounds[nm][0].reshape(b, -1) for nm in names], dim=1),
                        torch.cat([bounds[nm][1].reshape(b, -1) for nm in names], dim=1)],
                       dim=1).cpu()


def _optimise(network, ibp, known, lo, hi, C, splits, lb, which, iterations, stop=None,
              warm=None, betas=None, best=None):
    """(lb with the rows of the domains in `which` raised by beta-CROWN, their indices, their
    input A-matrices from beta-CROWN or None, their alphas after the optimisation).
    warm: (alphas of the batch's domains, and their betas under BETA_KEY + split node,
    (B,) bool: which have them) to start from.
    betas: a dict that receives the last iterate's split multipliers (beta_crown's
    `beta_out`: the children's warm start).
    best: a dict that receives the alphas and betas behind each row's bound (beta_crown's
    `best_out`: the Lagrangian the certificate re-evaluates)."""
    idx = torch.nonzero(which).reshape(-1)
    dev_idx = idx.to(lo.device)
    pick = lambda t: t.index_select(0, dev_idx)                                # noqa: E731
    sub = lambda m: {k: (pick(v[0]), pick(v[1])) for k, v in m.items()}       # noqa: E731
    start = beta_start = None
    if warm is not None and bool(warm[1][idx].any()):
        has = warm[1][idx]
        start = ({k: pick(v) for k, v in warm[0].items() if not k.startswith(BETA_KEY)}, has)
        beta_start = ({k[len(BETA_KEY):]: pick(v) for k, v in warm[0].items()
                       if k.startswith(BETA_KEY)}, has)
    alphas = {}
    with torch.no_grad():
        better, lA = beta_crown(network, sub(ibp), sub(known), pick(lo), pick(hi), C,
                                {k: pick(v) for k, v in splits.items()},
                                lb.index_select(0, idx).to(lo.device), iterations, stop=stop,
                                alpha_start=start, alpha_out=alphas, beta_out=betas,
                                beta_start=beta_start, best_out=best)
    out = lb.clone()
    out[idx] = torch.maximum(out[idx], better.cpu())
    return out, idx, (None if lA is None else lA.cpu()), alphas


def _best_to_tail(key: torch.Tensor, k: int):
    """(a, b): swapping positions a and b of the stack puts its k lowest keys (the most
    violated domains; ties: the lower position) in its last k places, moving as few entries
    as possible (only chosen entries outside the tail and unchosen ones inside it)."""
    n = len(key)
    best = torch.argsort(key, stable=True)[:k]
    tail = torch.arange(n - k, n)
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[best] = True
    return best[best < n - k], tail[~chosen[tail]]


def _swap_(tensors, a, b) -> None:
    """Swap rows a and b of every tensor in place (the stack's aligned per-domain data)."""
    for t in tensors:
        if t is not None and len(a):
            ta, tb = t[a].clone(), t[b].clone()
            t[a], t[b] = tb, ta


def _proof_out_of_reach(verified: float, since: tuple[float, float], deadline: float) -> bool:
    """Whether the proved share, growing at its recent rate (since `since` = (time, proved
    share then): the second half of the time so far; the first domains often prove half
    the tree at once and then stall), stays under the whole tree by the deadline."""
    now = time.monotonic()
    t0, v0 = since
    rate = (verified - v0) / max(now - t0, 1e-9)
    return verified + rate * (deadline - now) < 1.0


def relu_split(network, C, d, owner, lo, hi, deadline: float, agree, is_violation,
               batch: int | None = None, progress=None, iterations: int = DEFAULT_ITERATIONS,
               root_prior=None, stop=None, certify=None, attack_domains: int = ATTACK_DOMAINS,
               final_share: float = FINAL_SHARE, fsb: int = FSB_CANDIDATES,
               warm_start: bool = True, warm_betas: bool = True, keep_state: bool = False,
               resume: BabState | None = None, trace: list | None = None) -> ReluBabResult:
    """Prove or refute {x in [lo, hi]: some conjunction of C f(x) <= d} by ReLU splitting.

    agree(flag) -> bool: the flag OR-ed over ranks. is_violation(x (N, n)) -> index of a
    confirmed counterexample row, or None. root_prior: intermediate bounds known on the box
    (keyed like `Network.intermediate_bounds`' planned bounds), inherited by every domain.
    stop() -> bool: the time budget, agreed over ranks (default: `deadline`, agreed with
    `agree`), asked before each round and inside beta-CROWN's optimisation.
    certify(los, his, splits, lagrangian) -> (b,) bool: --soundness real/float32, the domains
    the rigorous bounds prove (with the split assumptions as clamps, and for domains
    beta-CROWN proved, its alphas and betas: lagrangian = (alphas, betas) or None); a domain
    the float32 bounds prove but these do not stays open and is split further.
    keep_state: a "timeout" carries the open tree (`BabState`); `resume` continues such a
    tree (same network, box and spec) with `root_prior` intersected into every open
    domain's bounds (runtime/verification/bab_state.py: a prior that holds on the box).
    trace: a list that receives each round's per-domain lower bounds (take, S) after
    beta-CROWN, for bitwise comparisons between modes (bench/bab_fsdp.py, the rank jobs).

    Counterexample search runs alongside the proof: domains are refined most violated first
    (the lowest CROWN / beta-CROWN margin, inherited by the children), every open domain's
    bound-minimising vertices are checked, `attack_domains` of the most violated open
    domains per round get a split-respecting attack (`falsify.split_pgd`; in at most
    ATTACK_SHARE of the time), and once only
    `final_share` of the time to `deadline` is left, unless the proved share (at its rate
    since halfway to that point) is on course to reach the whole tree by then, branching
    stops: the rest of the budget attacks the open domains, most violated first."""
    if stop is None:
        stop = lambda: agree(time.monotonic() > deadline)          # noqa: E731
    if batch is None:       # the same on every rank: the smallest rank's figure
        batch = batch_for_memory(network, C.shape[0], memory_figure(network), agree)
    signed = split_ops(network)
    relus = signed + interval_split_ops(network, {r.inputs[0] for r in signed})
    if not relus:
        return ReluBabResult("unknown", reason="no splittable op (ReLU, another kink or a "
                                               "smooth function) to split")
    n_sign = len(signed)
    names = [r.inputs[0] for r in relus]
    # Assumptions cover every neuron (the same on every rank); bounds only the neurons this
    # rank holds (all of them except in tp zones): `ranges` places a rank's neurons.
    ranges = [network.neuron_range(r) for r in relus]
    offsets = np.cumsum([0] + [total for _, _, total in ranges])
    local = np.cumsum([0] + [stop - start for start, stop, _ in ranges])
    n_conj = int(owner.max()) + 1
    dev = network.device
    Cd = C.to(dev)
    owner_t = torch.from_numpy(owner)
    lo_flat, hi_flat = lo.reshape(1, -1), hi.reshape(1, -1)
    # Sign assumptions per domain, over the sign-split neurons (the first n_sign ops); the
    # interval splits live in the domains' bounds.
    stack = torch.zeros(1, int(offsets[n_sign]), dtype=torch.int8)
    bounds = None                       # (N, 2, local neurons): parents' intermediate bounds
    if root_prior is not None and all(name in root_prior for name in names):
        bounds = _flat_bounds(root_prior, names, 1)
    # --soundness real/float32 with interval splits: what each domain assumes of the split
    # neurons (same layout; -inf / inf: nothing), apart from its computed bounds, which the
    # certificate does not take from the float32 engine.
    cuts = no_cuts(int(local[-1])) if certify is not None and n_sign < len(relus) else None
    # --soundness real/float32: each domain's rigorous bounds of `names` (N, 2, neurons)
    # float64, carried down the tree as the engine carries its own (certificate.py)
    domain_bounds = getattr(certify, "domain_bounds", None)
    shapes = [tuple(r.shape) for r in relus]
    rbounds = None
    depth = torch.zeros(1, dtype=torch.float64)
    since = torch.full((1,), -1)     # per domain: the split op of its last split (certificate.py)
    key = torch.zeros(1, dtype=torch.float64)   # the parent's margin: most violated first
    # Default mode: the parents' bounds per spec row, which hold on their children (a
    # subset), so a row a parent proved stays proved and beta-CROWN optimises only the open
    # (domain, row) pairs (row_pairs.py; in fsdp each rank its share of them). --soundness
    # real/float32 does the same with the parents' rigorous bounds per row (float64, from
    # `certify.row_bounds` on every domain): a row the parent proved rigorously stays proved,
    # and the leaf is certified by its rows' rigorous bounds. Under row sharding there every
    # row is bounded afresh (whole domains, each rank a slice of every domain's rows) and
    # each leaf certified on its own.
    by_rows = (certify is not None and getattr(certify, "row_bounds", None) is not None
               and domain_bounds is not None and not network.rows.enabled)
    carry = certify is None or by_rows
    by_pairs = carry
    plb = torch.full((1, C.shape[0]), -math.inf, dtype=torch.float64 if by_rows else None)
    d_up = np.nextafter(np.asarray(d, np.float64), np.inf)   # the certificate's threshold
    store = WarmAlphas(KEPT_ALPHA_BYTES if warm_start else 0)
    warm = torch.zeros(1, 0)                     # (N, alpha width): the parents' alphas
    has = torch.zeros(1, dtype=torch.bool)       # which domains have them
    bounded, verified, unresolved, rounds = 0, 0.0, 0, 0
    if resume is not None:
        r = resume
        stack, depth, key, warm, has, cuts, store = (r.stack, r.depth, r.key, r.warm, r.has,
                                                     r.cuts, r.store)
        rbounds = None if r.rbounds is None else Rows(r.rbounds.clone())
        since = torch.full((len(stack),), -1)           # a new prior: every node afresh
        plb = r.plb
        bounded, verified, unresolved, rounds = r.bounded, r.verified, r.unresolved, r.rounds
        bounds = r.bounds
        if root_prior is not None and all(name in root_prior for name in names):
            bounds = tightened(bounds, _flat_bounds(root_prior, names, 1), len(stack))
    if domain_bounds is not None and rbounds is None:       # nothing carried yet
        rbounds = Rows(no_cuts(int(offsets[-1])).to(torch.float64).expand(len(stack), -1, -1)
                       .clone())
    start = time.monotonic()
    final_at = (deadline - final_share * (deadline - start) if math.isfinite(deadline)
                else math.inf)
    final = False                       # the final falsification pass: attack, never branch
    dropped = 0                         # open domains it attacked and let go (never proved)
    attack_s = 0.0
    midway = None                       # (time, proved share) halfway to final_at
    while len(stack):
        if stop():
            state = None
            if keep_state:
                state = BabState(stack, depth, key, warm, has, bounds, cuts, store, bounded,
                                 verified, unresolved, rounds, plb,
                                 None if rbounds is None else rbounds.t.clone())
            return ReluBabResult("timeout", domains=bounded, verified_fraction=verified,
                                 state=state)
        if len(stack) > MAX_DOMAINS:
            return ReluBabResult("unknown", domains=bounded, verified_fraction=verified,
                                 reason=f"more than {MAX_DOMAINS} open domains")
        if midway is None and time.monotonic() > (start + final_at) / 2:
            midway = (time.monotonic(), verified)
        if not final and time.monotonic() > final_at:
            final = agree(_proof_out_of_reach(verified, midway or (start, 0.0), deadline))
            final_at = math.inf         # decided once
        take = min(batch, len(stack))
        _swap_((stack, depth, key, warm, has, bounds, cuts, plb, since,
                None if rbounds is None else rbounds.t),
               *_best_to_tail(key, take))
        dom, ddepth = stack[-take:], depth[-take:]
        bwarm, bhas, bplb = warm[-take:], has[-take:], plb[-take:]
        stack, depth, key, plb = stack[:-take], depth[:-take], key[:-take], plb[:-take]
        bsince, since = since[-take:], since[:-take]
        warm, has = warm[:-take], has[:-take]
        prior = bcuts = brb = None
        if cuts is not None:
            bcuts, cuts = cuts[-take:], cuts[:-take]
        if rbounds is not None:
            brb = rbounds.take(take)
        if bounds is not None:
            pb, bounds = bounds[-take:].to(dev), bounds[:-take]
            prior = {name: (pb[:, 0, local[i]:local[i + 1]].reshape(take, *relus[i].shape),
                            pb[:, 1, local[i]:local[i + 1]].reshape(take, *relus[i].shape))
                     for i, name in enumerate(names)}
        shape = (take, *network.input_shape)
        blo = lo_flat.expand(take, -1).reshape(shape).to(dev)
        bhi = hi_flat.expand(take, -1).reshape(shape).to(dev)
        splits = {name: dom[:, offsets[i] + ranges[i][0]:offsets[i] + ranges[i][1]]
                  .reshape(take, *relus[i].shape).to(dev) for i, name in enumerate(names)
                  if i < n_sign}
        with torch.no_grad():
            ibp, known = network.intermediate_bounds(blo, bhi, splits=splits, prior=prior)
            grab, split_A = {}, {}
            lb = crown_pairs(network, ibp, known, blo, bhi, Cd, input_A=grab, split_A=split_A)
        bounded += take
        rounds += 1
        lb = lb.cpu()
        if carry:       # --soundness real/float32: bplb is rigorous, float64 (rounded down)
            lb = torch.maximum(lb, bplb if not by_rows else down32(bplb))
        empty = torch.zeros(take, dtype=torch.bool)
        for name in names:
            l, h = known[name]
            empty |= (l > h).reshape(take, -1).any(dim=1).cpu()
        empty = network.any_over_ranks(empty)
        if by_rows and bool(empty.any()):
            # A domain the engine's float32 clamps leave empty (lower > upper) is closed only
            # by its rigorous row bounds, whose node bounds need not see it empty (they bound
            # a domain's own inexact neurons, a clamped split neuron no longer is one). Its
            # CROWN bound means nothing to them, so beta-CROWN bounds it from the rigorous
            # floor: on an infeasible split the multipliers grow, and their Lagrangian is
            # what the certificate re-evaluates (measured on mnistfc prop_3_0.03: the 0.599
            # plateau of proved share was 54,889 such leaves, README issue 17).
            lb[empty] = down32(bplb[empty]).to(lb.dtype)
        refuted = refuted_conjunctions(lb, d, owner, n_conj)
        lA = grab["lA"].cpu().reshape(take, C.shape[0], -1)
        lagrangian = None                   # beta-CROWN's (domain indices, alphas, betas)
        pair_lagrangian = None              # by_rows: (domains, rows, alphas, betas) per pair
        which = ~(refuted.all(dim=1) | (empty & (not by_rows)))
        if not final and iterations > 0 and bool(which.any()):
            start_alphas = ((store.unflatten(bwarm, dev), bhas)
                            if store.on and bool(bhas.any()) else None)
            betas, best = {}, ({} if certify is not None else None)
            if by_pairs:
                pairs = which.unsqueeze(1) & ~refuted[:, owner_t]
                lb, pair_lA, idx, alphas = optimise_pairs(network, ibp, known, blo, bhi, Cd,
                                                          splits, lb, pairs, iterations, stop,
                                                          start_alphas, BETA_KEY,
                                                          best if by_rows else None)
                if best:        # the Lagrangian of each optimised (domain, row) pair
                    pair_lagrangian = (*torch.nonzero(pairs, as_tuple=True), best["alphas"],
                                       best["betas"])
                    best = None
                beta_lA = None
                if pair_lA is not None:
                    lA = lA.clone()
                    lA[pairs] = pair_lA.reshape(len(pair_lA), -1)
            else:
                lb, idx, beta_lA, alphas = _optimise(network, ibp, known, blo, bhi, Cd, splits,
                                                     lb, which, iterations, stop, start_alphas,
                                                     betas, best)
            if best:        # the parameters of each row's best iterate, not the last
                lagrangian = (idx, best["alphas"], best["betas"])
            if store.on and alphas:
                kept = {k: v for k, v in alphas.items()
                        if warm_betas or not k.startswith(BETA_KEY)}
                if warm_betas:
                    kept.update({BETA_KEY + k: v for k, v in betas.items()})
                flat = store.flatten(kept, len(idx))
                bwarm, bhas = torch.zeros(take, flat.shape[1]), torch.zeros(take, dtype=torch.bool)
                bwarm[idx], bhas[idx] = flat, True
            refuted = refuted_conjunctions(lb, d, owner, n_conj)
            if beta_lA is not None:
                lA = lA.clone()
                lA[idx] = beta_lA.reshape(len(idx), C.shape[0], -1)
        if trace is not None:
            trace.append(lb.clone())
        done = refuted.all(dim=1) | empty
        cut = rb = None
        if certify is not None:
            cut = None if bcuts is None else cut_dict(bcuts, relus, names, local, n_sign)
        if domain_bounds is not None:
            rb = domain_bounds(blo, bhi, {k: v.cpu() for k, v in splits.items()}, cut,
                               carried_dict(brb, names, shapes), since=bsince)
        if by_rows:
            # every domain's rigorous row bounds (its parent's proved rows stay proved); a
            # domain is closed when they refute every conjunction, whatever the engine says
            rlb = torch.maximum(certify.row_bounds(blo, bhi, splits, rb, pair_lagrangian),
                                bplb)
            refuted = refuted_conjunctions(rlb, d_up, owner, n_conj)
            done = certify.agree(refuted.all(dim=1))
        elif certify is not None and bool(done.any()):
            ok = certified(certify, done, blo, bhi, splits, lagrangian, C.shape[0], cut, rb)
            refuted[done & ~ok] = False                 # not proved: open, every row
            done = done & ok
        verified += float(torch.pow(0.5, ddepth[done]).sum())
        open_ = ~done
        if progress is not None:
            progress(len(stack) + 2 * int(open_.sum()), verified, time.monotonic() - start)
        if not open_.any():
            continue
        open_rows = ~refuted[:, owner_t]                                      # (take, R)
        # Candidate counterexamples: per open row, the vertex minimising its lower line.
        sel = open_.unsqueeze(1) & open_rows                                   # (take, R)
        verts = torch.where(lA > 0, lo_flat.unsqueeze(0), hi_flat.unsqueeze(0))[sel]
        if len(verts):
            hit = is_violation(verts)
            if hit is not None:
                return ReluBabResult("sat", x=verts[hit], domains=bounded,
                                     verified_fraction=verified)
        close = closeness(lb, d, owner, n_conj)
        worst = torch.nonzero(open_).reshape(-1)
        worst = worst[torch.argsort(close[worst], stable=True)]
        # Attack while the attacks' share of the time stays under ATTACK_SHARE (agreed over
        # ranks, so every rank runs the same forward passes); every open domain in the final
        # pass.
        n_attack = len(worst) if final else attack_domains
        if not final and n_attack:
            n_attack *= agree(attack_s <= ATTACK_SHARE * (time.monotonic() - start))
        t_attack = time.monotonic()
        x = _attack_domains(network, lo_flat, hi_flat, C, d, owner_t, lA, lb, worst[:n_attack],
                            {k: v.cpu() for k, v in splits.items()}, open_rows, is_violation,
                            stop, seed=rounds)
        attack_s += time.monotonic() - t_attack
        if x is not None:
            return ReluBabResult("sat", x=x, domains=bounded, verified_fraction=verified)
        if final:
            dropped += len(worst)       # attacked, not refined: the budget is nearly spent
            continue
        scores = slack_scores(network, relus, split_A, known, open_rows.to(dev).to(lb.dtype),
                               n_sign).cpu()
        kb = _flat_bounds(known, names, take)
        scores, odom, odepth, okb = scores[open_], dom[open_], ddepth[open_], kb[open_]
        oclose = close[open_]
        best = scores.argmax(dim=1)
        splittable = scores.max(dim=1).values >= 0
        # Filtered smart branching, except in the `attack_domains` most violated domains:
        # there BaBSR's neuron (the most relaxation slack in the bound) is split, which
        # isolates a spike's support for the next attack (FSB prefers neurons that tighten
        # the bound, and reached a planted spike's ReLU thousands of domains later). tp: a
        # rank holds only its channels' bounds; BaBSR's choice stands there.
        fsb_rows = splittable.clone()
        fsb_rows[torch.isin(torch.nonzero(open_).reshape(-1), worst[:attack_domains])] = False
        if fsb > 1 and network.tp is None and bool(fsb_rows.any()):
            which = torch.nonzero(open_).reshape(-1)[fsb_rows]
            best = best.clone()
            sub_scores = scores[fsb_rows]
            chunk = max(1, batch // fsb)        # 2 * chunk * fsb children per CROWN call
            best[fsb_rows] = torch.cat([
                fsb_choice(network, relus, names, offsets, known, ibp, lo_flat, hi_flat, Cd,
                            d, owner, sub_scores[i:i + chunk], which[i:i + chunk], fsb, n_sign,
                            None if not carry else lb[which[i:i + chunk]])
                for i in range(0, len(which), chunk)])
        if not bool(splittable.all()):
            # No unstable neuron left and still open (beta-CROWN's fixed iterations did not
            # close it): set it aside, never count it as proved.
            unresolved += int((~splittable).sum())
        odom, best, odepth = odom[splittable], best[splittable], odepth[splittable]
        okb, oclose = okb[splittable], oclose[splittable]
        olb = (rlb if by_rows else lb)[open_][splittable]
        rows = torch.arange(len(best))
        sign = best < int(offsets[n_sign])
        active, inactive = odom.clone(), odom.clone()
        active[rows[sign], best[sign]] = 1
        inactive[rows[sign], best[sign]] = -1
        if cuts is not None:
            below, above, cut_below, cut_above = interval_children(
                relus, n_sign, offsets, local, ranges, okb, best, ~sign,
                bcuts[open_][splittable])
            cuts = torch.cat([cuts, cut_below, cut_above])
        else:
            below, above = interval_children(relus, n_sign, offsets, local, ranges, okb,
                                              best, ~sign)
        stack = torch.cat([stack, inactive, active])
        depth = torch.cat([depth, odepth + 1, odepth + 1])
        osince = torch.bucketize(best, torch.as_tensor(offsets[1:]), right=True)
        since = torch.cat([since, osince, osince])
        key = torch.cat([key, oclose, oclose])
        plb = torch.cat([plb, olb, olb])
        ow = bwarm[open_][splittable]
        oh = bhas[open_][splittable]
        if store.on and ow.shape[1] and store.fits(len(stack)):
            if warm.shape[1] != ow.shape[1]:          # the first alphas: the layout is known
                warm = torch.zeros(len(has), ow.shape[1])
            warm, has = torch.cat([warm, ow, ow]), torch.cat([has, oh, oh])
        else:
            warm, has = torch.zeros(len(stack), 0), torch.zeros(len(stack), dtype=torch.bool)
        bounds = torch.cat([bounds if bounds is not None else okb[:0], below, above])
        if rb is not None:
            rk = _flat_bounds(rb, names, take)[open_][splittable]
            rbounds.extend(rk, rk)
    if dropped:
        return ReluBabResult("timeout", domains=bounded, verified_fraction=verified,
                             reason="the final falsification pass found no counterexample")
    if unresolved:
        return ReluBabResult("unknown", domains=bounded, verified_fraction=verified,
                             reason=f"{unresolved} domain(s) with every ReLU split unresolved")
    return ReluBabResult("unsat", domains=bounded, verified_fraction=1.0)
