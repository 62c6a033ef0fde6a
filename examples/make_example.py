"""Writes examples/tiny_cnn.onnx and examples/tiny_cnn_box.json: the bundled example.

A small convolutional classifier (1x8x8 input -> Sub/Div normalisation -> Conv+BatchNorm+ReLU ->
AveragePool -> Gemm+ReLU -> Gemm, 4 classes) with fixed random weights, built with
onnx.helper so the example needs no training and no download. Run it again to regenerate the
files (the output is deterministic).
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))


def build(rng: np.random.Generator) -> onnx.ModelProto:
    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    inits: list = []
    nodes = [
        helper.make_node("Sub", ["image", const("mean", [[[[0.13]]]])], ["centered"], name="normalize_sub"),
        helper.make_node("Div", ["centered", const("std", [[[[0.31]]]])], ["normalized"], name="normalize_div"),
        helper.make_node("Conv", ["normalized", const("conv.weight", rng.normal(0, 0.4, (4, 1, 3, 3))),
                                  const("conv.bias", rng.normal(0, 0.1, 4))], ["conv"],
                         name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["conv", const("bn.scale", rng.uniform(0.8, 1.2, 4)),
                                                const("bn.bias", rng.normal(0, 0.1, 4)),
                                                const("bn.mean", rng.normal(0, 0.1, 4)),
                                                const("bn.var", rng.uniform(0.8, 1.2, 4))],
                         ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["relu1"], name="relu1"),
        helper.make_node("AveragePool", ["relu1"], ["pool"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", const("fc1.weight", rng.normal(0, 0.25, (32, 64))),
                                  const("fc1.bias", rng.normal(0, 0.1, 32))], ["fc1"],
                         name="fc1", transB=1),
        helper.make_node("Relu", ["fc1"], ["relu2"], name="relu2"),
        helper.make_node("Gemm", ["relu2", const("fc2.weight", rng.normal(0, 0.3, (4, 32))),
                                  const("fc2.bias", rng.normal(0, 0.1, 4))], ["logits"],
                         name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                              producer_name="shardbound-examples")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    rng = np.random.default_rng(2026)
    onnx.save(build(rng), os.path.join(HERE, "tiny_cnn.onnx"))
    image = rng.uniform(0, 1, 64)
    eps = 0.02
    box = {"lower": np.clip(image - eps, 0, 1).round(6).tolist(),
           "upper": np.clip(image + eps, 0, 1).round(6).tolist()}
    with open(os.path.join(HERE, "tiny_cnn_box.json"), "w", encoding="utf-8") as f:
        json.dump(box, f)
        f.write("\n")


if __name__ == "__main__":
    main()
