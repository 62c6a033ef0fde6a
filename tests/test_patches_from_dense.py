"""Dense rows that reach a conv node local to a window go on as patches (`Patches.from_dense`,
`patches.as_patches`): a per-pixel Softmax over a transposed conv output (carvana's UNet
shape, small) has rows that start dense at the Transpose and touch one pixel each. Under
`blocked` the bounds are bitwise the dense path's; under `fast` the same up to rounding; in
both they hold at sampled points of the box and the conversion did happen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo
from conftest import networks_by_order, random_box


def _softmax_unet(rng):
    """2x5x6 -> conv 4 3x3 -> ReLU -> conv 4 3x3 -> ReLU -> conv 2 1x1 -> Transpose to
    (6, 5, 2) -> Reshape (30, 2) -> Softmax over the 2 classes -> Reshape -> Transpose ->
    Flatten -> gemm 3."""
    b = zoo.Builder(rng, (2, 5, 6))

    def conv(x, c_in, c_out, k):
        return b.op("Conv", [x, b.const(b.weight(c_out, c_in, k, k)),
                             b.const(rng.normal(0, 0.1, (c_out,)))],
                    pads=[k // 2] * 4, strides=[1, 1])

    h = conv(b.relu(conv(b.relu(conv("x", 2, 4, 3)), 4, 4, 3)), 4, 2, 1)
    t = b.op("Transpose", [h], perm=[0, 3, 2, 1])
    s = b.op("Softmax", [b.op("Reshape", [t, b.const(np.array([1, 30, 2], np.int64))])],
             axis=2)
    t = b.op("Transpose", [b.op("Reshape", [s, b.const(np.array([1, 6, 5, 2], np.int64))])],
             perm=[0, 3, 2, 1])
    return b.build(b.gemm(b.op("Flatten", [t], axis=1), 60, 3)), b.input_shape


@pytest.fixture(scope="module")
def networks(tmp_path_factory):
    model, shape = _softmax_unet(np.random.default_rng(5))
    return networks_by_order(tmp_path_factory, "from_dense", model), shape


@pytest.mark.parametrize("order", ["blocked", "fast"])
def test_local_dense_rows_cross_convs_as_patches(networks, monkeypatch, order):
    from shardbound.runtime.ops.patches import Patches

    nets, shape = networks
    net = nets[order]
    made = []
    original = Patches.from_dense.__func__

    def counting(cls, A, node_shape, *args, **kw):
        P = original(cls, A, node_shape, *args, **kw)
        made.append(P is not None)
        return P

    monkeypatch.setattr(Patches, "from_dense", classmethod(counting))
    rng = np.random.default_rng(6)
    lo, hi = (torch.tensor(t).reshape(1, *shape) for t in random_box(rng, shape, radius=0.3))
    with torch.no_grad():
        got = net.crown(lo, hi)
        assert any(made)                                   # the Softmax rows went as patches
        net.patches = False
        try:
            ref = net.crown(lo, hi)
        finally:
            net.patches = True
        if order == "blocked":
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
        else:
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, ref))
        x = lo + (hi - lo) * torch.rand((256, *shape), generator=torch.Generator().manual_seed(7))
        y = net.forward(x)
    assert bool((y >= got[0] - 1e-5).all()) and bool((y <= got[1] + 1e-5).all())
    assert bool((got[1] - got[0] < 1e3).all())              # not vacuous


def test_from_dense_refuses_wide_rows_and_keeps_the_entries():
    from shardbound.runtime.ops.patches import Patches

    g = torch.Generator().manual_seed(3)
    A = torch.zeros(2, 3, 4, 7, 9)
    A[:, 0, :, 1:3, 2:5] = torch.randn(2, 4, 2, 3, generator=g)
    A[:, 1, 1, 6, 8] = 1.5                                    # a corner: the window moves in
    P = Patches.from_dense(A, (4, 7, 9))                      # row 2 is all zero
    assert P is not None and P.window == (2, 3)
    assert torch.equal(P.to_dense(), A)
    A[:, 2] = 1.0
    assert Patches.from_dense(A, (4, 7, 9)) is None


def test_injective_index_map_transpose_by_runs_is_the_indexed_one():
    """`IndexMap.scatter_add` copying runs (a channel slice, a crop) gives the bits of the
    indexed gather with its zero slot (-0.0 kept, +0.0 where nothing reads)."""
    import numpy as np
    from shardbound.runtime.ops.index_map import IndexMap

    g = torch.Generator().manual_seed(4)
    for axes in ([np.arange(3), np.arange(5), np.arange(6)],           # channels 0:3
                 [np.arange(1, 4), np.arange(1, 4), np.arange(6)]):    # a crop
        fast, ref = (IndexMap.from_axes((4, 5, 6), axes) for _ in range(2))
        ref._copy_runs = False                                        # the indexed route
        a = torch.randn(2, 7, fast.n_out, generator=g)
        a[0, 0, 0] = -0.0
        assert fast._runs() is not None
        got, want = fast.scatter_add(a), ref.scatter_add(a)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
