"""Untrusted ONNX names never become code.

Models whose node, tensor, input, output and initializer names (and file name) hold quotes,
triple quotes, backslashes, newlines, Python code, unicode, keywords, leading digits, duplicates
and very long strings must compile and bound exactly like the same model with plain names. The
generated program.py must parse, use only safe ASCII identifiers, and hold no untrusted text
outside comments; running it must not execute anything hidden in a name; plan.json keeps the
original names as data.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

PAYLOAD = "__import__('os').system('touch PWNED')"
EVIL = [
    'dq"uote', "sq'uote", '"""', "'''", 'tri"""ple', "tri'''ple", "back\\slash\\",
    "\\", "new\nline", "cr\r\nlf", PAYLOAD, '"); ' + PAYLOAD + ' #',
    "')\n" + PAYLOAD + "\n#", "\"\"\"\n" + PAYLOAD + "\n\"\"\"",
    "ünïcødé λ 数字 🙂", "\u2028line\u2029sep", "tab\there", "nul\x00byte",
    "class", "import", "None", "lambda", "match", "_", "__init__", "__builtins__",
    "0starts_with_digit", "123", "#comment", "{{ 7 * 7 }}{% raw %}", "${x}", "a-b", "a_b",
    "A_B", "x" * 3000, "os.system", "params", "nodes", "build", "ops.Relu",
]
SAFE_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PARAM_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[a-z]+$")
TEMPLATE_STRINGS = {"single", "fast", "crown", "ibp", "MKL_CBWR", "AUTO,STRICT",
                    "OMP_WAIT_POLICY", "PASSIVE", "__main__"}
FORBIDDEN_NAMES = {"__import__", "eval", "exec", "system", "compile", "getattr", "setattr",
                   "open", "globals", "locals", "vars", "__builtins__", "subprocess", "popen"}
WIDTH = 8


def _names(evil: bool, count: int, salt: int):
    """count names: untrusted ones cycling through EVIL (with repeats: duplicates), or plain."""
    if not evil:
        return [f"plain{salt}_{i}" for i in range(count)]
    return [EVIL[(i * 7 + salt) % len(EVIL)] for i in range(count)]


def build_model(evil: bool, seed: int = 0) -> onnx.ModelProto:
    """A chain over most supported ops; every name is untrusted when `evil`.

    Node names repeat (duplicates) and may be empty; tensor and initializer names are made
    unique by a suffix or prefix, as ONNX requires."""
    rng = np.random.default_rng(seed)
    node_names = _names(evil, 40, 0)
    node_names[5] = node_names[6] = node_names[7]            # explicit duplicates
    if evil:
        node_names[9] = ""                                    # unnamed node
    tensor_base = _names(evil, 60, 3)
    init_base = _names(evil, 60, 5)
    tensors = [f"{b}#t{i}" if i % 2 else f"t{i}#{b}" for i, b in enumerate(tensor_base)]
    inits = [f"{b}@w{i}" if i % 2 else f"w{i}@{b}" for i, b in enumerate(init_base)]
    input_name = PAYLOAD + '\n"input"' if evil else "x"
    output_name = "out'''\n\"" + PAYLOAD if evil else "y"

    nodes, initializers = [], []
    counter = {"node": 0, "tensor": 0, "init": 0}

    def const(array):
        name = inits[counter["init"]]
        counter["init"] += 1
        initializers.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    def op(op_type, inputs, out=None, **attrs):
        name = node_names[counter["node"]]
        counter["node"] += 1
        if out is None:
            out = tensors[counter["tensor"]]
            counter["tensor"] += 1
        nodes.append(helper.make_node(op_type, inputs, [out], name=name, **attrs))
        return out

    def gemm(x, n_in, n_out, out=None):
        w = rng.normal(0, 1 / np.sqrt(n_in), (n_out, n_in))
        return op("Gemm", [x, const(w), const(rng.normal(0, 0.1, n_out))], out=out, transB=1)

    h = op("Sub", [input_name, const(rng.uniform(-0.2, 0.2, 6))])
    h = op("Div", [h, const(rng.uniform(0.5, 2, 6))])
    h = op("Relu", [gemm(h, 6, WIDTH)])
    skip = h
    for _ in range(3):
        h = op("Relu", [gemm(h, WIDTH, WIDTH)])
        h = op("Identity", [h])
        h = op("Mul", [h, const(rng.uniform(0.5, 1.5, WIDTH))])
        h = op("Add", [h, skip])                                   # sum of computed tensors
        h = op("Sub", [h, const(rng.normal(0, 0.1, WIDTH))])
        h = op("Relu", [h])
        skip = h
    h = op("Flatten", [h], axis=1)
    gemm(h, WIDTH, 3, out=output_name)

    graph = helper.make_graph(
        nodes, "evil\n'''graph" if evil else "plain", [
            helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [1, 6])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, [1, 3])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _compile(model, directory, filename):
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    path = directory / filename
    onnx.save(model, path)
    out = directory / "prog"
    compile_model(str(path), str(out), PassOptions())
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(evil program dir, plain program dir, evil model, evil model file name); everything
    runs with the cwd inside a scratch directory so that a stray `touch PWNED` lands there."""
    evil_dir = tmp_path_factory.mktemp("evil")
    plain_dir = tmp_path_factory.mktemp("plain")
    filename = "m'od\"el\\ \n{{x}} \u00fc.onnx"
    cwd = os.getcwd()
    os.chdir(evil_dir)
    try:
        model = build_model(evil=True)
        evil = _compile(model, evil_dir, filename)
        plain = _compile(build_model(evil=False), plain_dir, "plain.onnx")
    finally:
        os.chdir(cwd)
    return evil, plain, model, filename


def _pwned_files(*dirs):
    return [os.path.join(d, f) for d in dirs for f in os.listdir(d) if "pwned" in f.lower()]


def test_names_really_are_untrusted(compiled):
    """The fixture model does carry the nasty names (guards against a builder that sanitises)."""
    _, _, model, _ = compiled
    names = ([n.name for n in model.graph.node] + [i.name for i in model.graph.initializer]
             + [model.graph.input[0].name, model.graph.output[0].name]
             + [t for n in model.graph.node for t in n.output])
    blob = "\0".join(names)
    for bad in ('"""', "'''", "\\", "\n", PAYLOAD, "数字", "\x00", "x" * 3000):
        assert bad in blob, bad
    node_names = [n.name for n in model.graph.node]
    assert len(set(node_names)) < len(node_names)                 # duplicates
    assert "class" in node_names and "123" in node_names and "" in node_names


def test_program_parses_and_identifiers_are_safe(compiled):
    evil, _, _, _ = compiled
    source = (evil / "program.py").read_text(encoding="utf-8")
    assert source.isascii()
    tree = ast.parse(source)
    idents = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            idents.append(node.id)
        elif isinstance(node, ast.Attribute):
            idents.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            idents.append(node.name)
        elif isinstance(node, ast.arg):
            idents.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg is not None:
            idents.append(node.arg)
        elif isinstance(node, ast.alias):
            idents.extend(node.name.split(".") + ([node.asname] if node.asname else []))
        elif isinstance(node, (ast.Lambda, ast.Global, ast.Nonlocal, ast.Await, ast.Yield)):
            pytest.fail(f"unexpected construct {type(node).__name__} at line {node.lineno}")
    for ident in idents:
        assert SAFE_IDENT.match(ident), ident
        assert ident not in FORBIDDEN_NAMES, ident
        assert not ident.startswith("__") or ident in ("__name__", "__file__"), ident


def _docstrings(tree) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.add(doc)
    return out


def test_no_untrusted_text_outside_comments(compiled):
    evil, _, _, _ = compiled
    source = (evil / "program.py").read_text(encoding="utf-8")
    docstrings = _docstrings(ast.parse(source))
    code_text = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        assert tok.type != tokenize.ERRORTOKEN, tok
        if tok.type == tokenize.COMMENT:
            assert "\n" not in tok.string and "\r" not in tok.string
            continue
        code_text.append(tok.string)
        if tok.type == tokenize.STRING:
            assert re.fullmatch(r"[rRbBuU]?(\"[^\"\\\n]*\"|'[^'\\\n]*'|\"\"\"[^\\]*\"\"\")",
                                tok.string), f"unexpected string token {tok.string!r}"
            value = ast.literal_eval(tok.string)
            ok = (SAFE_IDENT.match(value) or PARAM_KEY.match(value) or value in TEMPLATE_STRINGS
                  or (tok.string.startswith('"""') and value in docstrings))
            assert ok, f"string literal {tok.string!r} at line {tok.start[0]} is not a safe form"
        elif tok.type == tokenize.NAME:
            assert SAFE_IDENT.match(tok.string), tok
    code = " ".join(code_text)
    for fragment in ("PWNED", "__import__", "system(", "'''", "\\"):
        assert fragment not in code, fragment


def test_same_program_structure_as_plain_names(compiled):
    """Only identifiers and comments may differ: the ASTs have the same node types in order,
    and the same string literals up to the name mapping."""
    evil, plain, _, _ = compiled
    trees = [ast.parse((d / "program.py").read_text(encoding="utf-8")) for d in (evil, plain)]
    kinds = [[type(n).__name__ for n in ast.walk(t)] for t in trees]
    assert kinds[0] == kinds[1]
    numbers = [[n.value for n in ast.walk(t) if isinstance(n, ast.Constant)
                and not isinstance(n.value, str)] for t in trees]
    assert numbers[0] == numbers[1]


def test_bounds_equal_plain_model_and_payload_not_run(compiled, tmp_path):
    """The program loads and bounds; evil names change nothing numerically; running
    program.py as a script executes no payload."""
    from shardbound.runtime import load

    evil, plain, _, _ = compiled
    rng = np.random.default_rng(3)
    center = rng.uniform(-1, 1, 6).astype(np.float32)
    lo, hi = center - 0.2, center + 0.2
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        results = {}
        for label, d in (("evil", evil), ("plain", plain)):
            v = load(str(d))
            results[label] = [v.bounds(lo, hi, method=m) for m in ("ibp", "crown")]
    finally:
        os.chdir(cwd)
    for (lb, ub), (plb, pub) in zip(results["evil"], results["plain"]):
        assert lb.shape == (3,) and bool(np.isfinite(lb.numpy()).all())
        assert bool((lb <= ub).all())
        assert np.array_equal(lb.numpy(), plb.numpy()) and np.array_equal(ub.numpy(), pub.numpy())

    box = tmp_path / "box.json"
    box.write_text(json.dumps({"lower": lo.tolist(), "upper": hi.tolist()}))
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, str(evil / "program.py"), "--box", str(box),
                        "--json", str(tmp_path / "out.json")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert np.array_equal(np.asarray(out["lower"], np.float32), results["evil"][1][0].numpy())
    assert not _pwned_files(tmp_path, evil, evil.parent, plain, cwd)


def test_plan_carries_original_names(compiled):
    evil, _, model, filename = compiled
    text = (evil / "plan.json").read_text(encoding="utf-8")
    plan = json.loads(text)
    assert plan["source"] == filename
    assert plan["input"]["onnx_name"] == model.graph.input[0].name
    origins = [n["origin"] for n in plan["nodes"]]
    for n in plan["nodes"]:
        assert SAFE_IDENT.match(n["name"]), n["name"]
        assert all(SAFE_IDENT.match(i) for i in n["inputs"])
        assert all(PARAM_KEY.match(k) for k in n["params"].values())
    assert len({n["name"] for n in plan["nodes"]}) == len(plan["nodes"])
    # Every ReLU survives the passes; its origin names the ONNX node (or, when unnamed, its
    # output tensor) exactly, long names and control characters included.
    relus = [n for n in model.graph.node if n.op_type == "Relu"]
    assert relus
    for n in relus:
        label = n.name or n.output[0]
        assert f"Relu {label!r}" in origins, label
    assert any("x" * 3000 in o for o in origins)


def test_header_comments_escape_the_file_name(compiled):
    evil, _, _, filename = compiled
    source = (evil / "program.py").read_text(encoding="utf-8")
    model_lines = [ln for ln in source.splitlines() if ln.startswith("# model:")]
    assert model_lines == [f"# model:      {json.dumps(filename)}"]
