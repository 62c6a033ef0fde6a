"""The memory figure of one batched beta-CROWN call (runtime/engine/beta.py), registered with
the memory model as "beta-crown": what ReLU branch and bound (runtime/verification/
relu_split.py) holds while it optimises a batch of B domains, the batch being the figure's
boxes (`MethodContext.batch`).

beta-CROWN is alpha-CROWN's lower-side final pass with one more set of optimised tensors: per
node feeding a sign-splittable op (the split nodes), betas (B, S, *node) with Adam's two
moments and the split term -beta s made from them before every pass (4x), and the term's
signs (B, 1, *node) saved by autograd. The A-matrix has a gradient from the first split node
on (the term is added to it there), which is never earlier than the first ReLU's alphas give
it one. Everything else -- the alphas, the live A-matrices, what each step saves -- is
alpha-CROWN's (`alpha_model.optimised_pass_peak`); the bounds held are the batch's (the
intermediate bounds of its domains, clamped by their splits). The figure assumes every split
node has betas (a batch whose domains all carry splits there: the most a round can take).
The batch's round also runs CROWN on it first, so the peak is the larger of the two.
"""

from __future__ import annotations

import math

from shardbound.runtime.accounting.alpha_model import alpha_tensor_bytes, optimised_pass_peak
from shardbound.runtime.accounting.memory_model import F32, _result, register_method_model


def split_nodes(nodes) -> list[str]:
    """The nodes whose neurons branch and bound splits by sign (one per input node)."""
    return list(dict.fromkeys(n.inputs[0] for n in nodes
                              if n.traits.relaxed and getattr(n.traits, "splittable", False)))


@register_method_model("beta-crown")
def beta_crown_peak(ctx) -> dict:
    names = split_nodes(ctx.nodes)
    numel = sum(math.prod(ctx.nodes[ctx.index[name]].shape) for name in names)
    betas = 4 * ctx.batch * ctx.local_rows * numel * F32
    signs = ctx.batch * numel * F32
    peak, at = optimised_pass_peak(ctx, frozenset(names))
    total = ctx.resident + ctx.held + alpha_tensor_bytes(ctx) + betas + signs + peak
    if total <= ctx.crown["peak_tracked_bytes"]:
        return dict(ctx.crown)
    return _result(ctx.resident, total, ("beta-crown", ctx.nodes[at].name))
