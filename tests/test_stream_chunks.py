"""fsdp's stream chunk chosen per layer and rank count (runtime/accounting/chunk_choice.py).

The choice is a plan decision: recorded in plan.json per P, the same from one compile to the
next, taken by the runtime from the plan (every rank reads the same plan) and, for a P the plan
has no entry for, computed from the loaded network's shapes with the same result the compiler
gets. --stream-chunk-kib still fixes one chunk for every layer. (That the bits do not depend
on the chunks: tests/test_streaming.py, bench/fsdp_memory.py.)"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from multirank import compile_to
from shardbound.runtime.accounting.chunk_choice import MIN_CHUNK, choose_chunks
from shardbound.runtime.accounting.memory_model import network_shapes
from shardbound.runtime.parallel.params import STREAM_CHUNK_BYTES

WIDTHS = (64, 512, 64, 10)      # the 512x64 weights (128 KiB) are larger than the smallest chunk


def _mlp(path):
    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        inits += [numpy_helper.from_array((rng.standard_normal((b, a)) / a).astype(np.float32),
                                          f"W{i}"),
                  numpy_helper.from_array(np.zeros(b, np.float32), f"b{i}")]
        nodes.append(helper.make_node("Gemm", [h, f"W{i}", f"b{i}"], [f"g{i}"], transB=1))
        h = f"g{i}"
        if i < len(WIDTHS) - 2:
            nodes.append(helper.make_node("Relu", [h], [f"r{i}"]))
            h = f"r{i}"
    graph = helper.make_graph(
        nodes, "chunks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTHS[0]])],
        [helper.make_tensor_value_info(h, TensorProto.FLOAT, [1, WIDTHS[-1]])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def _plan(directory):
    with open(f"{directory}/plan.json", encoding="utf-8") as f:
        return json.load(f)


def test_chunks_are_chosen_per_rank_count_recorded_and_reproduced(tmp_path):
    from shardbound.runtime.program.loader import load

    model = _mlp(tmp_path / "m.onnx")
    a = _plan(compile_to(model, str(tmp_path / "a"), mode="fsdp"))
    b = _plan(compile_to(model, str(tmp_path / "b"), mode="fsdp"))
    three = _plan(compile_to(model, str(tmp_path / "c"), mode="fsdp", nproc=3))
    table = a["stream_chunks"]
    assert table == b["stream_chunks"] and sorted(table) == ["1", "2", "4"]
    assert sorted(three["stream_chunks"]) == ["1", "2", "3", "4"]
    assert a["stream_chunk_bytes"] == STREAM_CHUNK_BYTES          # the ceiling
    for chunks in table.values():
        assert len(chunks) == len(WIDTHS) - 1                     # every linear layer
        assert all(MIN_CHUNK <= c <= STREAM_CHUNK_BYTES for c in chunks.values())
    # a rank's peak here is far below 16 x 64 KiB: the 128 KiB weights stream in 64 KiB blocks
    assert min(table["4"].values()) == MIN_CHUNK

    net = load(str(tmp_path / "a")).network                      # one rank: the plan's "1"
    assert net.memory_setup["stream_chunk_bytes"] == table["1"]
    for node in net.nodes:
        if node.name in table["1"]:
            assert node.params["weight"].chunk_bytes == table["1"][node.name]
    # a P without an entry: the runtime's own choice, from the loaded shapes, is the compiler's
    got = choose_chunks(network_shapes(net), net.output.name, 3, STREAM_CHUNK_BYTES, net.order,
                        net.row_tile)
    assert got == three["stream_chunks"]["3"]


def test_stream_chunk_kib_still_fixes_every_layer(tmp_path):
    from shardbound.runtime.program.loader import load

    model = _mlp(tmp_path / "m.onnx")
    plan = _plan(compile_to(model, str(tmp_path / "p"), mode="fsdp", stream_chunk_bytes=8192))
    assert "stream_chunks" not in plan and plan["stream_chunk_bytes"] == 8192
    net = load(str(tmp_path / "p")).network
    assert net.memory_setup["stream_chunk_bytes"] == 8192
    assert {n.params["weight"].chunk_bytes for n in net.nodes if "weight" in n.params} == {8192}
    single = _plan(compile_to(model, str(tmp_path / "s"), mode="single"))
    assert "stream_chunks" not in single
