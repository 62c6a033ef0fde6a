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
from bab_rate import violation_check as _violation  # noqa: E402
from split_refine import _instance, _unstable  # noqa: E402


def _layers(net):
    """[(name, W, b)] of the Linear nodes in order, checking the net is Linear/ReLU only."""
    out = []
    for n in net.nodes:
        if n.kind == "linear":
            w, b = (n.params[k].detach().double().numpy() for k in ("weight", "bias"))
            out.append((n.name, w, b))
        elif n.kind not in ("input", "reshape", "relu"):
            sys.exit(f"milp_probe: {n.name} is a {n.kind}; only Linear/ReLU chains are probed")
    return out


class Mip:
    """x in the box, then per hidden layer z = W a + b with the bounds given and a = relu(z):
    exact for stable neurons, the triangle or (binary) the big-M encoding for unstable ones."""

    def __init__(self, hs, lo, hi, layers, bounds, binary_upto):
        self.hs = hs
        self.h = h = hs.Highs()
        for k, v in (("output_flag", False), ("threads", 1), ("random_seed", 0),
                     ("mip_rel_gap", 1e-4), ("presolve", "on" if binary_upto else "off")):
            h.setOptionValue(k, v)       # presolve off: the LPs' dual simplex cycled with it
        self.lp = not binary_upto
        self.n = 0
        a = self._vars(lo, hi)
        self.z = []
        for i, (name, w, b) in enumerate(layers[:-1]):
            l, u = bounds[name]
            z = self._affine(w, b, a, l, u)
            self.z.append(z)
            if i == len(layers) - 2 and binary_upto == -1:
                break
            a = self._relu(z, l, u, binary=binary_upto == -1 or i < binary_upto)
        self.last = a

    def _vars(self, l, u, integer=False):
        k = len(l)
        self.h.addVars(k, np.asarray(l, float), np.asarray(u, float))
        idx = np.arange(self.n, self.n + k, dtype=np.int32)
        if integer:
            self.h.changeColsIntegrality(k, idx, np.full(k, self.hs.HighsVarType.kInteger))
        self.n += k
        return idx

    def _row(self, lo, up, idx, val):
        self.h.addRow(lo, up, len(idx), np.asarray(idx, np.int32), np.asarray(val, float))

    def _affine(self, w, b, a, l, u):
        z = self._vars(l, u)
        for j in range(w.shape[0]):
            nz = np.nonzero(w[j])[0]
            self._row(b[j], b[j], np.r_[z[j], a[nz]], np.r_[1.0, -w[j, nz]])
        return z

    def _relu(self, z, l, u, binary):
        inf = self.hs.kHighsInf
        a = self._vars(np.maximum(l, 0), np.maximum(u, 0))
        for j in range(len(l)):
            if l[j] >= 0:
                self._row(0, 0, [a[j], z[j]], [1, -1])
            elif u[j] > 0:
                self._row(0, inf, [a[j], z[j]], [1, -1])                         # a >= z
                if binary:
                    (s,) = self._vars([0], [1], integer=True)
                    self._row(-inf, -l[j], [a[j], z[j], s], [1, -1, -l[j]])      # a <= z - l(1-s)
                    self._row(-inf, 0, [a[j], s], [1, -u[j]])                    # a <= u s
                else:
                    k = u[j] / (u[j] - l[j])
                    self._row(-inf, -k * l[j], [a[j], z[j]], [1, -k])            # a <= k(z - l)
        return a

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
    last_name, (w_out, b_out) = layers[-2][0], layers[-1][1:]
    spec_w, spec_b = C.double().numpy() @ w_out, C.double().numpy() @ b_out
    l2, u2 = (x.copy() for x in bounds[last_name])
    unstable = np.nonzero((l2 < 0) & (u2 > 0))[0]

    def spec_rows(mip, cap):
        for r in range(len(spec_w)):
            s, best, dual, t = mip.minimise(mip.last, spec_w[r], spec_b[r] - float(d[r]), cap)
            print(f"    row {r}: {s}, best {best:.4f}, bound {dual:.4f}, {t:.1f} CPU s", flush=True)

    for run in args.runs.split(","):
        c0 = time.process_time()
        if run == "lp":
            mip = Mip(hs, *box, layers, bounds, binary_upto=0)
            lo2, up2 = l2.copy(), u2.copy()
            for j in unstable:
                lo2[j] = max(lo2[j], mip.minimise([mip.z[-1][j]], [1.0])[2])
                up2[j] = min(up2[j], -mip.minimise([mip.z[-1][j]], [-1.0])[2])
            print(f"  lp: {last_name} {len(unstable)} unstable -> {int(((lo2 < 0) & (up2 > 0)).sum())}, "
                  f"mean width {np.mean(u2[unstable] - l2[unstable]):.4f} -> "
                  f"{np.mean(up2[unstable] - lo2[unstable]):.4f}; spec rows:")
            spec_rows(mip, args.cap)
        elif run == "layer":
            mip = Mip(hs, *box, layers, bounds, binary_upto=-1)
            for j in unstable:
                if -l2[j] < u2[j]:
                    l2[j] = max(l2[j], mip.minimise([mip.z[-1][j]], [1.0], cap=args.cap)[2])
                else:
                    u2[j] = min(u2[j], -mip.minimise([mip.z[-1][j]], [-1.0], cap=args.cap)[2])
            bounds[last_name] = (l2, u2)
            print(f"  layer: {last_name} {len(unstable)} unstable -> "
                  f"{int(((l2 < 0) & (u2 > 0)).sum())}")
        elif run == "spec":
            print("  spec MILP:")
            spec_rows(Mip(hs, *box, layers, bounds, binary_upto=len(layers)), args.cap)
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
