"""FSDP memory benchmark: per-rank memory and time of single mode vs fsdp, CROWN and alpha-CROWN.

Usage:
    python bench/fsdp_memory.py [--widths 784-4096-4096-4096-10]
                                [--alpha-widths 784-512-512-512-10]
                                [--nprocs 1,2,4] [--methods crown,alpha-crown,full-alpha-crown]
                                [--cnn-methods crown] [--models mlp,cnn] [--seed 0] [--eps 0.01]

Two networks are built in code with onnx.helper (weights fixed by --seed):

- mlp: a wide MLP, Gemm (transB=1) + Relu per hidden layer, widths from --widths
  (default 784-4096-4096-4096-10, about 147 MB of float32 weights); the alpha-CROWN table uses
  --alpha-widths, by default the narrower 784-512-512-512-10 (3.6 MiB): full alpha-CROWN
  (runtime/engine/full_alpha.py, 20 iterations) optimises a pass per start node, rows x
  earlier ReLU neurons of alphas each (14 MiB of alphas and moments here, against 3.6 MiB of
  weights), 13 s in single mode on the shared 2-core machine; at 2048 it would take minutes;
- cnn: input 3x32x32, Conv 3->32 3x3 stride 2 pad 1, Relu, Conv 32->64 3x3 stride 2 pad 1,
  Relu, Flatten, Gemm 4096->512, Relu, Gemm 512->10 (about 8 MiB of weights, almost all in
  the first Gemm). The first conv has stride 2 on purpose: with stride 1 (32x32x32 = 32768
  ReLU inputs, then Gemm 16384->512) CROWN's A-matrix through the second conv is
  16384 x 32768 floats (2 GiB, twice, plus temporaries); one rank reached 12 GB RSS and the
  P=2 run was killed by the OOM killer on a 23 GB machine after more than 5 minutes.

The MLP is benchmarked under each method of --methods, the CNN under each of --cnn-methods.
Each network is compiled three times into a temporary directory: single mode, fsdp mode (the
default `blocked` summation: weights sharded AND the rows of every CROWN backward pass -- the
neurons being bounded and the spec rows -- split over the ranks, with the alpha-CROWN alphas of
a row owned by its rank, and large linear weights streamed in blocks of at most 4 MiB instead
of gathered whole, runtime/numerics/streaming.py) and fsdp with `--summation fast` (weights sharded, no row sharding:
with `fast` the split would change bits, so it is off). A box of radius --eps around a seeded
random point in [0, 1] is written, and `shardbound run` is started through subprocess
(`sys.executable -m shardbound.compiler.cli run ... --threads 1 --method M`) once in single
mode, once per P in --nprocs in fsdp mode, and once with fsdp fast at P=2, so the effect of
row sharding is visible next to plain weight sharding.

Per run the table shows the memory report of OUT.json (each figure the max over ranks):
resident weight bytes; the peak of all tracked bytes (weights, gathered weights, CROWN
A-matrices, bounds, and for alpha-CROWN the slopes with Adam's moments and the tensors the
autograd graph saves) and its ratio to single mode; the memory model's prediction of that peak
(`memory.predicted_peak_tracked_bytes`, runtime/accounting/memory_model.py) and
predicted/measured; the peaks of the A-matrices, of the gathered weights
and of alpha + autograd alone; peak RSS from the OS
(VmHWM); the bound time (OUT.json `seconds`) and its ratio to single; and whether
bounds_sha256 equals single mode's (fsdp with blocked summation reproduces single mode bit for
bit; fsdp fast sums in another order, so different bits are expected there).
After each table two lines compare with the targets: the peak per rank at P=2 and P=4 as a
fraction of single mode, and whether every prediction is within 10% of the measured peak.

Notes on reading the numbers:
- P ranks each run with one thread; on a 2-core machine P=4 oversubscribes the cores, so its
  times measure contention as much as fsdp.
- Peak RSS includes the Python interpreter, torch and the safetensors file mapping of each
  rank (a few hundred MiB that do not shrink with P), so its cut is smaller than the cut in
  tracked bytes.
- Peak RSS is VmHWM of each rank (runtime/accounting/ledger.py), not inherited from the parent any more.
  Each model is still built and compiled in a child process (`--prepare`, internal) so that
  the driver stays small while the ranks run on a shared machine.

The whole default run took 329 s on the shared 2-core development machine (bound times, single
mode: 21 s CROWN on the 4096 MLP, 9 s alpha-CROWN (final pass only, then) on the 2048 MLP, 16 s CROWN on the CNN).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from onnx_graph import Graph

MIB = 1024.0 * 1024.0
TARGET = {2: 0.55, 4: 0.30}
PUBLISHED = "published FSDP: 0.61-0.66x"
PREDICTION_TOLERANCE = 0.10
COMPILES = ("single", "fsdp", "fsdp-fast", "fsdp-fixed")   # directory names under each model


# ----------------------------------------------------------------------------- models

def build_mlp(rng, widths):
    g = Graph(rng, (widths[0],))
    h = "x"
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        h = g.gemm(h, n_in, n_out)
        if i < len(widths) - 2:
            h = g.op("Relu", [h])
    return g.build(h, widths[-1], "fsdp_memory"), g.input_shape


def build_cnn(rng):
    g = Graph(rng, (3, 32, 32))
    h = g.op("Relu", [g.conv("x", 3, 32, 3, 2, 1)])      # 32x16x16
    h = g.op("Relu", [g.conv(h, 32, 64, 3, 2, 1)])       # 64x8x8
    h = g.op("Flatten", [h], axis=1)
    h = g.op("Relu", [g.gemm(h, 64 * 8 * 8, 512)])
    return g.build(g.gemm(h, 512, 10), 10, "fsdp_memory"), g.input_shape


# ----------------------------------------------------------------------------- runs

def prepare(kind: str, widths: str, mdir: str, seed: int, eps: float, chunk_kib: int = 0,
            fixed_kib: int = 0) -> None:
    """In a child process: build the ONNX model, compile it as single, fsdp, fsdp-fast and
    (fixed_kib > 0) fsdp-fixed, write the box and meta.json (total weight bytes). chunk_kib >
    0: fsdp streams its linear weights in chunks of at most that many KiB, every layer alike
    (compile's --stream-chunk-kib), instead of the default per-layer choice
    (runtime/accounting/chunk_choice.py); fsdp-fixed is fsdp with fixed_kib KiB chunks, the
    comparison rows (4096: the fixed default before the choice)."""
    import numpy as np
    import onnx
    from safetensors import safe_open

    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    rng = np.random.default_rng(seed)
    if kind == "mlp":
        model, input_shape = build_mlp(rng, [int(w) for w in widths.split("-")])
    else:
        model, input_shape = build_cnn(rng)
    onnx_path = os.path.join(mdir, "model.onnx")
    onnx.save(model, onnx_path)
    del model
    options = {"single": PassOptions(mode="single", method="crown"),
               "fsdp": PassOptions(mode="fsdp", method="crown",
                                   **({"stream_chunk_bytes": chunk_kib * 1024} if chunk_kib else {})),
               "fsdp-fast": PassOptions(mode="fsdp", method="crown", summation="fast"),
               "fsdp-fixed": PassOptions(mode="fsdp", method="crown",
                                         stream_chunk_bytes=max(fixed_kib, 1) * 1024)}
    for name in COMPILES:
        if name != "fsdp-fixed" or fixed_kib:
            compile_model(onnx_path, os.path.join(mdir, name), options[name])
    center = np.random.default_rng(seed + 1).uniform(0.0, 1.0, size=int(np.prod(input_shape)))
    with open(os.path.join(mdir, "box.json"), "w", encoding="utf-8") as f:
        json.dump({"lower": (center - eps).tolist(), "upper": (center + eps).tolist()}, f)
    total = 0
    with safe_open(os.path.join(mdir, "single", "weights.safetensors"), framework="pt") as f:
        for k in f.keys():
            total += int(np.prod(f.get_slice(k).get_shape(), dtype=np.int64)) * 4
    with open(os.path.join(mdir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({"weight_bytes": total}, f)


def run_once(program_dir, box, out_json, nproc, method, timeout) -> dict:
    cmd = [sys.executable, "-m", "shardbound.compiler.cli", "run", program_dir, "--box", box,
           "--json", out_json, "--nproc", str(nproc), "--threads", "1", "--method", method,
           "--collective-timeout", str(timeout), "--quiet"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} exited with code {proc.returncode}:\n"
                 f"{proc.stdout}{proc.stderr}")
    with open(out_json, encoding="utf-8") as f:
        result = json.load(f)
    result["process_seconds"] = wall
    return result


def model_key(kind: str, widths: str) -> str:
    return f"mlp_{widths}" if kind == "mlp" else "cnn"


def model_desc(kind: str, widths: str) -> str:
    if kind == "mlp":
        return "MLP " + widths
    return "CNN 3x32x32, conv 3->32 s2 p1, conv 32->64 s2 p1, gemm 4096->512->10"


def ensure_model(kind, widths, args, work, prepared) -> tuple[str, int]:
    key = model_key(kind, widths)
    mdir = os.path.join(work, key)
    if key not in prepared:
        os.makedirs(mdir)
        print(f"# {model_desc(kind, widths)}: building and compiling ...", file=sys.stderr,
              flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--prepare", kind, widths,
                        mdir, "--seed", str(args.seed), "--eps", str(args.eps),
                        "--stream-chunk-kib", str(args.stream_chunk_kib),
                        "--compare-chunk-kib", str(args.compare_chunk_kib)], check=True)
        with open(os.path.join(mdir, "meta.json"), encoding="utf-8") as f:
            prepared[key] = json.load(f)["weight_bytes"]
    return mdir, prepared[key]


def mem(r: dict, key: str):
    v = r["memory"].get(key)
    return None if v is None else float(v)


def bench_table(kind, widths, method, args, work, prepared) -> None:
    mdir, total = ensure_model(kind, widths, args, work, prepared)
    box = os.path.join(mdir, "box.json")
    fixed = f"fsdp, fixed {args.compare_chunk_kib} KiB chunk"
    runs = ([("single", "single", 1)] + [("fsdp", "fsdp", p) for p in args.nprocs]
            + [("fsdp-fast", "fsdp fast (no row sharding)", 2)]
            + ([("fsdp-fixed", fixed, p) for p in args.nprocs if p > 1]
               if args.compare_chunk_kib else []))
    rows = []
    for i, (compiled, label, p) in enumerate(runs):
        print(f"# {model_desc(kind, widths)}, {method}: {label} P={p} ...", file=sys.stderr,
              flush=True)
        out = os.path.join(mdir, f"out_{method}_{i}.json")
        t0 = time.perf_counter()
        r = run_once(os.path.join(mdir, compiled), box, out, p, method, args.timeout)
        print(f"#   done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        rows.append((compiled, label, p, r))

    with open(os.path.join(mdir, "fsdp", "plan.json"), encoding="utf-8") as f:
        chosen = json.load(f).get("stream_chunks")
    base = rows[0][3]
    b_peak, b_sec = mem(base, "peak_tracked_bytes"), float(base["seconds"])
    print(f"\n### {model_desc(kind, widths)}, {method}; total weight bytes {total} "
          f"({total / MIB:.2f} MiB)\n")
    print("| mode | P | resident weights MiB | peak tracked MiB | x single | predicted MiB "
          "| pred/meas | peak A-matrix MiB | peak gathered MiB | peak alpha + autograd MiB "
          "| peak RSS MiB | bound s | x single | bounds = single |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    ratios, errors = {}, []
    for compiled, label, p, r in rows:
        peak, pred = mem(r, "peak_tracked_bytes"), mem(r, "predicted_peak_tracked_bytes")
        if compiled == "fsdp":
            ratios[p] = peak / b_peak
        if pred is not None:
            pred_s, ratio_s = f"{pred / MIB:.2f}", f"{pred / peak:.3f}"
            errors.append((abs(pred / peak - 1.0), label, p))
        else:
            pred_s = ratio_s = "-"
        if r["bounds_sha256"] == base["bounds_sha256"]:
            same = "yes"
        else:
            same = "no (fast order, expected)" if compiled == "fsdp-fast" else "**NO**"
        print(f"| {label} | {p} | {mem(r, 'resident_param_bytes') / MIB:.2f} "
              f"| {peak / MIB:.2f} | {peak / b_peak:.3f} | {pred_s} | {ratio_s} "
              f"| {mem(r, 'peak_a_matrix_bytes') / MIB:.2f} "
              f"| {mem(r, 'peak_gathered_param_bytes') / MIB:.2f} "
              f"| {(mem(r, 'peak_alpha_bytes') + mem(r, 'peak_autograd_bytes')) / MIB:.2f} "
              f"| {mem(r, 'peak_rss_bytes') / MIB:.1f} "
              f"| {float(r['seconds']):.3f} | {float(r['seconds']) / b_sec:.3f} | {same} |")

    if chosen:
        print("\nfsdp's stream chunks, KiB per layer (plan.json stream_chunks): "
              + "; ".join(f"P={p}: " + ", ".join(f"{n} {b // 1024}" for n, b in chosen[str(p)].items())
                          for p in args.nprocs if str(p) in chosen))
    fixed_rows = {p: r for compiled, _, p, r in rows if compiled == "fsdp-fixed"}
    for compiled, _, p, r in rows:
        if compiled == "fsdp" and p in fixed_rows:
            old = fixed_rows[p]
            print(f"P={p}: chosen chunks against the fixed {args.compare_chunk_kib} KiB: peak "
                  f"{mem(r, 'peak_tracked_bytes') / mem(old, 'peak_tracked_bytes'):.3f}x, "
                  f"bound time {float(r['seconds']) / float(old['seconds']):.3f}x")
    measured = []
    for p, limit in TARGET.items():
        if p in ratios:
            ok = "met" if ratios[p] <= limit else "MISSED"
            measured.append(f"P={p} {ratios[p]:.3f}x ({ok})")
        else:
            measured.append(f"P={p} not run")
    print(f"\ntarget: peak per rank <= {TARGET[2]:.2f}x single at P=2 and <= {TARGET[4]:.2f}x "
          f"at P=4 ({PUBLISHED}); measured: {', '.join(measured)}")
    if errors:
        worst = max(errors)
        ok = "yes" if worst[0] <= PREDICTION_TOLERANCE else "no"
        print(f"prediction within {PREDICTION_TOLERANCE:.0%}: {ok} "
              f"(worst {100 * worst[0]:.1f}%, {worst[1]} P={worst[2]})")
    else:
        print(f"prediction within {PREDICTION_TOLERANCE:.0%}: n/a "
              f"({method} is not modelled by runtime/accounting/memory_model.py)")
    sys.stdout.flush()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="784-4096-4096-4096-10",
                        help="MLP layer widths, input first (default 784-4096-4096-4096-10)")
    parser.add_argument("--alpha-widths", default="784-512-512-512-10",
                        help="MLP widths of the alpha-CROWN table (default 784-512-512-512-10;"
                             " full alpha-CROWN's work grows with width squared per layer)")
    parser.add_argument("--nprocs", default="1,2,4", help="fsdp world sizes (default 1,2,4)")
    parser.add_argument("--methods", default="crown,alpha-crown,full-alpha-crown",
                        help="methods for the MLP: comma list of ibp, crown, alpha-crown, full-alpha-crown "
                             "(default crown,alpha-crown,full-alpha-crown)")
    parser.add_argument("--cnn-methods", default="crown",
                        help="methods for the CNN (default crown)")
    parser.add_argument("--models", default="mlp,cnn", help="comma list of mlp, cnn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eps", type=float, default=0.01, help="box radius (default 0.01)")
    parser.add_argument("--stream-chunk-kib", type=int, default=0,
                        help="fsdp (blocked) streams linear weights in chunks of at most KIB "
                             "KiB, every layer alike (default 0: compile's default, chosen "
                             "per layer and P)")
    parser.add_argument("--compare-chunk-kib", type=int, default=4096,
                        help="also run fsdp compiled with this fixed chunk at each P > 1, "
                             "for the memory and time of the per-layer choice against it "
                             "(default 4096, the fixed default before; 0: not run)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="collective timeout of each run in seconds (default 900)")
    parser.add_argument("--prepare", nargs=3, metavar=("KIND", "WIDTHS", "DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.prepare:
        prepare(args.prepare[0], args.prepare[1], args.prepare[2], args.seed, args.eps,
                args.stream_chunk_kib, args.compare_chunk_kib)
        return

    def methods(text):
        out = [m.strip() for m in text.split(",") if m.strip()]
        for m in out:
            if m not in ("ibp", "crown", "alpha-crown", "full-alpha-crown"):
                parser.error(f"unknown method {m!r}")
        return out

    for w in filter(None, (args.widths, args.alpha_widths)):
        if not all(part.isdigit() for part in w.split("-")) or len(w.split("-")) < 2:
            parser.error(f"bad widths {w!r} (expected e.g. 784-4096-10)")
    args.nprocs = [int(p) for p in args.nprocs.split(",")]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in ("mlp", "cnn"):
            parser.error(f"unknown model {m!r}")
    tables = []
    for m in models:
        for method in methods(args.methods if m == "mlp" else args.cnn_methods):
            widths = args.alpha_widths if "alpha" in method else args.widths
            tables.append((m, widths if m == "mlp" else "", method))

    print(f"# shardbound fsdp memory benchmark: threads 1, nprocs {args.nprocs} + fsdp fast P=2, "
          f"seed {args.seed}, eps {args.eps}, fsdp stream chunk "
          f"{f'{args.stream_chunk_kib} KiB' if args.stream_chunk_kib else 'default (per layer)'}"
          f", fixed-chunk comparison {args.compare_chunk_kib or 'off'} KiB, "
          f"{os.cpu_count()} CPUs")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fsdp_memory_") as work:
        prepared = {}
        for kind, widths, method in tables:
            bench_table(kind, widths, method, args, work, prepared)
    print(f"\n(total benchmark time {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
