"""The op registry: one handler per (domain, ONNX op type, since_version).

A handler lowers one ONNX node into IR nodes through the `LoweringContext`. Handlers are found
by the schema version the model's opset selects (`onnx.defs.get_schema(op,
max_inclusive_version=opset).since_version`), so an op whose signature changed between opsets
(Squeeze's axes moved from an attribute to an input in opset 13) gets the right handler.
Each op family lives in its own module, named as its kernels' module under runtime/ops/
(linear, conv, pooling, activation, arithmetic, layout, smooth, exponential, periodic, gated,
movement, reduction, normalization, discrete, constants); importing this package registers them all.
Registering one (domain, op, version) twice is an error at import.
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


_PRODUCTS: list[Handler] = []


def register_product(fn: Handler) -> Handler:
    """Register a lowering of `Mul(a, b)` for two computed tensors of a special form (x *
    sigmoid(x) -> silu, x * x -> pow, ...): `fn(ctx, node, a, b)` lowers the node and returns
    True, or returns False (emitting nothing) when the operands are not its form. The
    arithmetic family's Mul tries every registered one, in order, before it gives up; what a
    fused pattern leaves unused is dropped at the end of the import (frontend.py)."""
    _PRODUCTS.append(fn)
    return fn


def lower_product(ctx, node, a, b) -> bool:
    """Whether a registered product pattern lowered `Mul(a, b)` (a, b computed)."""
    return any(fn(ctx, node, a, b) for fn in _PRODUCTS)


_QUOTIENTS: list[Handler] = []


def register_quotient(fn: Handler) -> Handler:
    """Register a lowering of `Div(a, b)` with a computed divisor b of a special form (c / x
    is c * reciprocal(x), x / (1 + |x|) is softsign): `fn(ctx, node, a, b)` (a a constant
    array or computed) lowers the node and returns True, or returns False."""
    _QUOTIENTS.append(fn)
    return fn


def lower_quotient(ctx, node, a, b) -> bool:
    """Whether a registered quotient pattern lowered `Div(a, b)` (b computed)."""
    return any(fn(ctx, node, a, b) for fn in _QUOTIENTS)


_CONSTANT_ONLY: dict[tuple[str, str], str] = {}


def register_constant_only(op_types, why: str, domain: str = "") -> None:
    """Ops that shardbound evaluates only on constants (they are folded at compile time):
    applied to the network input they are discrete or dynamic, with no linear bound. `why`
    ends the unsupported-op message for a node whose input is computed."""
    for op in op_types:
        _CONSTANT_ONLY[(domain, op)] = why


def constant_only_reason(op_type: str, domain: str = "") -> str | None:
    return _CONSTANT_ONLY.get((domain, op_type))


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
from shardbound.compiler.lowering import (activation, arithmetic, bilinear, constants, conv,  # noqa: E402,F401
                                           discrete, exponential, gated, layout, linear, movement,
                                           normalization, periodic, pooling, reduction,
                                           smooth, softmax)
