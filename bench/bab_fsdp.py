"""ReLU branch and bound in fsdp: per-rank memory, CPU time and domains per second at P ranks,
and the per-domain bounds against single mode's (bitwise, `blocked`).

    python3 bench/bab_fsdp.py [--widths 20-256-256-2] [--nprocs 1,2,4] [--batch 32]
                              [--share 0.15] [--rows 1] [--timeout 300]

One instance: zoo.mlp (seed 11) with --widths, the box [-0.5, 0.5]^n, the rows y0 - y_j
(j = 1..--rows, one conjunction) and per row a threshold --share of the way from CROWN's
bound up to the lowest value PGD finds (unsat, needs branching: 617 domains by default). It
is compiled once in single mode and once in fsdp (`blocked`, the default); `relu_split` runs
on the root box with CROWN's intermediate bounds as the prior and a fixed batch (--batch),
in this process for single mode and on P gloo ranks (runtime/parallel/launch.py) for fsdp.
Per run: the verdict, domains, rounds, collectives per round (rank 0's count), CPU seconds
of the branch and bound (process time, summed over the ranks) and domains per CPU second,
each rank's peak tracked bytes during branch and bound (the ledger) against the memory
model's figure for the round (`batch_memory.bab_round_peak`), the peaks of beta-CROWN's
alphas, betas and Adam moments and of its autograd-saved tensors (the ledger's alpha and
autograd, added), and the SHA-256 of every round's per-domain lower bounds and the verdict
(`relu_split(trace=)`), which must equal single mode's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def trace_sha(trace, verdict: str) -> str:
    """SHA-256 of the rounds' per-domain lower bounds (float32 bytes, in order) and the
    verdict: how the runs are compared."""
    import torch

    h = hashlib.sha256(verdict.encode())
    for lb in trace:
        h.update(lb.to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def run_bab(verifier, comm, job) -> dict:
    """relu_split on the job's instance with this process's verifier (single or one fsdp
    rank); rank 0's figures plus every rank's peak and CPU time."""
    import numpy as np
    import torch

    from shardbound.runtime.verification.batch_memory import bab_round_peak
    from shardbound.runtime.verification.relu_split import relu_split

    net = verifier.network
    from rank_driver import bab_problem

    C, d, lo, hi, agree, is_violation = bab_problem(job, net, comm)
    owner = np.zeros(len(d), dtype=int)
    shape = (1, *net.input_shape)

    with torch.no_grad():
        _, prior = net.intermediate_bounds(lo.reshape(shape), hi.reshape(shape))
    net.ledger.reset_peaks()
    steps0 = getattr(comm, "step", 0)
    trace = []
    c0, w0 = time.process_time(), time.monotonic()
    res = relu_split(net, C, d, owner, lo, hi, time.monotonic() + job["timeout"], agree,
                     is_violation, batch=job["batch"], root_prior=prior, trace=trace)
    cpu, wall = time.process_time() - c0, time.monotonic() - w0
    report = net.ledger.report()
    mine = {"peak": report["peak_tracked_bytes"], "cpu": cpu,
            "beta": report["peak_alpha_bytes"] + report["peak_autograd_bytes"],
            "collectives": getattr(comm, "step", 0) - steps0}
    every = comm.all_gather_objects(mine)
    return {"verdict": res.verdict, "domains": res.domains, "rounds": len(trace),
            "wall": wall, "ranks": every, "sha": trace_sha(trace, res.verdict),
            "predicted": bab_round_peak(net, job["batch"], C.shape[0])}


def rank_main(job_path: str, out_path: str) -> None:
    import torch

    from shardbound.runtime.parallel import dist
    from shardbound.runtime.parallel.dist import exit_rank
    from shardbound.runtime.program.loader import load

    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    comm = dist.from_environment(timeout_s=600)
    out = run_bab(load(job["dir"], comm=comm), comm, job)
    comm.barrier()
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    if comm.world > 1:
        exit_rank(0)


def instance(widths, share, work, rows=1):
    """({mode: program dir}, job fields) of the bench instance: `rows` spec rows y0 - y_j
    (j = 1..rows) in one conjunction, each with its own threshold."""
    import numpy as np
    import onnx
    import torch

    import zoo
    from soundness import attack_min
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    sizes = tuple(int(w) for w in widths.split("-"))
    path = os.path.join(work, "net.onnx")
    onnx.save(zoo.mlp(np.random.default_rng(11), sizes=sizes)[0], path)
    dirs = {}
    for mode in ("single", "fsdp"):
        dirs[mode] = os.path.join(work, mode)
        compile_model(path, dirs[mode], PassOptions(mode=mode, summation="blocked"))
    net = load(dirs["single"]).network
    C = torch.zeros(rows, sizes[-1])
    C[:, 0] = 1.0
    C[torch.arange(rows), torch.arange(1, rows + 1)] = -1.0
    lo, hi = torch.full((sizes[0],), -0.5), torch.full((sizes[0],), 0.5)
    fwd = lambda x: net.forward(x.reshape(-1, *net.input_shape)).reshape(len(x), -1)  # noqa
    d = []
    for r in range(rows):
        found = attack_min(fwd, lo, hi, C[r:r + 1], torch.Generator().manual_seed(0))
        with torch.no_grad():
            lb = float(net.crown(lo.reshape(1, -1), hi.reshape(1, -1), C[r:r + 1])[0])
        d.append(lb + share * (found - lb))
    return dirs, {"C": C.tolist(), "d": d, "lower": lo.tolist(), "upper": hi.tolist()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="20-256-256-2")
    ap.add_argument("--nprocs", default="1,2,4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--share", type=float, default=0.15)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--rank-job", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_job:
        rank_main(*args.rank_job)
        return
    import torch

    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.parallel.launch import launch
    from shardbound.runtime.program.loader import load

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="bab_fsdp_")
    dirs, job = instance(args.widths, args.share, work, args.rows)
    job.update(batch=args.batch, timeout=args.timeout)
    print(f"# {args.widths}, batch {args.batch}, {args.rows} spec row(s), load average "
          f"{os.getloadavg()[0]:.2f} at start")
    rows = []
    single = None
    for P in [int(p) for p in args.nprocs.split(",")]:
        for mode in (("single", "fsdp") if P == 1 else ("fsdp",)):
            if mode == "single":
                out = run_bab(load(dirs["single"]), SingleComm(), job)
            else:
                jp, op = os.path.join(work, f"job_{P}.json"), os.path.join(work, f"out_{P}.json")
                with open(jp, "w") as f:
                    json.dump({**job, "dir": dirs["fsdp"]}, f)
                code = launch(os.path.abspath(__file__), ["--rank-job", jp, op], P, 600)
                assert code == 0, f"rank job failed ({code})"
                with open(op) as f:
                    out = json.load(f)
            if single is None:
                single = out
            rows.append((mode, P, out))
    print("| mode | P | verdict | domains | rounds | collectives / round | CPU s (all ranks) "
          "| domains / CPU s | wall s | peak tracked per rank (MiB) | predicted (MiB) "
          "| x single | beta-CROWN alpha + autograd per rank (MiB) | bounds = single |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    base = max(r["peak"] for r in single["ranks"])
    for mode, P, out in rows:
        cpu = sum(r["cpu"] for r in out["ranks"])
        peak = max(r["peak"] for r in out["ranks"])
        coll = out["ranks"][0]["collectives"] / max(out["rounds"], 1)
        print(f"| {mode} | {P} | {out['verdict']} | {out['domains']} | {out['rounds']} | "
              f"{coll:.0f} | {cpu:.2f} | {out['domains'] / max(cpu, 1e-9):.0f} | "
              f"{out['wall']:.2f} | {peak / 2**20:.2f} | "
              f"{out['predicted'] / 2**20:.2f} | {peak / base:.3f} | "
              f"{max(r['beta'] for r in out['ranks']) / 2**20:.2f} | "
              f"{'yes' if out['sha'] == single['sha'] else 'NO'} |", flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
