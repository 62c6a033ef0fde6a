"""`verify --mode tp`: attacks follow the same gradients as single mode, and branch and bound
(input splitting and ReLU splitting with beta-CROWN) gives sound verdicts when a zone's neurons
are spread over the ranks.

- Forward values and input gradients (what the attacks follow) in tp equal single mode's bit
  for bit under `blocked` for an MLP whose zones span several ranks, and closely for a conv
  zone and for `fast`: tests/test_tp.py (test_tp_gradients_match_single_mode, in that file's
  P = 2, 3 jobs).
- Verdicts on properties that need input splitting or ReLU splitting, for P = 2 and 3 with
  `fast` (zones split evenly, so every rank holds neurons that branching must choose among):
  unsat only when single mode proves it too and sampling finds no violation; sat only with a
  counterexample that onnxruntime confirms.
- With `blocked` and `--tp-intermediate crown` the result files are byte-identical to single
  mode's.

The single-mode references are the command called in this process. The tp verdicts come from
one rank job per P (tests/rank_driver.py: the verifier the command's ranks run, on tp programs
compiled as the command compiles them) that verifies every property of both models, instead
of one `verify` process (a launcher and its ranks, each importing torch) per property and P,
which was most of this file's time; the command itself runs once, launching its ranks, on the
ReLU-splitting property (test_tp_verify_command_equals_single). Those jobs are test_tp.py's
jobs of P = 2 and 3 (test_tp.TP_GUESTS: these entries ride along, sparing 5 rank processes),
so this file shares test_tp.py's xdist group.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import zoo
from multirank import compile_to
from test_tp import TP_GUESTS, tp_runs
from test_verify import (_forward, _parse_result, _verify, _verify_in_process,
                         _write_property)

# jobs of several processes (pyproject.toml); test_tp.py's group: its P = 2, 3 jobs run this
# file's verify entries (test_tp.TP_GUESTS, a per-process cache)
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("tp_jobs")]


# -- verdicts ---------------------------------------------------------------------------------------
def _properties(tmp, name, sizes, radius, seed):
    """A model and two properties on one output difference: sat (above a sampled value), and
    one that needs branch and bound (a threshold between the bound verify computes before
    branch and bound and the sampled minimum; single mode proves it unsat)."""
    from shardbound.runtime.program.loader import load

    model, _ = zoo.mlp(np.random.default_rng(seed), sizes=sizes)
    path = tmp / f"{name}.onnx"
    onnx.save(model, path)
    n = sizes[0]
    lower, upper = np.full(n, -radius), np.full(n, radius)
    net = load(compile_to(str(path), str(tmp / f"{name}_probe")))
    x = np.random.default_rng(0).uniform(lower, upper, (20000, n)).astype(np.float32)
    row = np.zeros((1, sizes[-1]))
    row[0, 0], row[0, 1] = 1.0, -1.0
    sampled = net.forward(x).numpy().astype(np.float64) @ row.T
    sampled_min = float(sampled.min())
    best = _root_bound(net.network, lower, upper, row)
    assert best < sampled_min
    props = {"sat": sampled_min + 0.2 * (float(np.median(sampled)) - sampled_min),
             "unsat": best + 0.3 * (sampled_min - best)}
    for prop, d in props.items():
        _write_property(tmp / f"{name}_{prop}.vnnlib", lower, upper, row, [d])
    return str(path), model, row, props, sampled_min


def _root_bound(net, lower, upper, row) -> float:
    """The lower bound of row . f(x) that verify computes before branch and bound (full
    alpha-CROWN, in every mode)."""
    import torch

    from shardbound.runtime.engine.full_alpha import root_bounds

    lo = torch.tensor(lower, dtype=torch.float32).reshape(1, -1)
    hi = torch.tensor(upper, dtype=torch.float32).reshape(1, -1)
    C = torch.tensor(row, dtype=torch.float32)
    with torch.no_grad():
        cache = net.intermediate_bounds(lo, hi)
    lb, _ = root_bounds(net, lo, hi, C, cache)
    return float(lb[0, 0])


def _verdict_models(tmp):
    # 3 inputs: input splitting, 2 zones of 16 neurons (the second needs every rank's rows);
    # 20 inputs: ReLU splitting, a zone of 24 neurons.
    return tmp, {"inputs": _properties(tmp, "inputs", (3, 16, 12, 16, 2), 0.5, 7),
                 "relus": _properties(tmp, "relus", (20, 24, 24, 3), 0.15, 4)}


def _run(tmp, path, vnnlib, tag, *args):
    """`verify` with ARGS: a real process (launching the ranks) for --mode tp, the CLI called
    in this process for the single-mode references."""
    out = tmp / f"{tag}.txt"
    argv = [path, vnnlib, "--result", str(out), "--timeout", "100", *args]
    res = _verify(argv, timeout=200) if "--mode" in args else _verify_in_process(argv)
    assert res.returncode == 0, res.stderr
    return res.stdout, out.read_text()


PROPS = ("sat", "unsat")
FAST = {"summation": "fast"}                                    # --summation fast
BLOCKED = {"summation": "blocked", "tp_intermediate": "crown"}  # the bitwise configuration


JOB_KINDS = {2: ("fast", "blocked"), 3: ("fast",)}      # the programs each P verifies


def _guest(tmp):
    """The verdict models and their tp programs' entries, verifying every property of both
    (`fast` on P = 2 and 3; `blocked` with CROWN intermediates on P = 2): ({P: entries},
    ((tmp, models), {(which, kind): (entry, {prop: spec})}))."""
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.verification.spec import spec_from_property

    tmp, models = _verdict_models(tmp)
    entries = {}
    for which, (path, *_rest) in models.items():
        specs = {}
        for prop in PROPS:
            spec = tmp / f"{which}_{prop}.json"
            vnnlib = str(tmp / f"{which}_{prop}.vnnlib")
            spec.write_text(spec_from_property(parse_vnnlib(vnnlib)).to_json())
            specs[prop] = str(spec)
        for kind, options in (("fast", FAST), ("blocked", BLOCKED)):
            d = compile_to(path, str(tmp / f"{which}_tp_{kind}"), mode="tp", **options)
            entries[(which, kind)] = ({"dir": d, "specs": [specs[p] for p in PROPS],
                                       "verify_timeout": 100}, specs)
    per_world = {P: [e for (_, kind), (e, _) in entries.items() if kind in kinds]
                 for P, kinds in JOB_KINDS.items()}
    return per_world, ((tmp, models), entries)


TP_GUESTS["verify_tp"] = _guest


@pytest.fixture(scope="module")
def guest(tmp_path_factory):
    return tp_runs(tmp_path_factory)["guests"]["verify_tp"]


@pytest.fixture(scope="module")
def verdict_models(guest):
    return guest["context"][0]


@pytest.fixture(scope="module")
def tp_jobs(guest):
    """{(P, which, prop, "fast" / "blocked"): rank 0's result} from test_tp.py's job of P."""
    entries = guest["context"][1]
    out = {}
    for P, kinds in JOB_KINDS.items():
        for (which, kind), (e, specs) in entries.items():
            if kind in kinds:
                for prop in PROPS:
                    out[(P, which, prop, kind)] = guest[P][(e["dir"], specs[prop])]
    return out


@pytest.mark.parametrize("which", ["inputs", "relus"])
def test_tp_verdicts_are_sound_with_zones_split_over_ranks(verdict_models, tp_jobs, which):
    tmp, models = verdict_models
    path, model, row, props, sampled_min = models[which]
    split = "input-split" if which == "inputs" else "relu-split"     # the deciding stage
    for prop, d in props.items():
        vnnlib = str(tmp / f"{which}_{prop}.vnnlib")
        if prop != "sat":       # the reference verdict (sat is checked with onnxruntime)
            single, _ = _run(tmp, path, vnnlib, f"{which}_{prop}_single", "--summation", "fast")
        for P in (2, 3):
            r = tp_jobs[(P, which, prop, "fast")]
            verdict, values = _parse_result(r["text"])
            if prop == "sat":
                assert verdict == r["verdict"] == "sat", (which, P, r)
                x = np.array([values[f"X_{i}"] for i in range(len(values)) if f"X_{i}" in values])
                y = _forward(model, x).astype(np.float64)
                assert (row @ y <= d).all(), (which, P)
            else:
                assert d < sampled_min
                assert verdict == single.splitlines()[0] == "unsat", (which, prop, P, r)
                assert r["decided"] == split, (which, P, r)     # branch and bound was needed


def test_tp_blocked_result_files_equal_single(verdict_models, tp_jobs):
    tmp, models = verdict_models
    for which in ("inputs", "relus"):
        path = models[which][0]
        for prop in PROPS:
            vnnlib = str(tmp / f"{which}_{prop}.vnnlib")
            _, ref = _run(tmp, path, vnnlib, f"{which}_{prop}_bs", "--summation", "blocked")
            assert tp_jobs[(2, which, prop, "blocked")]["text"] == ref, (which, prop)


def test_tp_verify_command_equals_single(verdict_models):
    """`verify --mode tp --nproc 2` itself (the launcher, its ranks, the result file) on the
    property that needs ReLU splitting over the zone's neurons: single mode's file, byte for
    byte, and the final line says branch and bound decided it."""
    from shardbound.runtime.verification.stages import LABELS

    tmp, models = verdict_models
    path = models["relus"][0]
    vnnlib = str(tmp / "relus_unsat.vnnlib")
    _, ref = _run(tmp, path, vnnlib, "relus_unsat_cs", "--summation", "blocked")
    stdout, got = _run(tmp, path, vnnlib, "relus_unsat_ct", "--summation", "blocked",
                       "--mode", "tp", "--nproc", "2", "--tp-intermediate", "crown")
    assert got == ref == "unsat\n", (got, ref)
    assert LABELS["relu-split"] in stdout, stdout
