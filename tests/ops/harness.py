"""The op-family test harness: one `OpCase` per op and way of using it; `generate(CASES)`
makes the tests every family file runs on its cases.

- forward: the compiled program's concrete forward pass equals onnxruntime (and onnx.reference,
  unless the case says the reference evaluator disagrees with the spec) on random inputs,
  for each opset the case lists (one per registered since-version: test_coverage.py checks
  that every registered (op, version) has a case);
- soundness (at the case's first opset: the variants differ in lowering, not in the kernel):
  IBP, CROWN and alpha-CROWN bounds (the default `blocked` build) contain 10,000 sampled
  outputs (a quarter on box corners) and a projected-gradient search's (evaluated by the
  case's `fast` build, which check_forward compares with the blocked one), on boxes of every kind (narrow, wide,
  crossing the kinks, deep in saturated regions, degenerate coordinates with lower == upper;
  for ops with a domain, the same kinds inside x > 0 or x < 0: `OpCase.domain`);
  CROWN's bounds are never looser than IBP's and alpha-CROWN's lower bounds never below
  CROWN's.

Case models put the op under test where the box reaches it directly (the first op after the
input, so the box kinds control its input range) and again deeper, behind a linear layer (so
its relaxation meets real A-matrices): see `sandwich`.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import pytest
import torch

import zoo
from soundness import REL_TOL, alpha_iterations, assert_within, witness_values

BOX_KINDS = ("narrow", "wide", "kinks", "saturated", "degenerate")
METHODS = ("ibp", "crown", "alpha-crown")


@dataclass(frozen=True)
class OpCase:
    name: str                           # test id
    op: str                             # the ONNX op under test (for coverage)
    build: Callable                     # build(rng, opset) -> (ModelProto, input shape)
    opsets: tuple[int, ...] = (13,)
    reference: bool = True              # onnx.reference agrees with the spec for this op
    boxes: tuple[str, ...] = BOX_KINDS
    methods: tuple[str, ...] = METHODS
    scale: float = 1.0                  # the input scale of boxes and forward samples
    domain: str = "real"                # "positive" / "negative": boxes inside x > 0 / x < 0
    rtol: float = 1e-4
    atol: float = 1e-5

    def id(self, opset: int) -> str:
        return f"{self.name}-op{opset}"


def make_box(kind: str, rng: np.random.Generator, shape, scale: float = 1.0,
             domain: str = "real"):
    """(lo, hi) float32 of one box kind; `domain` "positive" / "negative" keeps the box inside
    x > 0 / x < 0 (ops with a domain: log, sqrt, a reciprocal), with the kinds read there."""
    shape = tuple(shape)
    if domain != "real":
        lo, hi = _positive_box(kind, rng, shape, scale)
        return (lo, hi) if domain == "positive" else (-hi, -lo)
    center = rng.uniform(-1, 1, size=shape) * scale
    if kind == "narrow":
        radius = np.full(shape, 1e-3 * scale)
    elif kind == "wide":
        radius = rng.uniform(1.0, 3.0, size=shape) * scale
    elif kind == "kinks":           # centred near 0, so kinks at 0 lie inside
        center = rng.uniform(-0.1, 0.1, size=shape) * scale
        radius = rng.uniform(0.3, 0.8, size=shape) * scale
    elif kind == "saturated":       # far from 0 on either side
        center = np.sign(rng.uniform(-1, 1, size=shape)) * rng.uniform(4, 10, size=shape) * scale
        radius = rng.uniform(0.2, 1.0, size=shape) * scale
    elif kind == "degenerate":      # half of the coordinates fixed: lower == upper
        radius = rng.uniform(0.1, 0.5, size=shape) * scale
        radius[rng.uniform(size=shape) < 0.5] = 0.0
    else:
        raise ValueError(kind)
    lo = (center - radius).astype(np.float32)
    hi = (center + radius).astype(np.float32)
    return lo, np.maximum(hi, lo)


def _positive_box(kind: str, rng: np.random.Generator, shape, scale: float):
    """The box kinds inside x > 0: narrow; wide; near 0 (where log, sqrt and 1 / x bend
    hardest: "kinks"); far out ("saturated"); half the coordinates fixed."""
    if kind == "narrow":
        center = np.exp(rng.uniform(np.log(0.05), np.log(3.0), size=shape)) * scale
        lo, hi = center * (1 - 1e-3), center * (1 + 1e-3)
    elif kind == "wide":
        lo = rng.uniform(1e-3, 0.05, size=shape) * scale
        hi = lo + rng.uniform(1.0, 3.0, size=shape) * scale
    elif kind == "kinks":
        lo = rng.uniform(1e-4, 1e-2, size=shape) * scale
        hi = rng.uniform(0.3, 1.0, size=shape) * scale
    elif kind == "saturated":
        center = rng.uniform(4, 10, size=shape) * scale
        radius = rng.uniform(0.2, 1.0, size=shape) * scale
        lo, hi = center - radius, center + radius
    elif kind == "degenerate":
        center = rng.uniform(0.2, 2.0, size=shape) * scale
        radius = rng.uniform(0.1, 0.5, size=shape) * center
        radius[rng.uniform(size=shape) < 0.5] = 0.0
        lo, hi = center - radius, center + radius
    else:
        raise ValueError(kind)
    lo, hi = lo.astype(np.float32), hi.astype(np.float32)
    return lo, np.maximum(hi, lo)


def into_domain(domain: str):
    """A `prepare` for `sandwich`: maps a Gemm's output into (0.01, 2.01) (positive) or its
    mirror (negative) with a Sigmoid, so the op's second use stays inside its domain;
    "bounded": into (-3, 3) with a Tanh (exp after exp would overflow)."""
    if domain == "real":
        return None
    if domain == "bounded":
        return lambda b, h, shape: b.op("Mul", [b.op("Tanh", [h]), b.const(np.float32(3))])
    sign = 1.0 if domain == "positive" else -1.0

    def prepare(b, h, shape):
        h = b.op("Sigmoid", [h])
        return b.op("Add", [b.op("Mul", [h, b.const(np.float32(2 * sign))]),
                            b.const(np.float32(0.01 * sign))])

    return prepare


def sandwich(rng, opset: int, input_shape, apply, width: int = 12, outputs: int = 3,
             prepare=None):
    """x -> apply(op) -> Flatten -> Gemm -> apply(op) -> Gemm: the op under test once on the
    input itself and once behind a linear layer. `apply(builder, tensor, shape) -> (tensor,
    shape)` adds the op (with whatever constants it needs); `prepare(builder, tensor, shape)`,
    when given, maps the linear layer's output before the second use (`into_domain`)."""
    b = zoo.Builder(rng, input_shape, opset=opset)
    h, shape = apply(b, "x", (1, *input_shape))
    if len(shape) != 2:
        h = b.op("Flatten", [h], axis=1)
    n = int(np.prod(shape[1:]))
    h = b.gemm(h, n, width)
    if prepare is not None:
        h = prepare(b, h, (1, width))
    h, shape = apply(b, h, (1, width))
    if len(shape) != 2:
        h = b.op("Flatten", [h], axis=1)
    return b.build(b.gemm(h, int(np.prod(shape[1:])), outputs)), tuple(input_shape)


# -- compiling, with one compile per (case, opset) in a session --------------------------------
_COMPILED: dict[tuple[str, int], tuple] = {}
_TMP = tempfile.TemporaryDirectory(prefix="shardbound-ops-")


def compiled(case: OpCase, opset: int, **options):
    """(verifier, model) for the case at this opset, compiled once per session."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    key = (case.id(opset), tuple(sorted(options.items())))
    if key not in _COMPILED:
        model, _ = case.build(np.random.default_rng(7), opset)
        tag = "_".join([case.id(opset)] + [f"{k}-{v}" for k, v in sorted(options.items())])
        path = os.path.join(_TMP.name, f"{tag}.onnx")
        onnx.save(model, path)
        out = os.path.join(_TMP.name, f"{tag}_prog")
        compile_model(path, out, PassOptions(**options))
        _COMPILED[key] = (load(out), model)
    return _COMPILED[key]


def flat_forward(verifier):
    def forward(x):
        return verifier.network.forward(
            x.reshape(-1, *verifier.input_shape)).reshape(x.shape[0], -1)

    return forward


def references(model, use_reference: bool):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    refs = [("onnxruntime", lambda feed: session.run(None, feed)[0])]
    if use_reference:
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(model)
        refs.append(("onnx.reference", lambda feed: evaluator.run(None, feed)[0]))
    return refs


# -- the checks ---------------------------------------------------------------------------------
# alpha-CROWN's iterations in the soundness checks (its default is 20; the rank jobs' 3,
# multirank.ALPHA_ITERATIONS): soundness holds for any
# alphas, and a few steps already move every alpha off CROWN's slopes through the clamps, the
# relaxation's gradients and the best-so-far bookkeeping; the optimisation was 78% of a
# test_sound's time. Tightness after the full default optimisation is checked by each module's
# test_alpha_crown_beats_crown tests, which keep the default.
SOUND_ALPHA_ITERATIONS = 3


def check_forward(case: OpCase, opset: int) -> None:
    verifier, model = compiled(case, opset)
    rng = np.random.default_rng(11)
    name = model.graph.input[0].name
    refs = references(model, case.reference)
    for kind in BOX_KINDS:                  # inputs from every region the boxes visit
        lo, hi = make_box(kind, rng, verifier.input_shape, case.scale, case.domain)
        x = (lo + rng.uniform(size=lo.shape) * (hi - lo)).astype(np.float32)[None]
        got = verifier.forward(torch.from_numpy(x)).numpy().reshape(-1)
        for ref_name, ref in refs:
            want = np.asarray(ref({name: x})).reshape(-1)
            np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol,
                                       err_msg=f"{case.id(opset)} vs {ref_name} ({kind} input)")
        if opset == case.opsets[0]:         # the `fast` build that evaluates the witnesses
            fast = compiled(case, opset, summation="fast")[0].forward(torch.from_numpy(x))
            np.testing.assert_allclose(fast.numpy().reshape(-1), got, rtol=case.rtol,
                                       atol=case.atol, err_msg=f"{case.id(opset)}: fast vs blocked")


def check_sound(case: OpCase, opset: int, kind: str) -> None:
    verifier, _ = compiled(case, opset)
    rng = np.random.default_rng(zlib.crc32(f"{case.name}/{kind}".encode()))
    lo, hi = make_box(kind, rng, verifier.input_shape, case.scale, case.domain)
    # The witnesses (10,000 samples and a PGD search) are evaluated by the same network built
    # with `fast` sums: the orders differ by rounding only (REL_TOL; check_forward compares the
    # two builds), and the blocked im2col kernels took 1.5 s a box for them.
    sampler, _ = compiled(case, opset, summation="fast")
    values = witness_values(flat_forward(sampler), torch.from_numpy(lo), torch.from_numpy(hi))
    results = {}
    for method in case.methods:
        with alpha_iterations(SOUND_ALPHA_ITERATIONS):
            lb, ub = verifier.bounds(lo, hi, method=method)
        assert bool(torch.isfinite(lb).all() and torch.isfinite(ub).all()), (case.name, method)
        # lower <= upper up to float rounding (a point box: CROWN's rounding vs IBP's exact)
        slack = REL_TOL * (1 + torch.maximum(lb.abs(), ub.abs()))
        assert bool((lb <= ub + slack).all()), (case.name, kind, method)
        assert_within(values, lb, ub, label=f"{case.id(opset)}/{kind}/{method}")
        results[method] = (lb, ub)
    if "ibp" in results and "crown" in results:
        (il, iu), (cl, cu) = results["ibp"], results["crown"]
        assert bool((cl >= il).all() and (cu <= iu).all()), f"{case.name}/{kind}: CROWN looser than IBP"
    if "crown" in results and "alpha-crown" in results:
        assert bool((results["alpha-crown"][0] >= results["crown"][0]).all()), \
            f"{case.name}/{kind}: alpha-CROWN below CROWN"


def generate(cases: list[OpCase], namespace: dict) -> None:
    """Define test_forward and test_sound over `cases` in a test module's namespace."""
    forward_params = [pytest.param(c, o, id=c.id(o)) for c in cases for o in c.opsets]
    # Opset variants differ in their lowering only (the forward checks cover each); the kernel
    # and its bounds are the same, so soundness runs at the case's first opset.
    sound_params = [pytest.param(c, c.opsets[0], k, id=f"{c.id(c.opsets[0])}-{k}")
                    for c in cases for k in c.boxes]

    @pytest.mark.parametrize("case,opset", forward_params)
    def test_forward(case, opset):
        check_forward(case, opset)

    @pytest.mark.parametrize("case,opset,kind", sound_params)
    def test_sound(case, opset, kind):
        check_sound(case, opset, kind)

    namespace["test_forward"] = test_forward
    namespace["test_sound"] = test_sound
