"""The op registry: one handler per (domain, ONNX op type, since_version).

A handler lowers one ONNX node into IR nodes through the `LoweringContext`. Handlers are found
by the schema version the model's opset selects (`onnx.defs.get_schema(op,
max_inclusive_version=opset).since_version`), so an op whose signature changed between opsets
(Squeeze's axes moved from an attribute to an input in opset 13) gets the right handler.
Each op family lives in its own module; importing this package registers them all.
"""

from __future__ import annotations

from typing import Callable

import onnx

Handler = Callable[..., None]
_REGISTRY: dict[tuple[str, str], dict[int, Handler]] = {}


def register(op_type: str, since: int = 1, domain: str = ""):
    """Register a handler for `op_type` from schema version `since` on."""

    def wrap(fn: Handler) -> Handler:
        _REGISTRY.setdefault((domain, op_type), {})[since] = fn
        return fn

    return wrap


def supported_ops() -> list[str]:
    return sorted(op for (_, op) in _REGISTRY)


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
from shardbound.compiler.lowering import linear, elementwise, layout, conv  # noqa: E402,F401
