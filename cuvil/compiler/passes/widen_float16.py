"""Run float16 arithmetic in float32: the ops below compute float16 in float32 registers
anyway (ops/__init__.py's `compute_dtype`), but one output element at a time, off the
float32 kernels. This pass retypes each such node to float32, so Conv, Gemm and MatMul run
on the packed GEMM kernel, BatchNormalization folds and epilogues fuse as for a float32 model.

A region of widened nodes is entered through a Cast to float32 (float16 constants are
converted at compile time instead) and left through a Cast to float16 where a value is read
by a node that stays float16 or is a graph output. Inside a region values are not rounded to
float16 between ops, as onnxruntime runs float16 models on CPUs without float16 kernels:
results are closer to float32 than the graph's own rounding, and well within float16's
precision of it. Explicit Casts of the model stay, so a mixed model's precision changes where
the model says. Data-movement ops (Reshape, Concat...) join a region when their data comes
from one, so they do not cut it in two.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cuvil.compiler.ir import Graph, Node, TensorType, Value, subgraphs

__all__ = ["WIDENED_OPS", "widen_float16", "widened_nodes"]

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)

#: ops whose float16 lowering computes in float32: widened wherever they meet float16
WIDENED_OPS = frozenset({
    "Conv", "ConvTranspose", "Gemm", "MatMul",
    "BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
    "Softmax", "LogSoftmax",
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
    "AveragePool", "GlobalAveragePool", "MaxPool", "GlobalMaxPool",
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Exp", "Log", "Erf", "Tanh", "Sigmoid", "Relu",
    "LeakyRelu", "Elu", "Selu", "Gelu", "HardSigmoid", "HardSwish", "Softplus", "Softsign",
    "Mish", "PRelu", "Clip", "Neg", "Abs", "Reciprocal", "Sum", "Mean", "Max", "Min",
    "Sin", "Cos", "Where",
})

#: dtype-agnostic ops: widened when a float16 input of theirs comes out of a widened node
MOVERS = frozenset({
    "Reshape", "Flatten", "Transpose", "Concat", "Squeeze", "Unsqueeze", "Identity", "Dropout",
    "Split", "Slice", "Gather", "Expand", "Pad", "Tile", "DepthToSpace", "SpaceToDepth",
})


def _halves(values: Sequence[Value | None]) -> list[Value]:
    return [v for v in values if v is not None and v.type.dtype == F16]


def widened_nodes(graph: Graph) -> list[Node]:
    """The nodes (of `graph`, not its bodies) that `widen_float16` computes in float32."""
    chosen: list[Node] = []
    wide: set[int] = set()  # ids of float16 values a chosen node produces
    for node in graph.nodes:
        if node.domain or subgraphs(node) or not _halves(node.outputs):
            continue
        floats = [v for v in (*node.inputs, *node.outputs) if v is not None and v.type.dtype.kind == "f"]
        if any(v.type.dtype != F16 for v in floats):
            continue  # mixes float16 with another float dtype: left to the op
        if node.op_type in WIDENED_OPS or (
                node.op_type in MOVERS and any(id(v) in wide for v in _halves(node.inputs))):
            chosen.append(node)
            wide.update(id(v) for v in _halves(node.outputs))
    return chosen


def widen_float16(graph: Graph) -> Graph:
    nodes = widened_nodes(graph)
    if not nodes:
        return graph
    wide: dict[int, Value] = {}  # id of a float16 value -> its float32 counterpart

    def as_float32(v: Value, reader: Node) -> Value:
        if id(v) not in wide:
            if v.const is not None:
                wide[id(v)] = graph.constant(v.const.astype(F32), f"{v.name}_f32")
            else:
                w = graph.value(f"{v.name}_f32", TensorType(F32, v.type.shape))
                graph.insert_before(reader, Node("Cast", [v], [w], {"to": 1}, name=w.name,
                                                     opset=reader.opset))
                wide[id(v)] = w
        return wide[id(v)]

    originals: list[tuple[Node, Value, Value]] = []
    for node in nodes:
        if node.op_type == "Clip":
            _float16_bounds(graph, node)
        for i, v in enumerate(node.inputs):
            if v is not None and v.type.dtype == F16:
                graph.set_input(node, i, as_float32(v, node))
        for i, v in enumerate(node.outputs):
            if v.type.dtype == F16:
                w = graph.value(f"{v.name}_f32", TensorType(F32, v.type.shape))
                graph.set_output(node, i, w)
                wide[id(v)] = w
                originals.append((node, v, w))
    # the float16 values still read (by float16 nodes, bodies or as graph outputs) are
    # rounded once, right after the node that now computes them in float32
    for node, v, w in originals:
        if v.users or v in graph.outputs:
            graph.insert_after(node, Node("Cast", [w], [v], {"to": 10}, name=f"{v.name}_to_f16",
                                          opset=node.opset))
    return graph


def _float16_bounds(graph: Graph, clip: Node) -> None:
    """A Clip without a bound clips to its dtype's range: float16's, not float32's (an
    infinite input becomes +-65504)."""
    limit = float(np.finfo(F16).max)
    if clip.opset >= 11:
        for i, bound in ((1, -limit), (2, limit)):
            if clip.input(i) is None:
                graph.set_input(clip, i, graph.constant(np.array(bound, F16), "float16_limit"))
    else:
        clip.attrs = {"min": -limit, "max": limit, **clip.attrs}
