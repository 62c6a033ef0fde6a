"""Time the deterministic contraction orders against plain float32 matmul.

Prints, per shape, the wall time of ``fast`` (torch.matmul) and the time of the
other orders as a multiple of it.  All variants of a shape are measured side by
side, interleaved round-robin, best of several runs, so background load hits
them alike.  ``+pw`` columns use a PreparedWeight (weight conversion cached, as
a runtime would do for constant weights); ``grid`` is the portable ``blocked``
kernel (exact float64 block products, used without MKL or off the CPU) and
``f64 mm`` a plain float64 matmul, the floor for that kernel.

    python bench/summation_kernels.py [--quick] [--threads T] [--reps R]
"""
from __future__ import annotations

import argparse
import time

import torch

from shardbound.runtime.numerics import blocked_gemm
from shardbound.runtime.numerics import summation as S


def _grid(x, w):
    """blocked with the portable kernel (as without MKL)."""
    saved = blocked_gemm.available
    blocked_gemm.available = lambda t: False
    try:
        return S.matmul(x, w, "blocked")
    finally:
        blocked_gemm.available = saved


def _measure(fns: dict, reps: int) -> dict:
    best = {k: float("inf") for k in fns}
    for f in fns.values():
        f()                                           # warm-up
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller shapes")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = (1, 64) if args.quick else (1, 64, 1024)
    ks = (784,) if args.quick else (784, 4096)
    ns = (256,) if args.quick else (256, 4096)
    cols = ["blocked", "blocked+pw", "grid", "f64 mm", "exact", "exact+pw", "dot_last*"]
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}; "
          "fast in ms, other columns = time / fast time")
    print("* dot_last blocked vs (a*b).sum(-1) on min(rows*N, 2048) vectors of length K")
    hdr = f"{'rows':>5} {'K':>5} {'N':>5} | {'fast ms':>8} " + " ".join(f"{c:>10}" for c in cols)
    print(hdr)
    print("-" * len(hdr))
    for m in rows:
        for k in ks:
            for n in ns:
                x = torch.randn(m, k)
                w = torch.randn(n, k) / k ** 0.5
                xd, wd = x.double(), w.double()
                pw = S.prepare_weight(w)
                pw.padded()
                S.matmul(x, pw, "exact")                      # fills pw's exact cache
                a = torch.randn(min(m * n, 2048), k)
                b = torch.randn(min(m * n, 2048), k)
                t = _measure({
                    "fast": lambda: S.matmul(x, w, "fast"),
                    "f64 mm": lambda: xd @ wd.T,
                    "blocked": lambda: S.matmul(x, w, "blocked"),
                    "blocked+pw": lambda: S.matmul(x, pw, "blocked"),
                    "grid": lambda: _grid(x, w),
                    "exact": lambda: S.matmul(x, w, "exact"),
                    "exact+pw": lambda: S.matmul(x, pw, "exact"),
                }, args.reps)
                td = _measure({"f": lambda: S.dot_last(a, b, "fast"),
                               "b": lambda: S.dot_last(a, b, "blocked")}, args.reps)
                ratios = [t[c] / t["fast"] for c in cols[:-1]] + [td["b"] / td["f"]]
                print(f"{m:>5} {k:>5} {n:>5} | {t['fast'] * 1e3:>8.3f} "
                      + " ".join(f"{r:>10.2f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
