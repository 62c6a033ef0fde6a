"""The real console scripts on bad input: exit code 2, one `error:` line naming the culprit.

Every case calls an entry point (`compile`, `shardbound`, `python DIR/program.py`) with its
command line in this process and checks what it printed and its exit code (SystemExit), as a
user would see them; one case per entry point also runs as a real subprocess (a thread pool
starts them at once), so the exit code and the absence of a traceback hold in a process of
its own too.

Plus one happy path: compile -> `shardbound run --json` -> `python program.py` -> `inspect`,
with the bounds hash recomputed here from the JSON numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import zoo

TIMEOUT = 120
COMPILE = [sys.executable, "-c", "from shardbound.compiler.cli import compile_main; compile_main()"]
SHARDBOUND = [sys.executable, "-m", "shardbound.compiler.cli"]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)      # never look like a rank of someone else's torchrun job
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(argv, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                          env=_env())


# -- inputs -----------------------------------------------------------------------------------

def _unsupported(op: str, opset: int, node_name: str) -> onnx.ModelProto:
    if op == "LpPool":
        b = zoo.Builder(np.random.default_rng(0), (1, 4, 4), opset=opset)
        h = b.op("LpPool", ["x"], name=node_name, kernel_shape=[2, 2])
        h = b.op("Flatten", [h], axis=1)
        return b.build(b.gemm(h, 4, 2))
    b = zoo.Builder(np.random.default_rng(0), (4,), opset=opset)
    h = b.op(op, [b.gemm("x", 4, 3)], name=node_name)
    return b.build(h)


def _two_unsupported() -> onnx.ModelProto:
    """Two unsupported ops, one of them twice: the error lists each op once, with the first
    node that uses it."""
    b = zoo.Builder(np.random.default_rng(0), (4,), opset=13)
    h = b.op("Hardmax", [b.gemm("x", 4, 3)], name="first_hardmax")
    h = b.op("LpNormalization", [h], name="lpn")
    h = b.op("Hardmax", [h], name="second_hardmax")
    return b.build(h)


def _square() -> onnx.ModelProto:
    """A MatMul with a constant batch of matrices (products of two computed tensors
    compile: the bilinear family)."""
    b = zoo.Builder(np.random.default_rng(0), (4,))
    h = b.gemm("x", 4, 3)
    w = b.const(np.ones((2, 3, 3), np.float32))
    return b.build(b.op("MatMul", [h, w], name="square_me"))


def _dynamic() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["images", "W"], ["y"], transB=1, name="fc")], "dyn",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, "N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _box(path, lower, upper=None, raw=None):
    with open(path, "w", encoding="utf-8") as f:
        if raw is not None:
            f.write(raw)
        else:
            json.dump({"lower": lower, "upper": upper}, f)


def _broken_programs(d):
    """Copies of the compiled program with one file damaged."""
    from safetensors.torch import load_file, save_file

    for name in ("broken_plan", "broken_program", "broken_weights", "truncated_weights"):
        shutil.copytree(d / "prog", d / name)
    (d / "broken_plan" / "plan.json").write_text("[1, 2]\n")
    (d / "broken_program" / "program.py").write_text("def build(params:\n")
    tensors = load_file(str(d / "prog" / "weights.safetensors"))
    tensors.pop(sorted(tensors)[0])
    save_file(tensors, str(d / "broken_weights" / "weights.safetensors"))
    data = (d / "prog" / "weights.safetensors").read_bytes()
    (d / "truncated_weights" / "weights.safetensors").write_bytes(data[:100])


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A directory with the models, boxes and one compiled program (mlp: 6 inputs)."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    d = tmp_path_factory.mktemp("cli")
    mlp, _ = zoo.build("mlp")
    onnx.save(mlp, d / "mlp.onnx")
    compile_model(str(d / "mlp.onnx"), str(d / "prog"), PassOptions())
    onnx.save(_unsupported("Hardmax", 13, "squash"), d / "hardmax.onnx")
    onnx.save(_unsupported("LpPool", 12, "pool/lp"), d / "lppool.onnx")
    onnx.save(_two_unsupported(), d / "two_unsupported.onnx")
    onnx.save(_square(), d / "square.onnx")
    onnx.save(_dynamic(), d / "dynamic.onnx")
    future = onnx.load(d / "mlp.onnx")
    future.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    onnx.save(future, d / "future_opset.onnx")
    (d / "gzipped.vnnlib").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(200, 256)))
    data = (d / "mlp.onnx").read_bytes()
    (d / "truncated.onnx").write_bytes(data[: len(data) // 2])
    (d / "random.onnx").write_bytes(np.random.default_rng(0).bytes(512))
    (d / "empty.onnx").write_bytes(b"")
    (d / "a_directory.onnx").mkdir()
    (d / "not_a_program").mkdir()
    (d / "plain_file").write_text("hello\n")
    _broken_programs(d)
    ones = [1.0] * 6
    _box(d / "ok.json", [0.0] * 6, ones)
    _box(d / "short_lower.json", [0.0] * 5, ones)
    _box(d / "long_upper.json", [0.0] * 6, [1.0] * 7)
    _box(d / "crossed.json", [0.0, 0.0, 0.0, 2.5, 0.0, 0.0], ones)
    _box(d / "not_json.json", None, raw="{lower: [0, 1], upper: ")
    _box(d / "no_upper.json", None, raw=json.dumps({"lower": [0.0] * 6}))
    _box(d / "a_list.json", None, raw="[[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]")
    _box(d / "words.json", "zero", ones)
    return d


def _program(rel_dir):
    return [sys.executable, os.path.join(rel_dir, "program.py")]


# case id -> (entry point, argv, substrings the error line must contain). Most run in this
# process: the same code path as the console scripts (argparse, `guarded`, the error checks)
# without an interpreter and a torch import per case (each subprocess cost ~3 CPU-s). One case
# per entry point (the `compile` script, `python -m shardbound.compiler.cli`, `python
# DIR/program.py`) also runs as a real process: the exit code, stderr and no traceback as a
# user sees them; test_happy_path runs every entry point as a process too.
CASES = {
    "unsupported_hardmax": ("compile", ["hardmax.onnx", "-o", "out_hardmax"],
                            ["hardmax.onnx", "'squash'", "Hardmax", "opset 13",
                             "supported ops:", "Gemm", "Relu", "Conv"]),
    "unsupported_lppool": ("compile", ["lppool.onnx", "-o", "out_lppool"],
                           ["lppool.onnx", "'pool/lp'", "LpPool", "opset 12",
                            "supported ops:", "AveragePool"]),
    "every_unsupported_op": ("compile", ["two_unsupported.onnx", "-o", "out_two"],
                             ["two_unsupported.onnx", "2 unsupported op(s)", "Hardmax",
                              "'first_hardmax'", "LpNormalization", "'lpn'", "opset 13"]),
    "malformed_random_bytes": ("compile", ["random.onnx", "-o", "out_random"], ["random.onnx"]),
    "malformed_truncated": ("compile", ["truncated.onnx", "-o", "out_truncated"],
                            ["truncated.onnx"]),
    "malformed_empty": ("compile", ["empty.onnx", "-o", "out_empty"], ["empty.onnx"]),
    "malformed_missing": ("shardbound", ["compile", "missing.onnx", "-o", "out_missing"],
                          ["missing.onnx"]),
    "future_opset": ("compile", ["future_opset.onnx", "-o", "out_future"],
                     ["future_opset.onnx", f"opset {onnx.defs.onnx_opset_version() + 1}",
                      "re-export"]),
    "property_not_text": ("shardbound", ["verify", "mlp.onnx", "gzipped.vnnlib", "-o",
                                         "out_gz"], ["gzipped.vnnlib", "not a text file",
                                                     "0x8b"]),
    "dynamic_input_dim": ("compile", ["dynamic.onnx", "-o", "out_dynamic"],
                          ["dynamic.onnx", "'images'", "axis 1"]),
    "batched_constant_matmul": ("compile", ["square.onnx", "-o", "out_square"],
                                ["square.onnx", "'square_me'", "MatMul"]),
    "box_lower_too_short": ("shardbound", ["run", "prog", "--box", "short_lower.json"],
                            ["short_lower.json", "'lower'", "5", "6"]),
    "box_lower_above_upper": ("program", ["--box", "crossed.json"],
                              ["crossed.json", "lower[3]", "upper[3]", "2.5"]),
    "box_not_json": ("shardbound", ["run", "prog", "--box", "not_json.json"],
                     ["not_json.json", "JSON"]),
    "box_lacks_upper": ("shardbound", ["run", "prog", "--box", "no_upper.json"],
                        ["no_upper.json", "upper"]),
    "run_on_empty_directory": ("shardbound", ["run", "not_a_program", "--box", "ok.json"],
                               ["not_a_program", "compile"]),
    "unsupported_via_inspect": ("shardbound", ["inspect", "hardmax.onnx"],
                                ["hardmax.onnx", "'squash'", "Hardmax", "opset 13"]),
    "malformed_directory": ("compile", ["a_directory.onnx", "-o", "out_dir"],
                            ["a_directory.onnx"]),
    "output_dir_is_a_file": ("compile", ["mlp.onnx", "-o", "plain_file"], ["plain_file"]),
    "box_upper_too_long": ("shardbound", ["run", "prog", "--box", "long_upper.json"],
                           ["long_upper.json", "'upper'", "7", "6"]),
    "box_lower_above_upper_run": ("shardbound", ["run", "prog", "--box", "crossed.json"],
                                  ["crossed.json", "lower[3]", "upper[3]", "2.5"]),
    "box_is_a_list": ("shardbound", ["run", "prog", "--box", "a_list.json"],
                      ["a_list.json", "lower"]),
    "box_values_not_numbers": ("program", ["--box", "words.json"], ["words.json", "'lower'"]),
    "box_missing": ("shardbound", ["run", "prog", "--box", "nowhere.json"], ["nowhere.json"]),
    "box_is_a_directory": ("shardbound", ["run", "prog", "--box", "not_a_program"],
                           ["not_a_program"]),
    "run_on_a_file": ("shardbound", ["run", "plain_file", "--box", "ok.json"], ["plain_file"]),
    "run_on_missing_directory": ("shardbound", ["run", "no_such_dir", "--box", "ok.json"],
                                 ["no_such_dir"]),
    "run_plan_not_an_object": ("shardbound", ["run", "broken_plan", "--box", "ok.json"],
                               ["broken_plan", "plan.json"]),
    "run_program_syntax_error": ("shardbound", ["run", "broken_program", "--box", "ok.json"],
                                 ["broken_program", "program.py"]),
    "run_weights_lack_a_tensor": ("shardbound", ["run", "broken_weights", "--box", "ok.json"],
                                  ["broken_weights", "weights.safetensors"]),
    "run_weights_truncated": ("shardbound", ["run", "truncated_weights", "--box", "ok.json"],
                              ["weights.safetensors"]),
    "bad_flag_value": ("shardbound", ["run", "prog", "--box", "ok.json", "--method", "magic"],
                       ["--method", "magic"]),
    "missing_flag": ("program", [], ["--box"]),
    "bad_threads": ("shardbound", ["run", "prog", "--box", "ok.json", "--threads", "0"],
                    ["--threads", "0"]),
}
# The cases that also run as real processes: one per entry point.
AS_PROCESS = ("unsupported_hardmax", "box_lower_too_short", "box_lower_above_upper")
ENTRY_ARGV = {"compile": COMPILE, "shardbound": SHARDBOUND, "program": _program("prog")}


@pytest.fixture(scope="module")
def processes(work):
    """The AS_PROCESS cases run as real processes, at once (a thread pool)."""
    with ThreadPoolExecutor(max_workers=len(AS_PROCESS)) as pool:
        futures = {case: pool.submit(_run, ENTRY_ARGV[CASES[case][0]] + CASES[case][1], work)
                   for case in AS_PROCESS}
        return {case: f.result() for case, f in futures.items()}


def _in_process(entry: str, argv, work, capsys, monkeypatch) -> subprocess.CompletedProcess:
    import torch

    from shardbound.compiler.cli import compile_main, main
    from shardbound.runtime.program.main import program_main

    monkeypatch.chdir(work)
    threads = torch.get_num_threads()
    fn = {"compile": compile_main, "shardbound": main,
          "program": lambda a: program_main(str(work / "prog"), a)}[entry]
    capsys.readouterr()
    try:
        fn(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def assert_user_error(r: subprocess.CompletedProcess, needles, label=""):
    where = f"{label}: rc={r.returncode}\n--- stderr\n{r.stderr}\n--- stdout\n{r.stdout}"
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, where
    assert r.returncode == 2, where
    lines = r.stderr.splitlines()
    assert len(lines) == 1, where
    line = lines[0]
    assert line.startswith("error: ") and line[len("error: "):].strip(), where
    for needle in needles:
        if needle.isdigit():        # a size or an index: a whole number, not part of one
            assert re.search(rf"(?<![\d.]){needle}(?![\d])", line), f"{needle!r} not in: {where}"
        else:
            assert needle in line, f"{needle!r} not in: {where}"
    assert r.stdout.strip() == "", where


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_error(work, capsys, monkeypatch, case):
    entry, argv, needles = CASES[case]
    assert_user_error(_in_process(entry, argv, work, capsys, monkeypatch), needles, case)


@pytest.mark.parametrize("case", AS_PROCESS)
def test_user_error_as_a_process(processes, case):
    assert_user_error(processes[case], CASES[case][2], case)


def test_no_output_written_on_error(processes, work, capsys, monkeypatch):
    assert processes["unsupported_hardmax"].returncode == 2
    for case in ("unsupported_hardmax", "dynamic_input_dim", "batched_constant_matmul",
                 "malformed_random_bytes"):
        entry, argv, _ = CASES[case]
        out = work / argv[argv.index("-o") + 1]
        assert _in_process(entry, argv, work, capsys, monkeypatch).returncode == 2, case
        assert not (out / "program.py").exists(), case


# -- happy path --------------------------------------------------------------------------------

def _compile_script() -> list[str]:
    """The installed `compile` console script next to this interpreter (else skip)."""
    script = shutil.which("compile", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the `compile` console script is not installed next to this interpreter")
    return [script]


def _expected_sha(lower, upper) -> str:
    data = (np.asarray(lower, dtype="<f4").tobytes() + np.asarray(upper, dtype="<f4").tobytes())
    return hashlib.sha256(data).hexdigest()


def test_happy_path(tmp_path):
    model, shape = zoo.build("residual")
    onnx.save(model, tmp_path / "residual.onnx")
    rng = np.random.default_rng(5)
    center = rng.uniform(-1, 1, size=int(np.prod(shape)))
    _box(tmp_path / "box.json", (center - 0.1).tolist(), (center + 0.1).tolist())

    r = _run(_compile_script() + ["residual.onnx", "-o", "prog"], tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    for f in ("program.py", "plan.json", "weights.safetensors"):
        assert (tmp_path / "prog" / f).is_file(), f

    runs = [SHARDBOUND + ["run", "prog", "--box", "box.json", "--json", "out.json"],
            _program("prog") + ["--box", "box.json"],
            SHARDBOUND + ["inspect", "residual.onnx"]]
    with ThreadPoolExecutor(max_workers=3) as pool:
        run_cli, run_program, inspect = pool.map(lambda a: _run(a, tmp_path), runs)
    for r in (run_cli, run_program, inspect):
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr

    out = json.loads((tmp_path / "out.json").read_text())
    for key in ("lower", "upper", "bounds_sha256"):
        assert key in out, key
    assert len(out["lower"]) == len(out["upper"]) == 4
    assert all(lo <= hi for lo, hi in zip(out["lower"], out["upper"]))
    sha = _expected_sha(out["lower"], out["upper"])
    assert out["bounds_sha256"] == sha
    assert f"bounds_sha256 {sha}" in run_cli.stdout
    assert f"bounds_sha256 {sha}" in run_program.stdout, run_program.stdout

    plan = json.loads((tmp_path / "prog" / "plan.json").read_text())
    lines = inspect.stdout.splitlines()
    node_lines = [ln for ln in lines if ln.startswith("  ")]
    assert len(lines) == 1 + len(plan["nodes"]), inspect.stdout
    assert len(node_lines) == len(plan["nodes"])
    for ln, node in zip(node_lines, plan["nodes"]):
        assert ln.strip().startswith(f"{node['name']}("), (ln, node["name"])
        assert f"= {node['op']}(" in ln, (ln, node["op"])


def test_non_finite_constants_are_rejected_at_compile_time(tmp_path):
    """A weight with inf (or a constant that overflows float32) is a one-line error naming
    the node, not a program that bounds with nan."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from shardbound.compiler.driver import compile_model
    from shardbound.compiler.errors import ShardboundError
    from shardbound.passes.manager import PassOptions

    w = np.ones((2, 3), dtype=np.float32)
    w[0, 1] = np.inf
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], name="bad_gemm", transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "inf.onnx")
    try:
        compile_model(str(tmp_path / "inf.onnx"), str(tmp_path / "out"), PassOptions())
    except ShardboundError as e:
        message = str(e)
    else:
        raise AssertionError("compiled a model with an infinite weight")
    assert "bad_gemm" in message and "non-finite" in message and "\n" not in message
