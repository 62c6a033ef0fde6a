"""A compiled verifier used from Python under torch.inference_mode() (PyTorch's advice for
evaluation) gives what it gives outside it: the entry points leave inference mode for their
own work (runtime/program/grad_mode.py). Before, every model with a smooth function or a
softmax failed with "Inference tensors do not track version counter"."""
from __future__ import annotations

import pytest
import torch

from conftest import compile_zoo_in


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    return compile_zoo_in(tmp_path_factory.mktemp("inference_mode"), "sigmoid_mlp")[0]


def _box(v):
    x = torch.rand(*v.input_shape, generator=torch.Generator().manual_seed(0))
    return x - 0.05, x + 0.05


@pytest.mark.parametrize("method", ["ibp", "crown", "alpha-crown"])
def test_bounds_under_inference_mode_are_the_same_bits(verifier, method):
    lo, hi = _box(verifier)
    want = verifier.bounds(lo, hi, method=method)
    with torch.inference_mode():
        got = verifier.bounds(lo.clone(), hi.clone(), method=method)   # inference tensors
        y = verifier.forward(lo.clone())
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(y, verifier.forward(lo))


def test_verify_under_inference_mode(verifier, tmp_path):
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.verification.spec import spec_from_property
    from shardbound.runtime.verification.verdict import verify

    lo, hi = _box(verifier)
    n, m = lo.numel(), verifier.forward(lo).numel()
    ub = verifier.bounds(lo, hi, method="crown")[1]
    lines = [f"(declare-const X_{i} Real)" for i in range(n)]
    lines += [f"(declare-const Y_{j} Real)" for j in range(m)]
    lines += [f"(assert (>= X_{i} {float(a)!r}))\n(assert (<= X_{i} {float(b)!r}))"
              for i, (a, b) in enumerate(zip(lo.reshape(-1), hi.reshape(-1)))]
    lines.append(f"(assert (>= Y_0 {float(ub[0]) + 1.0!r}))")          # above every value
    (tmp_path / "p.vnnlib").write_text("\n".join(lines) + "\n")
    spec = spec_from_property(parse_vnnlib(str(tmp_path / "p.vnnlib")))
    with torch.inference_mode():
        result = verify(verifier, spec, 30, SingleComm())
    assert result.verdict == "unsat"
