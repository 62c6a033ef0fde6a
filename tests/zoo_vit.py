"""The tiny Vision Transformer of the test zoo (issue 15): a torch module exported with
`torch.onnx.export(..., dynamo=False)`; tests/zoo.py registers it as `vit_tiny`."""

from __future__ import annotations

import onnx


def vit_tiny_module(rng, gelu=None):
    """The torch module behind `vit_tiny` (eval mode; weights from rng's seed); `gelu` replaces
    torch's GELU (auto_LiRPA's own op: bench/vit_autolirpa.py)."""
    import torch
    from torch import nn

    torch.manual_seed(int(rng.integers(1 << 30)))
    dim, heads, tokens = 8, 2, 17
    hd = dim // heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.BatchNorm1d(dim), nn.BatchNorm1d(dim)
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.proj = nn.Linear(dim, dim)
            self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
            for bn in (self.n1, self.n2):
                bn.running_mean.uniform_(-0.2, 0.2)
                bn.running_var.uniform_(0.5, 1.5)
                bn.weight.data.uniform_(0.7, 1.3)
                bn.bias.data.uniform_(-0.1, 0.1)

        @staticmethod
        def norm(bn, x):
            return bn(x.transpose(1, 2)).transpose(1, 2)

        def split(self, t):
            return t.reshape(1, tokens, heads, hd).transpose(1, 2)      # (1, H, T, hd)

        def forward(self, x):
            h = self.norm(self.n1, x)
            q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
            att = torch.softmax((q @ k.transpose(-2, -1)) * hd ** -0.5, dim=-1)
            o = (att @ v).transpose(1, 2).reshape(1, tokens, dim)
            x = x + self.proj(o)
            act = gelu or nn.functional.gelu
            return x + self.fc2(act(self.fc1(self.norm(self.n2, x))))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(1, dim, kernel_size=2, stride=2)
            self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.5)
            self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.2)
            self.blocks = nn.Sequential(Block(), Block())
            self.head = nn.Linear(dim, 3)

        def forward(self, img):
            t = self.patch(img).flatten(2).transpose(1, 2)             # (1, 16, dim)
            t = torch.cat([self.cls, t], dim=1) + self.pos
            return self.head(self.blocks(t).mean(dim=1))

    return ViT().eval()


def vit_tiny(rng, opset: int = 17):
    """1x8x8 image -> 2x2 patches by a Conv (16 tokens of dim 8) -> a class token by Concat ->
    a positional embedding Add -> 2 blocks (BatchNorm1d over the embedding channels as the
    norm, 2-head attention: Q K^T, Softmax, . V; a GELU MLP 8-16-8; residual Adds) -> mean
    pooling over the tokens -> a linear head of 3 classes. BatchNorm stands in for LayerNorm
    (issue 15 allows either); its running statistics are random, so it is no identity."""
    import io
    import warnings

    import torch

    net = vit_tiny_module(rng)
    buf = io.BytesIO()
    with warnings.catch_warnings():      # the TorchScript exporter's deprecation notes
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(1, 1, 8, 8),), buf, dynamo=False,
                          opset_version=opset, input_names=["x"], output_names=["y"])
    return onnx.load_from_string(buf.getvalue()), (1, 8, 8)

