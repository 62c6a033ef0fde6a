"""Compile work grows linearly with depth (timings live in bench/compile_scale.py).

Counted, not timed: the memory model replays a handful of backward passes of a 20,000-node
chain (not 10,000), canonicalize looks at each node a bounded number of times while it folds
thousands of affines, and a 20,000-node chain compiles end to end. The pruned memory model
still returns exactly the peak of replaying every pass (checked on random DAGs against the
replay itself).
"""

from __future__ import annotations

import os
import random
import sys

import pytest

from shardbound.compiler.ir import Graph, Node
from shardbound.runtime.accounting import memory_model as mm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))


def _chain_shapes(n: int, width: int = 4) -> list:
    nodes = [mm.NodeShape("n0", "input", (), (width,), (), False)]
    for i in range(1, n):
        op = "linear" if i % 2 else "relu"
        params = (width * width, width) if op == "linear" else ()
        nodes.append(mm.NodeShape(f"n{i}", op, (f"n{i - 1}",), (width,), params, op == "linear",
                                  (width, width) if op == "linear" else ()))
    return nodes


def test_memory_model_replays_few_passes_of_a_long_chain(monkeypatch):
    calls = []
    real = mm._backward_peak
    monkeypatch.setattr(mm, "_backward_peak", lambda *a: calls.append(a[3]) or real(*a))
    nodes = _chain_shapes(20_000)
    pred = mm.predict_peak(nodes, "n19999", 1)
    assert pred["peak_tracked_bytes"] > 0
    assert len(calls) <= 4, len(calls)        # of 10,001 backward passes


def _full_replay_peak(nodes, output, world, batch, spec_rows, shard_rows, chunk):
    """predict_peak's definition: the maximum over every pass, each replayed."""
    index = {n.name: i for i, n in enumerate(nodes)}
    fsdp = shard_rows is not None
    gathered = [mm._gathered_bytes(n, fsdp and world > 1, bool(shard_rows) and chunk is not None,
                                   chunk or 0) for n in nodes]
    base = mm.predict_peak(nodes, output, world, batch, spec_rows, shard_rows, "ibp", chunk)
    resident, peak = base["resident_param_bytes"], base["peak_tracked_bytes"]
    rows = (lambda t: -(-t // world)) if (shard_rows and world > 1) else (lambda t: t)
    held = sum(2 * batch * mm.math.prod(n.shape) * 4 for n in nodes if not n.traits.is_view)
    starts = (world, bool(shard_rows) and chunk is not None, chunk or 0)
    for t, S, eye, bounds in mm._passes(nodes, index, batch, rows, held, output, spec_rows, None):
        got, _ = mm._backward_peak(nodes, index, gathered, t, S, eye, batch, starts)
        peak = max(peak, resident + bounds + got)
    return peak


def test_pruned_memory_model_equals_the_full_replay_on_random_dags():
    rng = random.Random(3)
    for trial in range(400):
        n = rng.randint(2, 30)
        nodes = [mm.NodeShape("n0", "input", (), (rng.randint(1, 6),), (), False)]
        for i in range(1, n):
            op = rng.choice(["relu", "reshape", "linear", "add", "affine", "transpose"])
            ins = ((f"n{rng.randrange(i)}", f"n{rng.randrange(i)}") if op == "add"
                   else (f"n{rng.randint(max(0, i - 4), i - 1)}",))
            shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 2)))
            linear = op == "linear"
            nodes.append(mm.NodeShape(f"n{i}", op, ins, shape,
                                      (rng.randint(1, 60), rng.randint(1, 6)) if linear else (),
                                      rng.random() < 0.6,
                                      (rng.randint(1, 9), rng.randint(1, 9)) if linear else ()))
        args = (rng.choice([1, 2, 3]), rng.randint(1, 3), rng.choice([None, 4]),
                rng.choice([None, False, True]), rng.choice([None, 16]))
        got = mm.predict_peak(nodes, f"n{n - 1}", args[0], args[1], args[2], args[3],
                              stream_chunk_bytes=args[4])["peak_tracked_bytes"]
        assert got == _full_replay_peak(nodes, f"n{n - 1}", *args), trial


def test_canonicalize_folds_a_long_chain_in_linear_work(monkeypatch):
    import numpy as np

    from shardbound.passes import canonicalize as canon

    n = 6_000                             # Relu, Mul, Add, Relu, ...: 2,000 merges
    nodes, tensors = [Node("input", "input", (), (4,))], {}
    for i in range(1, n):
        prev = nodes[-1].name
        if i % 3 == 1:
            nodes.append(Node(f"r{i}", "relu", (prev,), (4,)))
        else:
            tensors[f"a{i}.scale"] = np.full(4, 1.5, np.float32)
            nodes.append(Node(f"a{i}", "affine", (prev,), (4,), params=(("scale", f"a{i}.scale"),)))
    graph = Graph(tuple(nodes), tensors, nodes[-1].name)
    looked = []
    real = canon._Scratch.only_consumer
    monkeypatch.setattr(canon._Scratch, "only_consumer",
                        lambda self, node: looked.append(1) or real(self, node))
    out = canon.canonicalize(graph, None)
    relus = sum(1 for i in range(1, n) if i % 3 == 1)
    runs = sum(1 for i in range(1, n) if i % 3 != 1 and (i - 1) % 3 == 1)   # affine runs
    assert len(out.nodes) == 1 + relus + runs
    assert all(a.op != b.op for a, b in zip(out.nodes[1:], out.nodes[2:]))
    assert len(looked) <= 4 * n, len(looked)


@pytest.mark.parametrize("pattern", ["relu"])
def test_a_20000_node_chain_compiles(tmp_path, pattern):
    import onnx

    import compile_scale
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    path = tmp_path / "chain.onnx"
    onnx.save(compile_scale.chain(pattern, 20_000), path)
    graph = compile_model(str(path), str(tmp_path / "prog"), PassOptions())
    assert len(graph.nodes) == 20_001
