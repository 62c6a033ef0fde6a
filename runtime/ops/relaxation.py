"""The relaxation interface: how a nonlinear op gives CROWN its linear bounds.

A relaxed op y = f(x) gives, for input bounds [l, u], a lower and an upper line per element,

    lower_slope * x + lower_icpt  <=  f(x)  <=  upper_slope * x + upper_icpt   for x in [l, u],

each sound for every point of the interval (an intercept of None means 0). The backward
step is then generic (`ElementwiseRelaxation.crown_backward`): on the lower-bound side a
positive A-coefficient takes the lower line and a negative one the upper line, and the other
way round on the upper side.

Optimisable relaxations (`has_alpha`): the lines may depend on parameters alpha, one tensor per
node, with `alpha_init(in_bounds)` (B, *alpha_shape) giving the starting point (CROWN's own
choice), and `alpha_project_(alpha)` projecting in place onto the feasible set after each
optimiser step (default: the box [0, 1]). Every feasible alpha must give sound lines, so the
optimiser (runtime/engine/optimise.py) can do what it likes with them. The engine gives each
spec row its own alphas: `relax` receives them as (B, S, *alpha_shape).

Splittable ops (`splittable`): branch and bound may split the op's input at 0 (x >= 0 on one
child, x <= 0 on the other), after which the op is linear on each child; `branch_slack(l, u)`
scores how much relaxation slack a split removes.

Interval-splittable ops (`interval_splittable`, GenBaB-style): branch and bound may split the
op's input interval [l, u] at `split_point(l, u)` (the midpoint by default) into [l, p] and
[p, u]; each child relaxes the op on its half. `interval_slack(l, u)` scores a split: the gap
between the upper and the lower line at the midpoint (what the relaxation loses there).

Lines that do not exist (log near 0, a reciprocal across 0: no finite line bounds f there) have
infinite intercepts; a relaxation that may give them declares `infinite_lines`, and the CROWN
step then counts them apart, with 0 * inf = 0 (`_dot_infinite`).

Which neurons need input bounds at all: `inexact_inputs(in_bounds)` marks, per input, the
elements whose relaxation is not exact under the given bounds (a stable ReLU neuron is exact
whatever its bounds): CROWN spends its rows only on those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardbound.runtime.numerics.select import blend
from shardbound.runtime.numerics.shapes import broadcast_shape
from shardbound.runtime.ops.base import Op
from shardbound.runtime.ops.patches import Patches, SparseAlpha, WindowAlpha
from shardbound.runtime.ops.patches import dense as _dense

PATCH_STEP_CHUNK = 1 << 18     # elements of patch values per row chunk of the CROWN step


@dataclass
class Lines:
    """Elementwise linear bounds; tensors broadcast against (B, S, *shape); None = 0."""

    lower_slope: torch.Tensor
    lower_icpt: torch.Tensor | None
    upper_slope: torch.Tensor
    upper_icpt: torch.Tensor | None


class ElementwiseRelaxation(Op):
    """A unary op applied to each element alone, bounded by `relax`'s lines."""

    relaxed = True
    backward_memory = "separate"
    # alpha moves only the lower line's slope, on inexact neurons, and that line has no
    # intercept (ReLU): full alpha-CROWN then keeps alphas of the inexact neurons alone
    alpha_slope_only = False
    alpha_saved = (2.05, 4.5)       # measured (ReLU): slopes' masks and the clamped A
    accepts_patches = True          # its lines are gathered at each row's window

    def relax(self, lo: torch.Tensor, hi: torch.Tensor, alpha=None) -> Lines:
        """Sound lines over [lo, hi] (each (B, 1, *shape); alpha (B, S, *alpha_shape))."""
        raise NotImplementedError

    def inexact(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Bool, like lo: where the relaxation loses something (default: wherever lo < hi)."""
        return lo < hi

    def inexact_inputs(self, in_bounds) -> list[torch.Tensor | None]:
        lo, hi = in_bounds[0]
        return [self.inexact(lo, hi)]

    # -- optimisable parameters (used when has_alpha) ------------------------------------------
    def alpha_init(self, in_bounds) -> torch.Tensor:
        """Starting parameters (B, *alpha_shape) for the input bounds [(lo, hi)], each
        (B, *in_shape): the relaxation CROWN would use."""
        raise NotImplementedError

    def alpha_project_(self, alpha: torch.Tensor) -> None:
        """Project in place onto the feasible set (every point of it gives sound lines)."""
        alpha.clamp_(0, 1)

    # -- branch and bound (used when splittable) ---------------------------------------------
    def branch_slack(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """>= 0 per element: the relaxation slack a split of the input at 0 removes (0 where
        the element is not split-worthy)."""
        raise NotImplementedError

    # -- branch and bound on input intervals (used when interval_splittable) -------------------
    def split_point(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Where to split [lo, hi] (same shape): the midpoint."""
        return lo + (hi - lo) / 2

    def interval_slack(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """>= 0 per element (lo, hi: (B, *shape)): the gap between CROWN's upper and lower
        line at the interval's midpoint; 0 where the interval is a point, infinite or too
        narrow for its split point to lie strictly inside it."""
        lines = self.relax(lo.unsqueeze(1), hi.unsqueeze(1))
        mid = self.split_point(lo, hi)
        zero = torch.zeros_like(lo)
        gap = (lines.upper_slope - lines.lower_slope).squeeze(1) * mid + (
            (zero if lines.upper_icpt is None else lines.upper_icpt.squeeze(1))
            - (zero if lines.lower_icpt is None else lines.lower_icpt.squeeze(1)))
        inside = torch.isfinite(lo) & torch.isfinite(hi) & (mid > lo) & (mid < hi)
        return torch.where(inside & torch.isfinite(gap), gap.clamp(min=0), zero)

    # -- the generic CROWN step ------------------------------------------------------------------
    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        """`alpha`, when given, shapes the lower-bound side's lines (alpha-CROWN); the upper
        side keeps the default relaxation."""
        if isinstance(alpha, WindowAlpha):
            return self._crown_window_alpha(lA, uA, in_bounds[0], alpha.values)
        if isinstance(alpha, SparseAlpha):
            return self._crown_sparse_alpha(lA, uA, in_bounds[0], alpha)
        if alpha is not None:
            step = self._alpha_step(lA, uA, in_bounds[0], alpha)
            if step is not None:
                return step
        bounds = in_bounds[0]
        lo, hi = bounds[0].unsqueeze(1), bounds[1].unsqueeze(1)   # broadcast over the S rows
        if alpha is None and not _differentiable(*bounds):
            # CROWN's lines depend on the bounds alone, and every row tile and every node's
            # pass of one intermediate-bounds round meets the same ones (carvana's UNet: 16% of
            # its CROWN stage was Relu.relax remade per tile of 1,024 rows); the same memo as
            # the sparse-alpha step's, the same tensors as a fresh relax.
            lines = self.memo("_crown_lines").get(bounds, lambda: self.relax(lo, hi, None))
        else:
            lines = self.relax(lo, hi, alpha)
        if isinstance(lA, Patches) and alpha is None:
            return self._crown_patches(lA, uA, lines)
        lA_in, l_bias = self._side(lA, lines.lower_slope, lines.lower_icpt,
                                   lines.upper_slope, lines.upper_icpt)
        if uA is None:                      # lower bound only
            return [lA_in], [None], l_bias, None
        if alpha is not None:
            lines = self.relax(lo, hi, None)
        uA_in, u_bias = self._side(uA, lines.upper_slope, lines.upper_icpt,
                                   lines.lower_slope, lines.lower_icpt)
        return [lA_in], [uA_in], l_bias, u_bias

    def _alpha_step(self, lA, uA, bounds, alpha):
        """A kernel's own step with dense alphas (the four results of `crown_backward`), or
        None for the generic one (computed-intercept kernels make one line per element:
        selected_lines.py)."""
        return None

    def _crown_patches(self, lA, uA, lines: Lines):
        """The step on rows in patches form: the lines gathered once at the windows (both
        sides' windows lie alike after the same steps), then `_side_patches` per side; in
        chunks of rows (`PATCH_STEP_CHUNK` elements of values at a time) written into the
        outputs, so the gathered lines and the step's temporaries are a chunk's, not the
        pass's (the ResNet's peak was here: 3 gathered lines + 4 temporaries of 4,096 rows).
        Rows are independent, so chunking changes no bit."""
        sides = [lA] if uA is None else [lA, uA]
        if not all(isinstance(A, Patches) and A.window == lA.window
                   and torch.equal(A.origin, lA.origin) for A in sides):
            sides = [lA.to_dense()] + ([] if uA is None else [_dense(uA)])
            lA_in, l_bias = self._side(sides[0], lines.lower_slope, lines.lower_icpt,
                                       lines.upper_slope, lines.upper_icpt)
            if uA is None:
                return [lA_in], [None], l_bias, None
            uA_in, u_bias = self._side(sides[1], lines.upper_slope, lines.upper_icpt,
                                       lines.lower_slope, lines.lower_icpt)
            return [lA_in], [uA_in], l_bias, u_bias
        B, S = lA.values.shape[:2]
        step = max(1, PATCH_STEP_CHUNK // max(1, math.prod(lA.values.shape[2:]) * B))
        if step >= S or _differentiable(*(A.values for A in sides)):
            return self._crown_patch_rows(lA, uA, lines)
        outs = [A.values.new_empty((B, *A.values.shape[1:])) for A in sides]
        biases = [[] for _ in sides]
        table = lA.window_table(list(_line_tensors(lines).values()))    # once, not per chunk
        for s0 in range(0, S, step):
            rows = [A.with_values(A.values[:, s0:s0 + step], A.origin[s0:s0 + step])
                    for A in sides]
            dsts = [out[:, s0:s0 + step] for out in outs]
            (l_in,), (u_in,), l_bias, u_bias = self._crown_patch_rows(
                rows[0], None if uA is None else rows[1], lines, table, dsts)
            for dst, A_in, bias, acc in zip(dsts, (l_in, u_in), (l_bias, u_bias), biases):
                if A_in.values.data_ptr() != dst.data_ptr():    # not written in place
                    dst.copy_(A_in.values)
                acc.append(bias)
        biases = [None if acc[0] is None else torch.cat(acc, dim=1) for acc in biases]
        lA_in = lA.with_values(outs[0], dirty=False)
        if uA is None:
            return [lA_in], [None], biases[0], None
        return [lA_in], [uA.with_values(outs[1], dirty=False)], biases[0], biases[1]

    def _crown_sparse_alpha(self, lA, uA, bounds, alpha: SparseAlpha):
        """The step with alphas of the neurons `alpha.index` only (`SparseAlpha`; ops with
        `alpha_slope_only`): CROWN's lines on every column, then the columns of those neurons
        again with the alpha lines, copied over. Per element it is the arithmetic of dense
        alphas (B, S, *shape) holding CROWN's slopes elsewhere, and the bias terms are the
        same (the alpha does not move the line that carries an intercept), so the bits are
        theirs in every order; Adam then steps k instead of all neurons per row (bench cnn:
        521 of 12,288 per row of the fc start node)."""
        lo, hi = bounds
        lA, uA = (_dense(lA),) * 2 if uA is lA else (_dense(lA), _dense(uA))
        B, S = lA.shape[:2]
        n = math.prod(lA.shape[2:])
        # CROWN's lines depend on the bounds alone: every later pass of a full alpha-CROWN
        # iteration meets the same ones (a memo of the last bounds)
        base = self.memo("_crown_lines").get((lo, hi), lambda: self.relax(
            lo.unsqueeze(1), hi.unsqueeze(1), None))
        idx = alpha.index
        at = {k: t.reshape(t.shape[0], 1, n).index_select(-1, idx) for k, t in
              (("lo", lo), ("hi", hi))}
        lines = self.relax(at["lo"], at["hi"], alpha.values)
        lA_in, l_bias = self._side(lA, base.lower_slope, base.lower_icpt, base.upper_slope,
                                   base.upper_icpt, closed_form=True)
        part, _ = self._side(lA.reshape(B, S, n).index_select(-1, idx), lines.lower_slope,
                             None, lines.upper_slope, None, closed_form=True)
        lA_in = lA_in.reshape(B, S, n).index_copy(-1, idx, part).reshape(lA.shape)
        if uA is None:
            return [lA_in], [None], l_bias, None
        uA_in, u_bias = self._side(uA, base.upper_slope, base.upper_icpt, base.lower_slope,
                                   base.lower_icpt)
        return [lA_in], [uA_in], l_bias, u_bias

    def _crown_window_alpha(self, lA: Patches, uA, bounds, alpha: torch.Tensor):
        """The step on rows in patches form whose parameters `alpha` lie at their windows
        (B, S, C, ph, pw; `WindowAlpha`): the input bounds gathered at the windows, the lines
        made there (per row: alpha is), zero outside the grid as `_crown_patches`' gathered
        lines are (the rows' entries there are left by a conv step, `Patches.dirty`). Each
        line holds on its element's interval, so the step is as sound as the dense one; the
        values inside the windows are the dense rows' products. Under `fast` the bias terms
        sum over the windows; under the ordered summations over the dense rows, against the
        intercepts over the whole node, which for an op whose alpha moves only the lower
        line's slope (`alpha_slope_only`, the only ops full alpha-CROWN lays out at windows
        there) are the alpha-free lines' (`_side_patches`: the dense bits)."""
        lo, hi = bounds
        lo_w, hi_w = lA.gather_many([lo.unsqueeze(1), hi.unsqueeze(1)])
        inside = lA.inside()[None, :, None]
        zero = torch.zeros((), dtype=lo_w.dtype, device=lo_w.device)
        whole = {} if self.order == "fast" else _line_tensors(
            self.relax(lo.unsqueeze(1), hi.unsqueeze(1), None))

        def at_windows(lines: Lines) -> dict:
            got = {k: torch.where(inside, t, zero) for k, t in _line_tensors(lines).items()}
            return {k: None if k not in got else (whole.get(k, got[k]) if k.endswith("icpt")
                                                  else got[k], got[k]) for k in _LINE_NAMES}

        g = at_windows(self.relax(lo_w, hi_w, alpha))
        lA_in, l_bias = self._side_patches(lA, g["lower_slope"], g["lower_icpt"],
                                           g["upper_slope"], g["upper_icpt"], closed_form=True)
        if uA is None:
            return [lA_in], [None], l_bias, None
        g = at_windows(self.relax(lo_w, hi_w, None))
        uA_in, u_bias = self._side_patches(uA, g["upper_slope"], g["upper_icpt"],
                                           g["lower_slope"], g["lower_icpt"])
        return [lA_in], [uA_in], l_bias, u_bias

    def _crown_patch_rows(self, lA, uA, lines: Lines, table=None, outs=(None, None)):
        """`_crown_patches` on rows whose windows lie alike on both sides (`table`: the
        lines' windows per grid position, made once for all chunks of a step; `outs`: where
        each side's values may be written, see `_side_patches`)."""
        full = _line_tensors(lines)
        got = dict(zip(full, lA.gather_many(list(full.values()), table=table)))
        g = {k: (None if k not in full else (full[k], got[k])) for k in _LINE_NAMES}
        outs = list(outs) + [None] * (2 - len(outs))
        lA_in, l_bias = self._side_patches(lA, g["lower_slope"], g["lower_icpt"],
                                           g["upper_slope"], g["upper_icpt"], out=outs[0])
        if uA is None:
            return [lA_in], [None], l_bias, None
        uA_in, u_bias = self._side_patches(uA, g["upper_slope"], g["upper_icpt"],
                                           g["lower_slope"], g["lower_icpt"], out=outs[1])
        return [lA_in], [uA_in], l_bias, u_bias

    def _side(self, A, pos_slope, pos_icpt, neg_slope, neg_icpt, closed_form: bool = False):
        """pos * pos_line + neg * neg_line with pos = max(A, 0), neg = A - pos: one clamp,
        and the bias terms summed in the program's order. Without gradients the step works
        in place: the full-size temporaries are pos and the result alone (bits are those of
        A * neg_slope + pos * (pos_slope - neg_slope), computed in that order)."""
        B, S = self._rows(A)
        pos = A.clamp(min=0)
        bias = None
        if pos_icpt is not None:
            bias = self._bias_dot(pos, pos_icpt, B, S)
        if neg_icpt is not None:
            term = self._bias_dot(A - pos, neg_icpt, B, S)
            bias = term if bias is None else bias + term
        if closed_form and _differentiable(A, pos_slope, neg_slope, pos_icpt, neg_icpt):
            return _lines_step(A, pos, pos_slope, neg_slope), bias
        A_in = A * neg_slope
        step = pos_slope - neg_slope
        if _differentiable(A, pos_slope, neg_slope, pos_icpt, neg_icpt) \
                or A_in.shape != pos.shape:     # (a bias dot may keep pos for a gradient)
            return A_in + pos * step, bias
        pos.mul_(step)
        return A_in.add_(pos), bias

    def _side_patches(self, A: Patches, pos_slope, pos_icpt, neg_slope, neg_icpt,
                      closed_form: bool = False, out: torch.Tensor | None = None):
        """`_side` on rows in patches form; each line is (the full tensor, its values at the
        windows) or None. The same elementwise steps; the bias terms summed over the windows
        (`fast`) or over the dense rows (ordered summations: the dense bits). `out`, of the
        values' shape: the result is written there (a chunk of the step's output: no copy
        of each chunk afterwards; elementwise products have the same bits wherever they
        land)."""
        B, S = self._rows(A)
        values = A.values
        pos = values.clamp(min=0)
        bias = None
        for coef, icpt in ((pos, pos_icpt), (None, neg_icpt)):
            if icpt is None:
                continue
            coef = values - pos if coef is None else coef
            if self.order == "fast":
                g = icpt[1]
                n = math.prod(g.shape[2:])      # explicit sizes: a window may hold no neurons
                term = self._icpt_dot(coef.reshape(B, S, n), g.reshape(g.shape[0], S, n))
            else:
                term = self._ordered_patch_dot(A.with_values(coef), icpt[0], B)
            bias = term if bias is None else bias + term
        ns = neg_slope[1]
        grad = _differentiable(values, pos_slope[0], neg_slope[0], *(
            line[0] for line in (pos_icpt, neg_icpt) if line is not None))
        if closed_form and grad:
            return A.with_values(_lines_step(values, pos, pos_slope[1], ns), dirty=False), bias
        if out is not None and not grad and out.shape == pos.shape and \
                tuple(broadcast_shape(values.shape, ns.shape)) == tuple(out.shape):
            A_in = torch.mul(values, ns, out=out)
        else:
            A_in = values * ns
        step = pos_slope[1] - ns
        if grad or A_in.shape != pos.shape:
            return A.with_values(A_in + pos * step, dirty=False), bias
        pos.mul_(step)
        return A.with_values(A_in.add_(pos), dirty=False), bias

    def _ordered_patch_dot(self, A: Patches, icpt, B):
        """The bias term of patches rows under an ordered summation: the dense rows' bits,
        from the windows at the intercepts' nonzeros where the node's dot is the plain one
        (`Patches.support_dot`), else over the dense rows made in chunks."""
        if type(self)._dot is Op._dot and not getattr(self, "infinite_lines", False):
            term = A.support_dot(icpt, self.order)
            if term is not None:
                return term
        return A.dense_map(lambda rows: self._bias_dot(rows, icpt, B, rows.shape[1]))

    def _bias_dot(self, coef, icpt, B, S):
        flat = icpt.reshape(icpt.shape[0], icpt.shape[1], math.prod(icpt.shape[2:]))
        return self._icpt_dot(coef.reshape(B, S, flat.shape[-1]), flat)

    def _icpt_dot(self, coef, icpt):
        """sum(coef * icpt) over the last axis: the node's own dot, or `_dot_infinite` for
        kernels whose lines may not exist (`infinite_lines`)."""
        if getattr(self, "infinite_lines", False):
            return self._dot_infinite(coef, icpt)
        return self._dot(coef, icpt)

    def _dot_infinite(self, coef, icpt):
        """sum(coef * icpt) where intercepts may be infinite (a line that does not exist: log
        near 0, a reciprocal across 0), with 0 * inf = 0: the finite intercepts through the
        node's own dot, the infinite ones counted by two more dots (so a tp zone counts them
        across ranks; the trait is per class, so every rank makes the same calls). A sound
        line never makes the count come out both ways; if it did, -inf wins."""
        finite = torch.isfinite(icpt)
        part = self._dot(coef, torch.where(finite, icpt, torch.zeros_like(icpt)))
        ones = torch.ones_like(icpt)
        with torch.no_grad():
            down = ((coef > 0) & (icpt == -math.inf)) | ((coef < 0) & (icpt == math.inf))
            up = ((coef > 0) & (icpt == math.inf)) | ((coef < 0) & (icpt == -math.inf))
            n_down = self._dot(down.to(coef.dtype), ones)
            n_up = self._dot(up.to(coef.dtype), ones)
        part = torch.where(n_up > 0, torch.full_like(part, math.inf), part)
        return torch.where(n_down > 0, torch.full_like(part, -math.inf), part)


def _lines_step(A, pos, pos_slope, neg_slope):
    """A * neg_slope + pos * (pos_slope - neg_slope) (pos = max(A, 0)) under autograd: through
    `_LinesStep` (its gradient in closed form) where the result has A's shape, else composed.
    Full alpha-CROWN's layouts only (`SparseAlpha`, `WindowAlpha`), whose saved tensors the
    memory model counts as such; alpha-CROWN and beta-CROWN keep the composed ops (their
    figures, runtime/accounting/alpha_model.py, were measured on them)."""
    if not (isinstance(pos_slope, torch.Tensor) and isinstance(neg_slope, torch.Tensor)) \
            or tuple(broadcast_shape(A.shape, pos_slope.shape, neg_slope.shape)) != \
            tuple(A.shape):
        return A * neg_slope + pos * (pos_slope - neg_slope)
    return _LinesStep.apply(A, pos_slope, neg_slope)


class _LinesStep(torch.autograd.Function):
    """The CROWN step's product A * neg_slope + max(A, 0) * (pos_slope - neg_slope), the same
    bits as composed, with its gradient in closed form: autograd of the composed ops kept pos,
    the slope difference and clamp's mask per step and made ~8 full-size ops in backward (bench
    cnn, full alpha-CROWN: a third of the time was clamp's and where's backward); here it keeps
    A and the slopes, and makes d/dA = g * (A >= 0 ? pos_slope : neg_slope) (clamp's
    subgradient at 0), d/dpos_slope = g * max(A, 0), d/dneg_slope = g * min(A, 0), each summed
    to its operand's broadcast shape."""

    @staticmethod
    def forward(ctx, A, pos_slope, neg_slope):
        pos = A.clamp(min=0)
        out = A * neg_slope
        ctx.save_for_backward(A, pos_slope, neg_slope)
        return out.add_(pos.mul_(pos_slope - neg_slope))

    @staticmethod
    def backward(ctx, g):
        A, pos_slope, neg_slope = ctx.saved_tensors
        dA = dpos = dneg = None
        if ctx.needs_input_grad[0]:
            # (the sign of A follows the data: a branch-free pick, numerics/select.py)
            dA = g * blend(A >= 0, pos_slope, neg_slope)
        if ctx.needs_input_grad[1]:
            dpos = (g * A.clamp(min=0)).sum_to_size(pos_slope.shape)
        if ctx.needs_input_grad[2]:
            dneg = (g * A.clamp(max=0)).sum_to_size(neg_slope.shape)
        return dA, dpos, dneg


_LINE_NAMES = ("lower_slope", "lower_icpt", "upper_slope", "upper_icpt")


def _line_tensors(lines: Lines) -> dict:
    """The lines' tensors that exist, by name, in a fixed order."""
    return {k: getattr(lines, k) for k in _LINE_NAMES if getattr(lines, k) is not None}


def _differentiable(*tensors) -> bool:
    """Whether autograd records through any of these (then nothing is done in place)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)
