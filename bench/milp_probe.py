"""Can a MIP solver finish what full alpha-CROWN starts on a small ReLU MLP? An experiment
(issue 18, mnistfc prop_1_0.03), not a verifier stage: every number it prints is a float LP /
MILP solver's (HiGHS through highspy, one thread, fixed seed), uncertified.

    python3 bench/milp_probe.py --onnx mnist-net_256x2.onnx --vnnlib prop_1_0.03.vnnlib \
        [--runs lp,layer,spec,refute,bab] [--cap S] [--bab-cpu S]

From the root's best intermediate bounds (full alpha-CROWN's, `full_alpha.root_bounds`):
  lp     the triangle-relaxation LP for both bounds of every unstable neuron of the last
         hidden layer and for every spec row;
  layer  a MILP per unstable neuron of the last hidden layer (binaries for the unstable
         neurons of the layers before it), only the bound nearer 0 (the one that can make the
         neuron stable), each capped at --cap wall seconds; its dual bound is kept;
  spec   a MILP per spec row with binaries for every unstable neuron, on the layer's bounds
         when `layer` ran first;
  refute verify's MILP stage (`runtime/verification/milp.py`: each conjunction's MILP pruned
         at its threshold plus a margin), the rows sharing --cap x rows wall seconds;
  bab    verify's ReLU branch and bound (`relu_split`) from the prior with the layer's bounds
         intersected in, stopped after --bab-cpu CPU seconds.
Needs `pip install highspy` (not a shardbound dependency). Linear/ReLU chains only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from split_refine import _instance, _unstable, _violation  # noqa: E402


def _layers(net):
    """The Linear nodes' names in order, checking the net is Linear/ReLU only."""
    out = []
    for n in net.nodes:
        if n.kind == "linear":
            out.append(n.name)
        elif n.kind not in ("input", "reshape", "relu"):
            sys.exit(f"milp_probe: {n.name} is a {n.kind}; only Linear/ReLU chains are probed")
    return out


# HiGHS's own defaults for what verify's OPTIONS turn off: the probe solves to a gap and
# wants incumbents (its "best" column), which the heuristics find
PROBE_OPTIONS = (("mip_rel_gap", 1e-4), ("mip_heuristic_effort", 0.05),
                 ("mip_heuristic_run_feasibility_jump", True), ("mip_heuristic_run_rins", True),
                 ("mip_heuristic_run_rens", True), ("mip_heuristic_run_root_reduced_cost", True))


class Mip:
    """verify's MILP model (`milp._Model`: x in the box, z = W a + b per layer with the bounds
    given, a = relu(z)) with a choice per ReLU layer: "binary" (exact big-M) or "triangle"
    (its LP relaxation). All triangles is an LP, solved with presolve off (its dual simplex
    cycled with it); `lp` says it is one."""

    def __init__(self, hs, net, box, bounds, encoding, lp=False):
        from shardbound.runtime.verification import milp
        self.lp = lp
        prior = {k: tuple(torch.from_numpy(np.asarray(t)) for t in v) for k, v in bounds.items()}
        options = (*PROBE_OPTIONS, ("presolve", "off" if self.lp else "on"))
        m = milp._Model(hs, net, prior, *box, encoding=encoding, options=options)
        self.h, self.z, self.out = m.h, m.z, m.out
        self.n = m.n

    def minimise(self, idx, coef, const=0.0, cap=10.0):
        """(status, best solution's value, dual bound, CPU s) of min coef . v[idx] + const."""
        cost = np.zeros(self.n)
        cost[idx] = coef
        self.h.changeColsCost(self.n, np.arange(self.n, dtype=np.int32), cost)
        # HiGHS 1.16: the simplex checks time_limit against the object's run clock, which
        # adds up over runs; the MIP solver against its own start
        self.h.setOptionValue("time_limit", cap + (self.h.getRunTime() if self.lp else 0.0))
        t = time.process_time()
        self.h.run()
        t = time.process_time() - t
        info = self.h.getInfo()
        status = self.h.modelStatusToString(self.h.getModelStatus())
        if self.lp and status != "Optimal":
            sys.exit(f"milp_probe: an LP ended {status}")
        dual = info.objective_function_value if self.lp else info.mip_dual_bound
        return status, info.objective_function_value + const, dual + const, t


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--vnnlib", required=True)
    ap.add_argument("--runs", default="lp,layer,spec,bab")
    ap.add_argument("--cap", type=float, default=5.0, help="wall seconds per MILP")
    ap.add_argument("--bab-cpu", type=float, default=90.0)
    args = ap.parse_args(argv)
    try:
        import highspy as hs
    except ImportError:
        sys.exit("milp_probe: needs highspy (pip install highspy)")
    torch.set_num_threads(1)
    from shardbound.runtime.engine.full_alpha import root_bounds
    from shardbound.runtime.verification.input_split import closeness
    from shardbound.runtime.verification.relu_split import relu_split
    net, C, d, owner, lo, hi = _instance(args.onnx, args.vnnlib, tempfile.mkdtemp())
    layers = _layers(net)
    shape = (1, *net.input_shape)
    n_conj = int(owner.max()) + 1
    with torch.no_grad():
        cache = net.intermediate_bounds(lo.reshape(shape), hi.reshape(shape))
    lb, prior = root_bounds(net, lo.reshape(shape), hi.reshape(shape), C, cache)
    bounds = {k: tuple(t.detach().double().reshape(-1).numpy() for t in v) for k, v in prior.items()}
    print(f"{os.path.basename(args.vnnlib)}: full alpha-CROWN rows {np.round(lb.numpy(), 3)}, "
          f"margin {float(closeness(lb, d, owner, n_conj)[0]):.3f}; unstable: {_unstable(prior)}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    box = (lo.double().reshape(-1).numpy(), hi.double().reshape(-1).numpy())
    last_name, n_hidden = layers[-2], len(layers) - 1
    spec_w, spec_b = C.double().numpy(), -np.asarray(d, np.float64)
    l2, u2 = (x.copy() for x in bounds[last_name])
    unstable = np.nonzero((l2 < 0) & (u2 > 0))[0]

    def spec_rows(mip, cap):
        for r in range(len(spec_w)):
            s, best, dual, t = mip.minimise(mip.out, spec_w[r], spec_b[r], cap)
            print(f"    row {r}: {s}, best {best:.4f}, bound {dual:.4f}, {t:.1f} CPU s", flush=True)

    for run in args.runs.split(","):
        c0 = time.process_time()
        if run == "lp":
            mip = Mip(hs, net, box, bounds, lambda k: "triangle", lp=True)
            lo2, up2 = l2.copy(), u2.copy()
            for j in unstable:
                lo2[j] = max(lo2[j], mip.minimise([mip.z[-2][j]], [1.0])[2])
                up2[j] = min(up2[j], -mip.minimise([mip.z[-2][j]], [-1.0])[2])
            print(f"  lp: {last_name} {len(unstable)} unstable -> {int(((lo2 < 0) & (up2 > 0)).sum())}, "
                  f"mean width {np.mean(u2[unstable] - l2[unstable]):.4f} -> "
                  f"{np.mean(up2[unstable] - lo2[unstable]):.4f}; spec rows:")
            spec_rows(mip, args.cap)
        elif run == "layer":
            # binaries up to the layer bounded; its own ReLU (and after) relaxed, which leaves
            # every value of its z feasible
            mip = Mip(hs, net, box, bounds, lambda k: "binary" if k < n_hidden - 1 else "triangle")
            for j in unstable:
                if -l2[j] < u2[j]:
                    l2[j] = max(l2[j], mip.minimise([mip.z[-2][j]], [1.0], cap=args.cap)[2])
                else:
                    u2[j] = min(u2[j], -mip.minimise([mip.z[-2][j]], [-1.0], cap=args.cap)[2])
            bounds[last_name] = (l2, u2)
            print(f"  layer: {last_name} {len(unstable)} unstable -> "
                  f"{int(((l2 < 0) & (u2 > 0)).sum())}")
        elif run == "spec":
            print("  spec MILP:")
            spec_rows(Mip(hs, net, box, bounds, lambda k: "binary"), args.cap)
        elif run == "refute":
            from shardbound.runtime.verification import milp
            n = int(owner.max()) + 1
            refuted, found = milp.refute(net, prior, lo, hi, C.double().numpy(), d, owner, n,
                                         np.ones(n, dtype=bool), time.monotonic() + args.cap * n,
                                         stop_at_open=False)
            print(f"  refute: {int(refuted.sum())} of {n} conjunctions refuted {refuted.astype(int)}, "
                  f"{len(found)} points found")
        elif run == "bab":
            lo_t, up_t = prior[last_name]
            as32 = lambda v, way: torch.from_numpy(                          # noqa: E731
                np.nextafter(v.astype(np.float32), way)).reshape(lo_t.shape)
            root = dict(prior)
            root[last_name] = (torch.maximum(lo_t, as32(l2, -np.inf)),
                               torch.minimum(up_t, as32(u2, np.inf)))
            res = relu_split(net, C, d, owner, lo, hi, float("inf"), lambda f: f,
                             _violation(net, C, d, owner), root_prior=root,
                             stop=lambda: time.process_time() - c0 > args.bab_cpu)
            print(f"  bab from {_unstable(root)}: {res.verdict}, {res.domains} domains, "
                  f"proved {res.verified_fraction:.4f}")
        print(f"  {run}: {time.process_time() - c0:.1f} CPU s, load {os.getloadavg()[0]:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
