"""Issue 15's extreme widths for every smooth function and LayerNorm, end to end: IBP / CROWN /
alpha-CROWN bounds of the harness's sandwich models hold every sampled and PGD point of input boxes of
width 1e-6 and 1e3 (inside the op's domain), CROWN is never looser than IBP and alpha-CROWN
never below CROWN. The harness's box kinds (tests/ops/harness.py) stop at widths 2e-3 and 6;
the relaxations alone are checked at 1e-7 .. 1e30 by tests/ops/lines_check.py.

A 1e3-wide box may overflow float32 inside the model (exp of 500, a cube of 500 behind a
linear layer): bounds may then be infinite, never NaN, and the points still lie within.
The cases scaled up for the harness (`*_x3`, `*_x4`) add nothing at these widths and are
left out.
"""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import test_bilinear  # noqa: E402
import test_exponential  # noqa: E402
import test_gated  # noqa: E402
import test_normalization  # noqa: E402
import test_periodic  # noqa: E402
import test_smooth  # noqa: E402
import test_softmax  # noqa: E402
from harness import SOUND_ALPHA_ITERATIONS, compiled, flat_forward  # noqa: E402
from soundness import REL_TOL, alpha_iterations, assert_within, witness_values  # noqa: E402

CASES = [c for module in (test_smooth, test_exponential, test_periodic, test_gated,
                          test_bilinear, test_softmax, test_normalization)
         for c in module.CASES if "_x" not in c.name and c.boxes
         and c.name not in ("mul_computed", "div_computed", "log_softmax_last",
                            "layer_norm_two_axes_no_bias", "layer_norm_pattern",
                            "layer_norm_pattern_mul_sum_rsqrt")]
# (matmul's planes are mul's and div's; log_softmax's lines alone: tests/ops/test_softmax.py;
# LayerNormalization stands for the normalization variants: the opset-13 pattern is the
# same IR)
WIDTHS = (1e-6, 1e3)


def width_box(width: float, domain: str, rng, shape):
    """(lo, hi) float32 of about this width per coordinate: centred in [-1, 1] on the real
    line; inside x > 0 starting in [1e-3, 3] (the mirror for "negative")."""
    if domain == "real":
        lo = rng.uniform(-1, 1, size=shape) - width / 2
    else:
        lo = np.exp(rng.uniform(np.log(1e-3), np.log(3.0), size=shape))
    lo = lo.astype(np.float32)
    hi = np.maximum((lo.astype(np.float64) + width).astype(np.float32), lo)
    if domain == "negative":
        lo, hi = -hi, -lo
    return lo, hi


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"w{w:g}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sound_at_extreme_widths(case, width):
    opset = case.opsets[0]
    verifier, _ = compiled(case, opset)
    rng = np.random.default_rng(zlib.crc32(f"{case.name}/{width}".encode()))
    lo, hi = width_box(width, case.domain, rng, verifier.input_shape)
    assert bool((hi > lo).any())
    values = witness_values(flat_forward(verifier), torch.from_numpy(lo), torch.from_numpy(hi))
    results = {}
    # (alpha-CROWN through the attention pattern at these widths: 2.5 s each; the harness
    # samples it on its boxes, tests/ops/test_bilinear.py)
    for method in [m for m in case.methods
                   if not (case.name == "matmul_computed" and m == "alpha-crown")]:
        with alpha_iterations(SOUND_ALPHA_ITERATIONS):      # (harness.py: why a few)
            lb, ub = verifier.bounds(lo, hi, method=method)
        label = f"{case.id(opset)}/width {width:g}/{method}"
        assert not bool(torch.isnan(lb).any() or torch.isnan(ub).any()), label
        if width < 1:       # nothing overflows in a narrow box
            assert bool(torch.isfinite(lb).all() and torch.isfinite(ub).all()), label
        slack = REL_TOL * (1 + torch.maximum(lb.abs(), ub.abs()))
        assert bool((lb <= ub + slack).all()), label
        assert_within(values, lb, ub, label=label)
        results[method] = (lb, ub)
    (il, iu), (cl, cu) = results["ibp"], results["crown"]
    assert bool((cl >= il).all() and (cu <= iu).all()), f"{case.name}: CROWN looser than IBP"
    if "alpha-crown" in results:
        assert bool((results["alpha-crown"][0] >= cl).all()), f"{case.name}: alpha-CROWN below CROWN"
