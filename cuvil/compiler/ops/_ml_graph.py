"""Building the graphs of standard ops that most ai.onnx.ml operators compile as.

An ai.onnx.ml op whose arithmetic standard ONNX ops express (Scaler is Sub and Mul,
LinearClassifier is MatMul, Add, Softmax, ArgMax and Gather...) is compiled as such a graph
(`Op.expand`): the importer types it with the ops' own shape rules and the ops' kernels run
it, so these models get the same GEMM and vector code as any other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from cuvil.compiler.ir import Node, TensorType
from cuvil.compiler.ops import InferContext, Op, attr
from cuvil.errors import ModelError, UnsupportedOpError

ML = "ai.onnx.ml"


class Expanded(Op):
    """An ai.onnx.ml op compiled as standard ops; it has no lowering of its own."""

    domain = ML
    dtypes = ("float32", "float64", "int64", "int32")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        raise AssertionError("expanded by the importer")


def rows_2d(b: Body, x: str, node: Node) -> str:
    """X as [N, C] (a [C] input is one row)."""
    v = node.inputs[0]
    if v is not None and v.type.rank == 1:
        return b.op("Unsqueeze", x, b.const([0], np.int64))
    return x

#: the default-domain opset the bodies are written for
BODY_OPSET = 17


class Body:
    """A function body under construction: `inputs` are the formal names of the node's
    inputs (x0, x1...); `op` adds a node and returns its output name. A subgraph built
    alongside (a Loop body) takes its own `prefix` so its names stay distinct."""

    def __init__(self, node: Node, prefix: str = "t") -> None:
        self.node = node
        self.inputs = [f"x{i}" for i in range(len(node.inputs))]
        self.nodes: list[onnx.NodeProto] = []
        self._prefix = prefix
        self._count = 0

    def name(self) -> str:
        self._count += 1
        return f"{self._prefix}{self._count}"

    def op(self, op_type: str, *inputs: str, domain: str = "", **attrs: Any) -> str:
        """A node of one output; its name."""
        return self.outputs(op_type, 1, *inputs, domain=domain, **attrs)[0]

    def outputs(self, op_type: str, count: int, *inputs: str, domain: str = "",
                **attrs: Any) -> list[str]:
        """A node of `count` outputs; their names."""
        outs = [self.name() for _ in range(count)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain or None,
                                           **attrs))
        return outs

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        out = self.name()
        self.nodes.append(helper.make_node("Constant", [], [out],
                                           value=numpy_helper.from_array(arr, out)))
        return out

    def cast(self, x: str, dtype: Any) -> str:
        return self.op("Cast", x, to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))

    def as_float(self, i: int) -> str:
        """Input i as float32, as onnxruntime reads the numeric inputs of these ops."""
        v = self.node.inputs[i]
        x = self.inputs[i]
        return x if v is not None and v.type.dtype == np.float32 else self.cast(x, np.float32)

    def finish(self, *outputs: str, domains: dict[str, int] | None = None,
               opset: int = BODY_OPSET) -> onnx.FunctionProto:
        imports = [helper.make_opsetid("", opset)]
        imports += [helper.make_opsetid(d, v) for d, v in (domains or {}).items()]
        return helper.make_function(self.node.domain or "ai.onnx.ml", self.node.op_type,
                                    self.inputs, list(outputs), self.nodes, imports)


def text(node: Node, name: str, default: Any = None) -> str:
    """A string attribute (onnx keeps bytes; the importer decodes them)."""
    value = attr(node, name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def floats(node: Node, name: str) -> list[float]:
    return [float(v) for v in attr(node, name, None) or []]


def ints(node: Node, name: str) -> list[int]:
    return [int(v) for v in attr(node, name, None) or []]


def matrix_input(node: Node) -> tuple[int, Any]:
    """(features, rows) of input X, which these ops read as [N, C] (or [C], one row)."""
    x = node.inputs[0]
    if x is None:
        raise ModelError(f"{node.describe()}: input X is required")
    if x.type.rank not in (1, 2):
        raise ModelError(f"{node.describe()}: X must be [N, C] or [C], got {x.type}")
    features = x.type.shape[-1]
    if not isinstance(features, int):
        raise UnsupportedOpError(f"{node.describe()}: X's feature dim {features} must be known at "
                                 "compile time; pin it with `inputs = {...}` in the config")
    rows = x.type.shape[0] if x.type.rank == 2 else 1
    return features, rows


def no_string_labels(node: Node, name: str = "classlabels_strings") -> None:
    if attr(node, name, None):
        raise UnsupportedOpError(
            f"{node.describe()}: the class labels are strings ({name}); a cuvil library "
            "exchanges numeric arrays only. Train the model on integer labels (e.g. encode them "
            "with sklearn.preprocessing.LabelEncoder and map the predicted ids back to names in "
            "Python) and convert it again")


def post_transform(b: Body, scores: str, how: str) -> str:
    """The scores after onnxruntime's post_transform over the last axis."""
    if how == "NONE":
        return scores
    if how == "LOGISTIC":
        return b.op("Sigmoid", scores)
    if how == "SOFTMAX":
        return b.op("Softmax", scores, axis=-1)
    if how == "SOFTMAX_ZERO":
        # exp(v - max) for non-zero scores, zero scores stay (near) zero; sum to one
        big = b.op("Greater", b.op("Abs", scores), b.const(1e-7))
        top = b.op("ReduceMax", scores, axes=[-1], keepdims=1)
        e = b.op("Where", big, b.op("Exp", b.op("Sub", scores, top)),
                 b.op("Mul", scores, b.op("Exp", b.op("Neg", top))))
        return b.op("Div", e, b.op("ReduceSum", e, b.const([-1], np.int64), keepdims=1))
    raise UnsupportedOpError(f"{b.node.describe()}: post_transform {how!r} is not compiled by "
                             "cuvil (it compiles NONE, LOGISTIC, SOFTMAX and SOFTMAX_ZERO)")
