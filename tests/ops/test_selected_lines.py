"""One line per element (runtime/ops/selected_lines.py): alpha-CROWN's step of a
computed-intercept kernel makes, per (row, neuron), only the line the row's coefficient sign
picks. Its soundness rests on each of those lines being the line the two-line `relax` gives
that element: checked here bitwise (slopes, intercepts, and the gradients alpha receives
through both) for every registered computed-intercept kernel, on intervals of every kind
(narrow, wide, saturated, a point, outside a kernel's domain: infinite lines), and the step
itself against the two-line step up to rounding (its products are ordered differently)."""

from __future__ import annotations

import shardbound  # noqa: F401  (first: sets MKL_CBWR before any BLAS call)
import pytest
import torch

from shardbound.runtime.ops.base import OP_TYPES
from shardbound.runtime.ops.intercepts import ALPHA_SPAN, InterceptRelaxation
from shardbound.runtime.ops.selected_lines import crown_selected, selected_lines, selects_lines

KERNELS = sorted(name for name, cls in OP_TYPES.items()
                 if isinstance(cls, type) and issubclass(cls, InterceptRelaxation))


def _case(name, seed=0, n=96, S=5):
    op = OP_TYPES[name]("k", ["x"], [(n,)])
    g = torch.Generator().manual_seed(seed)
    centre = torch.rand(n, generator=g) * 8 - 4
    width = torch.rand(n, generator=g) * 3
    width[: n // 8] = torch.rand(n // 8, generator=g) * 1e-4      # narrow
    width[n // 8: n // 6] = 0.0                                      # a point
    centre[n // 6: n // 4] += 40.0                                   # saturated / huge
    width[n // 4: n // 3] *= 100.0                                   # wide
    lo = (centre - width / 2).reshape(1, 1, n)
    hi = (centre + width / 2).reshape(1, 1, n)
    alpha = (torch.rand(1, S, 2, n, generator=g) * ALPHA_SPAN).requires_grad_()
    A = torch.randn(1, S, n, generator=g)
    A[:, :, :4] = 0.0
    return op, lo, hi, alpha, A


@pytest.mark.parametrize("name", KERNELS)
def test_each_selected_line_is_the_two_line_relaxations_line_bitwise(name):
    op, lo, hi, alpha, A = _case(name)
    assert selects_lines(op, alpha, A)
    upper = A < 0
    w, b = selected_lines(op, lo, hi, alpha, upper)
    lines = op.relax(lo, hi, alpha)
    w2 = torch.where(upper, lines.upper_slope, lines.lower_slope)
    b2 = torch.where(upper, lines.upper_icpt, lines.lower_icpt)
    assert torch.equal(w, w2) and torch.equal(b, b2), name
    assert not torch.isnan(b).any()
    # the gradients alpha receives through the slopes and the intercepts
    g = torch.Generator().manual_seed(1)
    gw, gb = torch.randn(w.shape, generator=g), torch.randn(b.shape, generator=g)
    finite = torch.isfinite(b2)
    (d1,) = torch.autograd.grad((w * gw).sum() + (torch.where(finite, b, 0.0) * gb).sum(),
                                alpha)
    (d2,) = torch.autograd.grad((w2 * gw).sum() + (torch.where(finite, b2, 0.0) * gb).sum(),
                                alpha)
    assert torch.equal(d1, d2), name


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "exp", "gelu", "sin"])
def test_the_step_matches_the_two_line_step_up_to_rounding(name):
    op, lo, hi, alpha, A = _case(name, seed=2)
    lo, hi = lo[:, 0], hi[:, 0]
    with torch.no_grad():
        got = crown_selected(op, A, None, (lo, hi), alpha)
        op._alpha_step = lambda *args: None     # the generic two-line step, this instance
        ref = op.crown_backward(A, None, [(lo, hi)], alpha=alpha)
    assert torch.allclose(got[0][0], ref[0][0], rtol=1e-6, atol=1e-6)
    finite = torch.isfinite(ref[2])
    assert torch.equal(finite, torch.isfinite(got[2]))
    assert torch.equal(got[2][~finite], ref[2][~finite])
    assert torch.allclose(got[2][finite], ref[2][finite], rtol=1e-5, atol=1e-5)
