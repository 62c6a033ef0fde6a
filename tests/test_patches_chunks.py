"""Chunked and reshaped patch kernels keep the bits (issue 13): the CROWN step on patches in
row chunks, the blocked conv backward's im2col in row chunks, `to_dense` by whole windows, and
the residual Add of patches into one padded tensor give bitwise what one call / the dense rows
give, in `blocked` (against the dense path too) and `fast` (run to run), on a small conv ResNet
built here; and a conv step's rows left unmasked outside the grid give the bits of masking
them at once."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import zoo
from conftest import networks_by_order, random_box


def _conv3x3(b, rng, x, c_in, c_out, stride=1):
    """A 3x3 Conv with padding 1 and a bias (the models' one conv shape)."""
    return b.op("Conv", [x, b.const(b.weight(c_out, c_in, 3, 3)),
                         b.const(rng.normal(0, 0.1, (c_out,)))],
                pads=[1, 1, 1, 1], strides=[stride, stride])


def _conv_resnet(rng):
    """2x8x8 -> conv 4 3x3 s2 -> ReLU -> residual block (conv, ReLU, conv, Add, ReLU) ->
    gemm 3: windows that grow past the grid's edges, an Add of windows of two sizes."""
    b = zoo.Builder(rng, (2, 8, 8))

    def conv(x, c_in, c_out, stride=1):
        return _conv3x3(b, rng, x, c_in, c_out, stride)

    h = b.relu(conv("x", 2, 4, stride=2))
    r = conv(b.relu(conv(h, 4, 4)), 4, 4)
    h = b.relu(b.op("Add", [h, r]))
    h = b.op("Flatten", [h], axis=1)
    return b.build(b.gemm(h, 4 * 4 * 4, 3)), b.input_shape


@pytest.fixture(scope="module")
def networks(tmp_path_factory):
    model, shape = _conv_resnet(np.random.default_rng(11))
    return networks_by_order(tmp_path_factory, "patch_chunks", model), shape


@pytest.mark.parametrize("order", ["blocked", "fast"])
def test_chunked_patch_kernels_keep_the_bits(networks, monkeypatch, order):
    """`blocked`: bitwise under every chunking and the dense path's bits. `fast`: to_dense's
    two ways bitwise; one-row chunks of the CROWN step move its window sums onto the matrix
    product path (`contract._fast_dot` picks by shape), so there only rounding differs, and
    a chunked run repeats itself."""
    from shardbound.runtime.ops import conv, patches, relaxation

    nets, shape = networks
    net = nets[order]
    lo, hi = (torch.tensor(t).reshape(1, *shape)
              for t in random_box(np.random.default_rng(12), shape, radius=0.4))
    same = lambda x, y: all(torch.equal(a, b) for a, b in zip(x, y))    # noqa: E731
    with torch.no_grad():
        ref = net.crown(lo, hi)
        assert sum(net.crown_rows.values()) > 0
        for few in (0, 1 << 30):                                     # both to_dense paths
            monkeypatch.setattr(patches, "FEW_CHANNELS", few)
            assert same(net.crown(lo, hi), ref), few
        monkeypatch.setattr(relaxation, "PATCH_STEP_CHUNK", 1)     # one row per chunk
        monkeypatch.setattr(conv, "IM2COL_CHUNK", 1)
        got = net.crown(lo, hi)
        if order == "fast":
            assert same(net.crown(lo, hi), got)
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, ref))
            return
        assert same(got, ref)
        net.patches = False                                          # the dense rows' bits
        try:
            assert same(net.crown(lo, hi), ref)
        finally:
            net.patches = True


def test_patches_add_is_the_padded_sum_bit_for_bit():
    """Windows at offsets either way, entries -0 included (the in-place add must turn a -0
    outside the other operand's window into +0, as a + 0 does)."""
    from shardbound.runtime.ops.patches import Patches

    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        (ph, pw), (qh, qw) = (torch.randint(1, 5, (2,), generator=gen).tolist()
                              for _ in range(2))
        o1 = torch.randint(-2, 6, (4, 2), generator=gen)
        o2 = o1 + torch.randint(-3, 4, (1, 2), generator=gen)
        a, b = torch.randn(1, 4, 2, ph, pw, generator=gen), torch.randn(1, 4, 2, qh, qw,
                                                                        generator=gen)
        a[a.abs() < 0.5], b[b.abs() < 0.5] = -0.0, -0.0
        A, B = Patches(a, o1, (2, 7, 7)).masked(), Patches(b, o2, (2, 7, 7)).masked()
        s = A + B
        s = s.to_dense() if isinstance(s, Patches) else s
        ref = A.to_dense() + B.to_dense()
        assert torch.equal(s.view(torch.int32), ref.view(torch.int32))


def test_support_dot_of_patches_is_the_dense_rows_dot():
    """`Patches.support_dot` (an intercept that is zero off a few neurons, dotted from the
    windows' entries there) has the bits of the blocked dot over the dense rows: windows
    past the grid's edges with dirty entries outside, full 256-blocks (two FMA chains
    each) and a grid whose blocks straddle channels, one box or two."""
    from shardbound.runtime.numerics import summation, support_dot
    from shardbound.runtime.ops.patches import Patches

    if not support_dot.works():
        pytest.skip("no pinned BLAS here")
    gen = torch.Generator().manual_seed(3)
    for (C, H), B, ph in [((2, 16), 1, 5), ((3, 10), 2, 3), ((4, 16), 1, 9)]:
        S = 70
        vals = torch.randn(B, S, C, ph, ph, generator=gen)
        origin = torch.randint(-ph + 1, H, (S, 2), generator=gen)
        A = Patches(vals, origin, (C, H, H), dirty=True)     # outside entries not zeros
        vec = torch.randn(B, 1, C, H, H, generator=gen)
        vec[torch.rand(vec.shape, generator=gen) < 0.9] = 0
        got = A.support_dot(vec, "blocked")
        ref = A.dense_map(lambda rows: summation.dot_last(
            rows.reshape(B, rows.shape[1], -1), vec.reshape(B, 1, -1), "blocked"))
        assert got is not None and torch.equal(got, ref), (C, H, B, ph)


def test_channel_sums_of_patches_are_the_dense_rows_sums():
    """`Patches.channel_sums` (a conv's bias term: each channel's plane summed, from the
    windows alone) has the bits of the blocked sums over the dense rows: a 16x16 plane
    (one block, two FMA chains split mid-window), a 32x32 one (four blocks and the tree),
    a 10x10 one (one chain), windows past the edges, one box or two."""
    from shardbound.runtime.numerics import contract, support_dot
    from shardbound.runtime.ops.patches import Patches

    if not support_dot.works():
        pytest.skip("no pinned BLAS here")
    gen = torch.Generator().manual_seed(5)
    for S, C, ph, H, B in [(90, 3, 3, 16, 1), (40, 2, 7, 16, 2), (30, 2, 5, 32, 1),
                           (20, 3, 5, 10, 2)]:
        vals = torch.randn(B, S, C, ph, ph, generator=gen)
        vals[torch.rand(vals.shape, generator=gen) < 0.3] = 0
        A = Patches(vals, torch.randint(-ph + 1, H, (S, 2), generator=gen), (C, H, H))
        A = A.masked()
        got = A.channel_sums("blocked")
        ref = A.dense_map(lambda rows: contract.sum_last(
            rows.reshape(B, rows.shape[1], C, H * H), "blocked"))
        assert got is not None and torch.equal(got, ref), (S, C, ph, H, B)


def _conv_chain(rng):
    """2x8x8 -> conv s2 -> ReLU -> conv -> conv (no activation between) -> Add with the
    ReLU's output -> ReLU -> gemm 3: a conv step whose rows come straight from another
    conv step (what it scattered outside the grid must be masked first), an Add of such
    rows, and rows that reach the input from a conv step."""
    b = zoo.Builder(rng, (2, 8, 8))

    def conv(x, c_in, c_out, stride=1):
        return _conv3x3(b, rng, x, c_in, c_out, stride)

    h = b.relu(conv("x", 2, 3, stride=2))
    h = b.relu(b.op("Add", [h, conv(conv(h, 3, 3), 3, 3)]))
    h = b.op("Flatten", [h], axis=1)
    return b.build(b.gemm(h, 3 * 4 * 4, 3)), b.input_shape


def test_unmasked_conv_rows_keep_the_bits(tmp_path, monkeypatch):
    """A conv step leaves what it scattered outside the grid (`Patches.dirty`) for the
    next step: the bounds are bitwise those of masking every conv step's rows at once
    (`fast` and `blocked`), and `blocked` keeps the dense rows' bits."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load
    from shardbound.runtime.ops.conv import Conv2d
    from shardbound.runtime.ops.patches import Patches

    model, shape = _conv_chain(np.random.default_rng(13))
    onnx.save(model, tmp_path / "m.onnx")
    lo, hi = (torch.tensor(t).reshape(1, *shape)
              for t in random_box(np.random.default_rng(14), shape, radius=0.5))
    lazy = Conv2d._backward_patches

    def eager(self, A):
        (A_in,), bias = lazy(self, A)
        if isinstance(A_in, Patches):
            A_in = A_in.masked()
            assert not A_in.dirty
        return [A_in], bias

    for order in ("fast", "blocked"):
        compile_model(str(tmp_path / "m.onnx"), str(tmp_path / order),
                      PassOptions(summation=order))
        net = load(str(tmp_path / order)).network
        with torch.no_grad():
            got = net.crown(lo, hi)
            assert net.crown_rows[net.output.name] == 3 and sum(net.crown_rows.values()) > 3
            with monkeypatch.context() as m:
                m.setattr(Conv2d, "_backward_patches", eager)
                ref = net.crown(lo, hi)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), order
            if order == "blocked":
                net.patches = False
                assert all(torch.equal(a, b) for a, b in zip(net.crown(lo, hi), ref))
