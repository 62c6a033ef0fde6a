"""SoundnessBench-like planted counterexamples: a network with a hidden violation inside a
narrow ReLU spike near the edge of the input box, and its clean twin without the spike.

The base network (an MLP, or a small CNN) is random; the property asks whether the margin
m(x) = y_0 - y_1 can fall to d on the box, with d below what CROWN proves for the base
(so the clean twin is unsat). The spike adds to the network

    g(x) = relu(1 - sum_i |x_i - x*_i| / r),   |t| = relu(t) + relu(-t),

two first-layer ReLU units per input and one second-layer unit, and subtracts H g(x) from
y_0: the margin drops below d only inside an L1 ball of radius about r / 2 around x*, a point
near the box corner where the base margin is largest (so gradient attacks, which walk
towards the base's minimum, never get there, and g has no gradient outside its support).
x* is not a vertex (most inputs are a little inside the box), so a box vertex that minimises
a linear bound never lands in the ball either. Weights are fixed by the seed.

For the CNN, the first conv layer carries one extra channel that copies its input (a centred
delta kernel; the box lies in [0, 1], so the ReLU after it is the identity), and the spike's
first-layer units read that channel after the flatten.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 13


@dataclass
class Planted:
    model: onnx.ModelProto
    lower: np.ndarray         # (n,) float64 input box
    upper: np.ndarray
    row: np.ndarray           # (1, outputs): the margin y_0 - y_1
    d: float                  # violation region: row @ y <= d
    x_star: np.ndarray        # the planted counterexample (None for a clean twin)
    name: str


def _graph(nodes, inits, in_shape, out_dim, name):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, *in_shape])
    y = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, [1, out_dim])
    graph = helper.make_graph(nodes, name, [x], [y],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k)
                               for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def _gemm(inp, w, b, out, inits, nodes):
    inits[out + "_w"], inits[out + "_b"] = w, b
    nodes.append(helper.make_node("Gemm", [inp, out + "_w", out + "_b"], [out], transB=1))
    return out


def _relu(inp, out, nodes):
    nodes.append(helper.make_node("Relu", [inp], [out]))
    return out


class _Weights:
    """Base weights plus the spike's units, block by block."""

    def __init__(self, rng, n_feat, hidden, n_out):
        h1, h2 = hidden
        s = lambda k: 1 / np.sqrt(k)                                         # noqa: E731
        self.W1, self.b1 = rng.normal(0, s(n_feat), (h1, n_feat)), rng.normal(0, .1, h1)
        self.W2, self.b2 = rng.normal(0, s(h1), (h2, h1)), rng.normal(0, .1, h2)
        self.W3, self.b3 = rng.normal(0, s(h2), (n_out, h2)), rng.normal(0, .1, n_out)

    def base_forward(self, feats):
        h = np.maximum(feats @ self.W1.T + self.b1, 0)
        h = np.maximum(h @ self.W2.T + self.b2, 0)
        return h @ self.W3.T + self.b3

    def with_spike(self, pick, x_star, r, H):
        """Layers with the spike: `pick` (n, n_feat) selects the input coordinates from the
        first layer's features (identity for an MLP)."""
        n = len(x_star)
        h1, h2 = len(self.b1), len(self.b2)
        W1 = np.concatenate([self.W1, pick, -pick])
        b1 = np.concatenate([self.b1, -x_star, x_star])
        W2 = np.zeros((h2 + 1, h1 + 2 * n))
        W2[:h2, :h1] = self.W2
        W2[h2, h1:] = -1.0 / r
        b2 = np.concatenate([self.b2, [1.0]])
        W3 = np.concatenate([self.W3, np.zeros((len(self.b3), 1))], axis=1)
        W3[0, h2] = -H
        return (W1, b1), (W2, b2), (W3, self.b3)


def _margin(weights, feats_of, x, row):
    return float(row[0] @ weights.base_forward(feats_of(x[None]))[0])


def _place(rng, weights, feats_of, lower, upper, row, frac_inside=0.8):
    """(x*, r): x* near the corner where the margin's gradient at the centre points, most
    inputs 2-12% of the box width inside it; r the spike's L1 radius."""
    c = (lower + upper) / 2
    h = 1e-4
    grad = np.array([(_margin(weights, feats_of, c + h * e, row)
                      - _margin(weights, feats_of, c - h * e, row)) / (2 * h)
                     for e in np.eye(len(c))])
    width = upper - lower
    inside = rng.uniform(0.02, 0.12, len(c)) * (rng.random(len(c)) < frac_inside)
    x_star = np.where(grad >= 0, upper - inside * width, lower + inside * width)
    return x_star, 0.5 * float(width.mean())


def _height(weights, feats_of, x_star, row, d):
    """H: the margin at the tip falls below d once g > 1/2 (a ball of L1 radius r / 2)."""
    return 2.0 * (_margin(weights, feats_of, x_star, row) - d) + 0.5


def _interval(W, b, lo, hi):
    mid, rad = (lo + hi) / 2, (hi - lo) / 2
    return W @ mid + b - np.abs(W) @ rad, W @ mid + b + np.abs(W) @ rad


def base_d(weights, feat_map, lower, upper, row) -> float:
    """A threshold the clean network provably stays above: its interval (IBP) lower bound,
    which every CROWN-family bound beats. feat_map: (A, a) with features relu(A x + a), or
    None for features x."""
    lo, hi = lower, upper
    if feat_map is not None:
        lo, hi = (np.maximum(v, 0) for v in _interval(*feat_map, lo, hi))
    for W, b in ((weights.W1, weights.b1), (weights.W2, weights.b2)):
        lo, hi = (np.maximum(v, 0) for v in _interval(W, b, lo, hi))
    m_w, m_b = row[0] @ weights.W3, row[0] @ weights.b3
    return float(_interval(m_w[None], np.array([m_b]), lo, hi)[0][0]) - 0.01


def _layers(weights, feats_of, x_star, r, row, d, pick):
    base = [(weights.W1, weights.b1), (weights.W2, weights.b2), (weights.W3, weights.b3)]
    if x_star is None:
        return base
    return weights.with_spike(pick, x_star, r, _height(weights, feats_of, x_star, row, d))


def _mlp_nodes(t, layers, inits, nodes):
    for i, (w, b) in enumerate(layers):
        t = _gemm(t, w, b, f"fc{i}", inits, nodes)
        if i < 2:
            t = _relu(t, f"relu{i}", nodes)
    return t


def _margin_row(n_out):
    row = np.zeros((1, n_out))
    row[0, 0], row[0, 1] = 1.0, -1.0
    return row


def planted_mlp(seed: int, n_in: int = 24, hidden=(16, 16), n_out: int = 3,
                radius: float = 0.5, spike: bool = True, d: float | None = None) -> Planted:
    """An MLP on [c - radius, c + radius]^n_in (the clean twin: spike=False, same seed).
    d: the threshold (default: the clean network's interval bound, `base_d`); a tighter
    one that the clean twin still provably keeps (e.g. its alpha-CROWN bound) makes the
    spike lower (H scales with m(x*) - d)."""
    rng = np.random.default_rng(seed)
    weights = _Weights(rng, n_in, hidden, n_out)
    c = rng.uniform(-0.5, 0.5, n_in)
    lower, upper = c - radius, c + radius
    row = _margin_row(n_out)
    feats_of = lambda x: x                                                   # noqa: E731
    x_star, r = _place(rng, weights, feats_of, lower, upper, row)
    d = base_d(weights, None, lower, upper, row) if d is None else d
    x_star = x_star if spike else None
    nodes, inits = [], {}
    _mlp_nodes("x", _layers(weights, feats_of, x_star, r, row, d, np.eye(n_in)), inits, nodes)
    name = f"mlp{seed}-{'spike' if spike else 'clean'}"
    return Planted(_graph(nodes, inits, (n_in,), n_out, name.replace("-", "_")), lower, upper,
                   row, d, x_star, name)


def _conv_matrix(K, kb, side):
    """(A, a): the 3x3, pad-1 convolution of a (1, side, side) image as a dense affine map."""
    ch = K.shape[0]
    n = side * side
    A = np.zeros((ch, side, side, n))
    for k in range(ch):
        for y in range(side):
            for x in range(side):
                for i in range(3):
                    for j in range(3):
                        yy, xx = y + i - 1, x + j - 1
                        if 0 <= yy < side and 0 <= xx < side:
                            A[k, y, x, yy * side + xx] += K[k, 0, i, j]
    return A.reshape(ch * n, n), np.repeat(kb, n)


def planted_cnn(seed: int, side: int = 5, channels: int = 3, hidden=(16, 16), n_out: int = 3,
                radius: float = 0.1, spike: bool = True, d: float | None = None) -> Planted:
    """Conv(1 -> channels + 1, 3x3, pad 1) -> ReLU -> Flatten -> MLP, on an image box inside
    [0, 1]; the last conv channel copies the image (see the module docstring). d: as for
    `planted_mlp`."""
    rng = np.random.default_rng(seed)
    n = side * side
    K = np.concatenate([rng.normal(0, 1 / 3, (channels, 1, 3, 3)), np.zeros((1, 1, 3, 3))])
    K[channels, 0, 1, 1] = 1.0
    kb = np.concatenate([rng.normal(0, 0.1, channels), [0.0]])
    A, a = _conv_matrix(K, kb, side)
    weights = _Weights(rng, len(a), hidden, n_out)
    img = rng.uniform(radius, 1 - radius, n)
    lower, upper = img - radius, img + radius
    row = _margin_row(n_out)
    feats_of = lambda x: np.maximum(x @ A.T + a, 0)                          # noqa: E731
    x_star, r = _place(rng, weights, feats_of, lower, upper, row)
    d = base_d(weights, (A, a), lower, upper, row) if d is None else d
    x_star = x_star if spike else None
    pick = np.zeros((n, len(a)))
    pick[np.arange(n), channels * n + np.arange(n)] = 1.0
    nodes, inits = [], {"k": K, "kb": kb}
    nodes.append(helper.make_node("Conv", ["x", "k", "kb"], ["conv"], pads=[1, 1, 1, 1]))
    _relu("conv", "crelu", nodes)
    nodes.append(helper.make_node("Flatten", ["crelu"], ["flat"], axis=1))
    _mlp_nodes("flat", _layers(weights, feats_of, x_star, r, row, d, pick), inits, nodes)
    name = f"cnn{seed}-{'spike' if spike else 'clean'}"
    return Planted(_graph(nodes, inits, (1, side, side), n_out, name.replace("-", "_")),
                   lower, upper, row, d, x_star, name)
