"""Packaging (issue #20): one version source, entry points, compile-only dependencies as an
extra, and sdist/wheel builds that need no network.

The build runs setuptools' PEP 517 backend in this interpreter (no isolated build
environment, so nothing is downloaded) on a copy of the repository's files, so the checkout
gets no build/ or egg-info from it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser

import numpy as np
import onnx
import pytest

import shardbound
import zoo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = """
import sys
from setuptools import build_meta
out = sys.argv[1]
print(build_meta.build_wheel(out))
print(build_meta.build_sdist(out))
"""


def _repo_files() -> list[str]:
    res = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip("not a git checkout: cannot tell the project's files")
    return [f for f in res.stdout.splitlines() if os.path.isfile(os.path.join(REPO, f))]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    for rel in _repo_files():
        if rel.startswith("tests/"):
            continue
        os.makedirs(src / os.path.dirname(rel), exist_ok=True)
        shutil.copy2(os.path.join(REPO, rel), src / rel)
    out = tmp / "dist"
    out.mkdir()
    env = dict(os.environ, PIP_NO_INDEX="1")
    res = subprocess.run([sys.executable, "-c", BUILD, str(out)], cwd=src, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,), (sdist,) = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    return wheel, sdist


def test_wheel_metadata_version_and_dependencies(built):
    wheel, _ = built
    assert f"shardbound-{shardbound.__version__}-" in wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(info).decode())
        entry = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert meta["Version"] == shardbound.__version__
    requires = meta.get_all("Requires-Dist")
    plain = {r.split(";")[0].replace(" ", "") for r in requires if "extra" not in r}
    compile_only = {r.split(";")[0].replace(" ", "") for r in requires
                    if 'extra == "compile"' in r}
    assert {p.split(">=")[0] for p in plain} == {"torch", "numpy", "safetensors"}
    assert "torch>=2.13" in plain
    assert {p.split(">=")[0] for p in compile_only} == {"onnx", "onnx-graphsurgeon",
                                                         "networkx", "jinja2"}
    assert "compile = shardbound.compiler.cli:compile_main" in entry
    assert "shardbound = shardbound.compiler.cli:main" in entry
    for needed in ("shardbound/__init__.py", "shardbound/__main__.py", "shardbound/options.py",
                   "shardbound/readme.py", "shardbound/templates/program.py.j2",
                   "shardbound/compiler/vnnlib2.py", "shardbound/runtime/program/main.py",
                   "shardbound/passes/annotations.py"):
        assert needed in names, needed


def test_sdist_holds_the_sources(built):
    _, sdist = built
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for needed in ("pyproject.toml", "README.md", "shardbound_pkg/__init__.py",
                   "templates/program.py.j2", "compiler/cli.py", "runtime/__init__.py"):
        assert needed in names, needed


def test_a_compiled_program_runs_without_the_compile_only_packages(tmp_path):
    from shardbound.compiler.cli import COMPILE_ONLY
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    model, _ = zoo.mlp(np.random.default_rng(1), sizes=(3, 8, 2))
    onnx.save(model, tmp_path / "net.onnx")
    compile_model(str(tmp_path / "net.onnx"), str(tmp_path / "prog"), PassOptions())
    (tmp_path / "box.json").write_text(json.dumps({"lower": [-1.0] * 3, "upper": [1.0] * 3}))
    res = subprocess.run([sys.executable, "-X", "importtime", str(tmp_path / "prog" /
                                                                  "program.py"),
                          "--box", str(tmp_path / "box.json"), "--json",
                          str(tmp_path / "out.json"), "-q"],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0]
                for line in res.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2}
    assert "torch" in imported
    assert not set(COMPILE_ONLY) & imported, sorted(set(COMPILE_ONLY) & imported)
    assert json.loads((tmp_path / "out.json").read_text())["lower"]


@pytest.mark.parametrize("command", ["compile", "inspect", "verify"])
def test_missing_compile_extra_is_one_line_naming_it(monkeypatch, command):
    import importlib.util

    from shardbound.compiler import cli
    from shardbound.runtime.errors import ShardboundError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jinja2" else real(name, *a))
    fn = {"compile": cli._compile, "inspect": cli._inspect, "verify": cli._verify}[command]
    with pytest.raises(ShardboundError) as info:
        fn(None)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{command}: needs jinja2")
    assert "pip install 'shardbound[compile]'" in message
