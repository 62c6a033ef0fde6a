"""Every registered lowering (op, since-version) has a case in some tests/ops/test_<family>.py,
and every kernel kind is registered once with the traits the rest of the system reads."""

from __future__ import annotations

import glob
import importlib
import os

import onnx
import pytest

from shardbound.compiler import lowering
from shardbound.runtime.ops import OP_TYPES, Op, register_op

HERE = os.path.dirname(__file__)
FAMILY_FILES = sorted(glob.glob(os.path.join(HERE, "test_*.py")))


def _all_cases():
    cases = []
    for path in FAMILY_FILES:
        name = os.path.splitext(os.path.basename(path))[0]
        if name == "test_coverage":
            continue
        cases += getattr(importlib.import_module(name), "CASES", [])
    return cases


def _handler_version(op: str, opset: int) -> int | None:
    versions = lowering._REGISTRY.get(("", op), {})
    schema = onnx.defs.get_schema(op, max_inclusive_version=opset).since_version
    usable = [v for v in versions if v <= schema]
    return max(usable) if usable else None


def test_every_registered_op_version_has_a_case():
    covered = {(c.op, _handler_version(c.op, o)) for c in _all_cases() for o in c.opsets}
    missing = [(op, v) for (domain, op), versions in lowering.registered_versions().items()
               for v in versions if (op, v) not in covered]
    assert not missing, f"registered lowerings without an op test case: {missing}"


def test_family_files_match_kernel_modules():
    """Each lowering family module has a kernel module of the same name (or lowers to another
    family's kernels) and a test file."""
    families = {os.path.splitext(os.path.basename(p))[0] for p in
                glob.glob(os.path.join(os.path.dirname(lowering.__file__), "*.py"))} - {"__init__"}
    tests = {os.path.basename(p)[len("test_"):-3] for p in FAMILY_FILES}
    assert families <= tests, f"families without tests/ops/test_<family>.py: {families - tests}"


def test_registering_a_kind_twice_is_an_error():
    class Again(Op):
        kind = "relu"

    with pytest.raises(TypeError, match="registered twice"):
        register_op(Again)
    assert OP_TYPES["relu"].__name__ == "Relu"


def test_registering_a_lowering_twice_is_an_error():
    with pytest.raises(TypeError, match="registered twice"):
        lowering.register("Relu", since=1)(lambda ctx, node: None)


def test_relaxed_kernels_implement_the_interface():
    for kind, cls in OP_TYPES.items():
        if cls.relaxed:
            assert cls.backward_memory == "separate", kind
        if cls.has_alpha or cls.splittable:
            assert cls.relaxed, f"{kind}: alpha and splits need a relaxation"
