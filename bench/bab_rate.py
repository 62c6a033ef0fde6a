"""ReLU branch and bound, before and after, on one fixed instance: domains, seconds, domains
per second (CPU seconds of this one-thread process, so a loaded machine skews it less).

    python3 bench/bab_rate.py [--onnx NET --vnnlib PROP] [--baseline REV] [--batch B]

Default instance: the 24-input MLP of tests/test_bab.py (zoo.mlp seed 11, 24-20-20-3), row
y0 - y1, threshold a fifth of the way from the attacked minimum down to alpha-CROWN's bound
(unsat, a few thousand domains). With --onnx/--vnnlib: the property's first case (e.g.
mnistfc prop_5_0.03), with the optimised intermediate bounds as the root prior, as `verify`
runs it. "before" is runtime/verification/relu_split.py at git revision REV (default: the
branch point with main), loaded from `git show`; "after" is the working tree's, with its
configurations: everything on, then without filtered smart branching (BaBSR alone), without
alpha warm starts, and with a fixed batch of 32.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _old_module(rev):
    text = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:runtime/verification/relu_split.py"],
                          capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "relu_split_before.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("relu_split_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["relu_split_before"] = mod
    spec.loader.exec_module(mod)
    return mod


def _load(path, tmp):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    compile_model(path, os.path.join(tmp, "prog"), PassOptions(summation="fast"))
    return load(os.path.join(tmp, "prog")).network


def _default_instance(tmp):
    import zoo
    from soundness import attack_min
    from shardbound.runtime.engine.alpha import alpha_crown
    path = os.path.join(tmp, "net.onnx")
    onnx.save(zoo.mlp(np.random.default_rng(11), sizes=(24, 20, 20, 3))[0], path)
    net = _load(path, tmp)
    C = torch.tensor([[1.0, -1.0, 0.0]])
    lo, hi = torch.full((24,), -0.5), torch.full((24,), 0.5)
    fwd = lambda x: net.forward(x.reshape(-1, *net.input_shape)).reshape(len(x), -1)  # noqa
    found = attack_min(fwd, lo, hi, C, torch.Generator().manual_seed(0))
    shape = (1, *net.input_shape)
    lb = float(alpha_crown(net, lo.reshape(shape), hi.reshape(shape), C)[0])
    d = np.array([found - 0.2 * (found - lb)])
    return net, C, d, np.zeros(1, dtype=int), lo, hi, None, "zoo.mlp(11) 24-20-20-3"


def _file_instance(onnx_path, vnnlib, tmp):
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.engine.intermediate_alpha import optimise_intermediate_bounds
    from shardbound.runtime.verification.spec import outward_box, spec_from_property
    net = _load(onnx_path, tmp)
    case = spec_from_property(parse_vnnlib(vnnlib)).cases[0]
    C, d, owner = case.stacked()
    lo, hi = outward_box(case.lower, case.upper)
    shape = (1, *net.input_shape)
    with torch.no_grad():
        _, known = net.intermediate_bounds(lo.reshape(shape), hi.reshape(shape))
    prior = optimise_intermediate_bounds(net, lo.reshape(shape), hi.reshape(shape), known)
    return net, C, d, owner, lo, hi, prior, os.path.basename(vnnlib)


def violation_check(net, C, d, owner):
    """relu_split's `is_violation` for a bench: the first point xs (N, n) meeting every row of
    some conjunction (float32 forward, float64 comparison), else None. bench/split_refine.py
    uses it too."""
    def check(xs):
        with torch.no_grad():
            m = (net.forward(xs.reshape(-1, *net.input_shape)).reshape(len(xs), -1) @ C.T).double()
        ok = m <= torch.from_numpy(d)
        for j in range(int(owner.max()) + 1):
            rows = torch.from_numpy(np.nonzero(owner == j)[0])
            hit = torch.nonzero(ok[:, rows].all(dim=1)).reshape(-1)
            if len(hit):
                return int(hit[0])
        return None
    return check


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--onnx")
    ap.add_argument("--vnnlib")
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="git revision of the 'before' relu_split.py (default: merge-base with main)")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from shardbound.runtime.verification import relu_split as after
    rev = args.baseline or subprocess.run(["git", "-C", ROOT, "merge-base", "HEAD", "main"],
                                          capture_output=True, text=True).stdout.strip()
    tmp = tempfile.mkdtemp()
    if args.onnx:
        inst = _file_instance(args.onnx, args.vnnlib, tmp)
    else:
        inst = _default_instance(tmp)
    net, C, d, owner, lo, hi, prior, name = inst
    isv = violation_check(net, C, d, owner)
    runs = [(f"before ({rev[:8]})", _old_module(rev).relu_split, {}),
            ("after", after.relu_split, {}),
            ("after, BaBSR only", after.relu_split, {"fsb": 1}),
            ("after, no warm start", after.relu_split, {"warm_start": False}),
            ("after, batch 32", after.relu_split, {"batch": 32})]
    print(f"instance {name}; batch from the memory figure: "
          f"{after.batch_for_memory(net, C.shape[0], after.memory_figure(net))}")
    print("| run | verdict | domains | CPU s | wall s | domains / CPU s |")
    print("|---|---|---:|---:|---:|---:|")
    for label, fn, kw in runs:
        c0, w0 = time.process_time(), time.monotonic()
        res = fn(net, C, d, owner, lo, hi, time.monotonic() + args.timeout, lambda f: f, isv,
                 root_prior=prior, **kw)
        cpu, wall = time.process_time() - c0, time.monotonic() - w0
        print(f"| {label} | {res.verdict} | {res.domains} | {cpu:.2f} | {wall:.2f} | "
              f"{res.domains / max(cpu, 1e-9):.0f} |", flush=True)


if __name__ == "__main__":
    main()
