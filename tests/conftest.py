"""Shared fixtures: compiling zoo models into temporary program directories."""

from __future__ import annotations

import os
import sys

# One intra-op thread per test process unless the caller says otherwise: the suite runs two
# xdist workers (and rank jobs) on a 2-core machine, where torch's default of one thread per
# core in each worker oversubscribed the cores (OpenMP workers spinning beside the other
# worker): 7% of the wall time on tests/ops + test_verify_fsdp, 9% of a lone test_sound run.
# Tests about thread counts set them themselves (torch.set_num_threads, the jobs' "threads").
os.environ.setdefault("OMP_NUM_THREADS", "1")

import shardbound  # noqa: E402,F401  (first: sets MKL_CBWR before any BLAS call)
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import zoo  # noqa: E402
from shardbound.runtime.program.allocator import keep_freed_memory  # noqa: E402

# As a run does (dist.rank_session): the in-process bounds reuse freed memory instead of
# page-faulting it in again (test_gated 37.9 -> 35.1 CPU s, session 12). Children that test
# glibc's default (tests/test_allocator.py) are fresh processes with their own settings.
keep_freed_memory()

SHARED = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                       "benchmarks"))


def shared_path(*parts) -> str:
    """A file under ../shared/benchmarks, or a clean skip when it is not there."""
    path = os.path.join(SHARED, *parts)
    if not os.path.exists(path):
        pytest.skip(f"shared benchmark {os.path.join(*parts)} not present")
    return path


def compile_onnx_in(directory, model, name="m", **options):
    """onnx `model` saved as `directory`/`name`.onnx and compiled beside it with the pass
    options given, loaded: (verifier, model path). Module fixtures call it with their own
    folder (a pathlib.Path)."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    path = directory / f"{name}.onnx"
    onnx.save(model, path)
    out = directory / f"{name}_prog"
    compile_model(str(path), str(out), PassOptions(**options))
    return load(str(out)), str(path)


def networks_by_order(tmp_path_factory, tag, model, orders=("blocked", "fast")) -> dict:
    """{summation order: the loaded Network} of `model` compiled once per order in a new
    folder `tag` (module fixtures that compare the orders' bits)."""
    tmp = tmp_path_factory.mktemp(tag)
    return {order: compile_onnx_in(tmp, model, order, summation=order)[0].network
            for order in orders}


def compile_zoo_in(directory, name, seed=0, **options):
    """zoo model `name` saved and compiled under `directory` (a pathlib.Path), loaded:
    (verifier, onnx model, model path). Module fixtures call it with their own folder."""
    model, _ = zoo.build(name, seed)
    verifier, path = compile_onnx_in(directory, model, name, **options)
    return verifier, model, path


@pytest.fixture
def compile_zoo(tmp_path):
    """compile_zoo(name, seed=0, **options) -> (verifier, onnx model, model path)."""
    def make(name, seed=0, **options):
        return compile_zoo_in(tmp_path, name, seed, **options)

    return make


def random_box(rng, shape, radius=0.1, center_scale=1.0):
    center = rng.uniform(-center_scale, center_scale, size=shape).astype(np.float32)
    r = rng.uniform(0.2 * radius, radius, size=shape).astype(np.float32)
    return center - r, center + r


# The heaviest groups, heaviest first (CPU seconds, the test process's and its children's, in
# a run of the whole suite, session 12, before these groups' rank jobs were merged; the rest
# follow in collection order). xdist hands the groups out in collection order (pyproject.toml:
# --no-loadscope-reorder; its default, most tests first, put these groups of few but long
# tests last, where one could run alone on one worker for minutes after the others had
# finished: test_verify.py, unlisted, started at 868 s of 962 and ended the run). Most of them
# start rank jobs or CLI processes; a name that no longer matches only loses its place.
HEAVY_FIRST = (
    "tests/test_op_zoo.py",             # ~183 s
    "tp_jobs",                          # ~185 (test_tp.py and test_verify_tp.py)
    "fsdp_zoo",                         # ~200 (test_fsdp, test_determinism, test_verify_fsdp,
                                        #       test_streaming)
    "tests/test_verify.py",             # ~54 (CLI processes)
    "tests/ops/test_exponential.py",    # ~39
    "tests/ops/test_movement.py",       # ~33
    "tests/ops/test_smooth_widths.py",  # ~29
    "tests/ops/test_activation.py",     # ~29
    "tests/ops/test_gated.py",          # ~28
    "tests/test_budget.py",             # ~26 (and mostly waiting: 6 tests of 10-20 s each)
    "tests/test_cli_errors.py",         # ~22
    "tests/test_zoo_soundness.py",      # ~21
    "tests/test_torch_export.py",       # ~20
)


def _group(item) -> str:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return item.nodeid.split("::")[0]
    return marker.args[0] if marker.args else marker.kwargs.get("name", "default")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Work units for `pytest -n 3 --dist loadgroup` (pyproject.toml addopts): every test file
    is a group of its own (its module fixtures, such as compiled programs and whole multi-rank
    jobs, built once), unless its tests name a group themselves (`xdist_group`: files that
    share a process-level cache, such as multirank.fsdp_zoo_runs). Measured on 2 idle cores:
    one serial group for every multi-rank test made that group the critical path (487 s
    against 470 s for no groups at all). tryfirst: xdist's worker adds the group to each test's
    id in its own collection hook, which would otherwise run before this one and see no group
    (every test was then handed out alone, its file's module fixtures built on both
    workers). The groups are then ordered HEAVY_FIRST (each group's tests stay together and
    in their order)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_group(item), i)
    order = {id(item): (rank.get(_group(item), len(rank)), first_seen[_group(item)], i)
             for i, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])
