"""The activation family (runtime/ops/activation.py, compiler/lowering/activation.py):
Relu, LeakyRelu, PRelu, Abs, Sign, Clip (HardTanh, Relu6) and Max / Min with constants.

Besides the harness's forward and soundness checks on every case: the relaxation lines hold
exactly (float64 grid, exact comparison) on random intervals of every kind and for random
feasible alphas; alpha-CROWN beats CROWN on each optimisable op; bad models give one-line
errors."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch

import zoo
from conv_helpers import conv_net
from harness import OpCase, compiled, generate, make_box, sandwich


def _unary(op, **attrs):
    def apply(b, x, shape):
        return b.op(op, [x], **attrs), shape
    return apply


def _prelu(kind):
    """PRelu with a per-channel slope (C,) on (1, C), (C, 1, 1) on (1, C, H, W), or one
    shared slope; per-channel slopes in [-1.5, 2.5] (convex (<= 1), concave (> 1) and
    negative ones: "mixed" curvature) or in [-0.5, 1] ("convex")."""
    def apply(b, x, shape):
        low, high = (-0.5, 1.0) if kind == "convex" else (-1.5, 2.5)
        if kind == "shared":
            slope = np.array([1.7], dtype=np.float32)
        elif len(shape) == 2:
            slope = b.rng.uniform(low, high, (shape[1],))
        else:
            slope = b.rng.uniform(low, high, (shape[1], 1, 1))
        return b.op("PRelu", [x, b.const(slope)]), shape
    return apply


def _clip(low, high, as_inputs):
    """Clip(x, low, high) with attributes (opset < 11) or optional inputs ("" = missing)."""
    def apply(b, x, shape):
        if not as_inputs:
            attrs = {k: v for k, v in (("min", low), ("max", high)) if v is not None}
            return b.op("Clip", [x], **attrs), shape
        ins = [x] + ["" if v is None else b.const(np.float32(v)) for v in (low, high)]
        while ins[-1] == "":
            ins.pop()
        return b.op("Clip", ins), shape
    return apply


def _max_min(op, layout):
    """Max / Min of x and constants: `full` (same shape, what opset 6 requires), `left`
    (the constant first), `broadcast` (per-feature and scalar constants), `zero` (Max(x, 0) is
    a ReLU)."""
    def apply(b, x, shape):
        r = b.rng
        if layout == "full":
            ins = [x, b.const(r.uniform(-0.6, 0.6, shape))]
        elif layout == "left":
            ins = [b.const(r.uniform(-0.6, 0.6, shape)), x]
        elif layout == "broadcast":
            ins = [b.const(r.uniform(-0.6, 0.6, shape[1:])), x, b.const(np.float32(-0.1))]
        else:
            ins = [x, b.const(np.zeros(shape[1:]))]
        return b.op(op, ins), shape
    return apply


def _net(apply, n=8):
    return lambda rng, o: sandwich(rng, o, (n,), apply)


def _conv(apply):
    return lambda rng, o: conv_net(rng, o, (2, 4, 4), apply)


CASES = [
    OpCase("relu", "Relu", _net(_unary("Relu")), opsets=(8, 14)),
    OpCase("leaky_relu", "LeakyRelu", _net(_unary("LeakyRelu", alpha=0.1)), opsets=(7, 16)),
    OpCase("leaky_relu_default", "LeakyRelu", _net(_unary("LeakyRelu"))),
    OpCase("leaky_relu_concave", "LeakyRelu", _net(_unary("LeakyRelu", alpha=2.5))),
    OpCase("leaky_relu_negative", "LeakyRelu", _net(_unary("LeakyRelu", alpha=-0.4))),
    OpCase("prelu", "PRelu", _net(_prelu("channel")), opsets=(7, 9, 16)),
    OpCase("prelu_convex", "PRelu", _net(_prelu("convex"))),
    OpCase("prelu_shared", "PRelu", _net(_prelu("shared"))),
    OpCase("prelu_conv", "PRelu", _conv(_prelu("channel"))),
    OpCase("abs", "Abs", _net(_unary("Abs")), opsets=(7, 13)),
    OpCase("sign", "Sign", _net(_unary("Sign")), opsets=(9, 13)),
    OpCase("clip_attrs", "Clip", _net(_clip(-0.5, 0.7, as_inputs=False)), opsets=(7,)),
    OpCase("clip_attrs_min_only", "Clip", _net(_clip(-0.3, None, as_inputs=False)), opsets=(7,)),
    OpCase("clip", "Clip", _net(_clip(-0.5, 0.7, as_inputs=True)), opsets=(11, 12, 13)),
    OpCase("clip_min_only", "Clip", _net(_clip(0.2, None, as_inputs=True))),
    OpCase("clip_max_only", "Clip", _net(_clip(None, -0.2, as_inputs=True))),
    OpCase("clip_inverted", "Clip", _net(_clip(0.4, -0.2, as_inputs=True))),
    OpCase("relu6", "Clip", _net(_clip(0.0, 6.0, as_inputs=True)), scale=3.0),
    OpCase("hardtanh_conv", "Clip", _conv(_clip(-1.0, 1.0, as_inputs=True))),
    OpCase("max_const", "Max", _net(_max_min("Max", "full")), opsets=(7, 8, 12, 13)),
    OpCase("max_const_left", "Max", _net(_max_min("Max", "left"))),
    OpCase("max_const_broadcast", "Max", _net(_max_min("Max", "broadcast"))),
    OpCase("max_zero", "Max", _net(_max_min("Max", "zero"))),
    OpCase("min_const", "Min", _net(_max_min("Min", "full")), opsets=(7, 8, 12, 13)),
    OpCase("min_const_left", "Min", _net(_max_min("Min", "left"))),
    OpCase("min_const_broadcast", "Min", _net(_max_min("Min", "broadcast"))),
]

generate(CASES, globals())


# -- the relaxation lines, directly --------------------------------------------------------------
N = 6                                   # neurons (columns) per kernel
F32 = np.float32


def _split(x):
    """x = hi + lo with hi of at most 26 significant bits (Veltkamp): a float32 times either
    part is exact in float64."""
    c = 134217729.0 * x
    hi = c - (c - x)
    return hi, x - hi


class Ref:
    """f per neuron (column) i: in float64 on (M, B, N) arrays, and as float64 terms whose
    exact sum is f(x) (for an exact comparison with math.fsum)."""

    def __init__(self, kind, a=None, m=None, M=None):
        self.kind, self.a, self.m, self.M = kind, a, m, M

    def f64(self, x):
        if self.kind == "kink":
            return np.where(x >= 0, x, x * self.a)
        if self.kind == "sign":
            return np.sign(x)
        if self.m is not None:
            x = np.maximum(x, self.m)
        return x if self.M is None else np.minimum(x, self.M)

    def terms(self, x):
        if self.kind != "kink":
            return [self.f64(x)]                # max / min / sign: exact
        hi, lo = _split(x)
        neg = x < 0
        return [np.where(neg, self.a * hi, hi), np.where(neg, self.a * lo, lo)]

    def kinks(self):
        if self.kind == "clamp":
            return [k for k in (self.m, self.M) if k is not None]
        return [np.zeros(N)]


def _kernels():
    """(label, kernel, Ref) for every relaxed kernel of the family, with slopes and bounds of
    every kind (convex, concave, negative, linear; m < M, m == M, one bound)."""
    from shardbound.runtime.ops import OP_TYPES

    rng = np.random.default_rng(3)
    out = []
    for a in (0.01, 0.3, 1.0, 2.5, -0.4):
        a = float(F32(a))
        out.append((f"leaky_relu({a})", OP_TYPES["leaky_relu"]("n", ["x"], [(N,)], alpha=a),
                    Ref("kink", a=np.full(N, a))))
    for curvature, (low, high) in (("mixed", (-1.5, 2.5)), ("convex", (-1.5, 1.0)),
                                   ("concave", (1.0, 3.0))):
        slope = rng.uniform(low, high, N).astype(F32)
        slope[0] = 1.0 if curvature != "concave" else 1.5
        out.append((f"prelu({curvature})",
                    OP_TYPES["prelu"]("n", ["x"], [(N,)], curvature=curvature,
                                      params={"slope": torch.from_numpy(slope)}),
                    Ref("kink", a=slope.astype(np.float64))))
    out.append(("abs", OP_TYPES["abs"]("n", ["x"], [(N,)]), Ref("kink", a=np.full(N, -1.0))))
    low = rng.uniform(-1, 0.5, N).astype(F32)
    high = (low + rng.uniform(0, 1.5, N)).astype(F32)
    high[0] = low[0]                    # m == M: a constant
    six = (np.zeros(1, F32), np.full(1, 6, F32))
    for label, m, M in (("clip", low, high), ("max_const", low, None),
                        ("min_const", None, high), ("relu6", *six)):
        params = {k: torch.from_numpy(v) for k, v in (("min", m), ("max", M)) if v is not None}
        full = [None if v is None else np.broadcast_to(v, (N,)).astype(np.float64) for v in (m, M)]
        out.append((label, OP_TYPES["clamp"]("n", ["x"], [(N,)], params=params),
                    Ref("clamp", m=full[0], M=full[1])))
    out.append(("sign", OP_TYPES["sign"]("n", ["x"], [(N,)]), Ref("sign")))
    return out


def _intervals(ref, rng, B=12):
    """(lo, hi) float32 (B', N): every harness box kind at two scales; very wide and tiny
    intervals around each kink; intervals that end on a kink; a kink itself."""
    los, his = [], []
    for kind in ("narrow", "wide", "kinks", "saturated", "degenerate"):
        for scale in (1.0, 4.0):
            lo, hi = make_box(kind, rng, (B, N), scale)
            los.append(lo), his.append(hi)
    for k in ref.kinks():
        k = np.broadcast_to(k, (B, N))
        for lo, hi in ((k - rng.uniform(1e3, 1e30, (B, N)), k + rng.uniform(1e3, 1e30, (B, N))),
                       (k - rng.uniform(0, 1e-30, (B, N)), k + rng.uniform(0, 1e-30, (B, N))),
                       (k, k + rng.uniform(0, 2, (B, N))), (k - rng.uniform(0, 2, (B, N)), k),
                       (k, k)):
            lo = np.asarray(lo, F32)
            los.append(lo), his.append(np.maximum(np.asarray(hi, F32), lo))
    return np.concatenate(los), np.concatenate(his)


def _grid(ref, lo, hi, n=41):
    """(M, B, N) float64 points of each [lo, hi]: a dense grid, both ends and the kinks inside."""
    lo64, hi64 = lo.astype(np.float64), hi.astype(np.float64)
    t = np.linspace(0, 1, n).reshape(-1, 1, 1)
    pts = [lo64 + t * (hi64 - lo64), lo64[None], hi64[None]]
    pts += [np.clip(np.broadcast_to(k, lo.shape), lo64, hi64)[None] for k in ref.kinks()]
    return np.minimum(np.maximum(np.concatenate(pts), lo64), hi64)


def _assert_line(ref, xs, slope, icpt, upper, label):
    """slope x + icpt >= f(x) (upper) or <= f(x) at every point, exactly: a float64 screen,
    and where it is too close to call, the sign of the exact sum of exact float64 terms
    (math.fsum rounds that sum correctly, so its sign is exact)."""
    slope, icpt = slope.astype(np.float64), icpt.astype(np.float64)
    fx = ref.f64(xs)
    gap = (slope * xs + icpt - fx) * (1 if upper else -1)
    tol = 1e-9 * (np.abs(slope * xs) + np.abs(icpt) + np.abs(fx))
    bad = gap < -tol
    assert not bad.any(), (label, "upper" if upper else "lower", xs[bad][:3])
    close = np.abs(gap) <= tol
    x = xs[close]
    s, b = np.broadcast_to(slope, xs.shape)[close], np.broadcast_to(icpt, xs.shape)[close]
    hi, lo = _split(x)
    f_terms = [np.broadcast_to(t, xs.shape)[close] for t in ref.terms(xs)]
    terms = [s * hi, s * lo, b] + [-t for t in f_terms]
    sign = 1.0 if upper else -1.0
    for j, row in enumerate(zip(*terms)):
        assert sign * math.fsum(row) >= 0, (label, "upper" if upper else "lower", float(x[j]))


def _as_np(t, shape):
    return torch.broadcast_to(t.detach() if t is not None else torch.zeros(()), shape).numpy()


@pytest.mark.parametrize("k", range(len(_kernels())), ids=[k[0] for k in _kernels()])
def test_relaxation_lines_hold_exactly(k):
    """Lower <= f <= upper at every grid point (exactly) for CROWN's lines and for random
    feasible alphas (0 and 1 included); where the kernel says the relaxation is exact, the two
    lines are f's own piece."""
    label, op, ref = _kernels()[k]
    rng = np.random.default_rng(k)
    lo, hi = _intervals(ref, rng)
    B = lo.shape[0]
    tlo, thi = torch.from_numpy(lo).unsqueeze(1), torch.from_numpy(hi).unsqueeze(1)
    alphas = [None]
    if op.has_alpha:
        init = op.alpha_init([(tlo[:, 0], thi[:, 0])])
        S = 4
        a = torch.from_numpy(rng.uniform(0, 1, (B, S, *init.shape[1:])).astype(F32))
        a[:, 0], a[:, 1] = 0.0, 1.0
        op.alpha_project_(a)
        alphas.append(a)
    xs = _grid(ref, lo, hi)
    exact = ~op.inexact(tlo[:, 0], thi[:, 0]).numpy()
    for alpha in alphas:
        lines = op.relax(tlo, thi, alpha)
        S = 1 if alpha is None else alpha.shape[1]
        for s in range(S):
            pick = lambda t: _as_np(t, (B, S, N))[:, s]            # noqa: E731
            ls, li, us, ui = (pick(t) for t in (lines.lower_slope, lines.lower_icpt,
                                                 lines.upper_slope, lines.upper_icpt))
            assert np.isfinite([ls, li, us, ui]).all(), label
            _assert_line(ref, xs, ls, li, upper=False, label=label)
            _assert_line(ref, xs, us, ui, upper=True, label=label)
            if alpha is None and ref.kind != "sign":
                assert (ls[exact] == us[exact]).all() and (li[exact] == ui[exact]).all(), label


# -- alpha-CROWN earns its keep on every optimisable op ------------------------------------------
ALPHA_CASES = {"relu": "relu", "leaky_relu": "leaky_relu", "leaky_relu_concave": "leaky_relu",
               "prelu": "prelu", "abs": "abs", "clip": "clamp", "relu6": "clamp",
               "max_const": "clamp", "min_const": "clamp"}


def test_alpha_crown_beats_crown_on_every_optimisable_op():
    """On a wide box, alpha-CROWN's lower bound is strictly above CROWN's on some output, for
    each op with alphas (convex and concave kinks, lower- and upper-side parameters)."""
    from shardbound.runtime.ops import OP_TYPES

    family = {k for k, cls in OP_TYPES.items()
              if cls.has_alpha and cls.__module__.endswith("ops.activation")}
    assert family <= set(ALPHA_CASES.values()), family
    by_name = {c.name: c for c in CASES}
    for name in ALPHA_CASES:
        case = by_name[name]
        verifier, _ = compiled(case, case.opsets[-1])
        lo, hi = make_box("wide", np.random.default_rng(0), verifier.input_shape, case.scale)
        crown, _ = verifier.bounds(lo, hi, method="crown")
        alpha, _ = verifier.bounds(lo, hi, method="alpha-crown")
        assert bool((alpha >= crown).all()) and float((alpha - crown).max()) > 1e-3, name


# -- bad models: one line naming the node ----------------------------------------------------------
def _computed_second_operand(op, **attrs):
    b = zoo.Builder(np.random.default_rng(0), (4,), opset=13)
    h = b.gemm("x", 4, 4)
    other = b.gemm("x", 4, 4)
    ins = [h, other] if op != "Clip" else [h, other, b.const(np.float32(1))]
    return b.build(b.op(op, ins, name="culprit", **attrs))


@pytest.mark.parametrize("op,message", [
    ("PRelu", "slope is computed from the network input"),
    ("Clip", "min is computed from the network input"),
    ("Max", "Max of 2 computed tensors is not supported yet"),
    ("Min", "Min of 2 computed tensors is not supported yet"),
])
def test_computed_operands_are_one_line_errors(tmp_path, op, message):
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.errors import ShardboundError
    from shardbound.passes.manager import PassOptions

    path = tmp_path / "m.onnx"
    onnx.save(_computed_second_operand(op), path)
    with pytest.raises(ShardboundError) as info:
        compile_model(str(path), str(tmp_path / "out"), PassOptions())
    text = str(info.value)
    assert message in text and "'culprit'" in text and "\n" not in text, text


def test_clip_with_nan_bound_is_a_one_line_error(tmp_path):
    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.errors import ShardboundError
    from shardbound.passes.manager import PassOptions

    b = zoo.Builder(np.random.default_rng(0), (4,), opset=13)
    model = b.build(b.op("Clip", [b.gemm("x", 4, 4), b.const(np.float32(np.nan))], name="culprit"))
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(ShardboundError, match="culprit.*min holds nan"):
        compile_model(str(tmp_path / "m.onnx"), str(tmp_path / "out"), PassOptions())



def test_prelu_curvature_is_checked_against_the_slopes():
    """A program whose PRelu claims convex slopes (one side's intercept skipped) but holds a
    slope above 1 is refused, never bounded unsoundly."""
    from shardbound.runtime.errors import ShardboundError
    from shardbound.runtime.ops import OP_TYPES

    op = OP_TYPES["prelu"]("p", ["x"], [(3,)], curvature="convex",
                           params={"slope": torch.tensor([0.5, 2.0, 0.1])})
    lo, hi = torch.full((1, 1, 3), -1.0), torch.full((1, 1, 3), 1.0)
    with pytest.raises(ShardboundError, match="not all convex"):
        op.relax(lo, hi)

# -- the zoo models in every mode ---------------------------------------------------------------
# leaky_residual, clip_abs_mlp and tp_leaky_prelu are OP_ZOO models: tests/test_op_zoo.py
# checks them bitwise against single mode in fsdp P = 1..4 and tp (--tp-intermediate crown)
# P = 2, 3 under `blocked` (IBP, CROWN, alpha-CROWN), and through `verify` in every mode.
def test_tp_zone_holds_leaky_relu_prelu_and_max(tmp_path):
    """tp_leaky_prelu's zone of LeakyRelu -> PRelu (per-neuron slopes: each rank holds its
    slice) -> Max with per-neuron constants: all three are zone elementwise nodes, and its
    520 channels split at 512 on 2 ranks."""
    from shardbound.compiler.driver import inspect_model
    from shardbound.passes.manager import PassOptions

    model, _ = zoo.build("tp_leaky_prelu")
    onnx.save(model, tmp_path / "m.onnx")
    text = inspect_model(str(tmp_path / "m.onnx"), PassOptions(mode="tp", nproc=2))
    for kind in ("leaky_relu", "prelu", "clamp"):       # all three in the zone, split at 512
        (line,) = [ln for ln in text.splitlines() if f" = {kind}(" in ln]
        assert "tp=zone0 elementwise" in line, line
    assert "channels on P=2: [0,512) [512,520)" in text


def _property(path, lo, hi, C, d):
    lines = [f"(declare-const X_{i} Real)" for i in range(len(lo))]
    lines += [f"(declare-const Y_{j} Real)" for j in range(C.shape[1])]
    for i, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
        lines += [f"(assert (>= X_{i} {a!r}))", f"(assert (<= X_{i} {b!r}))"]
    terms = " ".join(f"(* {float(c)!r} Y_{j})" for j, c in enumerate(C[0]) if c != 0)
    lines.append(f"(assert (<= (+ {terms} 0.0) {float(d)!r}))")
    path.write_text("\n".join(lines) + "\n")


def _verify(tmp_path, verifier, lo, hi, C, d, tag):
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.verification.spec import spec_from_property
    from shardbound.runtime.verification.verdict import verify

    path = tmp_path / f"{tag}.vnnlib"
    _property(path, lo, hi, C, d)
    return verify(verifier, spec_from_property(parse_vnnlib(str(path))), 60, SingleComm())


@pytest.mark.parametrize("name,stage", [("leaky_residual", "relu-split"),
                                        ("clip_abs_mlp", "input-split")])
def test_verify_unsat_and_sat_on_zoo_models(tmp_path, name, stage):
    """Thresholds half-way between alpha-CROWN's bound (with optimised intermediates, as
    `verify` computes it) and the lowest value attacks find: unsat, by branch and bound
    (leaky_residual has 20 inputs: it splits LeakyRelu neurons, its only splittable op);
    just above that value: sat, with a counterexample onnxruntime confirms."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.engine.alpha import alpha_crown
    from shardbound.runtime.engine.intermediate_alpha import optimise_intermediate_bounds
    from soundness import attack_min

    model, shape = zoo.build(name)
    onnx.save(model, tmp_path / "m.onnx")
    compile_model(str(tmp_path / "m.onnx"), str(tmp_path / "prog"), PassOptions())
    verifier = load(str(tmp_path / "prog"))
    net = verifier.network
    c = np.random.default_rng(0).uniform(-1, 1, math.prod(shape)).astype(F32)
    lo, hi = torch.from_numpy(c - F32(0.3)), torch.from_numpy(c + F32(0.3))
    C = torch.tensor([[1.0, -1.0, 0.0]])
    found = attack_min(lambda x: net.forward(x.reshape(-1, *shape)).reshape(len(x), -1),
                       lo, hi, C, torch.Generator().manual_seed(0))
    L, H = lo.reshape(1, *shape), hi.reshape(1, *shape)
    with torch.no_grad():
        cache = net.intermediate_bounds(L, H)
    cache = (cache[0], optimise_intermediate_bounds(net, L, H, cache[1]))
    bound = float(alpha_crown(net, L, H, C, cache=cache)[0])
    assert bound < found - 0.1, (bound, found)          # alpha-CROWN alone cannot prove it

    res = _verify(tmp_path, verifier, lo, hi, C, (bound + found) / 2, "unsat")
    assert res.verdict == "unsat" and any(stage in s for s in res.stages), res
    res = _verify(tmp_path, verifier, lo, hi, C, found + 0.05, "sat")
    assert res.verdict == "sat", res
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = res.x.astype(F32).reshape(1, *shape)
    y = session.run(None, {"x": x})[0].reshape(-1)
    assert float(C[0] @ torch.from_numpy(y)) <= found + 0.05 + 1e-5
    assert bool(((res.x >= lo.numpy()) & (res.x <= hi.numpy())).all())


# -- as PyTorch exports them ----------------------------------------------------------------------
class _TorchActivations(torch.nn.Module):
    """nn.PReLU on conv channels and on features, relu6, leaky_relu, hardtanh, abs, clamp with
    a min only, maximum with a constant vector and sign, as `torch.onnx.export` writes them."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.conv, self.prelu_c = nn.Conv2d(2, 3, 3, padding=1), nn.PReLU(3)
        self.fc1, self.prelu_f = nn.Linear(48, 10), nn.PReLU(10)
        self.fc2, self.fc3 = nn.Linear(10, 10), nn.Linear(10, 4)
        with torch.no_grad():
            self.prelu_c.weight.uniform_(-1, 2)
            self.prelu_f.weight.uniform_(-1, 2)

    def forward(self, x):
        F = torch.nn.functional
        h = F.relu6(self.prelu_c(self.conv(x))).flatten(1)
        h = self.prelu_f(F.leaky_relu(self.fc1(h), 0.2))
        h = torch.abs(F.hardtanh(self.fc2(h)))
        h = torch.maximum(torch.clamp(h, min=0.1), torch.full((10,), 0.3))
        return self.fc3(torch.sign(h - 0.5) + h)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")      # the TorchScript exporter
@pytest.mark.parametrize("opset", [9, 13])
def test_torch_exported_activations(tmp_path, opset):
    """Compiled from torch's export (Clip with attributes at 9, Constant inputs at 13): the
    forward pass equals onnxruntime's and the CROWN bounds hold by sampling."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from soundness import assert_sound

    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    path = str(tmp_path / "m.onnx")
    torch.onnx.export(_TorchActivations().eval(), torch.zeros(1, 2, 4, 4), path,
                      opset_version=opset, dynamo=False)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"PRelu", "LeakyRelu", "Clip", "Abs", "Max", "Sign"} <= ops, ops
    compile_model(path, str(tmp_path / "prog"), PassOptions())
    verifier = load(str(tmp_path / "prog"))
    x = np.random.default_rng(0).normal(size=(1, 2, 4, 4)).astype(F32)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = session.run(None, {session.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(verifier.forward(torch.from_numpy(x)).numpy(), want,
                               rtol=1e-5, atol=1e-6)
    lo, hi = torch.from_numpy(x - F32(0.05)), torch.from_numpy(x + F32(0.05))
    lb, ub = verifier.bounds(lo.numpy(), hi.numpy(), method="crown")
    def forward(z):
        return verifier.network.forward(z.reshape(-1, 2, 4, 4)).reshape(len(z), -1)

    assert_sound(forward, lo, hi, lb.reshape(-1), ub.reshape(-1), n=2000, label=f"torch{opset}")
