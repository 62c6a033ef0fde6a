"""A network exported by torch.onnx.export(..., dynamo=False) that uses torch.cat, slicing,
chunk, gather, expand, F.pad, F.interpolate (nearest and bilinear), ConvTranspose2d and a
second input (X_i: both inputs flattened, in order): it compiles at several opsets, its forward pass equals onnxruntime's, its IBP / CROWN /
alpha-CROWN bounds are sound (sampling + PGD), and `verify` answers sat and unsat properties
correctly."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from soundness import assert_within, attack_min, witness_values
from test_verify import _write_property

INPUT = (2, 2, 4)
SECOND = (3,)
N_IN = 16 + 3


class MovingNet(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = nn.ConvTranspose2d(6, 3, 3, stride=2, padding=1, output_padding=1)
        self.conv = nn.Conv2d(5, 4, 3, padding=1)
        self.fc = nn.Linear(16, 3)
        self.zfc = nn.Linear(3, 3)
        self.register_buffer("idx", torch.randint(0, 4, (1, *INPUT), generator=g))

    def forward(self, x, z):
        a, b = torch.chunk(x, 2, dim=3)
        h = torch.cat([a, b * 0.5, x[:, :, :, 1:3]], dim=1)
        h = torch.relu(self.up(h))
        g = torch.gather(x, 3, self.idx)
        e = x[:, :1].expand(1, 3, 2, 4)
        u = F.interpolate(g + e[:, :2], scale_factor=2, mode="nearest")
        u = F.pad(u, (0, 0, 1, 1), value=0.1)[:, :, 1:5, 2:6]
        h = torch.relu(self.conv(torch.cat([h, u], dim=1)))
        h = F.interpolate(h, scale_factor=0.5, mode="bilinear", align_corners=False)
        return self.fc(h.flatten(1)) + self.zfc(torch.relu(z))


@pytest.fixture(scope="module", params=[11, 17])
def exported(request, tmp_path_factory):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    tmp = tmp_path_factory.mktemp(f"export{request.param}")
    torch.manual_seed(0)
    net = MovingNet().eval()
    path = tmp / "net.onnx"
    with warnings.catch_warnings():      # the TorchScript exporter's deprecation notes
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(1, *INPUT), torch.zeros(1, *SECOND)), str(path),
                          dynamo=False, opset_version=request.param, input_names=["x", "z"],
                          output_names=["y"])
    compile_model(str(path), str(tmp / "prog"), PassOptions())
    return tmp, net, onnx.load(str(path)), load(str(tmp / "prog"))


def _split(flat):
    """(x, z) torch tensors from X's flat values: x's first, in input order."""
    flat = torch.as_tensor(np.asarray(flat, dtype=np.float32))
    return flat[:16].reshape(1, *INPUT), flat[16:].reshape(1, *SECOND)


def _box(seed, radius=0.3):
    c = np.random.default_rng(seed).uniform(-1, 1, N_IN).astype(np.float32)
    return c - np.float32(radius), c + np.float32(radius)


def test_forward_equals_onnxruntime_and_torch(exported):
    import onnxruntime as ort

    _, net, model, verifier = exported
    ops = {n.op_type for n in model.graph.node}
    assert {"Concat", "Slice", "GatherElements", "Expand", "Pad", "Resize",
            "ConvTranspose"} <= ops
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [i.name for i in model.graph.input] == ["x", "z"]
    for flat in np.random.default_rng(1).normal(size=(5, N_IN)).astype(np.float32):
        x, z = _split(flat)
        want = s.run(None, {"x": x.numpy(), "z": z.numpy()})[0].reshape(-1)
        got = verifier.forward(torch.from_numpy(flat[None])).numpy().reshape(-1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            np.testing.assert_allclose(got, net(x, z).numpy().reshape(-1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed,radius", [(0, 0.3), (1, 1.5), (2, 0.01)])
def test_bounds_are_sound(exported, seed, radius):
    _, _, _, verifier = exported
    lo, hi = _box(seed, radius)
    net = verifier.network
    forward = lambda x: net.forward(x.reshape(-1, *net.input_shape)).reshape(x.shape[0], -1)  # noqa: E731
    values = witness_values(forward, torch.from_numpy(lo), torch.from_numpy(hi))
    widths = {}
    for method in ("ibp", "crown", "alpha-crown"):
        lb, ub = verifier.bounds(lo, hi, method=method)
        assert_within(values, lb, ub, label=f"export/{seed}/{method}")
        widths[method] = float((ub - lb).mean())
    assert widths["crown"] <= widths["ibp"] * (1 + 1e-6)


def test_verify_answers_sat_and_unsat(exported):
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.runtime.parallel.dist import SingleComm
    from shardbound.runtime.verification.spec import spec_from_property
    from shardbound.runtime.verification.verdict import verify

    tmp, net, model, verifier = exported
    lo, hi = _box(3, 0.2)
    row = np.array([[1.0, -1.0, 0.0]])
    found = attack_min(lambda x: verifier.network.forward(x.reshape(-1, N_IN)).reshape(
        x.shape[0], -1), torch.from_numpy(lo), torch.from_numpy(hi),
        torch.tensor(row, dtype=torch.float32), torch.Generator().manual_seed(0),
        n=2000)     # PGD from 2,256 points (20,256 took 25 s on 2 idle cores: blocked convs)
    crown = float(verifier.bounds(lo, hi, C=row.astype(np.float32), method="crown")[0][0])
    assert crown < found
    for kind, d, expected in (("sat", found + 0.05 * (abs(found) + 1), "sat"),
                              ("unsat", crown - 0.05 * (abs(crown) + 1), "unsat"),
                              ("unsat_bab", crown + 0.3 * (found - crown), "unsat")):
        prop = tmp / f"{kind}.vnnlib"
        _write_property(prop, lo, hi, row, [d])
        result = verify(verifier, spec_from_property(parse_vnnlib(str(prop))), 60, SingleComm())
        assert result.verdict == expected, (kind, result.verdict)
        if expected == "sat":
            with torch.no_grad():
                y = net(*_split(np.asarray(result.x, dtype=np.float32)))
            assert float(y[0, 0] - y[0, 1]) <= d + 1e-5
            assert np.all(result.x >= lo) and np.all(result.x <= hi)
