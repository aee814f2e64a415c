"""Write models/net.onnx (x[batch, 8] @ W[8, 4] -> SoftClip(alpha=2) -> y[batch, 4]) and
data/reference.npz (W and alpha, for check.py's numpy reference). Run: python make_model.py"""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).parent
ALPHA = 2.0

weights = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32) * 2
nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="project"),
         helper.make_node("SoftClip", ["h"], ["y"], domain="example.ops", name="clip", alpha=ALPHA)]
graph = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                          [numpy_helper.from_array(weights, "w")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("example.ops", 1)],
                          producer_name="examples/custom-op/make_model.py")
model.ir_version = 8
onnx.checker.check_model(model)
onnx.save(model, HERE / "models" / "net.onnx")
np.savez(HERE / "data" / "reference.npz", w=weights, alpha=np.float32(ALPHA))
