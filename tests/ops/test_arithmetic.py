"""The arithmetic family (runtime/ops/arithmetic.py, compiler/lowering/arithmetic.py):
constants on either side, broadcasting, sums of computed tensors, BatchNormalization."""

from __future__ import annotations

from conv_helpers import conv_net
from harness import OpCase, generate, sandwich


def _const_op(op, const_left=False):
    def apply(b, x, shape):
        n = shape[-1]
        c = b.const(b.rng.uniform(0.5, 1.5, (n,)) * (1 if op != "Sub" else -1))
        return b.op(op, [c, x] if const_left else [x, c]), shape
    return apply


def _residual(op):
    """x + relu(W x) (or x - ...): a sum of two computed tensors."""
    def apply(b, x, shape):
        n = shape[-1]
        h = b.relu(b.op("MatMul", [x, b.const(b.weight(n, n))]))
        return b.op(op, [x, h]), shape
    return apply


def _neg(b, x, shape):
    return b.op("Neg", [x]), shape


def _batchnorm(b, x, shape):
    c = shape[1]
    r = b.rng
    y = b.op("BatchNormalization", [x, b.const(r.uniform(0.5, 1.5, (c,))),
                                    b.const(r.normal(0, 0.1, (c,))), b.const(r.normal(0, 0.1, (c,))),
                                    b.const(r.uniform(0.5, 1.5, (c,)))], epsilon=1e-5)
    return y, shape


def _net(apply):
    return lambda rng, o: sandwich(rng, o, (6,), apply)


CASES = [
    OpCase("add_const", "Add", _net(_const_op("Add"))),
    OpCase("add_computed", "Add", _net(_residual("Add"))),
    OpCase("sub_const_right", "Sub", _net(_const_op("Sub"))),
    OpCase("sub_const_left", "Sub", _net(_const_op("Sub", const_left=True))),
    OpCase("sub_computed", "Sub", _net(_residual("Sub"))),
    OpCase("mul_const", "Mul", _net(_const_op("Mul", const_left=True))),
    OpCase("div_const", "Div", _net(_const_op("Div"))),
    OpCase("neg", "Neg", _net(_neg)),
    OpCase("batchnorm", "BatchNormalization",
           lambda rng, o: conv_net(rng, o, (2, 5, 5), _batchnorm), opsets=(9, 15),
           reference=False),     # onnx 1.23's reference BatchNormalization disagrees with the spec
]

generate(CASES, globals())
