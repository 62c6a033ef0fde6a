"""Helpers for multi-rank tests: compile programs, run a job on P real gloo ranks."""

from __future__ import annotations

import glob
import json
import os
import warnings

import numpy as np
import onnx

import zoo
from conftest import SHARED, random_box

HERE = os.path.dirname(os.path.abspath(__file__))


def compile_to(model_path: str, out_dir: str, **options) -> str:
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    compile_model(model_path, out_dir, PassOptions(**options))
    return out_dir


# alpha-CROWN's (and full alpha-CROWN's) iterations in the rank jobs' bounds, instead of the
# engines' 20: the optimisation was ~85% of a rank's work, and the bitwise claim is the same
# after any number of steps (each one a sharded backward pass, its reductions and an Adam
# update of every alpha). Three steps still take an update from Adam's first moments and the
# best-so-far choice between iterates (5 before session 6, when the suite ran out of room).
# verify's own optimisations (entries with "specs") keep theirs.
ALPHA_ITERATIONS = 3


def run_job(tmp_path, entries, methods, nproc, threads=1, tag="job", bounds=False,
            gradients=False, alpha_iterations=ALPHA_ITERATIONS) -> dict:
    """Results of tests/rank_driver.py run on `nproc` ranks: {(dir, method): result}; with
    `gradients`, also {(dir, "gradient"): forward values and input gradients}."""
    from shardbound.runtime.parallel.launch import launch

    job = tmp_path / f"{tag}_{nproc}.json"
    out = tmp_path / f"{tag}_{nproc}_out.json"
    job.write_text(json.dumps({"entries": entries, "methods": methods, "threads": threads,
                               "timeout": 180, "bounds": bounds,
                               "gradients": gradients,
                               "alpha_iterations": alpha_iterations}))
    if nproc == 1:
        from rank_driver import main

        main(str(job), str(out))
    else:
        log = tmp_path / f"{tag}_{nproc}.stderr"
        with open(log, "w") as err:
            code = launch(os.path.join(HERE, "rank_driver.py"), [str(job), str(out)], nproc, 180,
                          stderr=err)
        if code != 0:
            # A failed launch (a rendezvous port taken, a rank killed by the machine) is retried
            # once and reported with the ranks' last stderr lines; a bitwise mismatch never is
            # retried: that is checked by the caller.
            tail = " | ".join(log.read_text().strip().splitlines()[-6:])
            warnings.warn(f"rank job on {nproc} ranks failed with {code}; retrying once: {tail}")
            code = launch(os.path.join(HERE, "rank_driver.py"), [str(job), str(out)], nproc, 180)
        assert code == 0, f"rank job failed with {code}"
    data = json.loads(out.read_text())
    assert data["world"] == nproc
    return {(r["dir"], r["method"]): r for r in data["results"]}


def box_entry(directory, lower, upper) -> dict:
    return {"dir": str(directory), "lower": np.asarray(lower, dtype=np.float32).reshape(-1).tolist(),
            "upper": np.asarray(upper, dtype=np.float32).reshape(-1).tolist()}


# -- the models multi-rank tests run ------------------------------------------------------------
ACAS_BOX_LO = (0.6, -0.5, -0.5, 0.45, -0.5)


def zoo_cases(tmp, names, seed: int, radius: float) -> list[tuple]:
    """(name, onnx path, lower, upper) per zoo model, each with a box from rng(seed)."""
    out = []
    for name in names:
        model, shape = zoo.build(name)
        path = tmp / f"{name}.onnx"
        onnx.save(model, path)
        out.append((name, str(path), *random_box(np.random.default_rng(seed), shape, radius)))
    return out


def shared_cases(acas_net: str = "1_1", acas_lo=ACAS_BOX_LO, acas_width: float = 0.05,
                 mnist_seed: int | None = 3) -> list[tuple]:
    """The shared networks when present: an ACAS Xu network (ACASXU_run2a_<acas_net>) on a
    small box, and mnistfc 256x2 on a +-0.02 box around a random image (none if mnist_seed
    is None)."""
    out = []
    acas = sorted(glob.glob(os.path.join(SHARED, "acasxu", f"ACASXU_run2a_{acas_net}*.onnx")))
    if acas:
        lo = np.array(acas_lo, dtype=np.float32)
        out.append(("acasxu", acas[0], lo, lo + np.float32(acas_width)))
    mnist = os.path.join(SHARED, "mnistfc", "mnist-net_256x2.onnx")
    if mnist_seed is not None and os.path.exists(mnist):
        x = np.random.default_rng(mnist_seed).uniform(0, 1, 784).astype(np.float32)
        out.append(("mnist", mnist, np.clip(x - 0.02, 0, 1), np.clip(x + 0.02, 0, 1)))
    return out


def compile_pairs(tmp, cases, mode: str, summation: str = "blocked", **options) -> list[tuple]:
    """(name, single-mode entry, `mode` entry) per case; `options` go to the `mode` program."""
    pairs = []
    for name, path, lo, hi in cases:
        single = compile_to(path, str(tmp / f"{name}_single"), mode="single",
                            summation=summation)
        other = compile_to(path, str(tmp / f"{name}_{mode}"), mode=mode, summation=summation,
                           **options)
        pairs.append((name, box_entry(single, lo, hi), box_entry(other, lo, hi)))
    return pairs


def run_pairs(tmp, pairs, methods, worlds) -> tuple[dict, dict]:
    """The single-mode programs of `pairs` (compile_pairs' triples) in one in-process job and
    the other programs in one job per world size: (single results, {P: results})."""
    single = run_job(tmp, [s for _, s, _ in pairs], methods, 1, tag="single")
    runs = {P: run_job(tmp, [m for _, _, m in pairs], methods, P, tag="ranks") for P in worlds}
    return single, runs


def assert_pairs_bitwise(pairs, single, runs, methods, label=()) -> None:
    """Every pair's sharded bounds (bounds_sha256) equal its single-mode program's, for every
    world size in `runs` and every method."""
    for P, got in runs.items():
        for name, s, m in pairs:
            for method in methods:
                assert got[(m["dir"], method)]["sha"] == single[(s["dir"], method)]["sha"], \
                    (name, *label, method, P)


# -- fsdp zoo jobs shared by test_fsdp.py and test_determinism.py ---------------------------------
FSDP_METHODS = ["ibp", "crown", "alpha-crown"]
FSDP_WORLDS = (1, 2, 3, 4)


def fsdp_jobs(tmp, pair_sets: dict, methods=FSDP_METHODS, guests=None) -> dict:
    """compile_pairs' fsdp pairs run the way the determinism tests need: the single programs
    in process on 1 and on 2 threads ("t1", "t2"), the fsdp programs on P = 1..4 ranks
    ({P: results} under "fsdp"; 2 threads per rank at P = 2), every result with its memory
    ledger (max over ranks). `pair_sets` ({name: pairs}) share the jobs (one launch per P for
    all); the answer has the same keys, each {"pairs": its pairs, "t1", "t2", "fsdp"} (the
    result dicts, keyed by program directory, hold every set's). `guests` ({P: entries}):
    other files' rank-driver entries that ride along in the fsdp job of that P (their
    results are in the same dicts)."""
    guests = guests or {}
    singles = [s for pairs in pair_sets.values() for _, s, _ in pairs]
    fsdps = [f for pairs in pair_sets.values() for _, _, f in pairs]
    t1 = run_job(tmp, singles, methods, 1, threads=1, tag="t1")
    t2 = run_job(tmp, singles, methods, 1, threads=2, tag="t2")
    fsdp = {P: run_job(tmp, fsdps + guests.get(P, []), methods, P, threads=1 + (P == 2),
                       tag="fsdp")
            for P in FSDP_WORLDS}
    return {name: {"pairs": pairs, "t1": t1, "t2": t2, "fsdp": fsdp}
            for name, pairs in pair_sets.items()}


FSDP_ZOO_MODELS = ("mlp", "cnn_batchnorm", "residual", "cnn_avgpool", "layout_ops")
# test_determinism.py's `exact` programs: other models' seeds and boxes, ACAS Xu 1_9
FSDP_EXACT_MODELS = ("mlp", "cnn_batchnorm", "residual", "cnn_avgpool")
_FSDP_ZOO: dict = {}
# Guests of the fsdp zoo jobs: {name: (build, worlds)}, registered by the test files that read
# fsdp_zoo_runs(...)["guests"][name] (at import: under xdist every worker collects every file,
# so the guests are known before the first job). build(tmp) -> (entries, context) makes the
# guest's rank-driver entries (compiled under tmp, a folder of its own); the entries join the
# fsdp jobs of the world sizes in `worlds` (a subset of FSDP_WORLDS) instead of launches of
# their own (each launch starts P processes that import torch, ~3 CPU-s each). A guest file
# must share the "fsdp_zoo" xdist group, or its worker computes every job again.
FSDP_ZOO_GUESTS: dict = {}


def fsdp_zoo_runs(tmp_path_factory, order: str = "blocked") -> dict:
    """fsdp_jobs of two sets, computed once per process in the same jobs: "blocked", the zoo
    models FSDP_ZOO_MODELS (and the shared networks when present) compiled single and fsdp
    under `blocked`, read by test_fsdp.py (bitwise for P = 1..4, resident weights, the memory
    plan) and by test_determinism.py (threads and world sizes); "exact", test_determinism.py's
    FSDP_EXACT_MODELS and shared networks under `exact` (its own jobs before: 9 more ranks);
    order "guests": {name: {"context": build's context, P: that job's results}} of
    FSDP_ZOO_GUESTS."""
    if not _FSDP_ZOO:
        tmp = tmp_path_factory.mktemp("fsdp_zoo")
        cases = zoo_cases(tmp, FSDP_ZOO_MODELS, seed=11, radius=0.2) + shared_cases()
        pairs = compile_pairs(tmp, cases, "fsdp")
        for name, s, f in pairs:        # full alpha-CROWN: the zoo models (blocked: the claim)
            if name in FSDP_ZOO_MODELS:
                s["extra_methods"] = f["extra_methods"] = ["full-alpha-crown"]
        exact_tmp = tmp / "exact"
        exact_tmp.mkdir()
        exact_cases = (zoo_cases(exact_tmp, FSDP_EXACT_MODELS, seed=21, radius=0.2)
                       + shared_cases("1_9", (-0.3, -0.2, -0.5, 0.3, 0.3), 0.1, mnist_seed=4))
        exact = compile_pairs(exact_tmp, exact_cases, "fsdp", summation="exact")
        built, guest_entries = {}, {}
        for name, (build, worlds) in sorted(FSDP_ZOO_GUESTS.items()):
            assert set(worlds) <= set(FSDP_WORLDS), (name, worlds)
            guest_tmp = tmp / f"guest_{name}"
            guest_tmp.mkdir()
            entries, context = build(guest_tmp)
            built[name] = (worlds, context)
            for P in worlds:
                guest_entries.setdefault(P, []).extend(entries)
        _FSDP_ZOO.update(fsdp_jobs(tmp, {"blocked": pairs, "exact": exact},
                                   guests=guest_entries))
        fsdp = _FSDP_ZOO["blocked"]["fsdp"]
        _FSDP_ZOO["guests"] = {name: {"context": context, **{P: fsdp[P] for P in worlds}}
                               for name, (worlds, context) in built.items()}
    return _FSDP_ZOO[order]
