"""The op-family zoo (tests/zoo.py OP_ZOO: networks that mix the new ops with the old ones) in
every mode: fsdp P = 1, 2, 4 and tp P = 2, 3 bounds bitwise equal to single mode under
`blocked` (IBP, CROWN, alpha-CROWN), and `verify` answering a sat and an unsat property on
each model correctly in single mode, and on SHARDED_VERIFY_MODELS (one per op family) in fsdp
and tp mode on 2 ranks too (sat counterexamples re-checked with onnxruntime, result files
byte-identical to single mode's), plus an unsat property that needs branch and bound: on
every model in single mode, and on one model in all three modes (branch and bound over ranks
costs a collective per round: the suite's time budget decides). The wide tp_* models (zones
of 260-520 channels) take part in the bitwise bounds test only, and so do the guests
(GUESTS: the tiny ViT and test_gated's smooth and LayerNorm zones, which also run fsdp P = 3).
ReLU branch and bound on a small MLP (bab_guest) runs in the fsdp jobs of P = 2 and 4, every
round's per-domain bounds bitwise single mode's. A few process launches in all: one job per
P runs every model's bounds in each mode with that P, and verifies the properties too (P = 1,
single and fsdp, in this process; P = 2: fsdp and tp).

Why not every model in every (mode, P) (the suite's 8 minutes decide): the sharded modes'
bounds are checked bit for bit against single mode's on every model, so what a sharded
`verify` adds is its own plumbing (the ranks' attack, the verdict's agreement, the result
file), which is op-independent; and fsdp's P = 3 (an uneven row split) is covered on the
guests here and on the zoo models by test_fsdp.py / test_determinism.py (P = 1..4)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import zoo
from conftest import random_box
from multirank import ALPHA_ITERATIONS, box_entry, compile_to, run_job
from test_verify import _parse_result, _write_property

pytestmark = pytest.mark.multirank     # jobs of several processes (pyproject.toml)

METHODS = ["ibp", "crown", "alpha-crown"]
BAB_EVERY_MODE = "leaky_residual"      # the model whose branch-and-bound property runs in all modes
# the models `verify` also runs in fsdp and tp (the module docstring: why not all): ReLU with a
# residual, a CNN with a branch and Concat, MaxPool, a smooth activation, Slice / Gather
SHARDED_VERIFY_MODELS = (BAB_EVERY_MODE, "branch_concat_cnn", "maxpool_cnn", "sigmoid_mlp",
                         "slice_gather_mlp")
RADIUS = 0.15


@pytest.fixture(scope="module")
def op_zoo(tmp_path_factory):
    """Per OP_ZOO model: the onnx model, a box, and its single / fsdp / tp programs."""
    names = sorted(getattr(zoo, "OP_ZOO", {}))
    if not names:
        pytest.skip("no op-family zoo models")
    tmp = tmp_path_factory.mktemp("op_zoo")
    models = {}
    for i, name in enumerate(names):
        model, shape = zoo.build(name)
        path = tmp / f"{name}.onnx"
        onnx.save(model, path)
        rng = np.random.default_rng(100 + i)
        center = rng.uniform(-0.5, 0.5, size=int(np.prod(shape))).astype(np.float32)
        lo, hi = center - np.float32(RADIUS), center + np.float32(RADIUS)
        dirs = {mode: compile_to(str(path), str(tmp / f"{name}_{mode}"), mode=mode,
                                 summation="blocked", tp_intermediate="crown")
                for mode in ("single", "fsdp", "tp")}
        # The threshold search (80 PGD steps from thousands of points) runs on a `fast` build:
        # through the blocked im2col kernels it took 20 s per CNN.
        dirs["fast"] = compile_to(str(path), str(tmp / f"{name}_fast"), mode="single",
                                  summation="fast")
        models[name] = dict(model=model, path=str(path), lo=lo, hi=hi, dirs=dirs)
    return tmp, models


# Guests: models outside OP_ZOO that join the bitwise jobs only (the verify jobs leave them
# out), in the (mode, P) runs and with the methods named here, each next to its single-mode
# program (P = 1, in this process):
# - the tiny ViT (tests/zoo.py vit_tiny, issue 15; tests/test_vit.py verifies it): IBP and CROWN
#   (its alpha-CROWN would double the jobs' time);
# - tp_smooth_chain (silu, sin, hard_swish, softplus, log in one Megatron zone of 520 channels,
#   a replicated Gelu after it) and ln_relu_block (a transformer MLP zone between replicated
#   LayerNorms), for tests/ops/test_gated.py, whose own three jobs they were: P = 4 in tp leaves
#   one rank without a block of a zone, so every kernel also meets empty slices.
EVERY_SHARDED_RUN = {(mode, P) for mode in ("fsdp", "tp") for P in (2, 3, 4)}
GUESTS = {"vit_tiny": ({("fsdp", 2), ("fsdp", 3), ("tp", 2)}, ["ibp", "crown"]),
          "tp_smooth_chain": (EVERY_SHARDED_RUN, METHODS),
          "ln_relu_block": (EVERY_SHARDED_RUN, METHODS)}


# ReLU branch and bound in fsdp (issue 18: each rank bounds its share of a round's (domain,
# row) pairs, runtime/verification/row_pairs.py): relu_split on a small MLP with two spec rows
# whose property takes 4 rounds of branching (9 domains, batch 4: rounds of 2 to 8 pairs, so
# P = 4 also meets ranks with a stand-in pair), single mode (P = 1, in this process) against
# fsdp on P = 2 and 4, the rounds' per-domain bounds bitwise (tests/rank_driver.py "bab").
# 3 beta-CROWN iterations (as the jobs' alpha-CROWN, multirank.ALPHA_ITERATIONS) and no
# attacks inside domains (replicated forward passes, not the split): a collective costs
# ~1 ms of CPU per rank at P = 4 on the loaded 2 cores, and 20 iterations were ~270 a round.
BAB_WORLDS = (2, 4)


@pytest.fixture(scope="module")
def bab_guest(op_zoo):
    """(single and fsdp program dirs, the rank driver's "bab" job)."""
    import torch
    from shardbound.runtime.program.loader import load
    from soundness import attack_min

    tmp, _ = op_zoo
    model, _ = zoo.mlp(np.random.default_rng(11), sizes=(20, 24, 24, 3))
    path = tmp / "bab_mlp.onnx"
    onnx.save(model, path)
    dirs = {mode: compile_to(str(path), str(tmp / f"bab_mlp_{mode}"), mode=mode,
                             summation="blocked") for mode in ("single", "fsdp")}
    net = load(dirs["single"]).network
    C = torch.tensor([[1.0, -1.0, 0.0], [1.0, 0.0, -1.0]])
    lo, hi = torch.full((20,), -0.5), torch.full((20,), 0.5)
    fwd = lambda x: net.forward(x.reshape(-1, 20)).reshape(len(x), -1)       # noqa: E731
    d = []
    for r in range(2):          # 35% of the way from CROWN's bound to the attack's minimum
        found = attack_min(fwd, lo, hi, C[r:r + 1], torch.Generator().manual_seed(0), n=2000)
        lb = float(net.crown(lo.reshape(1, -1), hi.reshape(1, -1), C[r:r + 1])[0])
        d.append(lb + 0.35 * (found - lb))
    job = {"C": C.tolist(), "d": d, "lower": lo.tolist(), "upper": hi.tolist(), "batch": 4,
           "timeout": 60, "options": {"iterations": ALPHA_ITERATIONS, "attack_domains": 0}}
    return dirs, job


def _guest_box(name, shape):
    """The ViT: radius 0.02 around an image in [0, 1]; the others: multirank.zoo_cases' box
    (seed 5, radius 0.2), the box test_gated's jobs used."""
    if name == "vit_tiny":
        x0 = np.random.default_rng(3).uniform(0, 1, size=int(np.prod(shape))).astype(np.float32)
        return x0 - np.float32(0.02), x0 + np.float32(0.02)
    return random_box(np.random.default_rng(5), shape, 0.2)


@pytest.fixture(scope="module")
def guests(op_zoo):
    """Per guest: its runs, methods, box and single / fsdp / tp programs."""
    tmp, _ = op_zoo
    out = {}
    for name, (runs, methods) in GUESTS.items():
        model, shape = zoo.build(name)
        path = tmp / f"{name}.onnx"
        onnx.save(model, path)
        lo, hi = _guest_box(name, shape)
        dirs = {mode: compile_to(str(path), str(tmp / f"{name}_{mode}"), mode=mode,
                                 summation="blocked", tp_intermediate="crown")
                for mode in ("single", "fsdp", "tp")}
        out[name] = dict(runs=runs, methods=methods, lo=lo, hi=hi, dirs=dirs)
    return out


def _entries(models, mode):
    return [box_entry(m["dirs"][mode], m["lo"], m["hi"]) for m in models.values()]


def _guest_entries(guests, mode, P):
    return [{**box_entry(g["dirs"][mode], g["lo"], g["hi"]), "methods": g["methods"]}
            for g in guests.values() if mode == "single" or (mode, P) in g["runs"]]


BOUND_WORLDS = {"single": (1,), "fsdp": (1, 2, 4), "tp": (2, 3)}
VERIFY_WORLD = {"single": 1, "fsdp": 2, "tp": 2}


@pytest.fixture(scope="module")
def runs(op_zoo, guests, bab_guest):
    """{(mode, P): results} of one job per world size: every model's bounds (METHODS) in
    each mode of BOUND_WORLDS that has this P, the guests' in their runs (and single mode),
    and the properties of _properties verified on VERIFY_WORLD (tp_* models: bounds only) in
    the same jobs: the programs of every mode with this P share its job (results are per
    program directory; P = 1 runs in this process), so each P is one process launch."""
    tmp, models = op_zoo
    verified = {k: v for k, v in models.items() if not k.startswith("tp_")}
    specs = {name: _properties(tmp, name, m) for name, m in verified.items()}
    guest_runs = set().union(*(g["runs"] for g in guests.values()))
    out = {}
    for P in sorted({P for worlds in BOUND_WORLDS.values() for P in worlds}
                    | {P for _, P in guest_runs}):
        modes = sorted({mode for mode, worlds in BOUND_WORLDS.items() if P in worlds}
                       | {mode for mode, p in guest_runs if p == P})
        entries = []
        for mode in modes:
            if P in BOUND_WORLDS.get(mode, ()):
                entries += _entries(models, mode)
            entries += _guest_entries(guests, mode, P)
            if (mode, P) in {("single", 1), *(("fsdp", p) for p in BAB_WORLDS)}:
                entries.append({"dir": bab_guest[0][mode], "bab": bab_guest[1]})
            if VERIFY_WORLD[mode] == P:
                for name, m in verified.items():
                    chosen = [s for s, _ in specs[name] if _runs_in(mode, name, s)]
                    if chosen:
                        entries.append({"dir": m["dirs"][mode], "specs": chosen,
                                        "verify_timeout": 60})
        results = run_job(tmp, entries, METHODS, P, tag=f"ranks{P}")
        out.update({(mode, P): results for mode in modes})
    return verified, specs, out


def test_fsdp_and_tp_bounds_bitwise_equal_single(op_zoo, guests, runs):
    _, models = op_zoo
    results = runs[2]
    single = results[("single", 1)]
    for name, g in guests.items():
        for mode, P in g["runs"]:
            for method in g["methods"]:
                assert (results[(mode, P)][(g["dirs"][mode], method)]["sha"]
                        == single[(g["dirs"]["single"], method)]["sha"]), (name, mode, P, method)
    for mode in ("fsdp", "tp"):
        for P in BOUND_WORLDS[mode]:
            got = results[(mode, P)]
            for name, m in models.items():
                for method in METHODS:
                    assert (got[(m["dirs"][mode], method)]["sha"]
                            == single[(m["dirs"]["single"], method)]["sha"]), (name, mode, P, method)


def test_fsdp_relu_bab_bitwise_equal_single(bab_guest, runs):
    dirs, _ = bab_guest
    results = runs[2]
    single = results[("single", 1)][(dirs["single"], "relu-bab")]
    assert single["verdict"] == "unsat" and single["rounds"] >= 3, single
    for P in BAB_WORLDS:
        got = results[("fsdp", P)][(dirs["fsdp"], "relu-bab")]
        assert (got["verdict"], got["domains"], got["sha"]) == (
            single["verdict"], single["domains"], single["sha"]), P


def _properties(tmp, name, m):
    """(path of spec.json, expected verdict) for three properties on output row 0 - row 1:
    sat (a sampled point violates it), unsat below CROWN's bound, and unsat that CROWN alone
    cannot prove (between CROWN's bound and the lowest value sampling and PGD find)."""
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.program.loader import load
    from shardbound.runtime.verification.spec import spec_from_property
    from soundness import attack_min
    import torch

    net = load(m["dirs"]["single"])
    search = load(m["dirs"]["fast"])
    out = int(np.prod(net.output_shape))
    row = np.zeros((1, out))
    row[0, 0] = 1.0
    if out > 1:
        row[0, 1] = -1.0
    lo_t, hi_t = torch.from_numpy(m["lo"]), torch.from_numpy(m["hi"])
    lowest = attack_min(lambda x: search.network.forward(x.reshape(-1, *net.input_shape))
                        .reshape(x.shape[0], -1), lo_t, hi_t, torch.tensor(row, dtype=torch.float32),
                        torch.Generator().manual_seed(0), n=5000)
    crown_lb = float(net.bounds(m["lo"], m["hi"], C=row.astype(np.float32), method="crown")[0][0])
    assert crown_lb < lowest
    specs = []
    for kind, threshold, expected in (("sat", lowest + 0.05 * (abs(lowest) + 1), "sat"),
                                      ("unsat_crown", crown_lb - 0.05 * (abs(crown_lb) + 1), "unsat"),
                                      ("unsat_bab", crown_lb + 0.2 * (lowest - crown_lb), "unsat")):
        vnnlib = tmp / f"{name}_{kind}.vnnlib"
        _write_property(vnnlib, m["lo"], m["hi"], row, [threshold])
        spec = tmp / f"{name}_{kind}.json"
        spec.write_text(spec_from_property(parse_vnnlib(str(vnnlib))).to_json())
        specs.append((str(spec), expected))
    return specs


def _runs_in(mode, name, spec):
    """Which properties a mode verifies (see the module docstring)."""
    if mode == "single":
        return True
    return name in SHARDED_VERIFY_MODELS and (not spec.endswith("_unsat_bab.json")
                                              or name == BAB_EVERY_MODE)


def test_verify_answers_in_every_mode(runs):
    models, specs, jobs = runs
    assert set(SHARDED_VERIFY_MODELS) <= set(models)     # a renamed model is not skipped silently
    results = {mode: jobs[(mode, P)] for mode, P in VERIFY_WORLD.items()}
    for name, m in models.items():
        for spec, expected in specs[name]:
            got = {mode: results[mode][(m["dirs"][mode], spec)] for mode in results
                   if _runs_in(mode, name, spec)}
            for mode, r in got.items():
                assert r["verdict"] == expected, (name, spec, mode, r["verdict"])
                assert r["sha"] == got["single"]["sha"], (name, spec, mode)
            if expected == "sat":
                _check_counterexample(m, results["single"], spec)


def _check_counterexample(m, results, spec):
    text = results[(m["dirs"]["single"], spec)]["text"]
    verdict, values = _parse_result(text)
    x = np.array([values[f"X_{i}"] for i in range(m["lo"].size)], dtype=np.float32)
    assert bool(((x >= m["lo"]) & (x <= m["hi"])).all())
    y = _onnxruntime(m["model"], x)
    assert y[0] - (y[1] if y.size > 1 else 0.0) <= float(spec_threshold(spec)) + 1e-5


def _onnxruntime(model, x):
    ort = pytest.importorskip("onnxruntime")
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    shape = [1] + [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:]]
    return s.run(None, {s.get_inputs()[0].name: x.reshape(shape)})[0].reshape(-1)


def spec_threshold(spec):
    import json

    with open(spec) as f:
        data = json.load(f)
    return data["cases"][0]["conjunctions"][0]["d"][0]
