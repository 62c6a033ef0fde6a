"""Shared fixtures: compiling zoo models into temporary program directories."""

from __future__ import annotations

import os
import sys

import shardbound  # noqa: F401  (first: sets MKL_CBWR before any BLAS call)
import numpy as np
import onnx
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import zoo  # noqa: E402

SHARED = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                       "benchmarks"))


def shared_path(*parts) -> str:
    """A file under ../shared/benchmarks, or a clean skip when it is not there."""
    path = os.path.join(SHARED, *parts)
    if not os.path.exists(path):
        pytest.skip(f"shared benchmark {os.path.join(*parts)} not present")
    return path


@pytest.fixture
def compile_zoo(tmp_path):
    """compile_zoo(name, **options) -> (verifier, onnx model, model path)."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    def make(name, seed=0, **options):
        model, _ = zoo.build(name, seed)
        path = tmp_path / f"{name}.onnx"
        onnx.save(model, path)
        out = tmp_path / f"{name}_prog"
        compile_model(str(path), str(out), PassOptions(**options))
        return load(str(out)), model, str(path)

    return make


def random_box(rng, shape, radius=0.1, center_scale=1.0):
    center = rng.uniform(-center_scale, center_scale, size=shape).astype(np.float32)
    r = rng.uniform(0.2 * radius, radius, size=shape).astype(np.float32)
    return center - r, center + r


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Work units for `pytest -n 2 --dist loadgroup` (pyproject.toml addopts): every test file
    is a group of its own (its module fixtures, such as compiled programs and whole multi-rank
    jobs, built once), unless its tests name a group themselves (`xdist_group`: files that
    share a process-level cache, such as multirank.fsdp_zoo_runs). Measured on 2 idle cores:
    one serial group for every multi-rank test made that group the critical path (487 s
    against 470 s for no groups at all). tryfirst: xdist's worker adds the group to each test's
    id in its own collection hook, which would otherwise run before this one and see no group
    (every test was then handed out alone, its file's module fixtures built on both
    workers)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
