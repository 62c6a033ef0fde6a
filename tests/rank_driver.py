"""Run as every rank of a multi-process test job (launched by shardbound.runtime.parallel.launch).

argv: JOB.json OUT.json. JOB lists {"dir", "lower", "upper"} entries and "methods" (bound
methods, or "crown-prior": CROWN on a sub-box with the box's bounds as a prior; an entry's own
methods, or "crown-prior": CROWN on a sub-box with the box's bounds as a prior; an entry's own
"methods" list, when it has one, replaces the job's for that entry, its "extra_methods" run on
it besides; "gradients": true, in the job or in an entry, adds forward values and input
gradients; "alpha_iterations": the iteration count of alpha-CROWN and full alpha-CROWN in the
entries' bound methods, default the engines' own); rank 0
writes, per entry and method, the bounds_sha256 and the memory ledger (max over ranks), and
the bounds themselves when JOB has "bounds": true. An entry with "specs" (spec.json files as
`shardbound verify` writes them) is verified instead: per spec, the verdict and the SHA-256
of its VNN-COMP result text and the stage that decided it. An entry with "bab" (C, d,
lower, upper, batch, timeout, and "options": relu_split's keywords) runs ReLU branch and
bound (`relu_split`) on that one conjunction from the box's CROWN bounds: the verdict,
domains, and as "sha" the SHA-256 of every round's per-domain lower bounds and the verdict
(method "relu-bab").
Loading many programs in one job keeps the multi-rank tests to a few process launches.
"""

import json
import sys

import torch

from shardbound.runtime.parallel import dist
from shardbound.runtime.parallel.dist import exit_rank
from shardbound.runtime.accounting.ledger import max_over_ranks
from shardbound.runtime.program.loader import load
from shardbound.runtime.program.main import predicted_peak
from shardbound.runtime.program.report import bounds_sha256

from soundness import alpha_iterations


def main(job_path, out_path):
    with open(job_path) as f:
        job = json.load(f)
    previous = torch.get_num_threads()
    torch.set_num_threads(job.get("threads", 1))
    comm = dist.from_environment(timeout_s=job.get("timeout", 60))
    results = []
    for entry in job["entries"]:
        verifier = load(entry["dir"], comm=comm)
        if "specs" in entry:
            results += _verify_all(verifier, entry, comm)
            continue
        if "bab" in entry:
            results.append(_relu_bab(verifier, entry, comm))
            continue
        if job.get("gradients") or entry.get("gradients"):
            results.append(_forward_and_gradient(verifier, entry))
        for method in entry.get("methods", job["methods"]) + entry.get("extra_methods", []):
            verifier.network.ledger.reset_peaks()
            if method == "crown-prior":
                lb, ub = _crown_with_prior(verifier, entry)
            else:
                with alpha_iterations(job.get("alpha_iterations")):
                    lb, ub = verifier.bounds(entry["lower"], entry["upper"], method=method)
            memory = max_over_ranks(comm.all_gather_objects(verifier.network.ledger.report()))
            memory["predicted"] = predicted_peak(verifier, comm, method, lb)
            result = {"dir": entry["dir"], "method": method,
                      "sha": bounds_sha256(lb, ub), "memory": memory}
            if job.get("bounds"):
                result["lower"], result["upper"] = lb.tolist(), ub.tolist()
            results.append(result)
    comm.barrier()
    torch.set_num_threads(previous)   # the in-process (P = 1) run shares pytest's process
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": comm.world, "results": results}, f)
    if comm.world > 1:
        exit_rank(0)                  # skip the gloo teardown (see runtime.dist.exit_rank)


def _verify_all(verifier, entry, comm) -> list[dict]:
    import hashlib

    from shardbound.runtime.verification.spec import read_spec
    from shardbound.runtime.verification.verdict import verify

    out = []
    for path in entry["specs"]:
        result = verify(verifier, read_spec(path), entry.get("verify_timeout", 120), comm)
        text = result.vnncomp_text()
        out.append({"dir": entry["dir"], "method": path, "verdict": result.verdict,
                    "text": text, "sha": hashlib.sha256(text.encode()).hexdigest(),
                    "decided": None if result.decided is None else result.decided.stage})
    return out


def bab_problem(job, net, comm):
    """A ReLU-BaB job's conjunction (C, d), box (lo, hi) and relu_split's two callbacks:
    `agree` (a flag OR-ed over ranks) and `is_violation` (the first point meeting every row,
    else None). Shared with bench/bab_fsdp.py, whose rank jobs bound the same problems."""
    import numpy as np

    C = torch.tensor(job["C"], dtype=torch.float32)
    d = np.array(job["d"])
    lo = torch.tensor(job["lower"], dtype=torch.float32)
    hi = torch.tensor(job["upper"], dtype=torch.float32)

    def agree(flag):
        return bool(comm.all_reduce_max(torch.tensor([float(flag)]))[0] > 0)

    def is_violation(xs):
        with torch.no_grad():
            m = net.forward(xs.reshape(-1, *net.input_shape)).reshape(len(xs), -1) @ C.T
        hit = torch.nonzero((m.double() <= torch.from_numpy(d)).all(dim=1)).reshape(-1)
        return int(hit[0]) if len(hit) else None

    return C, d, lo, hi, agree, is_violation


def _relu_bab(verifier, entry, comm) -> dict:
    """relu_split on entry["bab"]'s conjunction, the box's CROWN intermediate bounds as the
    root prior, a fixed batch; the rounds' per-domain bounds hashed with the verdict."""
    import hashlib
    import time

    import numpy as np

    from shardbound.runtime.verification.relu_split import relu_split

    job, net = entry["bab"], verifier.network
    C, d, lo, hi, agree, is_violation = bab_problem(job, net, comm)
    shape = (1, *net.input_shape)
    with torch.no_grad():
        _, prior = net.intermediate_bounds(lo.reshape(shape), hi.reshape(shape))
    trace = []
    res = relu_split(net, C, d, np.zeros(len(d), dtype=int), lo, hi,
                     time.monotonic() + job["timeout"], agree, is_violation, batch=job["batch"],
                     root_prior=prior, trace=trace, **job.get("options", {}))
    h = hashlib.sha256(res.verdict.encode())
    for lb in trace:
        h.update(lb.contiguous().numpy().tobytes())
    return {"dir": entry["dir"], "method": "relu-bab", "sha": h.hexdigest(),
            "verdict": res.verdict, "domains": res.domains, "rounds": len(trace)}


def _crown_with_prior(verifier, entry):
    """CROWN on the lower half of the box (along every input) with the whole box's
    intermediate bounds as a prior, as a branch-and-bound child is bounded: CROWN then runs
    only for the neurons still unstable."""
    net = verifier.network
    shape = (1, *verifier.input_shape)
    lo = torch.tensor(entry["lower"], dtype=torch.float32).reshape(shape)
    hi = torch.tensor(entry["upper"], dtype=torch.float32).reshape(shape)
    mid = (lo + hi) / 2
    with torch.no_grad():
        _, known = net.intermediate_bounds(lo, hi)
        ibp, known = net.intermediate_bounds(lo, mid, prior=known)
        return net.final_crown(ibp, known, lo, mid)


def _forward_and_gradient(verifier, entry) -> dict:
    """f(x) and the gradient of w . f(x) w.r.t. x (what the attacks follow) at points of the
    box: the box's corners and its centre, as one batch."""
    lo = torch.tensor(entry["lower"]).reshape(1, -1)
    hi = torch.tensor(entry["upper"]).reshape(1, -1)
    x = torch.cat([lo, hi, (lo + hi) / 2]).reshape(3, *verifier.input_shape)
    x.requires_grad_(True)
    y = verifier.network.forward(x).reshape(3, -1)
    w = torch.linspace(-1, 1, y.shape[1])
    (grad,) = torch.autograd.grad((y * w).sum(), x)
    return {"dir": entry["dir"], "method": "gradient", "sha": bounds_sha256(y.detach(), grad),
            "y": y.detach().tolist(), "grad": grad.reshape(3, -1).tolist()}


if __name__ == "__main__":
    from shardbound.runtime.program.allocator import keep_freed_memory

    keep_freed_memory()   # as a run's rank does (dist.rank_session): fewer page faults
    main(sys.argv[1], sys.argv[2])
