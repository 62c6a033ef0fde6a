"""plan.json and weights.safetensors checked against each other and against program.py.

A program directory is three files that must agree; any of them may have been edited,
truncated or swapped. Unchecked, `mode: "evil"` ran, a missing `mode` was reported as a
missing tensor, and a weight of the wrong shape, dtype or with a nan failed deep inside a
kernel with a traceback. Every check here names the file and the field or tensor and ends
with what to do (recompile), as one ShardboundError line.
"""

from __future__ import annotations

import math
import os

import torch

from shardbound.runtime.errors import ShardboundError

MODES = ("single", "fsdp", "tp")
SUMMATIONS = ("blocked", "exact", "fast")
METHODS = ("crown", "ibp")
INTERMEDIATE = ("crown", "ibp")
SCAN_BYTES = 16 << 20          # a tp rank checks whole tensors for nan in blocks of this size


def _fail(path: str, message: str) -> ShardboundError:
    return ShardboundError(f"{path}: {message}; recompile the model")


def _shape(value, path: str, field: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value)):
        raise _fail(path, f"field {field!r} must be a non-empty list of positive integers, "
                          f"got {_short(value)}")
    return tuple(value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _choice(plan: dict, field: str, choices, path: str) -> str:
    if field not in plan:
        raise _fail(path, f"field {field!r} is missing")
    value = plan[field]
    if value not in choices or not isinstance(value, str):
        raise _fail(path, f"field {field!r} is {_short(value)}; expected one of "
                          f"{', '.join(choices)}")
    return value


def check_plan(plan: dict, path: str) -> None:
    """The fields the runtime reads: their presence, types and values."""
    _choice(plan, "mode", MODES, path)
    _choice(plan, "summation", SUMMATIONS, path)
    _choice(plan, "method", METHODS, path)
    _choice(plan, "intermediate", INTERMEDIATE, path)
    if plan["mode"] == "tp" and "tp_intermediate" in plan:
        _choice(plan, "tp_intermediate", INTERMEDIATE, path)
    for side in ("input", "output"):
        part = plan.get(side)
        if not isinstance(part, dict) or not isinstance(part.get("node"), str):
            raise _fail(path, f"field {side!r} must be an object with 'node' and 'shape'")
        _shape(part.get("shape"), path, f"{side}.shape")
    nodes = plan.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise _fail(path, "field 'nodes' must be a non-empty list of node objects")
    for i, node in enumerate(nodes):
        where = f"nodes[{i}]"
        if not isinstance(node, dict) or not isinstance(node.get("name"), str):
            raise _fail(path, f"{where} must be an object with a 'name'")
        params = node.get("params", {})
        if not isinstance(params, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in params.items()):
            raise _fail(path, f"{where} ({node['name']!r}): 'params' must map roles to tensor "
                              "names")
        shapes = node.get("param_shapes", {})
        if not isinstance(shapes, dict):
            raise _fail(path, f"{where} ({node['name']!r}): 'param_shapes' must be an object")
        for key, shape in shapes.items():
            if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                    and d >= 0 for d in shape)):
                raise _fail(path, f"{where} ({node['name']!r}): shape of {key!r} must be a "
                                  f"list of integers, got {_short(shape)}")


def check_program(plan: dict, module, directory: str) -> None:
    """plan.json against the constants program.py was generated with."""
    path = os.path.join(directory, "plan.json")
    for field, const in (("mode", "MODE"), ("summation", "SUMMATION"), ("method", "METHOD")):
        have = getattr(module, const, None)
        if have is not None and have != plan[field]:
            raise _fail(path, f"field {field!r} is {plan[field]!r} but program.py was "
                              f"generated for {have!r}")
    for side, const in (("input", "INPUT_SHAPE"), ("output", "OUTPUT_SHAPE")):
        have = getattr(module, const, None)
        if have is not None and tuple(have) != tuple(plan[side]["shape"]):
            raise _fail(path, f"field '{side}.shape' is {plan[side]['shape']} but program.py "
                              f"was generated for {list(have)}")


def check_nodes(plan: dict, network, directory: str) -> None:
    """The node list of plan.json against the network program.py builds."""
    path = os.path.join(directory, "plan.json")
    built = [n.name for n in network.nodes]
    listed = [n["name"] for n in plan["nodes"]]
    if built != listed:
        at = next((i for i, (a, b) in enumerate(zip(built, listed)) if a != b),
                  min(len(built), len(listed)))
        mine = listed[at] if at < len(listed) else "(end of the list)"
        theirs = built[at] if at < len(built) else "(no more nodes)"
        raise _fail(path, f"field 'nodes' does not match program.py: node {at} is {mine!r} "
                          f"in plan.json but {theirs!r} in program.py")
    if plan["output"]["node"] != network.output.name:
        raise _fail(path, f"field 'output.node' is {plan['output']['node']!r} but program.py "
                          f"ends at {network.output.name!r}")


def check_weights(plan: dict, path: str, scan_values: bool) -> None:
    """weights.safetensors against plan.json: every tensor a node needs is there, float32,
    of the recorded shape; with `scan_values`, finite (read in bounded blocks: for tp
    ranks, which otherwise read only their slices)."""
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="pt")
    except FileNotFoundError:
        raise ShardboundError(f"{path}: missing; recompile the model") from None
    except Exception as e:
        raise ShardboundError(f"{path}: unreadable weights ({type(e).__name__}); "
                              "recompile the model") from None
    with handle as f:
        keys = set(f.keys())
        for node in plan["nodes"]:
            shapes = node.get("param_shapes", {})
            for role, key in node.get("params", {}).items():
                where = f"tensor {key!r} (node {node['name']!r}, {role})"
                if key not in keys:
                    raise _fail(path, f"{where} is missing")
                sl = f.get_slice(key)
                dtype = sl.get_dtype()
                if dtype != "F32":
                    raise _fail(path, f"{where} is {dtype}; shardbound writes float32 (F32)")
                shape = list(sl.get_shape())
                if key in shapes and shape != list(shapes[key]):
                    raise _fail(path, f"{where} has shape {shape}; plan.json says "
                                      f"{list(shapes[key])}")
                if scan_values and shape:
                    rows = max(1, SCAN_BYTES // 4 // max(1, math.prod(shape[1:])))
                    for r in range(0, shape[0], rows):
                        check_finite(sl[r:r + rows], path, where)
                elif scan_values:
                    check_finite(f.get_tensor(key), path, where)


def check_finite(t: torch.Tensor, path: str, where: str) -> None:
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise _fail(path, f"{where} holds inf or nan values")
