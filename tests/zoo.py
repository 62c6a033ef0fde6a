"""The test zoo: small ONNX models built in code (onnx.helper), one per feature we support.

Every builder takes a numpy Generator and returns (model, input_shape_without_batch). Weights
are random but fixed by the generator's seed, so tests are repeatable.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 13


class Builder:
    """A tiny graph builder: named initializers and nodes, one float input and output."""

    def __init__(self, rng: np.random.Generator, input_shape, opset: int = OPSET):
        self.rng = rng
        self.input_shape = tuple(input_shape)
        self.opset = opset
        self.nodes, self.inits = [], []
        self.count = 0
        self.last = "x"

    def const(self, array, name=None) -> str:
        self.count += 1
        name = name or f"c{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32)
                                                  if np.asarray(array).dtype.kind == "f"
                                                  else np.asarray(array), name))
        return name

    def op(self, op_type, inputs, name=None, n_out=1, **attrs) -> str:
        self.count += 1
        outs = [f"t{self.count}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs,
                                           name=name or f"{op_type.lower()}{self.count}", **attrs))
        self.last = outs[0]
        return outs[0]

    def weight(self, *shape, scale=None):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        scale = scale if scale is not None else 1.0 / np.sqrt(fan_in)
        return self.rng.normal(0, scale, size=shape).astype(np.float32)

    def gemm(self, x, n_in, n_out, **attrs):
        transB = attrs.get("transB", 1)
        w = self.weight(n_out, n_in) if transB else self.weight(n_in, n_out)
        b = self.rng.normal(0, 0.1, size=(n_out,)).astype(np.float32)
        return self.op("Gemm", [x, self.const(w), self.const(b)], transB=transB,
                       **{k: v for k, v in attrs.items() if k != "transB"})

    def relu(self, x):
        return self.op("Relu", [x])

    def build(self, out=None, input_name="x") -> onnx.ModelProto:
        out = out or self.last
        x = helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [1, *self.input_shape])
        probe = helper.make_graph(self.nodes, "zoo", [x], [], self.inits)
        probe_model = helper.make_model(probe, opset_imports=[helper.make_opsetid("", self.opset)])
        inferred = onnx.shape_inference.infer_shapes(probe_model).graph.value_info
        shapes = {v.name: v for v in inferred}
        y = shapes[out] if out in shapes else helper.make_tensor_value_info(out, TensorProto.FLOAT, [1])
        graph = helper.make_graph(self.nodes, "zoo", [x], [y], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def mlp(rng, sizes=(6, 20, 20, 5)):
    b = Builder(rng, (sizes[0],))
    x = "x"
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        x = b.gemm(x, n_in, n_out)
        if i < len(sizes) - 2:
            x = b.relu(x)
    return b.build(x), b.input_shape


def mlp_matmul_add(rng):
    """MatMul + Add (as torch exports nn.Linear in some opsets), Gemm alpha/beta/transB=0."""
    b = Builder(rng, (1, 8))
    h = b.op("MatMul", ["x", b.const(b.weight(8, 16))])
    h = b.op("Add", [h, b.const(rng.normal(0, 0.1, (16,)))])
    h = b.relu(b.op("Flatten", [h], axis=1))
    h = b.gemm(h, 16, 12, transB=0, alpha=0.7, beta=1.3)
    h = b.relu(h)
    return b.build(b.gemm(h, 12, 4)), b.input_shape


def normalized_mlp(rng):
    """Input normalisation Sub/Div in front of an MLP (folded by canonicalize)."""
    b = Builder(rng, (10,))
    h = b.op("Sub", ["x", b.const(rng.uniform(-0.5, 0.5, (10,)))])
    h = b.op("Div", [h, b.const(rng.uniform(0.5, 2.0, (10,)))])
    h = b.relu(b.gemm(h, 10, 16))
    return b.build(b.gemm(h, 16, 3)), b.input_shape


def cnn_batchnorm(rng):
    """Conv (pads, strides) + BatchNorm + Relu, a second conv, Flatten, Gemm."""
    b = Builder(rng, (2, 8, 8))
    h = b.op("Sub", ["x", b.const(rng.uniform(0, 0.3, (1, 2, 1, 1)))])
    h = b.op("Div", [h, b.const(rng.uniform(0.5, 1.5, (1, 2, 1, 1)))])
    h = b.op("Conv", [h, b.const(b.weight(4, 2, 3, 3)), b.const(rng.normal(0, 0.1, (4,)))],
             pads=[1, 1, 1, 1], strides=[1, 1])
    h = b.op("BatchNormalization", [h, b.const(rng.uniform(0.5, 1.5, (4,))),
                                    b.const(rng.normal(0, 0.1, (4,))),
                                    b.const(rng.normal(0, 0.1, (4,))),
                                    b.const(rng.uniform(0.5, 1.5, (4,)))], epsilon=1e-5)
    h = b.relu(h)
    h = b.op("Conv", [h, b.const(b.weight(3, 4, 3, 3))], pads=[0, 1, 1, 0], strides=[2, 2],
             dilations=[1, 1])
    h = b.relu(h)
    h = b.op("Flatten", [h], axis=1)
    return b.build(b.gemm(h, 3 * 4 * 4, 5)), b.input_shape


def cnn_avgpool(rng):
    """Dilated conv, AveragePool with padding excluded from the count, GlobalAveragePool."""
    b = Builder(rng, (1, 9, 9))
    h = b.op("Conv", ["x", b.const(b.weight(3, 1, 3, 3)), b.const(rng.normal(0, 0.1, (3,)))],
             pads=[2, 2, 2, 2], dilations=[2, 2])
    h = b.relu(h)
    h = b.op("AveragePool", [h], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
             count_include_pad=0)
    h = b.op("Conv", [h, b.const(b.weight(4, 3, 2, 2))], strides=[1, 1])
    h = b.relu(h)
    h = b.op("AveragePool", [h], kernel_shape=[2, 2], strides=[2, 2])
    g = b.op("GlobalAveragePool", [h])
    h = b.op("Flatten", [g], axis=1)
    return b.build(b.gemm(h, 4, 3)), b.input_shape


def residual(rng):
    """A residual block: y = relu(x1 + W2 relu(W1 x1)), with a Sub of computed tensors too."""
    b = Builder(rng, (8,))
    x1 = b.relu(b.gemm("x", 8, 12))
    h = b.relu(b.gemm(x1, 12, 12))
    h = b.gemm(h, 12, 12)
    s = b.relu(b.op("Add", [x1, h]))
    t = b.gemm(s, 12, 12)
    d = b.relu(b.op("Sub", [t, s]))
    return b.build(b.gemm(d, 12, 4)), b.input_shape


def layout_ops(rng):
    """Reshape, Unsqueeze/Squeeze (opset 13 inputs), Transpose, Identity, Dropout, Neg, Mul,
    Constant and a constant subgraph (Shape -> Gather -> Concat) feeding Reshape."""
    b = Builder(rng, (3, 4))
    h = b.op("Transpose", ["x"], perm=[0, 2, 1])                       # (1, 4, 3)
    h = b.op("Unsqueeze", [h, b.const(np.array([1], dtype=np.int64))])  # (1, 1, 4, 3)
    h = b.op("Identity", [h])
    h = b.op("Squeeze", [h, b.const(np.array([1], dtype=np.int64))])    # (1, 4, 3)
    shape = b.op("Shape", [h])
    first = b.op("Gather", [shape, b.const(np.array([0], dtype=np.int64))], axis=0)
    target = b.op("Concat", [first, b.const(np.array([-1], dtype=np.int64))], axis=0)
    h = b.op("Reshape", [h, target])                                    # (1, 12)
    h = b.op("Dropout", [h])
    h = b.op("Neg", [h])
    k = b.op("Constant", [], value=numpy_helper.from_array(
        rng.uniform(0.5, 1.5, (12,)).astype(np.float32)))
    h = b.op("Mul", [h, k])
    h = b.relu(b.gemm(h, 12, 10))
    return b.build(b.gemm(h, 10, 4)), b.input_shape


def old_style_opset8(rng):
    """Initializers also listed as graph inputs (like the ACAS Xu files), opset 8."""
    model, shape = mlp(rng, sizes=(5, 10, 10, 5))
    model.opset_import[0].version = 8
    for init in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(
            init.name, init.data_type, list(init.dims)))
    model.ir_version = 3
    onnx.checker.check_model(model)
    return model, shape


def tp_linear_zone(rng):
    """One tp zone with no ReLU between its column and row layer (600 hidden: 3 blocks)."""
    b = Builder(rng, (8,))
    h = b.gemm("x", 8, 600)
    h = b.relu(b.gemm(h, 600, 16))
    return b.build(b.gemm(h, 16, 4)), b.input_shape


def tp_mlp(rng, zones=1, hidden=520, width=24, n_in=8, n_out=4):
    """`zones` Megatron zones: (n_in or width) -> hidden -> ReLU -> width (-> ReLU between
    zones); 520 hidden neurons are 3 blocks of 256, so P = 2, 3, 4 split them unevenly and
    P = 4 leaves a rank without any."""
    b = Builder(rng, (n_in,))
    h, k = "x", n_in
    for z in range(zones):
        h = b.relu(b.gemm(h, k, hidden))
        out = width if z < zones - 1 else n_out
        h = b.gemm(h, hidden, out)
        if z < zones - 1:
            h = b.relu(h)
        k = out
    return b.build(h), b.input_shape


def tp_cnn(rng, channels=260, side=3):
    """A conv zone: Conv 1 -> 260 channels, ReLU, Conv 260 -> 3 channels (row), then a
    replicated ReLU, Flatten, Gemm; the input is side x side."""
    b = Builder(rng, (1, side, side))
    h = b.op("Conv", ["x", b.const(b.weight(channels, 1, 3, 3)),
                      b.const(rng.normal(0, 0.1, (channels,)))], pads=[1, 1, 1, 1])
    h = b.relu(h)
    h = b.op("Conv", [h, b.const(b.weight(3, channels, 2, 2)), b.const(rng.normal(0, 0.1, (3,)))])
    h = b.relu(h)
    h = b.op("Flatten", [h], axis=1)
    return b.build(b.gemm(h, 3 * (side - 1) ** 2, 3)), b.input_shape


def tp_relu_input(rng, n_in=8, hidden=1024, width=24, n_out=4):
    """A ReLU on the input, then one zone (n_in -> hidden -> ReLU -> width) and a replicated
    ReLU: the zone's column node has a relaxed op upstream but no zone, so full alpha-CROWN
    optimises its rows on local rows (each rank its own neurons' rows and alphas); 1024
    hidden neurons are 4 blocks, one per rank on P = 4, so the gradient through the row layer
    must be reduced in the pair tree, not in rank order."""
    b = Builder(rng, (n_in,))
    h = b.relu(b.gemm(b.relu("x"), n_in, hidden))
    h = b.relu(b.gemm(h, hidden, width))
    return b.build(b.gemm(h, width, n_out)), b.input_shape


TP_ZOO = {
    "tp_linear_zone": tp_linear_zone,
    "tp_relu_input": tp_relu_input,
    "tp_mlp1": lambda rng: tp_mlp(rng, 1, hidden=1024),
    "tp_mlp2": lambda rng: tp_mlp(rng, 2),
    "tp_mlp3": lambda rng: tp_mlp(rng, 3),
    "tp_cnn": tp_cnn,
    # 1024 channels: 4 blocks, one per rank on P = 4 (the row conv's gradient is reduced)
    "tp_cnn_wide": lambda rng: tp_cnn(rng, channels=1024),
}

ZOO = {
    "mlp": mlp,
    "mlp_matmul_add": mlp_matmul_add,
    "normalized_mlp": normalized_mlp,
    "cnn_batchnorm": cnn_batchnorm,
    "cnn_avgpool": cnn_avgpool,
    "residual": residual,
    "layout_ops": layout_ops,
    "old_style_opset8": old_style_opset8,
}

MLPS = ("mlp", "mlp_matmul_add", "normalized_mlp", "old_style_opset8")

# Models of the op families beyond ReLU: each family appends its block of builders at the end
# of this file and adds them here.
OP_ZOO: dict = {}


# Models exported from torch (tests that name them build them; no zoo-wide test runs them).
TORCH_ZOO: dict = {}


def build(name: str, seed: int = 0):
    return {**ZOO, **TP_ZOO, **OP_ZOO, **TORCH_ZOO, **SOUNDNESS_ZOO}[name](
        np.random.default_rng(seed))


# -- models of the op-family ops (issue 12), one block per family --------------------------------
# activation family: LeakyRelu, PRelu, Clip / Relu6, Abs, Max with a constant
def leaky_residual(rng, n_in=20, width=16, n_out=3, alpha=0.1):
    """A LeakyRelu residual block: Gemm -> LeakyRelu -> Gemm (+ skip Add) -> LeakyRelu -> Gemm
    (20 inputs: branch and bound splits neurons rather than inputs)."""
    b = Builder(rng, (n_in,))
    h = b.op("LeakyRelu", [b.gemm("x", n_in, width)], alpha=alpha)
    s = b.op("Add", [h, b.gemm(h, width, width)])
    h = b.op("LeakyRelu", [s], alpha=alpha)
    return b.build(b.gemm(h, width, n_out)), b.input_shape


def clip_abs_mlp(rng, n_in=6, width=10, n_out=3):
    """Relu6 (Clip 0..6 with constant inputs), Abs, PRelu (per-neuron slopes of either sign,
    some above 1) and Max with a per-neuron constant, one per hidden layer."""
    b = Builder(rng, (n_in,))
    h = b.op("Clip", [b.gemm("x", n_in, width), b.const(np.float32(0)), b.const(np.float32(6))])
    h = b.op("Abs", [b.gemm(h, width, width)])
    h = b.op("PRelu", [b.gemm(h, width, width), b.const(rng.uniform(-0.5, 1.5, (width,)))])
    h = b.op("Max", [b.gemm(h, width, width), b.const(rng.uniform(-0.3, 0.3, (width,)))])
    return b.build(b.gemm(h, width, n_out)), b.input_shape


def tp_leaky_prelu(rng, n_in=8, hidden=520, n_out=4):
    """One tp zone whose elementwise chain is LeakyRelu -> PRelu (a slope per hidden neuron,
    so each rank holds its slice) -> Max with a per-neuron constant; 520 hidden = 3 blocks."""
    b = Builder(rng, (n_in,))
    h = b.op("LeakyRelu", [b.gemm("x", n_in, hidden)], alpha=0.2)
    h = b.op("PRelu", [h, b.const(rng.uniform(-0.5, 1.5, (hidden,)))])
    h = b.op("Max", [h, b.const(rng.uniform(-0.2, 0.1, (hidden,)))])
    return b.build(b.gemm(h, hidden, n_out)), b.input_shape


OP_ZOO.update({"leaky_residual": leaky_residual, "clip_abs_mlp": clip_abs_mlp,
               "tp_leaky_prelu": tp_leaky_prelu})


# -- smooth family: Sigmoid and Tanh ------------------------------------------------------------
def sigmoid_mlp(rng):
    """Three Sigmoid layers: 6 -> 16 -> 16 -> 12 -> 4."""
    b = Builder(rng, (6,))
    h = "x"
    for n_in, n_out in ((6, 16), (16, 16), (16, 12)):
        h = b.op("Sigmoid", [b.gemm(h, n_in, n_out)])
    return b.build(b.gemm(h, 12, 4)), b.input_shape


def tanh_mlp(rng):
    """Input normalisation, two Tanh layers and a ReLU: 6 -> 16 -> 16 -> 12 -> 4."""
    b = Builder(rng, (6,))
    h = b.op("Sub", ["x", b.const(rng.uniform(-0.2, 0.2, (6,)))])
    h = b.op("Div", [h, b.const(rng.uniform(0.5, 1.0, (6,)))])
    h = b.op("Tanh", [b.gemm(h, 6, 16)])
    h = b.op("Tanh", [b.gemm(h, 16, 16)])
    h = b.relu(b.gemm(h, 16, 12))
    return b.build(b.gemm(h, 12, 4)), b.input_shape


def tp_sigmoid(rng):
    """A Sigmoid inside a Megatron zone (Gemm 8 -> 520, Sigmoid, Gemm 520 -> 16: 3 blocks of
    256), then a replicated Tanh and Gemm 16 -> 4."""
    b = Builder(rng, (8,))
    h = b.op("Sigmoid", [b.gemm("x", 8, 520)])
    h = b.op("Tanh", [b.gemm(h, 520, 16)])
    return b.build(b.gemm(h, 16, 4)), b.input_shape


OP_ZOO.update({"sigmoid_mlp": sigmoid_mlp, "tanh_mlp": tanh_mlp, "tp_sigmoid": tp_sigmoid})


# -- smooth nonlinear functions (issue 15): exponential, periodic and gated families ----------
def gelu_mlp(rng):
    """Two Gelu layers as torch exports them (the Erf formula, then the tanh formula with
    x ** 3 as Mul(x, Mul(x, x))): 5 -> 12 -> 12 -> 3."""
    b = Builder(rng, (5,))
    h = b.gemm("x", 5, 12)
    e = b.op("Add", [b.op("Erf", [b.op("Div", [h, b.const(np.float32(np.sqrt(2)))])]),
                     b.const(np.float32(1))])
    h = b.op("Mul", [b.op("Mul", [h, e]), b.const(np.float32(0.5))])
    h = b.gemm(h, 12, 12)
    cube = b.op("Mul", [h, b.op("Mul", [h, h])])
    inner = b.op("Add", [h, b.op("Mul", [b.const(np.float32(0.044715)), cube])])
    t = b.op("Tanh", [b.op("Mul", [b.const(np.float32(np.sqrt(2 / np.pi))), inner])])
    h = b.op("Mul", [b.const(np.float32(0.5)),
                     b.op("Mul", [h, b.op("Add", [b.const(np.float32(1)), t])])])
    return b.build(b.gemm(h, 12, 3)), b.input_shape


def exp_log_mlp(rng):
    """Softplus, Log (of softplus + 0.1), Exp, Reciprocal (of 1 + exp) and Sqrt: 5 -> 12 -> 10
    -> 3, every op inside its domain by construction."""
    b = Builder(rng, (5,))
    h = b.op("Softplus", [b.gemm("x", 5, 12)])
    h = b.op("Log", [b.op("Add", [h, b.const(np.float32(0.1))])])
    h = b.op("Exp", [b.gemm(h, 12, 10)])
    h = b.op("Reciprocal", [b.op("Add", [h, b.const(np.float32(1))])])
    h = b.op("Sqrt", [h])
    return b.build(b.gemm(h, 10, 3)), b.input_shape


def sincos_mlp(rng):
    """Sin and Cos layers: 4 -> 12 -> 12 -> 3 (first-layer weights scaled up, so the boxes
    reach across several pieces of the sine)."""
    b = Builder(rng, (4,))
    h = b.op("Sin", [b.op("Mul", [b.gemm("x", 4, 12), b.const(np.float32(2.5))])])
    h = b.op("Cos", [b.gemm(h, 12, 12)])
    return b.build(b.gemm(h, 12, 3)), b.input_shape


def silu_hardswish_mlp(rng):
    """SiLU as Mul(x, Sigmoid(x)), HardSwish (opset 14) and Selu: 5 -> 12 -> 12 -> 10 -> 3."""
    b = Builder(rng, (5,), opset=14)
    h = b.gemm("x", 5, 12)
    h = b.op("Mul", [h, b.op("Sigmoid", [h])])
    h = b.op("HardSwish", [b.op("Mul", [b.gemm(h, 12, 12), b.const(np.float32(3))])])
    h = b.op("Selu", [b.gemm(h, 12, 10)])
    return b.build(b.gemm(h, 10, 3)), b.input_shape


OP_ZOO.update({"gelu_mlp": gelu_mlp, "exp_log_mlp": exp_log_mlp, "sincos_mlp": sincos_mlp,
               "silu_hardswish_mlp": silu_hardswish_mlp})


def tp_smooth_chain(rng, n_in=6, hidden=520, n_out=3):
    """One tp zone whose elementwise chain holds the smooth kernels -- silu (Mul(x,
    Sigmoid(x))), sin, hard_swish, softplus, log (of softplus + 0.1) -- over 520 hidden
    channels (3 blocks of 256: the ranks hold real slices), then a replicated Gelu and Gemm.
    In TP_ZOO: tests/ops/test_gated.py runs it in fsdp and tp (too wide for the op-zoo run)."""
    b = Builder(rng, (n_in,), opset=20)
    h = b.gemm("x", n_in, hidden)
    h = b.op("Sin", [b.op("Mul", [h, b.op("Sigmoid", [h])])])
    h = b.op("Softplus", [b.op("HardSwish", [h])])
    h = b.op("Log", [b.op("Add", [h, b.const(np.float32(0.1))])])
    h = b.op("Gelu", [b.gemm(h, hidden, 16)])
    return b.build(b.gemm(h, 16, n_out)), b.input_shape


TP_ZOO.update({"tp_smooth_chain": tp_smooth_chain})


# normalization family: LayerNormalization around a transformer MLP block
def ln_mlp_block(rng, d=16, hidden=520, n_out=3, act="Gelu"):
    """A transformer MLP block on one token: Gemm -> LayerNorm -> MatMul (520) -> Gelu ->
    MatMul -> + residual -> LayerNorm (no bias) -> Gemm. tp zones the MLP (column, Gelu, row:
    3 blocks of 256) and replicates the LayerNorms. In TP_ZOO, with its Relu twin
    `ln_relu_block`, which tests/ops/test_gated.py runs in fsdp and tp with tp_smooth_chain
    (the Gelu's alpha-CROWN over 520 channels cost 3.5x the Relu's in every rank of those
    jobs; tp_smooth_chain already holds smooth zones)."""
    b = Builder(rng, (d,), opset=20)
    h = b.gemm("x", d, d)
    n = b.op("LayerNormalization", [h, b.const(rng.uniform(0.5, 1.5, (d,))),
                                    b.const(rng.normal(0, 0.3, (d,)))], axis=-1)
    u = b.op(act, [b.op("MatMul", [n, b.const(b.weight(d, hidden))])])
    s = b.op("Add", [h, b.op("MatMul", [u, b.const(b.weight(hidden, d))])])
    n = b.op("LayerNormalization", [s, b.const(rng.uniform(0.5, 1.5, (d,)))], axis=-1)
    return b.build(b.gemm(n, d, n_out)), b.input_shape


TP_ZOO.update({"ln_mlp_block": ln_mlp_block,
               "ln_relu_block": lambda rng: ln_mlp_block(rng, act="Relu")})


# MaxPool and Pad (runtime/ops/pooling.py, runtime/ops/layout.py)
def maxpool_cnn(rng):
    """Conv -> ReLU -> MaxPool (3x3, stride 2, pads 1: overlapping windows) -> Conv -> ReLU ->
    Flatten -> Gemm."""
    b = Builder(rng, (2, 8, 8))
    h = b.op("Conv", ["x", b.const(b.weight(4, 2, 3, 3)), b.const(rng.normal(0, 0.1, (4,)))],
             pads=[1, 1, 1, 1])
    h = b.op("MaxPool", [b.relu(h)], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    h = b.op("Conv", [h, b.const(b.weight(4, 4, 3, 3)), b.const(rng.normal(0, 0.1, (4,)))])
    h = b.op("Flatten", [b.relu(h)], axis=1)
    return b.build(b.gemm(h, 4 * 2 * 2, 5)), b.input_shape


def pad_avgpool_cnn(rng):
    """Pad (reflect) -> Conv -> ReLU -> Pad (constant 0.2) -> AveragePool -> Flatten -> Gemm."""
    b = Builder(rng, (1, 6, 6))
    h = b.op("Pad", ["x", b.const(np.array([0, 0, 1, 2, 0, 0, 1, 0], dtype=np.int64))],
             mode="reflect")                                                   # (1, 1, 8, 8)
    h = b.op("Conv", [h, b.const(b.weight(3, 1, 3, 3)), b.const(rng.normal(0, 0.1, (3,)))])
    h = b.op("Pad", [b.relu(h), b.const(np.array([0, 0, 0, 1, 0, 0, 0, 1], dtype=np.int64)),
                     b.const(np.array(0.2, dtype=np.float32))], mode="constant")  # (1, 3, 6, 8)
    h = b.op("AveragePool", [h], kernel_shape=[2, 2], strides=[2, 2])          # (1, 3, 3, 4)
    h = b.op("Flatten", [h], axis=1)
    return b.build(b.gemm(h, 36, 4)), b.input_shape


def tp_maxpool_cnn(rng, channels=260):
    """A conv tp zone that holds a MaxPool: Conv 1 -> 260 channels (two 256-blocks, so P = 2
    splits it), ReLU, MaxPool 2x2 stride 2, Conv 260 -> 3 (row), then ReLU, Flatten, Gemm."""
    b = Builder(rng, (1, 4, 4))
    h = b.op("Conv", ["x", b.const(b.weight(channels, 1, 3, 3)),
                      b.const(rng.normal(0, 0.1, (channels,)))], pads=[1, 1, 1, 1])
    h = b.op("MaxPool", [b.relu(h)], kernel_shape=[2, 2], strides=[2, 2])
    h = b.op("Conv", [h, b.const(b.weight(3, channels, 2, 2)), b.const(rng.normal(0, 0.1, (3,)))])
    h = b.op("Flatten", [b.relu(h)], axis=1)
    return b.build(b.gemm(h, 3, 3)), b.input_shape


def tp_pad_cnn(rng, channels=260):
    """A conv tp zone that holds a Pad (constant 0.3 on the spatial axes: elementwise per
    channel, with a bias term): Conv 1 -> 260, ReLU, Pad, Conv 260 -> 3, ReLU, Flatten, Gemm."""
    b = Builder(rng, (1, 3, 3))
    h = b.op("Conv", ["x", b.const(b.weight(channels, 1, 2, 2)),
                      b.const(rng.normal(0, 0.1, (channels,)))])                # (260, 2, 2)
    h = b.op("Pad", [b.relu(h), b.const(np.array([0, 0, 1, 0, 0, 0, 0, 1], dtype=np.int64)),
                     b.const(np.array(0.3, dtype=np.float32))])                 # (260, 3, 3)
    h = b.op("Conv", [h, b.const(b.weight(3, channels, 2, 2)), b.const(rng.normal(0, 0.1, (3,)))])
    h = b.op("Flatten", [b.relu(h)], axis=1)
    return b.build(b.gemm(h, 12, 3)), b.input_shape


OP_ZOO.update({
    "maxpool_cnn": maxpool_cnn,
    "pad_avgpool_cnn": pad_avgpool_cnn,
    "tp_maxpool_cnn": tp_maxpool_cnn,
    "tp_pad_cnn": tp_pad_cnn,
})


# -- data movement (issue 14): branches merged by Concat / Add / Mul, upsampling, zone moves ------
def _ints(*v):
    return np.array(v, dtype=np.int64)


def branch_concat_cnn(rng):
    """One tensor feeding four branches merged again: Conv -> ReLU -> (Slice rows | Transpose
    of the spatial axes * 0.5 | Gather columns + a constant | nothing); Concat on channels with
    a constant channel, Add, ReduceMean, Split, Gemm."""
    b = Builder(rng, (1, 3, 4))
    h = b.relu(b.op("Conv", ["x", b.const(b.weight(3, 1, 2, 2)),
                             b.const(rng.normal(0, 0.1, (3,)))], pads=[1, 1, 0, 1]))   # (3, 3, 5)
    s = b.op("Slice", [h, b.const(_ints(0)), b.const(_ints(3)), b.const(_ints(3)),
                       b.const(_ints(1))])                                           # (3, 3, 3)
    t = b.op("Mul", [b.op("Transpose", [b.op("Slice", [h, b.const(_ints(1)), b.const(_ints(4)),
                                                       b.const(_ints(3))])],
                          perm=[0, 1, 3, 2]), b.const(np.float32(0.5))])             # (3, 3, 3)
    g = b.op("Add", [b.op("Gather", [h, b.const(_ints(4, 0, 2))], axis=3),
                     b.const(rng.normal(0, 0.2, (3, 1, 3)))])                        # (3, 3, 3)
    c = b.op("Concat", [s, t, b.const(rng.normal(0, 0.5, (1, 1, 3, 3))), g], axis=1)  # (10, 3, 3)
    c = b.op("Add", [c, b.op("Concat", [g, s, t, b.const(np.zeros((1, 1, 3, 3), np.float32))],
                             axis=1)])
    r = b.relu(b.op("ReduceMean", [c], axes=[2], keepdims=0))                       # (10, 3)
    first, second = b.op("Split", [r, b.const(_ints(6, 4))], n_out=2, axis=1), None
    second = first[:-1] + "1"
    m = b.op("Concat", [b.op("Flatten", [first], axis=1), b.op("Flatten", [second], axis=1)],
             axis=1)
    return b.build(b.gemm(m, 30, 3)), b.input_shape


def upsample_mlp(rng):
    """A generator-like net: Gemm -> Reshape (4, 2, 2) -> ConvTranspose (stride 2) -> ReLU ->
    Resize (nearest x2) -> Conv (stride 2) -> ReLU -> Resize (linear, half-pixel) -> Flatten ->
    Gemm; 5 inputs."""
    b = Builder(rng, (5,))
    h = b.op("Reshape", [b.gemm("x", 5, 16), b.const(_ints(1, 4, 2, 2))])
    h = b.relu(b.op("ConvTranspose", [h, b.const(b.weight(4, 3, 3, 3)),
                                      b.const(rng.normal(0, 0.1, (3,)))], strides=[2, 2]))
    h = b.op("Resize", [h, b.const(np.zeros(0, np.float32)),
                        b.const(np.array([1, 1, 2, 2], np.float32))], mode="nearest")
    h = b.relu(b.op("Conv", [h, b.const(b.weight(2, 3, 3, 3)), b.const(rng.normal(0, 0.1, (2,)))],
                    strides=[2, 2]))                                                  # (2, 4, 4)
    h = b.op("Resize", [h, b.const(np.zeros(0, np.float32)),
                        b.const(np.array([1, 1, 0.6, 0.6], np.float32))], mode="linear")
    return b.build(b.gemm(b.op("Flatten", [h], axis=1), 8, 3)), b.input_shape


def slice_gather_mlp(rng):
    """pensieve / ml4acopf patterns: a (2, 6) input sliced, gathered and split into branches,
    each through its own layer (MatMul, W @ x on a transposed row), concatenated."""
    b = Builder(rng, (2, 6))
    a = b.op("Gather", ["x", b.const(np.array(0, np.int64))], axis=1)               # (1, 6)
    c = b.op("Slice", ["x", b.const(_ints(1)), b.const(_ints(2)), b.const(_ints(1))])  # (1, 1, 6)
    c = b.op("Reshape", [c, b.const(_ints(1, 6))])
    ct = b.op("Transpose", [c], perm=[1, 0])                                        # (6, 1)
    wc = b.op("Transpose", [b.op("MatMul", [b.const(b.weight(8, 6)), ct])], perm=[1, 0])
    p, q = b.op("Split", [a, b.const(_ints(4, 2))], n_out=2, axis=1), None
    q = p[:-1] + "1"
    hp = b.relu(b.op("MatMul", [p, b.const(b.weight(4, 6))]))
    hq = b.relu(b.gemm(q, 2, 6))
    h = b.op("Concat", [hp, hq, b.relu(wc)], axis=1)                               # (1, 20)
    h = b.op("Sum", [b.gemm(h, 20, 8), b.op("Slice", [h, b.const(_ints(0)), b.const(_ints(8)),
                                                      b.const(_ints(1))])])
    return b.build(b.gemm(b.relu(h), 8, 3)), b.input_shape


def tp_move_cnn(rng, channels=260):
    """A conv tp zone holding data movement that acts on each channel alone: Conv 1 -> 260,
    ReLU, Slice (spatial), Resize (linear), ReduceSum over rows (keepdims), Conv 260 -> 3."""
    b = Builder(rng, (1, 3, 4))
    h = b.relu(b.op("Conv", ["x", b.const(b.weight(channels, 1, 2, 2)),
                             b.const(rng.normal(0, 0.1, (channels,)))], pads=[1, 1, 1, 1]))
    h = b.op("Slice", [h, b.const(_ints(1, 0)), b.const(_ints(4, 4)), b.const(_ints(2, 3)),
                       b.const(_ints(1, 2))])                                       # (260, 3, 2)
    h = b.op("Resize", [h, b.const(np.zeros(0, np.float32)),
                        b.const(np.array([1, 1, 1, 2], np.float32))], mode="linear")  # (260, 3, 4)
    h = b.op("ReduceSum", [h, b.const(_ints(2))], keepdims=1)                       # (260, 1, 4)
    h = b.op("Conv", [h, b.const(b.weight(3, channels, 1, 2)), b.const(rng.normal(0, 0.1, (3,)))])
    return b.build(b.gemm(b.op("Flatten", [b.relu(h)], axis=1), 9, 3)), b.input_shape


OP_ZOO.update({
    "branch_concat_cnn": branch_concat_cnn,
    "upsample_mlp": upsample_mlp,
    "slice_gather_mlp": slice_gather_mlp,
    "tp_move_cnn": tp_move_cnn,
})


# -- a tiny Vision Transformer (issue 15): tests/zoo_vit.py (torch-exported) ------------------
from zoo_vit import vit_tiny, vit_tiny_module  # noqa: E402,F401  (vit_tiny_module: bench/)

TORCH_ZOO["vit_tiny"] = vit_tiny


# Models of the ops `--soundness real|float32` covered last (issue 17): tests/zoo_soundness.py.
from zoo_soundness import discrete_mix, norm_softmax_mlp  # noqa: E402

SOUNDNESS_ZOO = {"discrete_mix": discrete_mix, "norm_softmax_mlp": norm_softmax_mlp}
