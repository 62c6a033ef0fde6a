"""Soundness checks: sampled points and projected-gradient attacks inside the box must land
within the bounds, for every output row."""

from __future__ import annotations

from contextlib import contextmanager

import torch

# Bounds are computed in float32; a concrete forward pass rounds differently. This slack
# (relative to the output scale) absorbs rounding only: any real relaxation error is far larger.
REL_TOL = 2e-5


def sample_box(lower, upper, n, generator):
    """n points: uniform inside, a quarter of them on random vertices (where extremes lie)."""
    lo, hi = lower.reshape(1, -1), upper.reshape(1, -1)
    u = torch.rand(n, lo.shape[1], generator=generator)
    vertices = (torch.rand(n // 4, lo.shape[1], generator=generator) > 0.5).float()
    u[: n // 4] = vertices
    return torch.minimum(torch.maximum(lo + u * (hi - lo), lo), hi)


def pgd(forward, lower, upper, C, steps=40, restarts=4, generator=None):
    """Points that push every row of C f(x) down and up (one attack per row and direction).

    Both directions run as one batch (the downward attacks' rows first, their objective's
    sign folded into the targets): the same starting points (drawn in the same order from
    `generator`), steps and step sizes as one attack per direction, each point's gradient its
    own row's, in half the forward and backward passes (the passes' fixed per-op cost was
    most of the ops harness's time; session 13)."""
    lo, hi = lower.reshape(1, -1), upper.reshape(1, -1)
    starts = [lo + torch.rand(restarts * C.shape[0], lo.shape[1], generator=generator) * (hi - lo)
              for _ in (1.0, -1.0)]
    x = torch.cat(starts).requires_grad_(True)
    target = torch.cat([C.repeat(restarts, 1), -C.repeat(restarts, 1)])
    step = (hi - lo) / 8
    for _ in range(steps):
        obj = (forward(x) * target).sum()
        (g,) = torch.autograd.grad(obj, x)
        with torch.no_grad():
            x -= step * g.sign()
            x.copy_(torch.maximum(torch.minimum(x, hi), lo))
        step = step * 0.9
    return x.detach()


def witness_values(forward, lower, upper, C=None, n=10000, seed=0):
    """Values (N, S) of C f(x) at n sampled points (a quarter on box corners) and at the
    points of a projected-gradient search up and down every row: what bounds must contain."""
    g = torch.Generator().manual_seed(seed)
    lower, upper = lower.reshape(-1).float(), upper.reshape(-1).float()
    out_dim = forward(lower.reshape(1, -1)).shape[1]
    C = torch.eye(out_dim) if C is None else torch.as_tensor(C, dtype=torch.float32)
    with torch.no_grad():
        points = sample_box(lower, upper, n, g)
    points = torch.cat([points, pgd(forward, lower, upper, C, generator=g)])
    assert bool(((points >= lower) & (points <= upper)).all()), "attack left the box"
    with torch.no_grad():
        return forward(points) @ C.T


def assert_within(values, lb, ub, label=""):
    """Every row of `values` (N, S) lies in [lb, ub] up to float rounding (REL_TOL)."""
    scale = 1.0 + torch.maximum(lb.abs(), ub.abs())
    slack = REL_TOL * scale
    below = values < lb - slack
    above = values > ub + slack
    assert not bool(below.any()), (f"{label}: lower bound violated: row "
                                   f"{int(below.any(0).nonzero()[0])}, min value "
                                   f"{values.min(0).values.tolist()} vs lb {lb.tolist()}")
    assert not bool(above.any()), (f"{label}: upper bound violated: row "
                                   f"{int(above.any(0).nonzero()[0])}, max value "
                                   f"{values.max(0).values.tolist()} vs ub {ub.tolist()}")


def node_values(net, name):
    """x (N, n_in) -> the concrete values (N, neurons) of node `name` of a loaded network: the
    forward function that assert_sound samples when checking an intermediate node's bounds."""
    def forward(x):
        vals = {}
        for n in net.nodes:
            vals[n.name] = (n.forward(*(vals[i] for i in n.inputs)) if n.inputs
                            else x.reshape(-1, *net.input_shape))
            if n.name == name:
                return vals[name].reshape(x.shape[0], -1)
        raise KeyError(name)
    return forward


def assert_sound(forward, lower, upper, lb, ub, C=None, n=10000, seed=0, label=""):
    """forward: (N, n_in) -> (N, n_out) flattened; lb/ub: (S,) bounds of C f(x)."""
    values = witness_values(forward, lower, upper, C, n, seed)
    assert_within(values, lb, ub, label)
    return values


def attack_min(forward, lo, hi, C, generator, n=20000):
    """The lowest value of C f(x) (one row) that sampling and PGD (from all n + 256 points)
    find in the box: an upper estimate of the true minimum. forward: (N, n_in) -> (N, n_out)
    flattened."""
    x = sample_box(lo, hi, n, generator)
    x = torch.cat([x, lo + torch.rand(256, lo.numel(), generator=generator) * (hi - lo)])
    x = x.requires_grad_()
    for i in range(80):
        (g,) = torch.autograd.grad((forward(x) @ C.T).sum(), x)
        with torch.no_grad():
            x -= (hi - lo) * 0.05 * (1 - i / 80) * g.sign()
            x.copy_(torch.maximum(torch.minimum(x, hi), lo))
    with torch.no_grad():
        return float((forward(x) @ C.T).min())


@contextmanager
def alpha_iterations(n):
    """alpha-CROWN and full alpha-CROWN run `n` iterations (None: their defaults) inside: their
    default argument, so the bounds take the product's own path (Verifier.bounds -> Network.
    bounds -> the engine). The jobs' bitwise comparisons hold for any count; the optimisation
    is most of a rank's work, and a few steps already move every alpha through the sharded
    backward passes and their reductions."""
    if n is None:
        yield
        return
    from shardbound.runtime.engine.alpha import alpha_crown
    from shardbound.runtime.engine.full_alpha import full_alpha_crown

    saved = []
    for fn in (alpha_crown, full_alpha_crown):
        code, defaults = fn.__code__, fn.__defaults__
        names = code.co_varnames[code.co_argcount - len(defaults):code.co_argcount]
        assert "iterations" in names, fn.__name__       # the engine's signature moved
        saved.append((fn, defaults, names.index("iterations")))
    try:
        for fn, defaults, i in saved:
            fn.__defaults__ = (*defaults[:i], int(n), *defaults[i + 1:])
        yield
    finally:
        for fn, defaults, _ in saved:
            fn.__defaults__ = defaults
