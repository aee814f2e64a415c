"""Evaluate nodes whose inputs are all constants at compile time.

onnx's reference evaluator is the oracle for what an op computes, so folding covers every
standard op, including ones cuvil has no lowering for (shape arithmetic on constants).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import helper

#: do not fold results larger than this many elements: they would bloat the library
MAX_FOLDED_ELEMENTS = 1 << 24

#: ops whose result is not a function of their inputs
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                    "Multinomial", "Bernoulli"}
#: ops left as nodes on constants of these dtypes: passes/fuse_qdq.py reads quantized weights
#: through them (and folds the ones it does not fuse into integer products)
KEPT_FOR_PASSES = {"DequantizeLinear": ("int8", "uint8")}


def fold_node(node: onnx.NodeProto, inputs: list[np.ndarray | None],
              opsets: dict[str, int], ir_version: int) -> list[np.ndarray] | None:
    """The outputs of `node` for constant `inputs`, or None when it cannot be folded."""
    kept = KEPT_FOR_PASSES.get(node.op_type, ())
    if inputs and inputs[0] is not None and inputs[0].dtype.name in kept:
        return None
    if node.op_type in NONDETERMINISTIC or any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    ):
        return None
    from onnx.reference import ReferenceEvaluator

    names = list(node.input)
    graph_inputs = []
    feeds = {}
    for name, arr in zip(names, inputs):
        if name and arr is not None and name not in feeds:
            graph_inputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape))
            feeds[name] = arr
    outputs = [helper.make_value_info(n, onnx.TypeProto()) for n in node.output if n]
    graph = helper.make_graph([node], "fold", graph_inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
        ir_version=ir_version,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = ReferenceEvaluator(model).run(None, feeds)
    except Exception:
        return None  # the lowering (or its error message) takes over
    arrays = [np.asarray(r, order="C") for r in results]  # keeps 0-D results 0-D
    if any(a.dtype == object or a.size > MAX_FOLDED_ELEMENTS for a in arrays):
        return None
    return arrays
