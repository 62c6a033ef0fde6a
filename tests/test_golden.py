"""Golden text files and determinism of compiled output.

Golden files (tests/golden/*.txt) hold the exact `shardbound inspect` output (IR after the
passes) of a few zoo models and one generated program.py. A change to the IR, the passes or the
templates shows up here as a diff to review.

Accept switch: when an intended change alters the output, regenerate the files with

    SHARDBOUND_ACCEPT_GOLDEN=1 python -m pytest tests/test_golden.py

In that mode each golden test whose output differs rewrites its file and reports it as a skip
("accepted golden file ... (rewritten)"; shown by `-rs`), so an accept never passes silently;
tests whose file is already up to date pass. Review the diff of tests/golden/ afterwards.

Determinism: compiling the same model three times (two processes with different hash seeds,
and this one) gives byte-identical program.py, plan.json and weights.safetensors for every zoo
model, in single and tp mode, and no file written by the compiler holds an absolute path.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import onnx
import pytest

import zoo

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
ACCEPT = os.environ.get("SHARDBOUND_ACCEPT_GOLDEN", "") not in ("", "0")
INSPECT_MODELS = ("mlp", "cnn_batchnorm", "residual")
PROGRAM_MODELS = ("mlp",)
# program.py in each mode: (golden name, model, PassOptions); fsdp and tp planned for P ranks
PROGRAM_MODES = {"fsdp_mlp": ("mlp", {"mode": "fsdp", "nproc": 2}),
                 "tp_tp_mlp2": ("tp_mlp2", {"mode": "tp", "nproc": 3})}
INSPECT_TP_MODELS = ("tp_mlp2", "tp_cnn")      # tp placements and the channel split at P=3


def check_golden(name: str, text: str) -> None:
    """Compare `text` with tests/golden/NAME exactly, or rewrite it in accept mode."""
    path = os.path.join(GOLDEN_DIR, name)
    old = None
    if os.path.exists(path):
        with open(path, encoding="utf-8", newline="") as f:
            old = f.read()
    if ACCEPT:
        if old != text:
            os.makedirs(GOLDEN_DIR, exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
            pytest.skip(f"accepted golden file tests/golden/{name} "
                        f"({'created' if old is None else 'rewritten'})")
        return                      # already up to date: a plain pass
    if old is None:
        pytest.fail(f"golden file tests/golden/{name} is missing; create it with "
                    "SHARDBOUND_ACCEPT_GOLDEN=1 python -m pytest tests/test_golden.py")
    if old != text:
        diff = "".join(difflib.unified_diff(old.splitlines(keepends=True),
                                            text.splitlines(keepends=True),
                                            f"golden/{name}", "now", n=2))
        pytest.fail(f"output differs from tests/golden/{name}; if the change is intended, "
                    "rerun with SHARDBOUND_ACCEPT_GOLDEN=1 and review the diff\n" + diff,
                    pytrace=False)


def _save(name: str, directory) -> str:
    model, _ = zoo.build(name)
    path = os.path.join(directory, f"{name}.onnx")
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("name", INSPECT_MODELS)
def test_inspect_golden(tmp_path, name):
    from shardbound.compiler.driver import inspect_model
    from shardbound.passes.manager import PassOptions

    text = inspect_model(_save(name, tmp_path), PassOptions())
    check_golden(f"inspect_{name}.txt", text)


@pytest.mark.parametrize("name", INSPECT_TP_MODELS)
def test_inspect_tp_golden(tmp_path, name):
    from shardbound.compiler.driver import inspect_model
    from shardbound.passes.manager import PassOptions

    text = inspect_model(_save(name, tmp_path), PassOptions(mode="tp", nproc=3))
    check_golden(f"inspect_tp_{name}.txt", text)


@pytest.mark.parametrize("name", PROGRAM_MODELS)
def test_program_golden(tmp_path, name):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    out = tmp_path / "prog"
    compile_model(_save(name, tmp_path), str(out), PassOptions())
    check_golden(f"program_{name}.txt", (out / "program.py").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(PROGRAM_MODES))
def test_program_golden_modes(tmp_path, name):
    """fsdp and tp programs: the gathers/frees and placements, reductions and the channel
    split for the compiled P at the nodes that do them, every note in full."""
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    model, options = PROGRAM_MODES[name]
    out = tmp_path / "prog"
    compile_model(_save(model, tmp_path), str(out), PassOptions(**options))
    check_golden(f"program_{name}.txt", (out / "program.py").read_text(encoding="utf-8"))


def test_golden_files_have_tests():
    """No stale golden files: every file in tests/golden/ belongs to a test above."""
    expected = ({f"inspect_{n}.txt" for n in INSPECT_MODELS}
                | {f"inspect_tp_{n}.txt" for n in INSPECT_TP_MODELS}
                | {f"program_{n}.txt" for n in PROGRAM_MODELS}
                | {f"program_{n}.txt" for n in PROGRAM_MODES})
    present = set(os.listdir(GOLDEN_DIR)) if os.path.isdir(GOLDEN_DIR) else set()
    assert present <= expected, f"stale golden files: {sorted(present - expected)}"


# -- determinism ------------------------------------------------------------------------------

COMPILE_ALL = """
import sys
from shardbound.compiler.driver import compile_model
from shardbound.passes.manager import PassOptions
src, out = sys.argv[1], sys.argv[2]
for name in sys.argv[3:]:
    compile_model(f"{src}/{name}.onnx", f"{out}/{name}", PassOptions())
    compile_model(f"{src}/{name}.onnx", f"{out}/{name}_tp", PassOptions(mode="tp"))
"""


def _digests(directory) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, directory)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_compile_is_deterministic_and_has_no_absolute_paths(tmp_path):
    names = sorted(zoo.ZOO)
    src = tmp_path / "models"
    src.mkdir()
    for name in names:
        _save(name, src)
    runs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")
        runs.append(([sys.executable, "-c", COMPILE_ALL, str(src), str(tmp_path / f"out{seed}"),
                      *names], env))
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda a: subprocess.run(a[0], env=a[1], capture_output=True,
                                                      text=True, timeout=300), runs))
    for r in done:
        assert r.returncode == 0, r.stderr
    # A third compile in this process (another hash seed, another Rust HashMap seed).
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    for name in names:
        compile_model(str(src / f"{name}.onnx"), str(tmp_path / "out3" / name), PassOptions())
        compile_model(str(src / f"{name}.onnx"), str(tmp_path / "out3" / f"{name}_tp"),
                      PassOptions(mode="tp"))
    a = _digests(tmp_path / "out1")
    for name in names:
        for f in ("program.py", "plan.json", "weights.safetensors"):
            assert os.path.join(name, f) in a, (name, f)
    for other in ("out2", "out3"):
        b = _digests(tmp_path / other)
        assert sorted(a) == sorted(b)
        differ = [f for f in sorted(a) if a[f] != b[f]]
        assert not differ, f"not byte-identical across compiles (out1 vs {other}): {differ}"

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    needles = {str(tmp_path), os.path.realpath(str(tmp_path)), repo, os.getcwd(),
               os.path.expanduser("~")}
    needles = {n.encode() for n in needles if len(n) > 1}
    for root, _, files in os.walk(tmp_path / "out1"):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                data = fh.read()
            for n in needles:
                assert n not in data, f"{os.path.join(root, f)} holds the path {n.decode()!r}"
