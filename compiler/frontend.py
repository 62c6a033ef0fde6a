"""ONNX file -> bound IR.

onnx.load -> onnx.checker -> onnx-graphsurgeon import (cleanup, toposort) -> for each node in
order: fold it if every input is a constant (onnx.reference evaluates it), else lower it with
the registered handler. Old-style models whose initializers are also graph inputs load as they
are: graphsurgeon treats those inputs as constants.
"""

from __future__ import annotations

import math
import os
from types import MappingProxyType

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from shardbound.compiler.context import Computed, LoweringContext
from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.ir import Graph, Node
from shardbound.compiler.lowering import (constant_only_reason, find_handler,
                                          has_constant_output, supported_ops)

DEFAULT_DOMAINS = ("", "ai.onnx")
MAX_LISTED = 12          # unsupported ops named in one error line


def load_model(path: str) -> onnx.ModelProto:
    """Read and check an untrusted ONNX file; every failure is a one-line ShardboundError."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise ShardboundError(f"{path}: no such file")
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf raises several unrelated types on garbage
        raise ShardboundError(f"{name}: not a readable ONNX model ({type(e).__name__}); "
                              "check that the file is a complete .onnx export") from None
    if not model.graph.node:
        raise ShardboundError(f"{name}: the model has no nodes (empty or not an ONNX graph)")
    # Weights in external data files (models over protobuf's 2 GB limit): the checker reads
    # the model by path, shape inference runs without the data, and the data is loaded last.
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    try:
        onnx.checker.check_model(path if external else model)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShardboundError(f"{name}: the ONNX checker rejects the model: {first}") from None
    _check_known_opset(model, name)
    return model


def _check_known_opset(model: onnx.ModelProto, name: str) -> None:
    """Refuse an ONNX opset newer than the installed onnx knows. The checker lets it pass, and
    each op would be lowered by its newest known schema, whose meaning a later opset may have
    changed: a silent wrong answer, where a re-export at a known opset is a simple fix."""
    newest = onnx.defs.onnx_opset_version()
    declared = model_opset(model)
    if declared > newest:
        raise ShardboundError(f"{name}: the model declares ONNX opset {declared}, newer than the "
                              f"newest this installation knows ({newest}); re-export it with "
                              f"opset <= {newest} or upgrade onnx")


def _external_dir(model: onnx.ModelProto, path: str) -> str | None:
    """The folder of the model's external weight data, or None when it has none."""
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return os.path.dirname(os.path.abspath(path))
    return None


def model_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in DEFAULT_DOMAINS:
            return int(imp.version)
    return 1


def import_onnx(path: str, max_elements: int | None = None, fixed=None) -> Graph:
    """Lower the model at `path` into a bound IR graph (before any pass). No tensor -- the
    input, a constant, a folded or computed value, as declared or as built -- may exceed
    `max_elements` (default: PassOptions' MAX_ELEMENTS; `--max-elements`). `fixed`
    (compiler/fixed_inputs.FixedInputs): input elements folded in as constants first; the
    graph records them (`Graph.fixed_inputs`) when folding changed the model."""
    from shardbound.passes.manager import MAX_ELEMENTS

    model = load_model(path)
    source = os.path.basename(path)
    opset = model_opset(model)
    external_dir = _external_dir(model, path)
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:
        pass  # shapes are recomputed by our own ops; inference only helps graphsurgeon
    if external_dir is not None:
        from onnx.external_data_helper import load_external_data_for_model

        try:
            load_external_data_for_model(model, external_dir)
        except Exception as e:
            raise ShardboundError(f"{source}: cannot read its external weight data "
                                  f"({type(e).__name__}); keep the data files next to the "
                                  "model") from None
    if fixed is not None:
        from shardbound.compiler.fixed_inputs import fold_fixed_inputs

        model, count = fold_fixed_inputs(model, fixed, source)
        fixed = fixed if count else None
    graph = gs.import_onnx(model)
    del model               # graphsurgeon holds what it needs (a wide model: GiBs)
    graph.cleanup().toposort()
    _check_supported(graph, source, opset)
    ctx = LoweringContext(source, opset, max_elements or MAX_ELEMENTS)
    ctx.graph_outputs = {t.name for t in graph.outputs}
    input_name = _lower_input(ctx, graph)
    for node in graph.nodes:
        ctx.onnx_node = node
        for t in node.outputs:          # sizes known from shape inference, before any work
            ctx.check_size(getattr(t, "shape", None), f"output {t.name!r}")
        _lower_node(ctx, node, opset)
    ctx.onnx_node = None
    out = _single_output(ctx, graph)
    nodes = _used(ctx.nodes, out.node)
    keys = {key for n in nodes for _, key in n.params}
    tensors = {k: v for k, v in ctx.tensors.items() if k in keys}
    return Graph(nodes=tuple(nodes), tensors=MappingProxyType(tensors),
                 output=out.node, source=source, input_name=input_name, fixed_inputs=fixed)


def _lower_input(ctx: LoweringContext, graph) -> str:
    for t in graph.inputs:        # (initializer-inputs were turned into constants already)
        if isinstance(t, gs.Constant):
            ctx.set_const(t, t.values)
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant):
            ctx.set_const(t, t.values)
    inputs = [t for t in graph.inputs if isinstance(t, gs.Variable)]
    if not inputs:
        raise ShardboundError(f"{ctx.source}: the model has no input tensor")
    layouts = [_input_layout(ctx, x) for x in inputs]
    name = ctx.names.name("input")
    if len(inputs) == 1:
        (dims, batched), = layouts
        ctx.check_size(dims, f"input {inputs[0].name!r}")
        ctx.nodes.append(Node(name=name, op="input", inputs=(), shape=tuple(dims),
                              origin=f"input {inputs[0].name!r}{_dtype_note(inputs[0])}"))
        ctx.alias(inputs[0], Computed(name, tuple(dims), batched))   # batch-less: context.py
        return inputs[0].name
    # Several inputs: one flat input node holding their values in input order (the property's
    # X_i as VNN-COMP numbers them); each ONNX input is a move of it (a range, reshaped).
    from shardbound.compiler.lowering.movement import emit_move

    sizes = [math.prod(dims) for dims, _ in layouts]
    total = sum(sizes)
    ctx.check_size((total,), "the inputs together")
    names = ", ".join(f"{x.name!r}{_dtype_note(x)}" for x in inputs)
    ctx.nodes.append(Node(name=name, op="input", inputs=(), shape=(total,),
                          origin=f"inputs {names} (flattened, in order)"))
    flat = Computed(name, (total,), False)
    offset = 0
    for x, (dims, batched), n in zip(inputs, layouts, sizes):
        full = (1, *dims) if batched else tuple(dims)
        emit_move(ctx, [flat], [("range", 0, offset, offset + n, 1), ("reshape", full)], full, x)
        offset += n
    return ",".join(x.name for x in inputs)


def _dtype_note(x) -> str:
    """' (float64, computed in float32)' for an input not declared float32 (inspect shows it)."""
    if x.dtype is None or np.dtype(x.dtype) == np.float32:
        return ""
    return f" ({np.dtype(x.dtype)}, computed in float32)"


def _input_layout(ctx: LoweringContext, x) -> tuple[list[int], bool]:
    """(sample dims, batched) of one graph input, or a one-line error. A first axis of size 1
    or symbolic is the batch axis; one of another fixed size is a data axis (no batch axis)."""
    if x.dtype is not None and np.dtype(x.dtype).kind != "f":
        raise ShardboundError(f"{ctx.source}: input {x.name!r} has type {np.dtype(x.dtype)}; "
                              "a floating-point input is required")
    shape = list(x.shape or [])
    if not shape:
        raise ShardboundError(f"{ctx.source}: input {x.name!r} has no static shape; "
                              "re-export the model with a fixed input shape")
    batched = not (isinstance(shape[0], int) and shape[0] > 1)
    dims = []
    for i, d in enumerate(shape):
        if i == 0 and batched and (not isinstance(d, int) or d in (1, -1)):
            continue  # the batch axis: symbolic or 1
        if not isinstance(d, int) or d <= 0:
            raise ShardboundError(f"{ctx.source}: input {x.name!r} has a dynamic dimension "
                                  f"{d!r} at axis {i} (shape {shape}); re-export the model with "
                                  "a fixed input shape")
        dims.append(int(d))
    return dims, batched


def _check_supported(graph, source: str, opset: int) -> None:
    """Every op the model needs that has no handler, in one message: (op, opset, first node)
    for each. A node whose inputs are all constants is folded, not lowered, so it needs no
    handler; constness is followed through the graph as the lowering will see it."""
    constant = {t.name for t in graph.tensors().values() if isinstance(t, gs.Constant)}
    missing: dict[str, str] = {}
    for node in graph.nodes:
        domain = node.domain or ""
        inputs = [t for t in node.inputs if t.name != ""]
        folds = node.op != "Constant" and inputs and all(t.name in constant for t in inputs)
        known = domain in DEFAULT_DOMAINS and find_handler(node.op, opset) is not None
        if folds or (known and has_constant_output(node.op)) or node.op == "Constant":
            constant.update(t.name for t in node.outputs)
        elif not known:
            label = node.op if domain in DEFAULT_DOMAINS else f"{domain}.{node.op}"
            name = node.name or (node.outputs[0].name if node.outputs else "?")
            missing.setdefault(label, name)
    if missing:
        shown = list(missing.items())[:MAX_LISTED]
        listed = ", ".join(f"{op} (opset {opset}, first node {name!r})" for op, name in shown)
        if len(missing) > MAX_LISTED:
            listed += f" and {len(missing) - MAX_LISTED} more"
        reasons: dict[str, list[str]] = {}
        for op in missing:
            why = constant_only_reason(op)
            if why:
                reasons.setdefault(why, []).append(op)
        notes = "".join(f"; {', '.join(ops)}: {why}" for why, ops in reasons.items())
        raise ShardboundError(f"{source}: {len(missing)} unsupported op(s): {listed}{notes}; "
                              f"supported ops: {', '.join(supported_ops())}")


def _lower_node(ctx: LoweringContext, node, opset: int) -> None:
    domain = node.domain or ""
    if domain not in DEFAULT_DOMAINS:
        raise ctx.error(f"op domain {domain!r} is not supported (only the default ONNX domain)")
    inputs = [t for t in node.inputs if t.name != ""]
    if node.op != "Constant" and inputs and all(ctx.is_const(t) for t in inputs):
        _fold(ctx, node, opset)
        return
    handler = find_handler(node.op, opset)
    if handler is None:
        raise ctx.error(f"op {node.op} is not supported; supported ops: {', '.join(supported_ops())}")
    handler(ctx, node)


def _fold(ctx: LoweringContext, node, opset: int) -> None:
    """Evaluate a node whose inputs are all constants with the ONNX reference evaluator."""
    names = [t.name for t in node.inputs]
    attrs = {}
    for k, v in node.attrs.items():
        if isinstance(v, gs.Constant):
            v = numpy_helper.from_array(np.asarray(v.values))
        elif isinstance(v, gs.Graph):
            raise ctx.error("ops with subgraphs are not supported")
        attrs[k] = v
    proto = helper.make_node(node.op, names, [t.name for t in node.outputs], **attrs)
    inits = [numpy_helper.from_array(np.asarray(ctx.values[n]), n) for n in dict.fromkeys(names) if n]
    g = helper.make_graph([proto], "fold", [], [helper.make_value_info(t.name, onnx.TypeProto())
                                                 for t in node.outputs], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    try:
        results = ReferenceEvaluator(model).run(None, {})
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ctx.error(f"could not evaluate this constant subgraph: {first}") from None
    for t, r in zip(node.outputs, results):
        ctx.set_const(t, np.asarray(r))


def _used(nodes: list[Node], output: str) -> list[Node]:
    """The nodes the output depends on, and the input (graphsurgeon's cleanup dropped the
    unused ONNX nodes; a fused product pattern leaves the IR nodes it replaced unused)."""
    needed = {output}
    for n in reversed(nodes):
        if n.name in needed:
            needed.update(n.inputs)
    return [n for n in nodes if n.name in needed or n.op == "input"]


def _single_output(ctx: LoweringContext, graph) -> Computed:
    """The model's output; several outputs are one flat tensor of their values in output order
    (the property's Y_j as VNN-COMP numbers them), a move of them."""
    from shardbound.compiler.lowering.movement import emit_move

    if not graph.outputs:
        raise ShardboundError(f"{ctx.source}: the model has no output")
    values = []
    for out in graph.outputs:
        value = ctx.values.get(out.name)
        if not isinstance(value, Computed):
            raise ShardboundError(f"{ctx.source}: output {out.name!r} does not depend on the "
                                  "input")
        values.append(value)
    if len(values) == 1:         # a scalar output (a ReduceSum without keepdims) is one value
        return values[0] if values[0].shape else ctx.reshaped(values[0], (1,), None, "output")
    flats = [ctx.reshaped(v, (math.prod(v.shape),), None, "output") for v in values]
    distinct, where = [], []          # one input per distinct tensor (an output listed twice)
    for f in flats:
        if f not in distinct:
            distinct.append(f)
        where.append(distinct.index(f))
    total = sum(f.shape[0] for f in flats)
    return emit_move(ctx, distinct, [("concat", 0, tuple(where))], (total,))
