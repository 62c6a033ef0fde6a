"""The op registry: one handler per (domain, ONNX op type, since_version).

A handler lowers one ONNX node into IR nodes through the `LoweringContext`. Handlers are found
by the schema version the model's opset selects (`onnx.defs.get_schema(op,
max_inclusive_version=opset).since_version`), so an op whose signature changed between opsets
(Squeeze's axes moved from an attribute to an input in opset 13) gets the right handler.
Each op family lives in its own module, named as its kernels' module under runtime/ops/
(linear, conv, pooling, activation, arithmetic, layout); importing this package registers
them all. Registering one (domain, op, version) twice is an error at import.
"""

from __future__ import annotations

from typing import Callable

import onnx

Handler = Callable[..., None]
_REGISTRY: dict[tuple[str, str], dict[int, Handler]] = {}
_CONSTANT_OUTPUT: set[tuple[str, str]] = set()


def register(op_type: str, since: int = 1, domain: str = "", constant_output: bool = False):
    """Register a handler for `op_type` from schema version `since` on. `constant_output`:
    the op's outputs are compile-time constants whatever its inputs (Shape, Constant), which
    the frontend's scan for unsupported ops needs to know."""
    if constant_output:
        _CONSTANT_OUTPUT.add((domain, op_type))

    def wrap(fn: Handler) -> Handler:
        versions = _REGISTRY.setdefault((domain, op_type), {})
        if since in versions:
            raise TypeError(f"{op_type} (domain {domain!r}) since opset {since} is registered "
                            f"twice: {versions[since].__module__}.{versions[since].__name__} and "
                            f"{fn.__module__}.{fn.__name__}")
        versions[since] = fn
        return fn

    return wrap


def supported_ops() -> list[str]:
    return sorted(op for (_, op) in _REGISTRY)


def has_constant_output(op_type: str, domain: str = "") -> bool:
    return (domain, op_type) in _CONSTANT_OUTPUT


def registered_versions() -> dict[tuple[str, str], tuple[int, ...]]:
    """(domain, op) -> the since-versions that have a handler (the op tests cover each)."""
    return {key: tuple(sorted(v)) for key, v in sorted(_REGISTRY.items())}


def find_handler(op_type: str, opset: int, domain: str = "") -> Handler | None:
    """The handler for this op at this opset, or None when the op is not supported."""
    versions = _REGISTRY.get((domain, op_type))
    if not versions:
        return None
    try:
        schema_version = onnx.defs.get_schema(op_type, max_inclusive_version=opset,
                                              domain=domain).since_version
    except Exception:  # unknown to this onnx build: use the newest handler we have
        schema_version = max(versions)
    usable = [v for v in versions if v <= schema_version]
    return versions[max(usable)] if usable else None


# Register every op family (imported for their side effect on _REGISTRY).
from shardbound.compiler.lowering import (activation, arithmetic, conv, layout, linear,  # noqa: E402,F401
                                           pooling, smooth)
