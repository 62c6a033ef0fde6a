"""LayerNorm tightness: shardbound's `normalize` relaxation beside auto_LiRPA's.

    python bench/normalization.py [--lirpa-python PY] [--lirpa-compat FILE] [--radii 0.01,0.05,0.2]

The model (torch, seeded): Linear 6 -> 24, reshape (3, 8), LayerNorm(8) (random gamma, beta),
Linear 24 -> 16, ReLU, Linear 16 -> 3. shardbound compiles its opset-17 export
(LayerNormalization) and its opset-13 export (the ReduceMean / Sub / Pow / Sqrt / Div pattern);
auto_LiRPA (when `--lirpa-python` names a venv with it, see ../shared/oracle/README.md) bounds
the torch module itself. One box per radius around a seeded point; the table gives the mean
bound width (ub - lb over the 3 outputs) of IBP, CROWN and alpha-CROWN, and the range that
20,000 samples reach (a lower estimate of the true width). auto_LiRPA 0.7.1's alpha-CROWN
fails on this model (an assertion that sqrt's input lower bound is >= 0, or a shape error in
its optimiser): its cell is then empty.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def make_model():
    import torch

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 24)
            self.ln = torch.nn.LayerNorm(8)
            self.b = torch.nn.Linear(24, 16)
            self.c = torch.nn.Linear(16, 3)
            with torch.no_grad():
                self.ln.weight.uniform_(0.5, 1.5)
                self.ln.bias.normal_()

        def forward(self, x):
            h = self.ln(self.a(x).reshape(-1, 3, 8))
            return self.c(torch.relu(self.b(h.reshape(-1, 24))))

    return Net().eval()


def center():
    import torch

    return torch.randn(1, 6, generator=torch.Generator().manual_seed(5))


def lirpa_widths(radii, compat):
    import torch

    if compat:
        sys.path.insert(0, os.path.dirname(os.path.abspath(compat)))
        __import__(os.path.splitext(os.path.basename(compat))[0])
    from auto_LiRPA import BoundedModule, BoundedTensor
    from auto_LiRPA.perturbations import PerturbationLpNorm

    torch.set_num_threads(1)
    x = center()
    out = {}
    for r in radii:
        bx = BoundedTensor(x, PerturbationLpNorm(norm=float("inf"), x_L=x - r, x_U=x + r))
        row = {}
        for name, method in (("ibp", "IBP"), ("crown", "CROWN"), ("alpha-crown", "alpha-CROWN")):
            model = BoundedModule(make_model(), torch.empty_like(x), device="cpu",
                                  bound_opts={"optimize_bound_args": {"iteration": 20}})
            try:
                lb, ub = model.compute_bounds(x=(bx,), method=method,
                                              bound_upper=method != "alpha-CROWN")
            except (AssertionError, RuntimeError):   # 0.7.1: see the module docstring
                continue
            if method == "CROWN":
                crown_ub = ub
            if ub is None:              # alpha-CROWN: lower side optimised, upper is CROWN's
                ub = crown_ub
            row[name] = float((ub - lb).mean())
        out[str(r)] = row
    return out


def shardbound_widths(radii, opset):
    import torch

    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    torch.set_num_threads(1)
    model = make_model()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ln.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, torch.randn(1, 6), path, opset_version=opset, dynamo=False)
        compile_model(path, os.path.join(d, "out"), PassOptions())
        verifier = load(os.path.join(d, "out"))
    x = center()
    out = {}
    for r in radii:
        row = {m: float((lambda b: (b[1] - b[0]).mean())(verifier.bounds(x - r, x + r, method=m)))
               for m in ("ibp", "crown", "alpha-crown")}
        xs = (x - r) + torch.rand(20000, 6, generator=torch.Generator().manual_seed(0)) * 2 * r
        with torch.no_grad():
            y = model(xs)
        row["sampled"] = float((y.amax(0) - y.amin(0)).mean())
        out[str(r)] = row
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lirpa-python", default=None, metavar="PY")
    ap.add_argument("--lirpa-compat", default=os.path.join(HERE, "..", "..", "shared", "oracle",
                                                           "lirpa_compat.py"))
    ap.add_argument("--radii", default="0.01,0.05,0.2")
    ap.add_argument("--lirpa-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    radii = [float(r) for r in args.radii.split(",")]
    compat = args.lirpa_compat if os.path.exists(args.lirpa_compat) else None
    if args.lirpa_worker:
        print(json.dumps(lirpa_widths(radii, compat)))
        return 0
    rows = {f"shardbound (opset {o})": shardbound_widths(radii, o) for o in (17, 13)}
    if args.lirpa_python:
        cmd = [args.lirpa_python, os.path.abspath(__file__), "--lirpa-worker", "--radii",
               args.radii, "--lirpa-compat", args.lirpa_compat]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows["auto_LiRPA"] = json.loads(done.stdout.strip().splitlines()[-1])
    print("| tool | radius | IBP | CROWN | alpha-CROWN | sampled range |")
    print("|---|---:|---:|---:|---:|---:|")
    for tool, by_radius in rows.items():
        for r, row in by_radius.items():
            cells = [f"{row[k]:.4g}" if k in row else "" for k in
                     ("ibp", "crown", "alpha-crown", "sampled")]
            print(f"| {tool} | {r} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
