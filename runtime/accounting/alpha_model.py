"""The memory figure of alpha-CROWN (runtime/engine/alpha.py), registered with the memory model.

alpha-CROWN first runs CROWN (the intermediate passes and a plain final pass: CROWN's own
prediction), then optimises the slopes of the final pass: every iteration replays that pass on
the lower side only, with gradients. What the ledger sees then, on top of the resident
parameters and the bounds held for the final pass:

- `alpha`: one slope tensor per optimisable op, (B, S, *its input), with Adam's two moments
  (3x), S being this rank's spec rows (fsdp shards them; the optimisation is never tiled);
- `autograd`: what each backward step saves for the gradient. That depends on the kernel's
  arithmetic, so each kernel class declares it (`Op.alpha_saved`: A-matrix-sized tensors
  saved per step, in units of B x S x its inputs' elements x 4 bytes, for an incoming
  A-matrix without and with a gradient -- an A-matrix has one once a step with alphas lies
  between it and the output), plus its bias once gradients flow (and its weight where the
  kernel declares `alpha_saves_weight`: the im2col convolution); the box terms at the input
  save two more input-sized A-matrices;
- `a_matrix`: the one (lower) side's live A-matrices and the step's outputs.

The figures were measured with the ledger's own SavedTensorCounter on the zoo (ReLU 2.05 /
4.5, sigmoid-like smooth functions ~10.6 / 12.6, MaxPool 9.1, linear and conv 0.25);
tests/test_memory_budget.py checks the whole prediction against measured peaks.
"""

from __future__ import annotations

import math

from shardbound.runtime.accounting.memory_model import F32, _result, register_method_model


def _numel(nodes, index, name) -> int:
    return math.prod(nodes[index[name]].shape)


def _kept_param_bytes(node) -> int:
    """Parameter bytes autograd keeps once gradients flow: the bias, and the weight where the
    kernel declares it (`alpha_saves_weight`: the im2col convolution)."""
    weight = math.prod(node.weight_shape) if node.weight_shape else 0
    kept = sum(node.param_numels) - weight
    if getattr(node.traits, "alpha_saves_weight", False):
        kept += weight
    return kept * F32


def optimised_pass_peak(ctx, grad_from=frozenset()) -> tuple[int, int]:
    """(bytes on top of resident parameters, held bounds and the optimised tensors, index of
    the node at the peak) of one lower-side final pass with gradients: the live A-matrices,
    each step's outputs and gathered parameters, and what autograd saved so far. An incoming
    A-matrix has a gradient once a step with alphas lies between it and the output, or from
    a node in `grad_from` on (beta-CROWN adds its split terms to the A-matrix there)."""
    nodes, index, B, S = ctx.nodes, ctx.index, ctx.batch, ctx.local_rows
    t = index[ctx.output]
    first = B * S * math.prod(nodes[t].shape) * F32
    live = {nodes[t].name: first}
    a_prev = first
    saved, grad = 0, False
    peak, at = first + ctx.gathered[t], t
    for j in range(t, -1, -1):
        node = nodes[j]
        if node.name not in live or node.traits.is_input:
            continue
        incoming = live.pop(node.name)
        grad = grad or node.name in grad_from
        new_bytes = 0
        sizes = [B * S * _numel(nodes, index, name) * F32 for name in node.inputs]
        for name, size in zip(node.inputs, sizes):
            produced = incoming if node.traits.backward_memory == "view" else size
            if node.traits.backward_memory != "view":
                new_bytes += size
            if name in live:
                produced = size             # summed into a new tensor
            live[name] = produced
        units = getattr(node.traits, "alpha_saved", (0.0, 0.25))[1 if grad else 0]
        saved += int(units * sum(sizes)) + (_kept_param_bytes(node) if grad else 0)
        if saved + a_prev + new_bytes + ctx.gathered[j] > peak:
            peak, at = saved + a_prev + new_bytes + ctx.gathered[j], j
        if node.traits.relaxed and node.traits.has_alpha:
            grad = True
        a_prev = sum(live.values())
        if saved + a_prev > peak:
            peak, at = saved + a_prev, j
    if grad:                            # the box terms keep the input's A-matrix twice
        saved += 2 * B * S * math.prod(nodes[0].shape) * F32
        peak = max(peak, saved + a_prev)
    return peak, at


def alpha_tensor_bytes(ctx) -> int:
    """The slopes of every optimisable op, (B, S, *its input) each, with Adam's moments."""
    nodes, index = ctx.nodes, ctx.index
    return 3 * sum(ctx.batch * ctx.local_rows * n.traits.alpha_per_element
                   * sum(_numel(nodes, index, i) for i in n.inputs) * F32
                   for n in nodes if n.traits.relaxed and n.traits.has_alpha)


@register_method_model("alpha-crown")
def alpha_crown_peak(ctx) -> dict:
    peak, at = optimised_pass_peak(ctx)
    total = ctx.resident + ctx.held + alpha_tensor_bytes(ctx) + peak
    if total <= ctx.crown["peak_tracked_bytes"]:
        return dict(ctx.crown)
    return _result(ctx.resident, total, ("alpha-crown", ctx.nodes[at].name))
