"""ReLU branch and bound on one property, as `verify` runs it after full alpha-CROWN, with and
without split refinement of the root prior (runtime/engine/split_refine.py), in one process
and one thread; CPU seconds, so a loaded machine skews the comparison less.

    python3 bench/split_refine.py --onnx mnist-net_256x2.onnx --vnnlib prop_3_0.03.vnnlib \
        [--timeout S] [--runs before,after]

Runs: "before" is the branch point's settings (no refinement, 12 beta-CROWN iterations, no
beta warm starts); "after" refines the prior, then today's defaults (20 iterations, betas
warm-started); "resume" is verify's path: branch and bound on the unrefined prior for
--first CPU seconds, then the refinement, then the same tree continued under the refined
prior (`relu_split(keep_state=, resume=)`). Printed per run: the unstable neurons of each
split node in the prior, the refinement's CPU seconds, the verdict, domains, proved share,
CPU seconds and domains per CPU second of branch and bound, and the proved share every ~10
CPU seconds. `--cpu S` stops each run after S CPU seconds (refinement included), so a
loaded machine changes the wall time, not the work.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from bab_rate import violation_check


def _instance(onnx_path, vnnlib, tmp):
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.verification.spec import outward_box, spec_from_property
    compile_model(onnx_path, os.path.join(tmp, "prog"), PassOptions(summation="fast"))
    net = load(os.path.join(tmp, "prog")).network
    case = spec_from_property(parse_vnnlib(vnnlib)).cases[0]
    C, d, owner = case.stacked()
    lo, hi = outward_box(case.lower, case.upper)
    return net, C, d, owner, lo, hi


def _unstable(prior):
    return ", ".join(f"{k} {int(((l < 0) & (h > 0)).sum())}" for k, (l, h) in prior.items())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--vnnlib", required=True)
    ap.add_argument("--timeout", type=float, default=300.0, help="wall seconds per run")
    ap.add_argument("--runs", default="before,after")
    ap.add_argument("--cpu", type=float, default=float("inf"), help="CPU seconds per run")
    ap.add_argument("--first", type=float, default=10.0,
                    help="resume: CPU seconds of branch and bound before the refinement")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from shardbound.runtime.engine.full_alpha import root_bounds
    from shardbound.runtime.engine.split_refine import refine_by_splits
    from shardbound.runtime.verification.input_split import closeness
    from shardbound.runtime.verification.relu_split import relu_split
    net, C, d, owner, lo, hi = _instance(args.onnx, args.vnnlib, tempfile.mkdtemp())
    n_conj = int(owner.max()) + 1
    shape = (1, *net.input_shape)
    with torch.no_grad():
        cache = net.intermediate_bounds(lo.reshape(shape), hi.reshape(shape))
    lb, prior = root_bounds(net, lo.reshape(shape), hi.reshape(shape), C, cache)
    print(f"{os.path.basename(args.vnnlib)}: full alpha-CROWN margin "
          f"{float(closeness(lb, d, owner, n_conj)[0]):.3f}; unstable: {_unstable(prior)}")
    settings = {"before": (False, {"iterations": 12, "warm_betas": False}),
                "after": (True, {}), "resume": (True, {})}
    for label in args.runs.split(","):
        refine, kw = settings[label]
        c0 = time.process_time()
        deadline = time.monotonic() + args.timeout
        out_of_time = lambda: (time.process_time() - c0 > args.cpu       # noqa: E731
                               or time.monotonic() > deadline)
        mark = [c0]

        def progress(n_open, verified, elapsed):
            if time.process_time() - mark[0] > 10:
                mark[0] = time.process_time()
                print(f"    {mark[0] - c0:6.1f} CPU s: {n_open} open, proved {verified:.4f}",
                      flush=True)
        progress.done = lambda: None
        bab = lambda root, **more: relu_split(                          # noqa: E731
            net, C, d, owner, lo, hi, float("inf"), lambda f: f, violation_check(net, C, d, owner),
            root_prior=root, progress=progress, **kw, **more)
        root, state = prior, None
        if label == "resume":
            res = bab(prior, keep_state=True, stop=lambda: out_of_time()
                      or time.process_time() - c0 > args.first)
            print(f"  first try: {res.verdict}, {res.domains} domains, proved "
                  f"{res.verified_fraction:.4f}, {time.process_time() - c0:.1f} CPU s")
            state = res.state
        if refine and (state is not None or label != "resume"):
            c = time.process_time()
            root = refine_by_splits(net, lo.reshape(shape), hi.reshape(shape), prior)
            with torch.no_grad():
                lb2, _ = net.final_crown(cache[0], root, lo.reshape(shape), hi.reshape(shape), C)
            print(f"  {label}: refined in {time.process_time() - c:.1f} CPU s; unstable: "
                  f"{_unstable(root)}; CROWN margin on it "
                  f"{float(closeness(lb2, d, owner, n_conj)[0]):.3f}")
        c1 = time.process_time()
        if label != "resume" or state is not None:
            res = bab(root, stop=out_of_time, resume=state)
        cpu = time.process_time() - c1
        print(f"  {label}: {res.verdict}, {res.domains} domains, proved {res.verified_fraction:.4f}, "
              f"{cpu:.1f} CPU s of branch and bound ({time.process_time() - c0:.1f} in all), "
              f"{res.domains / max(cpu, 1e-9):.0f} domains / CPU s", flush=True)


if __name__ == "__main__":
    main()
