"""The activation family (runtime/ops/activation.py, compiler/lowering/activation.py)."""

from __future__ import annotations

from harness import OpCase, generate, sandwich


def _unary(op, **attrs):
    def apply(b, x, shape):
        return b.op(op, [x], **attrs), shape
    return apply


CASES = [
    OpCase("relu", "Relu", lambda rng, o: sandwich(rng, o, (8,), _unary("Relu")), opsets=(8, 14)),
]

generate(CASES, globals())
