"""Inputs a property fixes (lower == upper) folded into the model as constants, before import.

Why: some models compute shapes and indices from input values (a patch position read from
the input, a class index, a box): the frontend refuses a Slice whose starts depend on the
input, because in general they vary. When the property pins those input elements to one
value, the computation is static for that property; folding them turns it into a constant
that the frontend folds on (onnx.reference, as for any constant subgraph).

How: a partial evaluation of the ONNX graph, element by element. Every tensor is a value
array with a `known` mask. The graph inputs are known where the property fixes them (at the
float32 value a float32 evaluation of the model sees: the nearest one). A node whose inputs
are all fully known is evaluated (onnx.reference); a movement op (Slice, Gather, Reshape,
Concat, ...) whose index/shape inputs are fully known moves the mask with the data; an
elementwise op knows an output element where every input element it reads is known; any
other node's outputs are unknown. Unknown elements hold a filler that is never read for a
known result. Known tensors that depended on the input become initializers and the nodes
that made them go; the rest of the graph is untouched.

The program compiled from the folded model is only valid for these values: the caller records
them (plan.json "fixed_inputs", runtime/program/fixed_inputs.py checks every box against them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from shardbound.compiler.errors import ShardboundError

# op -> the input positions that carry data (the mask moves with them); every other input
# (indices, shapes, axes) must be fully known for the output's mask to be computed.
MOVEMENT = {"Slice": (0,), "Gather": (0,), "GatherElements": (0,), "GatherND": (0,),
            "Reshape": (0,), "Squeeze": (0,), "Unsqueeze": (0,), "Flatten": (0,),
            "Transpose": (0,), "Identity": (0,), "Expand": (0,), "Tile": (0,),
            "Split": (0,), "Concat": None, "ScatterND": (0, 2), "ScatterElements": (0, 2)}
# ops whose output element i reads input element i of each (broadcast) input only
ELEMENTWISE = frozenset((
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Min", "Max", "Sum", "Mean", "Equal", "Less",
    "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Not", "Where", "Cast",
    "Neg", "Abs", "Relu", "Floor", "Ceil", "Round", "Sign", "Sqrt", "Exp", "Log", "Sigmoid",
    "Tanh", "Clip", "Erf", "Reciprocal", "IsNaN", "IsInf"))
SHAPE_ONLY = frozenset(("Shape", "Size"))     # known from the input's (static) shape alone


@dataclass(frozen=True)
class FixedInputs:
    """Input elements (flat, in the property's X_i numbering) that every case of a property
    fixes to one value: `values` as the property states them (float64), `folded` the float32
    values the model was folded with."""
    indices: np.ndarray
    values: np.ndarray

    @property
    def folded(self) -> np.ndarray:
        return self.values.astype(np.float32)

    @classmethod
    def from_cases(cls, cases) -> "FixedInputs | None":
        """The elements with lower == upper in every case, at the same value in all."""
        fixed = first = None
        for c in cases:
            lo, hi = np.asarray(c.lower, np.float64), np.asarray(c.upper, np.float64)
            if fixed is None:
                fixed, first = lo == hi, lo
            else:
                fixed = fixed & (lo == hi) & (lo == first)
        if fixed is None or not fixed.any():
            return None
        idx = np.flatnonzero(fixed)
        return cls(idx.astype(np.int64), first[idx].copy())

    def as_json(self) -> dict:
        return {"indices": [int(i) for i in self.indices],
                "values": [float(v) for v in self.values]}


def _input_sizes(model: onnx.ModelProto) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each graph input that is not an initializer; a symbolic first axis
    is the batch axis (one sample)."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for x in model.graph.input:
        if x.name in inits:
            continue
        dims = []
        for i, d in enumerate(x.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            elif i == 0:
                dims.append(1)
            else:
                raise ShardboundError(f"input {x.name!r} has a dynamic dimension at axis {i}; "
                                      "fixed inputs cannot be folded into it")
        out.append((x.name, tuple(dims)))
    return out


def _evaluate(node: onnx.NodeProto, arrays: list, opset) -> list[np.ndarray] | None:
    """The node's outputs on these input arrays (None at an absent optional input), or None
    where onnx.reference cannot evaluate them (a filler value out of an op's range)."""
    names = [f"i{k}" if a is not None else "" for k, a in enumerate(arrays)]
    outs = [f"o{k}" for k in range(len(node.output))]
    proto = helper.make_node(node.op_type, names, outs, domain=node.domain)
    proto.attribute.extend(node.attribute)
    inits = [numpy_helper.from_array(np.asarray(a), n) for n, a in zip(names, arrays) if n]
    g = helper.make_graph([proto], "fold", [], [helper.make_value_info(o, onnx.TypeProto())
                                                 for o in outs], inits)
    model = helper.make_model(g, opset_imports=list(opset))
    try:
        with np.errstate(all="ignore"):
            return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, {})]
    except Exception:
        return None


def _reduces(node) -> bool:
    """A scatter that combines data and updates (reduction add/mul/max/min): an element is
    known only where both are, which moving the mask (an OR for add) would not say."""
    return any(a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute)


def _partial(node, lookup, opset):
    """[(value, known mask)] for the node's outputs, or None where nothing is known;
    `lookup(name)` gives an input's (value, known mask), or None."""
    ins = [lookup(n) if n else None for n in node.input]
    if any(s is None for n, s in zip(node.input, ins) if n):
        return None
    if any(a.HasField("g") or a.graphs for a in node.attribute):
        return None                     # If/Loop/Scan: not followed
    values = [s[0] if s is not None else None for s in ins]
    full = [s is None or bool(s[1].all()) for s in ins]
    op = node.op_type if node.domain in ("", "ai.onnx") else None
    if all(full) or op in SHAPE_ONLY:
        out = _evaluate(node, values, opset)
        return None if out is None else [(v, np.ones(v.shape, bool)) for v in out]
    if op in MOVEMENT and not _reduces(node):
        data = MOVEMENT[op] or tuple(range(len(ins)))
        if not all(f for k, f in enumerate(full) if k not in data):
            return None
        out = _evaluate(node, values, opset)
        masks = _evaluate(node, [s[1] if k in data and s is not None else v
                                 for k, (s, v) in enumerate(zip(ins, values))], opset)
        if out is None or masks is None:
            return None
        return [(v, m.astype(bool)) for v, m in zip(out, masks)]
    if op in ELEMENTWISE:
        out = _evaluate(node, values, opset)
        if out is None:
            return None
        known = np.ones(out[0].shape, bool)
        for s in ins:
            if s is not None:
                known = known & np.broadcast_to(s[1], out[0].shape)
        return [(out[0], known)]
    return None


def fold_fixed_inputs(model: onnx.ModelProto, fixed: FixedInputs, source: str
                      ) -> tuple[onnx.ModelProto, int]:
    """The model with every tensor that the fixed inputs determine (and that depended on the
    input) replaced by its value; and how many tensors were folded (0: the model as given)."""
    layout = _input_sizes(model)
    total = sum(int(np.prod(s)) for _, s in layout)
    if fixed.indices.size and int(fixed.indices[-1]) >= total:
        raise ShardboundError(f"{source}: the property fixes input {int(fixed.indices[-1])}, "
                              f"but the model has {total} input values")
    flat_v = np.zeros(total, np.float32)
    flat_k = np.zeros(total, bool)
    flat_v[fixed.indices] = fixed.folded
    flat_k[fixed.indices] = True
    states, depends, offset = {}, set(), 0
    for name, shape in layout:
        n = int(np.prod(shape))
        states[name] = (flat_v[offset:offset + n].reshape(shape),
                        flat_k[offset:offset + n].reshape(shape))
        depends.add(name)
        offset += n
    opset = model.opset_import
    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: node for node in model.graph.node for o in node.output}

    def constant(name):
        """A tensor that does not depend on the input, evaluated when a node that does
        reads it (so weights are converted, and constant subgraphs run, only where needed:
        the frontend folds the rest as before)."""
        if name not in states:
            if name in inits:
                v = numpy_helper.to_array(inits[name])
                states[name] = (v, np.ones(v.shape, bool))
            elif name in producer:
                node = producer[name]
                result = _partial(node, lookup, opset)
                for out_name, state in zip(node.output, result or ()):
                    states[out_name] = state
        return states.get(name)

    def lookup(name):
        if name in depends:
            return states.get(name)
        try:
            return constant(name)
        except RecursionError:          # a constant chain deeper than the stack: not followed
            return None

    folded: dict[str, np.ndarray] = {}
    drop: set[int] = set()
    for k, node in enumerate(model.graph.node):
        if not any(n in depends for n in node.input):
            continue                    # a constant: evaluated when a dependent node reads it
        depends.update(node.output)
        result = _partial(node, lookup, opset)
        if result is None:
            continue
        for name, state in zip(node.output, result):
            states[name] = state
        if node.output and all(bool(m.all()) for _, m in result):
            drop.add(k)
            folded.update({n: v for n, (v, _) in zip(node.output, result)})
    outputs = {o.name for o in model.graph.output}
    if outputs & set(folded):
        raise ShardboundError(f"{source}: the property fixes every input that output "
                              f"{sorted(outputs & set(folded))[0]!r} depends on; there is "
                              "nothing to bound")
    if not folded:
        return model, 0
    kept = [n for k, n in enumerate(model.graph.node) if k not in drop]
    used = {n for node in kept for n in node.input}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(kept)
    out.graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(v), n)
                                 for n, v in folded.items() if n in used)
    return out, len(folded)
