"""`attack.pgd` over several boxes at once (what input splitting runs on a round's most
promising domains): the point found lies in the box that holds the violations, and one box
given as (n,) or (1, n) is the same search, bit for bit."""

import numpy as np
import torch

from shardbound.runtime.verification.attack import pgd

W = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.2, -1.0]])


def _forward(x):
    return torch.relu(x @ W.T) - 0.1 * x.sum(dim=1, keepdim=True)


def test_pgd_over_boxes_finds_the_box_that_holds_the_violation():
    C = torch.tensor([[1.0, -1.0]])
    los = torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0], [-1.0, 1.0, -1.0]])
    his = los + 0.5
    with torch.no_grad():
        samples = [_forward(lo + torch.rand(4000, 3, generator=torch.Generator().manual_seed(0))
                            * (hi - lo)) @ C.T for lo, hi in zip(los, his)]
    lows = [float(s.min()) for s in samples]
    # a threshold only the last box reaches
    d = np.array([lows[2] + 0.25 * (min(lows[:2]) - lows[2])])
    assert lows[2] < d[0] < min(lows[:2])
    x = pgd(_forward, los, his, C, d, np.zeros(1, dtype=int), restarts=2, steps=15)
    assert x is not None
    assert bool(((x >= los[2]) & (x <= his[2])).all())
    assert float(_forward(x.reshape(1, -1)) @ C.T) <= d[0]
    # the first two boxes alone hold no violation
    assert pgd(_forward, los[:2], his[:2], C, d, np.zeros(1, dtype=int), restarts=2,
               steps=15) is None


def test_one_box_is_the_same_search_either_shape():
    C = torch.tensor([[1.0, -1.0], [-1.0, 0.0]])
    lo, hi = torch.tensor([-1.0, 0.0, -0.5]), torch.tensor([1.0, 0.5, 0.5])
    d = np.array([-0.8, -0.1])
    owner = np.array([0, 1])
    a = pgd(_forward, lo, hi, C, d, owner, restarts=4, steps=20, seed=3)
    b = pgd(_forward, lo.reshape(1, -1), hi.reshape(1, -1), C, d, owner, restarts=4, steps=20,
            seed=3)
    assert a is not None and b is not None and torch.equal(a, b)
