"""What `--soundness real` and `--soundness float32` cost against the float32 engine.

    python3 bench/soundness_modes.py [--repeat 3] [--shared DIR] [--models a,b]

Per model, on one input box, side by side in one run: the engine's CROWN under `fast` and
`exact` (each its own compiled program) and the rigorous CROWN of runtime/rigorous/
in `real` and `float32` mode (float64 with the error account). Times are medians of
--repeat runs after a warm-up; `x fast` is the time ratio against `fast`; widths are mean
output-bound widths and `w/fast` their ratio against `fast`'s. Models: the test zoo's
(tests/zoo.py) that the rigorous bounds cover (the op families' models among them), and with ../shared/benchmarks (or --shared)
ACAS Xu 1_1 and mnistfc 256x2 on a box of their properties.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx
import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

ZOO_MODELS = ("mlp", "mlp_matmul_add", "normalized_mlp", "cnn_batchnorm", "cnn_avgpool",
              "residual", "layout_ops", "sigmoid_mlp", "tanh_mlp", "leaky_residual",
              "clip_abs_mlp", "maxpool_cnn", "pad_avgpool_cnn", "slice_gather_mlp",
              "upsample_mlp", "branch_concat_cnn", "gelu_mlp", "discrete_mix",
              "norm_softmax_mlp", "ln_mlp_block", "vit_tiny")
SHARED = {"acasxu_1_1": ("acasxu/ACASXU_run2a_1_1_batch_2000.onnx", "acasxu/prop_2.vnnlib"),
          "mnistfc_256x2": ("mnistfc/mnist-net_256x2.onnx", "mnistfc/prop_0_0.03.vnnlib")}


def _median_time(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench_one(name, onnx_path, lo, hi, work, repeat):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.rigorous import RigorousBounds

    row = {"model": name}
    lo_t = torch.tensor(lo, dtype=torch.float32)
    hi_t = torch.tensor(hi, dtype=torch.float32)
    verifiers = {}
    for order in ("fast", "exact"):
        out = os.path.join(work, f"{name}_{order}")
        compile_model(onnx_path, out, PassOptions(summation=order))
        v = verifiers[order] = load(out)
        with torch.no_grad():
            t, (lb, ub) = _median_time(lambda: v.bounds(lo_t, hi_t, method="crown"), repeat)
        row[order] = (t, float((ub - lb).double().mean()))
    v = verifiers["fast"]
    m = int(np.prod(v.output_shape))
    eye = torch.eye(m, dtype=torch.float64)
    for mode in ("real", "float32"):
        rig = RigorousBounds(v.network, mode)
        blo, bhi = rig.outward(np.asarray(lo, np.float64)[None], np.asarray(hi, np.float64)[None])

        def run():                  # lower and upper bounds in one pass, as `run --box`
            both = rig.spec_lower(blo, bhi, torch.cat([eye, -eye]))
            return both[:, :m], -both[:, m:]
        t, (lb, ub) = _median_time(run, repeat)
        row[mode] = (t, float((ub - lb).mean()))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models", default="")
    ap.add_argument("--shared", default=os.path.join(ROOT, "..", "shared", "benchmarks"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import zoo
    from bounds import vnnlib_box, zoo_box

    wanted = set(filter(None, args.models.split(",")))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in ZOO_MODELS:
            if wanted and name not in wanted:
                continue
            model, shape = zoo.build(name)
            path = os.path.join(work, name + ".onnx")
            onnx.save(model, path)
            lo, hi = zoo_box(shape)
            rows.append(bench_one(name, path, lo, hi, work, args.repeat))
        for name, (net, prop) in SHARED.items():
            if (wanted and name not in wanted) or not os.path.isdir(args.shared):
                continue
            lo, hi, _ = vnnlib_box(os.path.join(args.shared, prop))
            rows.append(bench_one(name, os.path.join(args.shared, net), lo, hi, work,
                                  args.repeat))
    print(f"soundness modes: CROWN, torch {torch.__version__}, threads 1, repeat "
          f"{args.repeat} (median after 1 warm-up), one box per model\n")
    cols = ("fast", "exact", "real", "float32")
    head = ["model"] + [f"{c} ms" for c in cols] + [f"{c} x fast" for c in cols[1:]] + \
        ["fast width"] + [f"{c} w/fast" for c in cols[1:]]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join([":---"] + ["---:"] * (len(head) - 1)) + "|")
    for r in rows:
        f_t, f_w = r["fast"]
        vals = [r["model"]] + [f"{r[c][0] * 1e3:.2f}" for c in cols]
        vals += [f"{r[c][0] / f_t:.2f}" for c in cols[1:]]
        vals += [f"{f_w:.4g}"] + [f"{r[c][1] / f_w:.6f}" for c in cols[1:]]
        print("| " + " | ".join(vals) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
