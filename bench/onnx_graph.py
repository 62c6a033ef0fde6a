"""The onnx.helper graph builder the bench scripts share (bench/vs_autolirpa.py,
bench/fsdp_memory.py, bench/scale.py): seeded weights, one float input `x` of shape
(1, *input_shape), one output (1, n_out). Each script had its own copy."""

from __future__ import annotations

import numpy as np

OPSET = 13


class Graph:
    """Nodes and initializers of one graph, named in order (`c1`, `t2`, ...)."""

    def __init__(self, rng, input_shape):
        self.rng, self.input_shape = rng, tuple(input_shape)
        self.nodes, self.inits, self.count = [], [], 0

    def const(self, array) -> str:
        from onnx import numpy_helper

        self.count += 1
        name = f"c{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    def op(self, op_type, inputs, **attrs) -> str:
        from onnx import helper

        self.count += 1
        out = f"t{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out],
                                           name=f"{op_type.lower()}{self.count}", **attrs))
        return out

    def weight(self, *shape):
        fan_in = int(np.prod(shape[1:]))
        return self.rng.normal(0, 1.0 / np.sqrt(fan_in), size=shape).astype(np.float32)

    def bias(self, n):
        return self.rng.normal(0, 0.1, size=(n,)).astype(np.float32)

    def gemm(self, x, n_in, n_out) -> str:
        return self.op("Gemm", [x, self.const(self.weight(n_out, n_in)),
                                self.const(self.bias(n_out))], transB=1)

    def conv(self, x, c_in, c_out, k, stride, pad) -> str:
        return self.op("Conv", [x, self.const(self.weight(c_out, c_in, k, k)),
                                self.const(self.bias(c_out))],
                       kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)

    def model(self, out: str, n_out: int, name: str):
        """The ModelProto (default IR version, not checked: bench/scale.py's external data
        is checked by path)."""
        from onnx import TensorProto, helper

        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, *self.input_shape])
        y = helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, n_out])
        graph = helper.make_graph(self.nodes, name, [x], [y], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])

    def build(self, out: str, n_out: int, name: str):
        """The checked ModelProto at IR version 8."""
        import onnx

        model = self.model(out, n_out, name)
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model
