"""verify's default memory budget: the reader of the available memory, the plan it makes
when the machine is small (row tiles in the mode asked for: the same bits and verdict), the
one-line error when nothing fits, `--memory-budget none`, and branch and bound's batches
under the same ceiling.

The machine is made small in process (the reader `available.available_memory` is
monkeypatched); the reader itself reads files given as paths, never this machine's.
"""

from __future__ import annotations

import json

import onnx
import pytest
import torch

import zoo
from test_verify import _verify_in_process
from shardbound.runtime.accounting import available
from shardbound.runtime.accounting.available import Available


MEMINFO = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:    8000000 kB
Buffers:           10000 kB
"""


def test_meminfo_parses_memavailable():
    assert available.parse_meminfo(MEMINFO) == 8000000 * 1024
    assert available.parse_meminfo("MemTotal: 5 kB\n") is None


def _cgroup(tmp_path, version, limit, usage, stat, path="/job/step"):
    """A /proc/self/cgroup file and a cgroup tree under tmp_path (the job's group limited,
    its parent not)."""
    proc = tmp_path / f"cgroup_{version}"
    if version == "v2":
        proc.write_text(f"0::{path}\n")
        names = ("memory.max", "memory.current")
    else:
        proc.write_text(f"12:cpu,cpuacct:/\n4:memory:{path}\n")
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    root = tmp_path / version
    leaf = root / path.strip("/")
    leaf.mkdir(parents=True)
    (leaf / names[0]).write_text(f"{limit}\n")
    (leaf / names[1]).write_text(f"{usage}\n")
    (leaf / "memory.stat").write_text(stat)
    parent = leaf.parent
    (parent / names[0]).write_text("max\n" if version == "v2" else "9223372036854771712\n")
    (parent / names[1]).write_text("1\n")
    return str(proc), str(root)


def test_cgroup_headroom_v2_and_v1_from_files(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    proc, root = _cgroup(tmp_path, "v2", 3 << 30, 2 << 30, "anon 5\ninactive_file 1073741824\n")
    got = available.available_memory(str(meminfo), proc, v2_root=root, v1_root="/nonexistent")
    assert got.bytes == 2 << 30 and got.source.startswith("cgroup v2 ")    # 3 - (2 - 1) GiB
    proc, root = _cgroup(tmp_path, "v1", 1 << 30, 1 << 29, "total_inactive_file 0\n")
    got = available.available_memory(str(meminfo), proc, v2_root="/nonexistent", v1_root=root)
    assert got.bytes == 1 << 29 and got.source.startswith("cgroup v1 ")
    # no limit set: MemAvailable decides
    (tmp_path / "v1" / "job" / "step" / "memory.limit_in_bytes").write_text(
        "9223372036854771712\n")
    got = available.available_memory(str(meminfo), proc, v2_root="/nonexistent", v1_root=root)
    assert got == Available(8000000 * 1024, "MemAvailable")
    assert available.available_memory("/nonexistent", "/nonexistent") is None
    budget = available.default_budget(2, reader=lambda: got)
    assert budget.per_rank == int(got.bytes * available.DEFAULT_FRACTION) // 2
    assert "MemAvailable" in budget.describe() and "2 ranks" in budget.describe()


VNNLIB_3_ROWS = "".join(f"(declare-const X_{i} Real)\n" for i in range(6)) + "".join(
    f"(declare-const Y_{j} Real)\n" for j in range(5)) + "".join(
    f"(assert (>= X_{i} -0.1))\n(assert (<= X_{i} 0.1))\n" for i in range(6)) + \
    "(assert (or (and (>= Y_0 Y_1)) (and (>= Y_0 Y_2) (>= Y_0 Y_3))))\n"


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memdefault")
    model, _ = zoo.build("mlp")
    path = tmp / "mlp.onnx"
    onnx.save(model, path)
    prop = tmp / "p.vnnlib"
    prop.write_text(VNNLIB_3_ROWS)
    return str(path), str(prop), tmp


def _verify(args):
    r = _verify_in_process(args)
    return r.returncode, r.stdout, r.stderr


def _small_machine(monkeypatch, budget_bytes: int):
    """The machine as the default budget sees it: `budget_bytes` per rank."""
    free = int(budget_bytes / available.DEFAULT_FRACTION) + 1
    monkeypatch.setattr(available, "available_memory", lambda: Available(free, "MemAvailable"))


def test_small_machine_plans_row_tiles_with_the_same_bits_and_verdict(mlp, monkeypatch):
    """The zoo MLP's verify plan predicts 25.6 KB whole, 13.6 KB in tiles of 8 rows: on a
    machine whose default budget is 16 KB, verify compiles tiles of 8 (single mode, P=1, as
    asked), and the program bounds bit for bit as the untiled one, with the same verdict."""
    from shardbound.runtime import load

    path, prop, tmp = mlp
    common = [path, prop, "--summation", "blocked", "--timeout", "60"]
    code, whole_out, _ = _verify([*common, "-o", str(tmp / "whole"), "--memory-budget",
                                  "none", "--json", str(tmp / "whole.json")])
    assert code == 0
    assert "plan" not in json.loads((tmp / "whole.json").read_text())
    _small_machine(monkeypatch, 16000)
    code, tiled_out, err = _verify([*common, "-o", str(tmp / "tiled"),
                                    "--json", str(tmp / "tiled.json")])
    assert code == 0, err
    plan = json.loads((tmp / "tiled.json").read_text())["plan"]
    assert plan["row_tile"] == 8 and plan["changed"] and plan["mode"] == "single"
    assert plan["budget_bytes"] == 16000 and "MemAvailable" in plan["source"]
    assert err.startswith("plan: memory budget 15.62KiB per rank (default: 50% of MemAvailable")
    tiled_plan = json.loads((tmp / "tiled" / "plan.json").read_text())
    assert tiled_plan["row_tile"] == 8 and "memory_budget_bytes" not in tiled_plan
    assert whole_out.splitlines()[0] == tiled_out.splitlines()[0]
    whole, tiled = load(str(tmp / "whole")), load(str(tmp / "tiled"))
    assert whole.network.row_tile is None and tiled.network.row_tile == 8
    lo, hi = -0.1 * torch.ones(6), 0.1 * torch.ones(6)
    for method in ("crown", "alpha-crown"):
        a, b = whole.bounds(lo, hi, method=method), tiled.bounds(lo, hi, method=method)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), method


def test_a_machine_too_small_for_one_row_tile_is_the_one_line_error(mlp, monkeypatch):
    path, prop, tmp = mlp
    _small_machine(monkeypatch, 2000)
    code, out, err = _verify([path, prop, "--quiet"])
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: no plan fits the memory "
                                                   "budget 1.95KiB per rank (default: 50% of")
    assert "--memory-budget none" in lines[0] and "smallest predicted peak" in lines[0]


def test_branch_and_bound_batches_shrink_under_the_ceiling(mlp, monkeypatch):
    """ReLU splitting's batch is halved below MIN_BATCH (down to 1) where its round passes
    the default budget, and kept where it fits; input splitting's likewise. (And `run
    --memory-budget none` enforces no budget, not even the planned one.)"""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.verification import batch_memory as bm

    path, _, tmp = mlp
    out = tmp / "planned"
    compile_model(path, str(out), PassOptions(memory_budget=1 << 30))
    assert load(str(out), memory_budget=0).network.ledger.budget is None   # run ... none
    net = load(str(out)).network
    assert net.ledger.budget == 1 << 30
    roomy = bm.batch_for_memory(net, 3, 1 << 30, ceiling=None)
    assert roomy == bm.MAX_BATCH and bm.batch_for_memory(net, 3, 1 << 30) == roomy
    one, slope = bm._crown_slope(net, 3)
    tight = one + 2 * slope * bm.BETA_MEMORY_FACTOR
    assert bm.batch_for_memory(net, 3, 1 << 30, ceiling=tight) == 2
    assert bm.batch_for_memory(net, 3, 1 << 30, ceiling=1) == 1
    assert bm.input_batch_for_memory(net, 3, 512, ceiling=one + 63 * slope) == 64
    _small_machine(monkeypatch, tight)                 # the default ceiling reads the machine
    assert bm.batch_for_memory(net, 3, 1 << 30) == 2
    net.default_budget = False                         # --memory-budget none
    assert bm.batch_for_memory(net, 3, 1 << 30) == roomy
