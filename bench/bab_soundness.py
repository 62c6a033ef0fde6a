"""Branch and bound of `verify` on one instance, in a soundness mode, stage by stage with the
CPU seconds of each (this one-thread process): the CROWN stage and full alpha-CROWN (with the
root certificate in real/float32), split refinement of the root prior, then ReLU branch and
bound from the refined prior to the end (no first try, no MILP, no final attack share, no
clock-dependent stage shares: the same work however loaded the machine is). Run one process
per mode side by side to compare modes (issue 17).

    python3 bench/bab_soundness.py --onnx NET.onnx --vnnlib PROP.vnnlib [--soundness real]
                                   [--summation blocked] [--no-refine] [--limit S]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--onnx", required=True)
    p.add_argument("--vnnlib", required=True)
    p.add_argument("--soundness", default="default")
    p.add_argument("--summation", default="blocked")
    p.add_argument("--no-refine", action="store_true")
    p.add_argument("--limit", type=float, default=3000.0, help="wall-clock budget (s)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.engine.full_alpha import root_bounds
    from shardbound.runtime.parallel import dist
    from shardbound.runtime.verification import verdict as V
    from shardbound.runtime.verification.budget import Budget
    from shardbound.runtime.verification.relu_split import relu_split
    from shardbound.runtime.verification.spec import spec_from_property
    from shardbound.runtime.verification.stages import StageLog

    out = tempfile.mkdtemp(prefix="bab_soundness_")
    compile_model(args.onnx, out, PassOptions(summation=args.summation))
    case = spec_from_property(parse_vnnlib(args.vnnlib)).cases[0]
    cpu = time.process_time
    mode = args.soundness
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    with dist.rank_session(1, args.limit) as comm:
        v = load(out, comm=comm)
        net = v.network
        budget = Budget(time.monotonic() + args.limit, comm)
        r = V._CaseRunner(v, case, budget, comm, StageLog(time.time(), quiet=True, boxes=1),
                          lambda s: None, mode, V.rigorous_for(net, mode), "off")
        shape = (1, *net.input_shape)
        lo, hi = r.lo.reshape(shape), r.hi.reshape(shape)
        t0 = cpu()
        with torch.no_grad():
            cache = r.crown_intermediate(lo, hi)
        r._replay = {} if r.rigorous else None
        _, prior = root_bounds(net, lo, hi, r.C, cache, stop=budget, replay=r._replay)
        if r.rigorous:
            r.root_certificate()
        t1 = cpu()
        if not args.no_refine:
            prior = r.refine_prior(lo, hi, prior)
        t2 = cpu()
        res = relu_split(net, r.C, r.d, r.owner, r.lo, r.hi, budget.deadline, r.agree,
                         r.is_violation, root_prior=prior, certify=r.certify(),
                         final_share=0.0)
        t3 = cpu()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| mode | verdict | domains | CROWN + alpha-CROWN CPU s | refinement CPU s | "
          "branch and bound CPU s | total CPU s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print(f"| {mode} | {res.verdict} | {res.domains} | {t1 - t0:.1f} | {t2 - t1:.1f} | "
          f"{t3 - t2:.1f} | {t3 - t0:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
