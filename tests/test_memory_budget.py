"""--memory-budget: the planner's choice, the run-time guard, and the memory model it trusts.

One small zoo MLP is compiled once; the planner is asked for three budgets (too small: the
one-line error with the smallest peak; tight, below what one rank needs in any plan: fsdp on
the fewest ranks; generous: single); a run past its budget stops with exit code 2 and one
line naming the node; the memory model's predictions of IBP, CROWN, alpha-CROWN and of a
batched beta-CROWN round of branch and bound are within 10% of the ledger's measured peaks
(full alpha-CROWN's: tests/test_fsdp.py); row tiles change no bit under blocked.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

import zoo
from conftest import random_box


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """(onnx path, the memory model's shapes after the passes, output node)."""
    from shardbound.compiler.driver import plan_model
    from shardbound.passes.manager import PassOptions
    from shardbound.passes.memory_plan import graph_shapes

    tmp = tmp_path_factory.mktemp("budget")
    model, _ = zoo.build("mlp")
    path = tmp / "mlp.onnx"
    onnx.save(model, path)
    graph, _ = plan_model(str(path), PassOptions())
    return str(path), graph_shapes(graph), graph.output, tmp


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """An MLP 6-400-400-5 (the 400x400 weight dominates): fsdp's shards and streamed blocks
    pay off here, as on the networks the planner is for."""
    from shardbound.compiler.driver import plan_model
    from shardbound.passes.manager import PassOptions
    from shardbound.passes.memory_plan import graph_shapes

    path = tmp_path_factory.mktemp("wide") / "wide.onnx"
    onnx.save(zoo.mlp(np.random.default_rng(0), sizes=(6, 400, 400, 5))[0], path)
    graph, _ = plan_model(str(path), PassOptions())
    return str(path), graph_shapes(graph), graph.output, None


def _choose(mlp, budget, **kw):
    from shardbound.passes.manager import PassOptions
    from shardbound.passes.memory_budget import choose

    path, shapes, output, _ = mlp
    return choose(shapes, output, PassOptions(memory_budget=budget, **kw), source=path)


def _floor(mlp, mode, P, method="crown"):
    """The least peak any plan of (mode, P) can have: its smallest row tile and chunk."""
    from shardbound.passes.manager import PassOptions
    from shardbound.passes.memory_budget import candidates, predict

    _, shapes, output, _ = mlp
    options = PassOptions(mode=mode)
    last = list(candidates(options, 400, P))[-1]
    return predict(shapes, output, last, options, method)["peak_tracked_bytes"]


def test_generous_budget_plans_single(mlp):
    plan = _choose(mlp, 1 << 30)
    assert (plan.mode, plan.nproc, plan.row_tile, plan.tried) == ("single", 1, 0, 1)
    assert plan.peak_bytes <= 1 << 30


def test_tight_budget_plans_fsdp_on_the_fewest_ranks(wide):
    one, two = _floor(wide, "single", 1), _floor(wide, "fsdp", 2)
    assert two < one
    plan = _choose(wide, one - 1)               # no single-rank plan fits, two ranks do
    assert (plan.mode, plan.nproc) == ("fsdp", 2)
    assert plan.peak_bytes <= one - 1
    assert _choose(wide, one - 1) == plan       # deterministic
    kept = _choose(wide, 1 << 30, nproc=3, nproc_given=True)     # the given --nproc is kept
    assert (kept.mode, kept.nproc, kept.row_tile) == ("fsdp", 3, 0)


def test_too_small_budget_is_one_line_with_the_smallest_peak(mlp):
    from shardbound.compiler.errors import ShardboundError

    with pytest.raises(ShardboundError) as e:
        _choose(mlp, 1000)
    text = str(e.value)
    assert "\n" not in text and "no plan fits --memory-budget" in text
    assert "smallest predicted peak" in text and "raise the budget" in text


def test_inspect_prints_the_plan_and_the_error(mlp, capsys):
    from shardbound.compiler.cli import main

    path = mlp[0]
    with pytest.raises(SystemExit) as e:
        main(["inspect", path, "--memory-budget", "1GiB"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("plan: --memory-budget 1.00GiB per rank -> single P=1")
    with pytest.raises(SystemExit) as e:
        main(["inspect", path, "--memory-budget", "1KB"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: no plan fits")


def test_memory_size_flag():
    import argparse

    from shardbound.options import memory_size

    assert memory_size("512MiB") == 512 << 20 and memory_size("2GB") == 2 * 10 ** 9
    assert memory_size("1.5g") == 3 << 29 and memory_size("4096") == 4096
    assert memory_size("none") == memory_size("None") == 0     # no budget, not even verify's
    for bad in ("", "-1GB", "12XB", "0", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_size(bad)


@pytest.fixture(scope="module")
def program(mlp):
    """The MLP compiled for a generous budget (the budget lands in plan.json), and a box."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    path, _, _, tmp = mlp
    out = tmp / "prog"
    compile_model(path, str(out), PassOptions(memory_budget=1 << 30))
    lo, hi = random_box(np.random.default_rng(1), (6,), 0.3)
    box = tmp / "box.json"
    box.write_text(json.dumps({"lower": lo.tolist(), "upper": hi.tolist()}))
    return str(out), str(box), lo, hi


def test_a_run_over_its_budget_stops_with_exit_code_2_and_one_line(program, capsys):
    from shardbound.compiler.cli import main

    out, box, _, _ = program
    assert json.loads(open(f"{out}/plan.json").read())["memory_budget_bytes"] == 1 << 30
    with pytest.raises(SystemExit) as e:
        main(["run", out, "--box", box, "--memory-budget", "4KiB", "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: memory budget exceeded: this crown run")
    assert "at node 'relu" in err[0] and "stopped before allocating" in err[0]


def test_the_ledger_stops_a_run_at_the_node_before_allocating(program):
    from shardbound.runtime import load
    from shardbound.runtime.accounting.ledger import MemoryBudgetExceeded

    out, _, lo, hi = program
    v = load(out, memory_budget=5000)
    v.network.memory_setup = None               # no pre-run check: the ledger alone guards
    with pytest.raises(MemoryBudgetExceeded) as e:
        v.bounds(lo, hi, method="crown")
    assert "at node '" in str(e.value) and "5000 bytes" in str(e.value)
    assert v.network.ledger.peak_total <= 5000  # stopped before the step that would pass it


@pytest.mark.parametrize("name", ["mlp", "residual", "sigmoid_mlp"])
def test_prediction_within_10_percent_for_every_method(compile_zoo, name):
    from shardbound.runtime.accounting.memory_model import METHOD_MODELS, network_shapes, \
        predict_peak

    v, _, _ = compile_zoo(name, summation="blocked")
    net = v.network
    lo, hi = random_box(np.random.default_rng(0), net.input_shape, 0.3)
    for method in ("ibp", "crown", *(m for m in METHOD_MODELS if m != "beta-crown")):
        net.ledger.reset_peaks()
        v.bounds(lo, hi, method=method)
        measured = net.ledger.report()["peak_tracked_bytes"]
        pred = predict_peak(network_shapes(net), net.output.name, 1, method=method,
                            crown_rows=net.bounded_rows)["peak_tracked_bytes"]
        assert abs(pred - measured) <= 0.10 * measured, (name, method, pred, measured)


def test_beta_crown_batch_prediction_within_10_percent_and_sizes_the_bab_batch(program, mlp):
    """A branch-and-bound round on B domains (CROWN, then beta-CROWN with betas on every split
    node) peaks within 10% of the "beta-crown" figure for that B, for two B; the planner's
    bab batch is the largest whose beta-CROWN figure fits (larger than alpha-CROWN's)."""
    from shardbound.passes.manager import PassOptions
    from shardbound.passes.memory_budget import BAB_BATCHES, Candidate, _bab_batch, predict
    from shardbound.runtime import load
    from shardbound.runtime.accounting.memory_model import network_shapes, predict_peak
    from shardbound.runtime.engine.beta import beta_crown
    from shardbound.runtime.verification.branching import split_ops

    net = load(program[0]).network
    C = torch.tensor([[1.0, -1.0, 0, 0, 0], [0, 1.0, 0, -1.0, 0], [0, 0, 1.0, 0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    for B in (4, 16):
        lo = torch.linspace(-0.5, -0.4, B).reshape(B, 1).expand(B, 6).contiguous()
        hi = lo + 1.0
        splits = {op.inputs[0]: torch.randint(-1, 2, (B, *op.shape), generator=gen,
                                              dtype=torch.int8) for op in split_ops(net)}
        net.ledger.set("bounds", 0)
        net.ledger.reset_peaks()
        with torch.no_grad():
            ibp, known = net.intermediate_bounds(lo, hi, splits=splits)
            lb, _ = net.final_crown(ibp, known, lo, hi, C, lower_only=True, split_A={})
            beta_crown(net, ibp, known, lo, hi, C, splits, lb, iterations=1)
        assert net.ledger.peak["alpha"] > 0 and net.ledger.peak["autograd"] > 0
        measured = net.ledger.peak_total
        pred = predict_peak(network_shapes(net), net.output.name, 1, batch=B, spec_rows=3,
                            method="beta-crown", crown_rows=net.bounded_rows)
        assert pred["peak_phase"] == "beta-crown"
        assert abs(pred["peak_tracked_bytes"] - measured) <= 0.10 * measured, (B, pred, measured)
    _, shapes, output, _ = mlp
    options = PassOptions(plan_methods=("full-alpha-crown", "alpha-crown"), spec_rows=3)
    cand = Candidate("single", 1, None, options.stream_chunk_bytes)
    beta16, alpha16 = (predict(shapes, output, cand, options, m, batch=16, spec_rows=3)
                       ["peak_tracked_bytes"] for m in ("beta-crown", "alpha-crown"))
    assert alpha16 < beta16 - 1 and BAB_BATCHES.index(16) == BAB_BATCHES.index(8) - 1
    for budget, batch in ((beta16, 16), (beta16 - 1, 8)):      # alpha-CROWN's would take 16
        assert _bab_batch(shapes, output, cand, options, budget, ("alpha-crown",),
                          spec_rows=3) == batch


def test_row_tiles_change_no_bit_and_cut_the_peak(program):
    from shardbound.runtime import load
    from shardbound.runtime.accounting.memory_model import network_shapes, predict_peak

    out, _, lo, hi = program
    v = load(out)
    net = v.network
    whole = v.bounds(lo, hi, method="crown")
    peak = net.ledger.report()["peak_a_matrix_bytes"]
    net.row_tile = 3
    net.ledger.reset_peaks()
    tiled = v.bounds(lo, hi, method="crown")
    assert torch.equal(whole[0], tiled[0]) and torch.equal(whole[1], tiled[1])
    assert net.ledger.report()["peak_a_matrix_bytes"] < peak
    pred = predict_peak(network_shapes(net), net.output.name, 1, crown_rows=net.bounded_rows,
                        row_tile=3)["peak_tracked_bytes"]
    measured = net.ledger.report()["peak_tracked_bytes"]
    assert abs(pred - measured) <= 0.10 * measured, (pred, measured)


def test_a_model_with_external_weight_data_imports_alike(tmp_path):
    """Models over protobuf's 2 GB limit keep their weights in external data files (the
    scale benchmark's MLP): the same IR and weights as the model saved in one file."""
    from shardbound.compiler.frontend import import_onnx

    model, _ = zoo.mlp(np.random.default_rng(3), sizes=(6, 64, 64, 5))
    onnx.save(model, tmp_path / "one.onnx")
    onnx.save(model, tmp_path / "ext.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="ext.data", size_threshold=64)
    a, b = import_onnx(str(tmp_path / "one.onnx")), import_onnx(str(tmp_path / "ext.onnx"))
    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]
    assert a.tensors.keys() == b.tensors.keys()
    assert all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


@pytest.fixture(scope="module")
def tp_net(tmp_path_factory):
    """A 2-zone MLP (tp_mlp2: 520 hidden = 3 blocks): (path, shapes, output, tp view)."""
    from shardbound.compiler.driver import _tp_view, plan_model
    from shardbound.passes.manager import PassOptions
    from shardbound.passes.memory_plan import graph_shapes

    path = tmp_path_factory.mktemp("tpnet") / "tp_mlp2.onnx"
    onnx.save(zoo.build("tp_mlp2")[0], path)
    graph, _ = plan_model(str(path), PassOptions())
    return str(path), graph_shapes(graph), graph.output, _tp_view(graph, PassOptions())


def test_planner_offers_tp_where_the_network_has_zones(tp_net):
    """On 3 ranks tp's zone A-matrices (each rank's own neurons) fit a budget that fsdp's
    whole rows do not: the planner takes tp; a budget both fit goes to the smaller peak."""
    from shardbound.passes.manager import PassOptions
    from shardbound.passes.memory_budget import choose

    path, shapes, output, tp = tp_net
    assert tp.places                            # zones found

    def plan(budget, **kw):
        options = PassOptions(memory_budget=budget, nproc=3, nproc_given=True,
                              method="alpha-crown", **kw)
        return choose(shapes, output, options, source=path, tp=tp)

    got = plan(3 << 20)
    assert (got.mode, got.nproc, got.row_tile) == ("tp", 3, 0) and got.peak_bytes <= 3 << 20
    fsdp = plan(3 << 20, mode="fsdp", mode_given=True)
    assert fsdp.mode == "fsdp" and fsdp.peak_bytes > got.peak_bytes     # tp: the smaller peak
    assert choose(shapes, output, PassOptions(memory_budget=3 << 20, nproc=3, nproc_given=True,
                                              method="alpha-crown"), tp=None).mode == "fsdp"


def test_inspect_mode_tp_prints_the_prediction_or_refuses_in_one_line(tp_net, capsys):
    from shardbound.compiler.cli import main

    path = tp_net[0]
    for argv, code, first in (
            (["--memory-budget", "10MiB"], 0, "plan: --memory-budget 10.00MiB per rank -> tp P=1"),
            (["--memory-budget", "100KiB"], 2, f"error: {path}: no plan fits"),
            (["--memory-budget", "1GiB", "--method", "full-alpha-crown"], 0,
             "plan: --memory-budget 1.00GiB per rank -> tp P=1")):
        with pytest.raises(SystemExit) as e:
            main(["inspect", path, "--mode", "tp", *argv])
        captured = capsys.readouterr()
        assert e.value.code == code, (argv, captured.err)
        lines = (captured.out if code == 0 else captured.err).strip().splitlines()
        assert lines[-1].startswith(first), (argv, lines[-1])
        if code:
            assert len(lines) == 1


VNNLIB_3_ROWS = """(declare-const X_0 Real)\n(declare-const X_1 Real)\n(declare-const X_2 Real)
(declare-const X_3 Real)\n(declare-const X_4 Real)\n(declare-const X_5 Real)
(declare-const Y_0 Real)\n(declare-const Y_1 Real)\n(declare-const Y_2 Real)
(declare-const Y_3 Real)\n(declare-const Y_4 Real)
""" + "".join(f"(assert (>= X_{i} -0.1))\n(assert (<= X_{i} 0.1))\n" for i in range(6)) + \
    "(assert (or (and (>= Y_0 Y_1)) (and (>= Y_0 Y_2) (>= Y_0 Y_3))))\n"


def test_verify_plans_with_the_property_rows(mlp, monkeypatch, capsys):
    """verify --memory-budget hands the planner the property's C rows (here 1 + 2 stacked),
    and the planner predicts with them (not one row per output)."""
    from shardbound.compiler import driver
    from shardbound.compiler.cli import main
    from shardbound.compiler.errors import ShardboundError
    from shardbound.passes.manager import PassOptions
    from shardbound.passes.memory_budget import Candidate, choose, predict

    path, shapes, output, tmp = mlp
    prop = tmp / "three_rows.vnnlib"
    prop.write_text(VNNLIB_3_ROWS)
    seen = {}

    def compile_model(model, out, options, plan_out=None):
        seen["options"] = options
        raise ShardboundError("stop here")

    monkeypatch.setattr(driver, "compile_model", compile_model)
    with pytest.raises(SystemExit) as e:
        main(["verify", path, str(prop), "--memory-budget", "1GiB", "--quiet"])
    assert e.value.code == 2 and "stop here" in capsys.readouterr().err
    options = seen["options"]
    assert options.spec_rows == 3 and "full-alpha-crown" in options.plan_methods
    plan = choose(shapes, output, options, source=path)
    assert plan.spec_rows == 3 and "3 spec rows" in plan.text()
    cand = Candidate(plan.mode, plan.nproc, plan.row_tile or None,
                     plan.stream_chunk_kib * 1024)
    with_rows = predict(shapes, output, cand, options, plan.method, spec_rows=3)
    assert plan.peak_bytes == with_rows["peak_tracked_bytes"]
    assert with_rows != predict(shapes, output, cand, PassOptions(), plan.method)


def test_tp_run_over_its_budget_stops_before_allocating(tp_net, tmp_path):
    """The run-time guard predicts tp runs too (the largest rank's peak): a tp program run
    under a budget below its prediction stops before the first pass, naming the node."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.accounting.ledger import MemoryBudgetExceeded

    out = tmp_path / "tp_prog"
    compile_model(tp_net[0], str(out), PassOptions(mode="tp"))
    lo, hi = random_box(np.random.default_rng(2), (8,), 0.2)
    v = load(str(out), memory_budget=1 << 20)        # resident weights fit, CROWN does not
    with pytest.raises(MemoryBudgetExceeded) as e:
        v.bounds(lo, hi, method="crown")
    assert "this crown run needs" in str(e.value) and "stopped before allocating" in str(e.value)
    assert v.network.ledger.peak["a_matrix"] == 0


def test_a_verify_run_over_its_budget_stops_on_the_property_rows(program, mlp, capsys):
    """`run --verify SPEC` checks each case's own C rows against the budget before bounding."""
    from shardbound.compiler.cli import main
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.verification.spec import spec_from_property

    out, tmp = program[0], mlp[3]
    prop = tmp / "three_rows_run.vnnlib"
    prop.write_text(VNNLIB_3_ROWS)
    spec = tmp / "spec.json"
    spec.write_text(spec_from_property(parse_vnnlib(str(prop))).to_json())
    with pytest.raises(SystemExit) as e:
        main(["run", out, "--verify", str(spec), "--memory-budget", "6KiB", "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: memory budget exceeded: this crown run")
