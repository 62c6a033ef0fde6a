"""The pooling family (compiler/lowering/pooling.py): AveragePool lowers to a depthwise conv2d
of the conv family, plus a divisor affine where padding is not counted; MaxPool and
GlobalMaxPool lower to the `maxpool2d` kernel (runtime/ops/pooling.py), whose relaxation is
checked here directly too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conv_helpers import conv_net
from harness import OpCase, generate


def _pool(op, **attrs):
    def apply(b, x, shape):
        y = b.op(op, [x], **attrs)
        return y, _pooled(shape, attrs, op)
    return apply


def _axis(n, k, s, begin, end, d, ceil):
    """One pooled axis by the ONNX formula (ceil mode drops a window starting in the end
    padding, as onnxruntime does)."""
    span = n + begin + end - d * (k - 1) - 1
    out = (-(-span // s) if ceil else span // s) + 1
    return out - 1 if ceil and (out - 1) * s >= n + begin else out


def _pooled(shape, attrs, op):
    n, c, H, W = shape
    if op.startswith("Global"):
        return (n, c, 1, 1)
    kh, kw = attrs["kernel_shape"]
    sh, sw = attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    ceil = attrs.get("ceil_mode", 0)
    if attrs.get("auto_pad", "NOTSET").startswith("SAME"):
        return (n, c, -(-H // sh), -(-W // sw))
    pt, pl, pb, pr = attrs.get("pads", [0, 0, 0, 0])
    return (n, c, _axis(H, kh, sh, pt, pb, dh, ceil), _axis(W, kw, sw, pl, pr, dw, ceil))


def _case(name, op="AveragePool", opsets=(11,), shape=(2, 7, 7), reference=True, **attrs):
    return OpCase(name, op, lambda rng, o: conv_net(rng, o, shape, _pool(op, **attrs)),
                  opsets=opsets, reference=reference)


CASES = [
    _case("avgpool_stride", kernel_shape=[2, 2], strides=[2, 2]),
    _case("avgpool_pads_excluded", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
          count_include_pad=0),
    _case("avgpool_pads_included", kernel_shape=[3, 2], strides=[1, 2], pads=[1, 0, 1, 1],
          count_include_pad=1),
    _case("global_avgpool", op="GlobalAveragePool"),
    # MaxPool: schema 1 (opset 7), 8 (+ Indices output), 10 on (+ dilations, ceil_mode)
    _case("maxpool_stride", op="MaxPool", opsets=(7, 8), kernel_shape=[2, 2], strides=[2, 2]),
    _case("maxpool_overlap_pads", op="MaxPool", opsets=(8, 12), kernel_shape=[3, 3],
          strides=[2, 2], pads=[1, 1, 1, 1]),
    _case("maxpool_overlap_stride1", op="MaxPool", opsets=(11,), shape=(2, 5, 5),
          kernel_shape=[3, 2], strides=[1, 1]),
    _case("maxpool_asymmetric_pads", op="MaxPool", opsets=(12,), kernel_shape=[2, 3],
          strides=[2, 1], pads=[0, 2, 1, 0]),
    _case("maxpool_same_upper", op="MaxPool", opsets=(10,), shape=(2, 6, 7), kernel_shape=[3, 2],
          strides=[2, 2], auto_pad="SAME_UPPER"),
    # onnx.reference pools SAME_LOWER to another shape than the spec and onnxruntime
    _case("maxpool_same_lower", op="MaxPool", opsets=(12,), shape=(2, 6, 7), kernel_shape=[2, 3],
          strides=[2, 1], auto_pad="SAME_LOWER", reference=False),
    _case("maxpool_dilated", op="MaxPool", opsets=(10,), kernel_shape=[2, 2], strides=[1, 2],
          pads=[1, 1, 1, 0], dilations=[2, 2]),
    _case("maxpool_ceil", op="MaxPool", opsets=(12,), kernel_shape=[3, 3], strides=[2, 2],
          pads=[1, 0, 0, 1], ceil_mode=1, shape=(2, 6, 6)),
    _case("global_maxpool", op="GlobalMaxPool", shape=(2, 4, 5)),
]

generate(CASES, globals())


# -- the relaxation of one window, directly --------------------------------------------------------
def _random_windows(g, n, K):
    """n windows of K slots with bounds of every kind: wide, narrow, degenerate, far apart,
    overlapping, equal bounds across slots (ties), huge magnitudes; a random slot pattern of
    padding (at least one real slot per window)."""
    scale = 10.0 ** torch.randint(-3, 4, (n, 1), generator=g, dtype=torch.float64)
    centre = torch.randn(n, K, generator=g, dtype=torch.float64) * scale
    width = torch.rand(n, K, generator=g, dtype=torch.float64) * scale * 2
    width[torch.rand(n, K, generator=g) < 0.2] = 0                     # degenerate slots
    ties = torch.rand(n, generator=g) < 0.05                           # identical slots
    centre[ties] = centre[ties, :1]
    width[ties] = width[ties, :1]
    lo = (centre - width).float()
    hi = torch.maximum((centre + width).float(), lo)
    valid = torch.rand(n, K, generator=g) < 0.8
    valid[torch.arange(n), torch.randint(0, K, (n,), generator=g)] = True
    return lo, hi, valid


def _feasible_w(g, n, K, valid):
    """Random w >= 0 with sum <= 1, zero on padding (one-hot, interior, on the boundary)."""
    w = torch.rand(n, K, generator=g, dtype=torch.float64) * valid
    total = w.sum(-1, keepdim=True)
    target = torch.rand(n, 1, generator=g, dtype=torch.float64)
    target[torch.rand(n, generator=g) < 0.3] = 1.0
    return (w / total.clamp(min=1e-12) * target).float()


def test_maxpool_window_lines_are_sound():
    """lower line <= max <= upper line at every corner of random windows and at random points
    (float64 evaluation of the float32 lines), for random feasible lower weights w; the upper
    line never exceeds max_i u_i (DeepPoly's constant) at any point; exact windows are exact."""
    from shardbound.runtime.ops.pooling import window_lines

    g = torch.Generator().manual_seed(0)
    for K in (1, 2, 4, 9):
        lo, hi, valid = _random_windows(g, 4000, K)
        lines = window_lines(lo, hi, valid)
        w = _feasible_w(g, lo.shape[0], K, valid)
        w = torch.where(lines.exact.unsqueeze(-1), lines.low_slope, w)
        max_lo = torch.where(valid, lo, torch.tensor(-np.inf)).amax(-1).double()
        rest = 1 - w.double().sum(-1)
        scale = torch.maximum(lo.abs(), hi.abs()).masked_fill(~valid, 0).amax(-1).double()
        corners = [torch.tensor([(c >> k) & 1 for k in range(K)], dtype=torch.bool)
                   for c in range(2 ** K)] if K <= 4 else []
        points = [torch.where(c, hi, lo) for c in corners]
        points += [lo + torch.rand(lo.shape, generator=g) * (hi - lo) for _ in range(64)]
        for x in points:
            x = x.double()
            y = torch.where(valid, x, torch.tensor(-np.inf, dtype=torch.float64)).amax(-1)
            up = (lines.up_slope.double() * x * valid).sum(-1) + lines.up_icpt.double()
            low = (w.double() * x * valid).sum(-1) + rest * max_lo
            default_low = (lines.low_slope.double() * x).sum(-1)
            tol = 1e-12 * (1 + y.abs())
            assert bool((y <= up + tol).all()), (K, float((y - up).max()))
            assert bool((low <= y + 1e-6 * (1 + y.abs())).all()), (K, float((low - y).max()))
            assert bool((default_low <= y).all()), K
            max_hi = hi.double().masked_fill(~valid, -np.inf).amax(-1)
            assert bool((up <= max_hi + 1e-6 * (1 + scale)).all()), K    # float32 slopes
            exact = lines.exact
            assert bool((up[exact] == y[exact]).all() and (default_low[exact] == y[exact]).all())


def test_maxpool_alpha_projection_is_feasible():
    """alpha_project_ lands every alpha in {w >= 0, sum w <= 1, 0 on padding}."""
    from shardbound.runtime.ops.pooling import MaxPool2d

    op = MaxPool2d("p", ["x"], [(2, 5, 5)], kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1))
    alpha = torch.randn(3, 4, 2, 9, 9) * 3
    op.alpha_project_(alpha)
    valid = op._valid(alpha.device)
    assert bool((alpha >= 0).all() and (alpha <= 1).all())
    assert bool((alpha.sum(-1) <= 1 + 1e-6).all())
    assert bool((alpha[..., ~valid] == 0).all())


def test_maxpool_backward_is_the_same_for_any_row_split():
    """Overlapping windows add onto shared cells in a fixed order: the A-matrix of a row does
    not depend on which other rows go with it (blocked order)."""
    from shardbound.runtime.ops.pooling import MaxPool2d

    op = MaxPool2d("p", ["x"], [(3, 6, 6)], kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1),
                   order="blocked")
    g = torch.Generator().manual_seed(1)
    lo = torch.randn(2, 3, 6, 6, generator=g)
    hi = lo + torch.rand(2, 3, 6, 6, generator=g)
    A = torch.randn(2, 7, *op.shape, generator=g)
    whole = op.crown_backward(A, A.clone(), [(lo, hi)])
    for a, b in ((0, 3), (3, 4), (4, 7)):
        part = op.crown_backward(A[:, a:b].contiguous(), A[:, a:b].clone(), [(lo, hi)])
        for w, p in zip((whole[0][0], whole[1][0], whole[2], whole[3]),
                        (part[0][0], part[1][0], part[2], part[3])):
            assert torch.equal(w[:, a:b], p)


def _pool_model(attrs, shape=(1, 1, 4, 4), use_indices=False):
    from onnx import TensorProto, helper

    outs = ["y", "i"] if use_indices else ["y"]
    nodes = [helper.make_node("MaxPool", ["x"], outs, name="pool", **attrs)]
    if use_indices:
        nodes += [helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
                  helper.make_node("Add", ["y", "f"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, list(shape))], [helper.make_tensor_value_info(
        nodes[-1].output[0], TensorProto.FLOAT, None)])
    graph.output[0].type.tensor_type.shape.dim.add()       # rank only: the checker needs one
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


@pytest.mark.parametrize("attrs,shape,use_indices,message", [
    ({"kernel_shape": [2, 2]}, (1, 1, 4, 4), True, "Indices output is used"),
    ({"kernel_shape": [2, 2], "pads": [3, 0, 0, 0]}, (1, 1, 4, 4), False, "only padding"),
    ({"kernel_shape": [2, 2], "dilations": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 1, 4, 4),
     False, "disagree on the padding"),
    ({"kernel_shape": [5, 5]}, (1, 1, 4, 4), False, "fits"),
    ({"kernel_shape": [2]}, (1, 1, 4), False, "only 2-D max pooling"),
])
def test_maxpool_errors_are_one_line(tmp_path, attrs, shape, use_indices, message):
    import onnx

    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.errors import ShardboundError
    from shardbound.passes.manager import PassOptions

    path = tmp_path / "m.onnx"
    onnx.save(_pool_model(attrs, shape, use_indices), path)
    with pytest.raises(ShardboundError, match=message) as err:
        compile_model(str(path), str(tmp_path / "out"), PassOptions())
    assert "\n" not in str(err.value) and "'pool'" in str(err.value)


def test_alpha_crown_on_maxpool_beats_crown(compile_zoo):
    """On maxpool_cnn, optimising the MaxPool lower-line weights alone raises every spec
    row's lower bound above CROWN's, and so does alpha-CROWN (ReLU and MaxPool parameters
    together); both stay sound, and CROWN is much tighter than IBP."""
    from conftest import random_box
    from soundness import assert_sound

    from shardbound.runtime.engine.optimise import alpha_group, initial_alphas, maximise

    verifier, _, _ = compile_zoo("maxpool_cnn", summation="blocked")
    net = verifier.network
    lo, hi = (torch.from_numpy(t)[None] for t in
              random_box(np.random.default_rng(3), verifier.input_shape, 0.1))
    with torch.no_grad():
        ibp, known = net.intermediate_bounds(lo, hi)
        crown_lb, crown_ub = net.final_crown(ibp, known, lo, hi)
    pools = [n for n in net.optimisable_nodes() if n.kind == "maxpool2d"]
    assert len(pools) == 1 and pools[0].has_alpha
    alphas = initial_alphas(net, known, 1, crown_lb.shape[1], pools)

    def objective(last):
        return net.final_crown(ibp, known, lo, hi, None, alphas, lower_only=True, gather=False)[0]

    pool_lb = maximise(objective, [alpha_group(net, alphas, 0.25)], 20, start=crown_lb)
    assert bool((pool_lb > crown_lb).all()), (pool_lb, crown_lb)
    alpha_lb, alpha_ub = verifier.bounds(lo, hi, method="alpha-crown")
    assert bool((alpha_lb > crown_lb).all())
    ibp_lb, ibp_ub = verifier.bounds(lo, hi, method="ibp")
    assert float((crown_ub - crown_lb).mean()) < 0.5 * float((ibp_ub - ibp_lb).mean())

    def forward(x):
        return net.forward(x.reshape(-1, *verifier.input_shape)).reshape(x.shape[0], -1)

    for lb, ub in ((pool_lb, crown_ub), (alpha_lb, alpha_ub)):
        assert_sound(forward, lo, hi, lb[0], ub[0], n=4000, label="maxpool_cnn alpha")
