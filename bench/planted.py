"""Planted counterexamples (SoundnessBench-like, tests/planted.py): does `verify` find them?

    python3 bench/planted.py [--seeds 0-9] [--kinds mlp,cnn] [--timeout 60] [--clean] [--tight]

Per instance: whether a 50-restart PGD finds the planted violation (it should not), then the
verdict of `verify` (in process, one thread) and its time. The spiked networks must come out
`sat` (never `unsat`), their clean twins (`--clean`) `unsat`. Prints one line per instance
and the sat rate. --tight: the threshold is the clean twin's alpha-CROWN bound minus 0.01
instead of its interval bound (a lower spike, closer to the base network's own margin).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import onnx
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import planted  # noqa: E402


def _seeds(text):
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",")]


def spec_of(p):
    from shardbound.runtime.verification.spec import Conjunction, Spec, SpecCase
    case = SpecCase(p.lower, p.upper, (Conjunction(p.row, np.array([p.d])),))
    return Spec(p.name, len(p.lower), p.row.shape[1], (case,))


def compiled(p, tmp):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    path = os.path.join(tmp, p.name + ".onnx")
    onnx.save(p.model, path)
    compile_model(path, os.path.join(tmp, p.name), PassOptions(summation="fast"))
    return load(os.path.join(tmp, p.name))


def pgd_finds(verifier, p, restarts=50, steps=100):
    from shardbound.runtime.verification.attack import pgd
    net = verifier.network
    fwd = lambda x: net.forward(x.reshape(-1, *net.input_shape)).reshape(len(x), -1)  # noqa
    lo = torch.tensor(p.lower, dtype=torch.float32)
    hi = torch.tensor(p.upper, dtype=torch.float32)
    x = pgd(fwd, lo, hi, torch.tensor(p.row, dtype=torch.float32), np.array([p.d]),
            np.zeros(1, dtype=int), restarts=restarts, steps=steps, seed=7)
    return x is not None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--kinds", default="mlp,cnn")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--clean", action="store_true", help="also run the clean twins")
    ap.add_argument("--tight", action="store_true", help="threshold from alpha-CROWN")
    args = ap.parse_args(argv)
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.verification.verdict import verify
    torch.set_num_threads(1)
    build = {"mlp": planted.planted_mlp, "cnn": planted.planted_cnn}
    sat = total = wrong = 0
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            for seed in _seeds(args.seeds):
                d = None
                if args.tight:
                    clean = build[kind](seed, spike=False)
                    cv = compiled(clean, tmp)
                    lo = torch.tensor(clean.lower, dtype=torch.float32)
                    hi = torch.tensor(clean.upper, dtype=torch.float32)
                    d = float(cv.bounds(lo, hi, C=clean.row.astype(np.float32),
                                        method="alpha-crown")[0][0]) - 0.01
                for spike in ((True, False) if args.clean else (True,)):
                    p = build[kind](seed, spike=spike, d=d)
                    v = compiled(p, tmp)
                    seen = pgd_finds(v, p) if spike else False
                    t0 = time.monotonic()
                    res = verify(v, spec_of(p), args.timeout, SingleComm())
                    dt = time.monotonic() - t0
                    ok = (res.verdict == "sat") if spike else (res.verdict == "unsat")
                    bad = (res.verdict == "unsat") if spike else (res.verdict == "sat")
                    if spike:
                        total += 1
                        sat += res.verdict == "sat"
                    wrong += bad
                    decided = res.decided.stage if res.decided is not None else "-"
                    print(f"{p.name:14s} pgd50={'HIT' if seen else 'miss'} {res.verdict:8s} "
                          f"{dt:6.1f} s  {decided}{'  WRONG' if bad else ''}"
                          f"{'' if ok else '  (not decided)'}", flush=True)
    print(f"planted sat {sat}/{total} ({100 * sat / max(total, 1):.0f}%), wrong {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
