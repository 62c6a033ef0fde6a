"""The arithmetic family (runtime/ops/arithmetic.py, compiler/lowering/arithmetic.py):
constants on either side, broadcasting (also when it grows the computed tensor), sums of
computed tensors and constants (Add, Sub, Sum), Where with a constant condition,
BatchNormalization."""

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


def _unfoldable_batchnorm(after):
    """BatchNorm between nonlinear ops, where canonicalize cannot fold it into a layer:
    Relu -> BN -> Relu, or (x + Relu(Conv x)) -> BN -> Relu (after an Add of two computed
    tensors). It stays a pointwise `affine` node."""
    def apply(b, x, shape):
        c = shape[1]
        if after == "relu":
            h = b.relu(x)
        else:
            w = b.const(b.weight(c, c, 3, 3))
            h = b.op("Add", [x, b.relu(b.op("Conv", [x, w], pads=[1, 1, 1, 1]))])
        y, _ = _batchnorm(b, h, shape)
        return b.relu(y), shape
    return apply


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
    OpCase("batchnorm_after_relu", "BatchNormalization",
           lambda rng, o: conv_net(rng, o, (2, 3, 3), _unfoldable_batchnorm("relu")),
           opsets=(15,), reference=False, boxes=("kinks",)),
    OpCase("batchnorm_after_add", "BatchNormalization",
           lambda rng, o: conv_net(rng, o, (2, 3, 3), _unfoldable_batchnorm("add")),
           opsets=(15,), reference=False, boxes=("wide",)),
]


# -- broadcasting that grows the computed tensor, Sum, Where (issue 14) ------------------------------
def _twice(shape, apply):
    from test_movement import twice

    return lambda rng, o: twice(rng, o, shape, lambda b, x, f: apply(b, x, f))


def _grow(op, left=False):
    """x (1, 2, 1, 4) op c (3, 4): the constant grows x to (1, 2, 3, 4)."""
    import numpy as np

    def apply(b, x, full):
        h = b.op("ReduceSum", [x, b.const(np.array([2], dtype=np.int64))], keepdims=1)
        c = b.const(b.rng.uniform(0.5, 1.5, (3, 4)))
        return b.op(op, [c, h] if left else [h, c])
    return apply


def _computed_broadcast(op):
    """x (1, 2, 3, 4) op its row sums (1, 2, 3, 1): two computed operands, one broadcast."""
    import numpy as np

    def apply(b, x, full):
        s = b.op("ReduceSum", [b.op("Relu", [x]), b.const(np.array([3], dtype=np.int64))])
        return b.op(op, [s, x] if op == "Sub" else [x, s])
    return apply


def _sum(b, x, full):
    import numpy as np

    r = b.op("Relu", [x])
    col = b.op("ReduceSum", [x, b.const(np.array([3], dtype=np.int64))])
    return b.op("Sum", [x, r, b.const(b.rng.normal(0, 1, (4,))), col, x])


def _sum_8(b, x, full):
    """Opset 8 (broadcasting Sum, ReduceSum's axes still an attribute)."""
    col = b.op("ReduceSum", [x], axes=[3])
    return b.op("Sum", [col, b.op("Relu", [x]), b.const(b.rng.normal(0, 1, (3, 1)))])


def _where(both_computed):
    def apply(b, x, full):
        c = b.const(b.rng.uniform(size=(3, 1)) > 0.4)
        other = b.op("Neg", [b.op("Relu", [x])]) if both_computed else \
            b.const(b.rng.normal(0, 1, (2, 1, 4)).astype("float32"))
        return b.op("Where", [c, x, other] if both_computed else [c, other, x])
    return apply


CASES += [
    OpCase("add_grows", "Add", _twice((2, 3, 4), _grow("Add", left=True))),
    OpCase("sub_grows", "Sub", _twice((2, 3, 4), _grow("Sub"))),
    OpCase("mul_grows", "Mul", _twice((2, 3, 4), _grow("Mul", left=True))),
    OpCase("div_grows", "Div", _twice((2, 3, 4), _grow("Div"))),
    OpCase("add_computed_broadcast", "Add", _twice((2, 3, 4), _computed_broadcast("Add"))),
    OpCase("sub_computed_broadcast", "Sub", _twice((2, 3, 4), _computed_broadcast("Sub"))),
    OpCase("sum", "Sum", _twice((2, 3, 4), _sum), opsets=(13,)),
    OpCase("sum_8", "Sum", _twice((2, 3, 4), _sum_8), opsets=(8,)),
    OpCase("where_computed", "Where", _twice((2, 3, 4), _where(True)), opsets=(9, 16)),
    OpCase("where_constant_operand", "Where", _twice((2, 3, 4), _where(False))),
]

generate(CASES, globals())


def test_unfoldable_batchnorm_stays_a_pointwise_affine():
    """After a ReLU or an Add of two computed tensors (and before a ReLU) a BatchNorm has no
    layer to fold into: it is one `affine` node between them, in every use."""
    from harness import compiled

    for case in CASES:
        if not case.name.startswith("batchnorm_after"):
            continue
        net = compiled(case, case.opsets[0])[0].network
        kinds = {n.name: n.kind for n in net.nodes}
        found = [n for n in net.nodes if n.kind == "affine"
                 and kinds[n.inputs[0]] in ("relu", "add")]
        assert len(found) == 2, (case.name, [(n.kind, n.inputs) for n in net.nodes])
        assert all(n.params["scale"].shape[0] == n.shape[0] for n in found)
