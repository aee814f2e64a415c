"""Model projects for tests of the build backend, its compile cache and its options."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def write_model(path: Path, seed: int = 0) -> None:
    """A tiny model at `path`: x[batch, 4] -> Gemm (weights from `seed`) -> Relu -> y[batch, 3]."""
    weights = np.random.default_rng(seed).standard_normal((4, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
