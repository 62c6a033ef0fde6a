"""plan.json, program.py and `inspect` tell the same story (issue #20: the program is the
readable truth), in single, fsdp and tp mode.

- program.py's header constants are the plan's fields the runtime runs with (MODE, METHOD,
  SUMMATION, NPROC, INPUT_SHAPE, OUTPUT_SHAPE), read by importing the program itself;
- its node blocks are the plan's nodes, in order, each built with the plan's name and inputs;
- every annotation of every node is in program.py in full under its key (unwrapped, the
  same text as plan.json's typed annotation) and in `inspect`'s line for the node (one
  printer for both);
- `compile --nproc P` plans for P: the tp channel split in the program names P.
"""

from __future__ import annotations

import importlib.util
import json
import re

import onnx
import pytest

import zoo

CASES = {
    "single": ("mlp", {}),
    "fsdp": ("mlp", {"mode": "fsdp", "nproc": 2}),
    "tp": ("tp_mlp2", {"mode": "tp", "nproc": 3}),
    "tp-alpha": ("tp_mlp2", {"mode": "tp", "nproc": 2, "method": "alpha-crown"}),
}
HEADER = re.compile(r"^    # ---- \[(\d+)/(\d+)\] (\S+) = (\S+)\((.*)\) -+$")


@pytest.fixture(scope="module", params=sorted(CASES))
def compiled(request, tmp_path_factory):
    from shardbound.compiler.driver import compile_model, inspect_model
    from shardbound.passes.manager import PassOptions

    name, options = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model, _ = zoo.build(name)
    path = tmp / f"{name}.onnx"
    onnx.save(model, path)
    out = tmp / "prog"
    compile_model(str(path), str(out), PassOptions(**options))
    plan = json.loads((out / "plan.json").read_text(encoding="utf-8"))
    program = (out / "program.py").read_text(encoding="utf-8")
    inspect = inspect_model(str(path), PassOptions(**options))
    return request.param, options, out, plan, program, inspect


def _blocks(program: str) -> list[tuple[re.Match, dict[str, str]]]:
    """Each node block of build(): its header and its comment fields, continuation lines
    joined (`key: text` as the printer wrote it, whitespace normalised)."""
    blocks, fields, key = [], None, None
    for line in program.splitlines():
        header = HEADER.match(line)
        if header:
            fields, key = {}, None
            blocks.append((header, fields))
            continue
        if fields is None or not line.startswith("    # "):
            if fields is not None and line.strip().startswith("nodes.append"):
                fields = None
            continue
        body = line[len("    # "):]
        field = re.match(r"([a-z_]+):\s+(.*)$", body)
        if field and not body.startswith(" "):
            key = field.group(1)
            fields[key] = field.group(2)
        elif key is not None:
            fields[key] += " " + body.strip()
    return blocks


def _norm(text: str) -> str:
    return " ".join(text.split())


def _load_program(out):
    spec = importlib.util.spec_from_file_location("compiled_program_under_test",
                                                  out / "program.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)          # the __main__ block does not run
    return module


def test_header_constants_are_what_the_plan_runs_with(compiled):
    _, options, out, plan, _, _ = compiled
    program = _load_program(out)
    assert program.MODE == plan["mode"] == options.get("mode", "single")
    assert program.METHOD == plan["method"] == options.get("method", "crown")
    assert program.SUMMATION == plan["summation"]
    assert program.NPROC == plan["nproc"] == options.get("nproc", 1)
    assert program.INPUT_SHAPE == tuple(plan["input"]["shape"])
    assert program.OUTPUT_SHAPE == tuple(plan["output"]["shape"])


def test_node_blocks_are_the_plan_nodes_in_order(compiled):
    _, _, _, plan, program, _ = compiled
    blocks = _blocks(program)
    nodes = plan["nodes"]
    assert [h.group(3) for h, _ in blocks] == [n["name"] for n in nodes]
    for (header, _), node in zip(blocks, nodes):
        assert int(header.group(2)) == len(nodes)
        assert header.group(4) == node["op"]
        assert [s.strip() for s in header.group(5).split(",") if s.strip()] == node["inputs"]
    built = re.findall(r'nodes\.append\([\w.]+\(\n\s+"([^"]+)", inputs=(\([^)]*\))', program)
    assert [name for name, _ in built] == [n["name"] for n in nodes]
    for (_, inputs), node in zip(built, nodes):
        assert list(eval(inputs)) == node["inputs"]      # a tuple literal the codegen wrote


def test_every_annotation_is_in_the_program_and_in_inspect_in_full(compiled):
    _, _, _, plan, program, inspect = compiled
    blocks = dict((h.group(3), fields) for h, fields in _blocks(program))
    lines = {m.group(1): line for line in inspect.splitlines()
             if (m := re.match(r"^  (\S+?)\(", line))}
    seen = 0
    for node in plan["nodes"]:
        for key, value in node.get("annotations", {}).items():
            text = value["text"] if isinstance(value, dict) else str(value)
            assert _norm(blocks[node["name"]].get(key, "")) == _norm(text), (node["name"], key)
            assert f"{key}={text}" in lines[node["name"]], (node["name"], key)
            seen += 1
    assert seen >= len(plan["nodes"])


def test_tp_channel_split_is_planned_for_the_compiled_nproc(compiled):
    case, options, _, plan, program, _ = compiled
    if options.get("mode") != "tp":
        pytest.skip("tp only")
    p = options["nproc"]
    splits = [n["annotations"]["tp"]["split"] for n in plan["nodes"]
              if n["annotations"].get("tp", {}).get("split")]
    assert splits and all(len(s) == p for s in splits)
    assert program.count(f"channels on P={p}:") == len(splits)
