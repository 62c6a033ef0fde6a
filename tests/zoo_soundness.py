"""Models of the ops `--soundness real|float32` covered last (issue 17: the discrete family,
LayerNorm, Softmax). In no zoo-wide dict: tests/test_soundness_modes_ops.py and
bench/soundness_modes.py name them; tests/zoo.py registers them in SOUNDNESS_ZOO."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto


def _builder(rng, shape, **kw):
    from zoo import Builder     # here, not at import: tests/zoo.py imports this module

    return Builder(rng, shape, **kw)


def discrete_mix(rng):
    """Gemm -> Floor, Round, Cast int32, Where(Less), And, Equal, ArgMax, OneHot(ArgMin) ->
    Concat -> Gemm."""
    b = _builder(rng, (4,))
    h = b.gemm("x", 4, 6)
    two = b.op("Mul", [h, b.const(np.float32(2.0))])
    fl = b.op("Floor", [b.op("Mul", [h, b.const(np.float32(1.5))])])
    rd = b.op("Round", [h])
    ci = b.op("Cast", [b.op("Cast", [two], to=TensorProto.INT32)], to=TensorProto.FLOAT)
    wh = b.op("Where", [b.op("Less", [h, b.const(np.float32(0.1))]), h, two])
    lg = b.op("Cast", [b.op("And", [b.op("Less", [h, b.const(np.float32(0.3))]),
                                    b.op("Greater", [h, b.const(np.float32(-0.2))])])],
              to=TensorProto.FLOAT)
    eq = b.op("Cast", [b.op("Equal", [fl, rd])], to=TensorProto.FLOAT)
    am = b.op("Cast", [b.op("ArgMax", [h], axis=1, keepdims=1)], to=TensorProto.FLOAT)
    oh = b.op("OneHot", [b.op("ArgMin", [h], axis=1, keepdims=0),
                         b.const(np.array(6, np.int64)),
                         b.const(np.array([-1.0, 2.0], np.float32))],
              axis=-1)
    cat = b.op("Concat", [fl, rd, ci, wh, lg, eq, am, oh], axis=1)
    return b.build(b.gemm(cat, 43, 3)), b.input_shape


def norm_softmax_mlp(rng):
    """Gemm -> LayerNorm -> Gemm -> Softmax -> Gemm, and a LogSoftmax beside it."""
    b = _builder(rng, (4,), opset=17)
    h = b.gemm("x", 4, 6)
    h = b.op("LayerNormalization", [h, b.const(rng.uniform(0.5, 1.5, (6,)).astype(np.float32)),
                                    b.const(rng.normal(0, .1, (6,)).astype(np.float32))], axis=-1)
    h = b.gemm(h, 6, 5)
    s = b.gemm(b.op("Softmax", [h], axis=-1), 5, 2)
    t = b.gemm(b.op("LogSoftmax", [h], axis=-1), 5, 2)
    return b.build(b.op("Concat", [s, t], axis=1)), b.input_shape

