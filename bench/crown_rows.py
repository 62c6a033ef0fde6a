"""CPU seconds of CROWN for some inexact neurons of chosen nodes of a VNN-COMP network, on
the property's box, with the session-11 engine changes on and off in one process (alternated):
the ReLU lines remembered across row tiles, injective index maps transposed by copied runs,
and dense rows that are local to a window turned into patches at a conv node. Earlier nodes'
bounds are IBP's (the same for both), so the figures compare the passes, not a verdict.

python3 bench/crown_rows.py --onnx SHARED/carvana_unet_2022/unet_simp_small.onnx \
    --vnnlib SHARED/carvana_unet_2022/spec_..._65051cfe0789_16_eps_0.00400.vnnlib \
    --node conv_11:1024 --node softmax_15:256 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _switch(on: bool):
    """Turn the three changes on or off (monkeypatching this process only)."""
    from shardbound.runtime.engine import network
    from shardbound.runtime.ops import index_map, relaxation

    saved = _switch.__dict__.setdefault("saved", {
        "as_patches": network.as_patches,
        "runs": index_map.IndexMap._runs,
        "crown_backward": relaxation.ElementwiseRelaxation.crown_backward})
    if on:
        network.as_patches = saved["as_patches"]
        index_map.IndexMap._runs = saved["runs"]
        relaxation.ElementwiseRelaxation.crown_backward = saved["crown_backward"]
        return

    def forget(self, *a, **kw):           # the lines remade at every call, as before
        self.memo("_crown_lines").clear()
        return saved["crown_backward"](self, *a, **kw)

    network.as_patches = lambda shape, lA, uA, local: (lA, uA)
    index_map.IndexMap._runs = lambda self, most=16: None
    relaxation.ElementwiseRelaxation.crown_backward = forget


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--vnnlib", required=True)
    ap.add_argument("--node", action="append", required=True, help="NAME:ROWS")
    ap.add_argument("--summation", default="fast")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.vnnlib import parse_vnnlib
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    out = tempfile.mkdtemp(prefix="crown_rows_")
    compile_model(args.onnx, out, PassOptions(summation=args.summation))
    net = load(out).network
    case = parse_vnnlib(args.vnnlib).cases[0]
    shape = (1, *net.input_shape)
    lo = torch.tensor(case.lower, dtype=torch.float32).reshape(shape)
    hi = torch.tensor(case.upper, dtype=torch.float32).reshape(shape)
    print(f"load {os.getloadavg()[0]:.1f}; {args.summation}; one thread")
    with torch.no_grad():
        ibp = net.ibp_all(lo, hi)
        known = dict(ibp)
        for spec in args.node:
            name, rows = spec.split(":")
            node = net.by_name[name]
            idx = torch.nonzero(net.inexact_mask(node, ibp[name]).reshape(-1)).reshape(-1)
            idx = idx[:int(rows)]
            got = {}
            for r in range(args.repeat):
                for on in (False, True):
                    _switch(on)
                    t = time.process_time()
                    b = net.crown_node(node, lo, hi, known, idx)
                    got.setdefault(on, []).append(time.process_time() - t)
                    if r == 0:
                        got[(on, "b")] = b
            _switch(True)
            width = {on: float((got[(on, "b")][1] - got[(on, "b")][0]).mean()) for on in (0, 1)}
            diff = max(float((got[(0, "b")][k] - got[(1, "b")][k]).abs().max()) for k in (0, 1))
            print(f"{name}: {len(idx)} rows; CPU s off {min(got[False]):.2f}, on "
                  f"{min(got[True]):.2f} ({min(got[False]) / min(got[True]):.2f}x); mean width "
                  f"off {width[0]:.6g} on {width[1]:.6g}; largest bound difference {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
