"""Split refinement's tightened intermediate bounds, made rigorous (--soundness real/float32).

`verify` tightens branch and bound's root prior by small branch and bounds over earlier ReLU
splits (runtime/engine/split_refine.py). The engine's leaves are then proved with those
bounds, and a certificate that starts from the root certificate's bounds alone does not
reach them: measured on mnistfc prop_3_0.03 (66 unstable second-layer neurons under the
root bounds, 49 after refinement), 327 of 26,743 leaves the float32 engine proved in 300 s
were certified, and the run timed out.

So the refinement's final leaves are re-evaluated here, each by one rigorous backward pass
from its target neuron (RigorousBounds._backward: the error account of every other bound)
with the leaf's own alphas and betas as fixed parameters (any alpha in its set and any
beta >= 0 gives a bound) and its sign assignment as clamps on the rigorous bounds of the
split nodes. A leaf those clamps leave empty bounds nothing (+inf). An objective's leaves
cover the box, so the lowest of their rigorous bounds holds on it; intersected with the
bounds it started from, it becomes the prior of every leaf certificate (verdict.py).
Targets are refined in order, so a later target's leaves see the earlier ones' bounds.
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.rigorous.core import DT

CHUNK = 1024      # leaves per backward pass


def refined_bounds(rig, bounds: dict, lo: torch.Tensor, hi: torch.Tensor, leaves, check=None,
                   chunk: int = CHUNK) -> dict:
    """A copy of `bounds` (rigorous, every node over the box lo, hi (1, n) float64) with each
    target node of `leaves` (split_refine.RefineLeaves, in order) intersected with its leaves'
    rigorous bounds. `check()` runs before each pass (the verify budget's)."""
    from shardbound.runtime.engine.split_refine import ALPHA_KEY, BETA_KEY

    out = dict(bounds)
    for rec in leaves:
        node = rig.by_name[rec.node]
        k = len(rec.j)
        n = math.prod(node.shape)
        best = torch.full((2 * k,), math.inf, dtype=DT)
        total = len(rec.obj)
        for at in range(0, total, chunk):
            if check is not None:
                check()
            sl = slice(at, min(at + chunk, total))
            m = sl.stop - sl.start
            obj = rec.obj[sl]
            b = {name: (v[0].expand(m, *v[0].shape[1:]), v[1].expand(m, *v[1].shape[1:]))
                 for name, v in out.items()}
            empty = torch.zeros(m, dtype=torch.bool)
            extra = {}
            for i, nm in enumerate(rec.names):
                l, h = b[nm]
                s = torch.zeros(m, l[0].numel(), dtype=DT)
                s[:, rec.cand[i]] = rec.assign[sl, rec.offsets[i]:rec.offsets[i + 1]].to(DT)
                s = s.reshape(l.shape)
                l, h = torch.where(s > 0, l.clamp(min=0), l), torch.where(s < 0, h.clamp(max=0), h)
                b[nm] = (l, h)
                empty |= (l > h).reshape(m, -1).any(dim=1)
                beta = rec.params.get(BETA_KEY + nm)
                if beta is not None:
                    extra[nm] = -(beta[sl].to("cpu", DT).clamp(min=0) * s.unsqueeze(1))
            alphas = {name[len(ALPHA_KEY):]: t[sl].to("cpu", DT)
                      for name, t in rec.params.items() if name.startswith(ALPHA_KEY)}
            L0 = torch.zeros(m, 1, n, dtype=DT)
            L0[torch.arange(m), 0, rec.j[obj % k]] = torch.where(obj < k, 1.0, -1.0).to(DT)
            rig.f32_deltas(b)
            c = rig._backward(rec.node, L0.reshape(m, 1, *node.shape), b,
                              lo.expand(m, -1), hi.expand(m, -1), alphas, extra)[:, 0]
            c = torch.where(empty, torch.full_like(c, math.inf), c)
            best.scatter_reduce_(0, obj, c, reduce="amin")
        l, h = out[rec.node]
        fl, fh = l.reshape(-1).clone(), h.reshape(-1).clone()
        fl[rec.j] = torch.maximum(fl[rec.j], best[:k])
        fh[rec.j] = torch.minimum(fh[rec.j], -best[k:])
        out[rec.node] = (fl.reshape(l.shape), fh.reshape(h.shape))
    return out
