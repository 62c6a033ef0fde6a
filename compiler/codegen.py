"""Render a planned IR graph into a program directory: program.py, weights.safetensors, plan.json.

Everything written is a pure function of the graph and the options: no timestamps, absolute
paths or dict-order accidents, so compiling twice gives byte-identical directories. No ONNX
string reaches program.py except as an identifier from `naming.Namespace` or as an escaped,
one-line literal inside a comment; attribute values are checked to be plain numbers.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import jinja2
import numpy as np
import torch
from safetensors.torch import save_file

import shardbound
from shardbound.compiler.ir import Graph
from shardbound.compiler.naming import comment_text, is_identifier
from shardbound.passes.annotations import as_json as annotation_json
from shardbound.passes.annotations import notes as annotation_notes
from shardbound.runtime.ops import OP_TYPES
from shardbound.runtime.parallel.params import STREAM_CHUNK_BYTES

PLAN_FORMAT = "shardbound-plan/1"


def literal(value) -> str:
    """A Python literal for a number, bool, str identifier or a (nested) tuple/list/dict of them;
    anything else is refused, so no untrusted text can become code."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, np.integer)):
        return repr(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if not np.isfinite(v):
            raise ValueError(f"non-finite attribute {v!r}")
        return repr(v)
    if isinstance(value, str):
        if not (is_identifier(value) or value in ("crown", "ibp")):
            raise ValueError(f"refusing to render string {value!r} as code")
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [literal(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in sorted(value.items())) + "}"
    raise ValueError(f"refusing to render {type(value).__name__} as code")


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    """One per process: it keeps the compiled template (compiling it took half of a warm
    compile, which a prestarted verifier pays per instance; compiler/prestart.py)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("shardbound.templates", ""),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
        trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters["literal"] = literal
    env.filters["comment"] = comment_text
    return env


@dataclass(frozen=True)
class NodeView:
    """What the template needs of one node (all fields already safe to render)."""
    name: str
    op: str
    module: str                 # "ops", or "tp" for the zone ops of a tp program
    cls: str
    inputs: tuple[str, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]
    params: tuple[tuple[str, str], ...]
    attrs: tuple[tuple[str, object], ...]
    origin: str
    notes: tuple[str, ...]


COMMENT_WIDTH = 96      # program.py comment lines are wrapped here, never cut


def _notes(graph: Graph, name: str) -> tuple[str, ...]:
    """The node's annotations as comment lines (the printer `inspect` uses), in full:
    long ones wrap onto indented continuation lines."""
    import textwrap

    lines = []
    for key, text in annotation_notes(graph, name):
        safe = comment_text(text, limit=1 << 30)[1:-1]
        head = f"{key}: "
        lines += textwrap.wrap(safe, COMMENT_WIDTH, initial_indent=head,
                               subsequent_indent=" " * len(head), break_long_words=False,
                               break_on_hyphens=False) or [head]
    return tuple(lines)


def _op_class(graph: Graph, n) -> tuple[str, str, tuple]:
    """(module, class name, extra attributes): a tp zone node gets its zone op (registry in
    runtime.tp) and the zone facts; every other node its plain op."""
    place = graph.annotation("tp", n.name)
    role = getattr(place, "role", "replicate")
    if role == "replicate":
        return "ops", OP_TYPES[n.op].__name__, ()
    from shardbound.runtime.parallel.tp import zone_op

    extra = (("tp_zone", place.zone), ("tp_channels", place.channels),
             ("tp_local_rows", place.local_rows))
    return "tp", zone_op(n.op, role).__name__, extra


def node_views(graph: Graph) -> list[NodeView]:
    shapes = {n.name: n.shape for n in graph.nodes}
    views = []
    for n in graph.nodes:
        for ident in (n.name, *n.inputs, *(k for _, k in n.params)):
            if not is_identifier(ident.replace(".", "_")):
                raise ValueError(f"unsafe identifier {ident!r} reached codegen")
        module, cls, extra = _op_class(graph, n)
        views.append(NodeView(
            name=n.name, op=n.op, module=module, cls=cls, inputs=n.inputs,
            in_shapes=tuple(shapes[i] for i in n.inputs) if n.inputs else (n.shape,),
            shape=n.shape, params=n.params, attrs=n.attrs + extra, origin=n.origin,
            notes=_notes(graph, n.name)))
    return views


def render_program(graph: Graph, options) -> str:
    tensors = {k: np.asarray(v) for k, v in graph.tensors.items()}
    return _environment().get_template("program.py.j2").render(
        version=shardbound.__version__, source=graph.source, mode=options.mode,
        method=options.method, intermediate=options.intermediate, summation=options.summation,
        tp_intermediate=options.tp_intermediate,
        nodes=node_views(graph), tensors=tensors, output=graph.output,
        input_shape=graph.input.shape, output_shape=graph.node(graph.output).shape,
        param_count=sum(int(v.size) for v in tensors.values()),
        param_bytes=sum(int(v.size) * 4 for v in tensors.values()),
        nproc=options.nproc,
        intermediate_plan={k: v.method for k, v in graph.annotations.get("bounds", {}).items()})


def plan_dict(graph: Graph, options, passes: list[str]) -> dict:
    plan = {
        "format": PLAN_FORMAT,
        "shardbound_version": shardbound.__version__,
        "source": graph.source,
        "mode": options.mode, "method": options.method,
        "intermediate": options.intermediate, "summation": options.summation,
        "stream_chunk_bytes": options.stream_chunk_bytes or STREAM_CHUNK_BYTES,
        "nproc": options.nproc,
        "passes": list(passes),
        "input": {"onnx_name": graph.input_name, "node": graph.input.name,
                  "shape": list(graph.input.shape)},
        "output": {"node": graph.output, "shape": list(graph.node(graph.output).shape)},
        "nodes": [{"name": n.name, "op": n.op, "origin": n.origin, "inputs": list(n.inputs),
                   "shape": list(n.shape), "params": dict(n.params),
                   "param_shapes": {key: list(np.shape(graph.tensors[key])) for _, key in n.params},
                   "annotations": {k: annotation_json(v[n.name])
                                   for k, v in sorted(graph.annotations.items()) if n.name in v}}
                  for n in graph.nodes],
    }
    if graph.fixed_inputs is not None:
        plan["fixed_inputs"] = graph.fixed_inputs.as_json()
    if options.mode == "tp":
        plan["tp_intermediate"] = options.tp_intermediate
    chunks = graph.annotations.get("stream", {}).get(graph.input.name)
    if chunks is not None:      # fsdp: each layer's stream chunk per P (chunk_choice.py)
        plan["stream_chunks"] = chunks.as_dict()
    for field in ("memory_budget", "row_tile", "bab_batch"):   # only when planned for a budget
        value = getattr(options, field, None)
        if value is not None:
            plan[field + ("_bytes" if field == "memory_budget" else "")] = int(value)
    return plan


def _unshared_tensors(arrays: dict) -> dict[str, torch.Tensor]:
    """The graph's parameters as float32 tensors, sorted by name, none sharing memory with
    another: an ONNX model may feed one initializer to several nodes (two branches with tied
    weights), and safetensors refuses to save tensors that share storage. Only those get a
    copy, so a large model is not duplicated in memory."""
    out, seen = {}, set()
    for name, value in sorted(arrays.items()):
        t = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def write_program(graph: Graph, options, passes: list[str], out_dir: str) -> None:
    """Write the three files of a compiled program into `out_dir` (created if missing)."""
    os.makedirs(out_dir, exist_ok=True)
    program = render_program(graph, options)
    with open(os.path.join(out_dir, "program.py"), "w", encoding="utf-8", newline="\n") as f:
        f.write(program)
    with open(os.path.join(out_dir, "plan.json"), "w", encoding="utf-8", newline="\n") as f:
        json.dump(plan_dict(graph, options, passes), f, indent=1, sort_keys=True)
        f.write("\n")
    tensors = _unshared_tensors(graph.tensors)
    # One metadata entry only: safetensors keeps `__metadata__` in a Rust HashMap whose
    # iteration order is randomised per process, so two entries make the header (and the
    # file's bytes) differ from one compile to the next. plan.json names the producer.
    save_file(tensors, os.path.join(out_dir, "weights.safetensors"), metadata={"format": "pt"})
