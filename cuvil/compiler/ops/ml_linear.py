"""ai.onnx.ml linear models and per-feature transforms: LinearClassifier, LinearRegressor,
Scaler, Normalizer, Binarizer, Imputer.

Each compiles as a graph of standard ops (`_ml_graph`), following onnxruntime's kernels where
the ONNX-ML spec leaves room: inputs are read as float32 (Binarizer and Imputer keep their
dtype), and a LinearClassifier with one score column and two class labels returns the raw
score s as [1 - s, s] with the label chosen by s > 0, as onnxruntime does.
"""

from __future__ import annotations

import numpy as np
import onnx

from cuvil.compiler.ir import Node
from cuvil.compiler.ops import register
from cuvil.compiler.ops._ml_graph import (
    Body,
    Expanded,
    floats,
    ints,
    matrix_input,
    no_string_labels,
    post_transform,
    rows_2d,
    text,
)
from cuvil.errors import ModelError, UnsupportedOpError


def _weights(node: Node, features: int, what: str) -> np.ndarray:
    coef = np.asarray(floats(node, "coefficients"), dtype=np.float32)
    if coef.size == 0 or coef.size % features:
        raise ModelError(f"{node.describe()}: {coef.size} coefficients do not make whole rows of "
                         f"{features} features (one row per {what})")
    return coef.reshape(-1, features)


def _intercepts(node: Node, rows: int) -> np.ndarray:
    b = np.asarray(floats(node, "intercepts"), dtype=np.float32)
    if b.size == 0:
        return np.zeros(rows, np.float32)
    if b.size != rows:
        raise ModelError(f"{node.describe()}: {b.size} intercepts for {rows} rows of coefficients")
    return b


@register
class LinearClassifier(Expanded):
    op_type = "LinearClassifier"

    def expand(self, node: Node) -> onnx.FunctionProto:
        no_string_labels(node)
        features, _ = matrix_input(node)
        w = _weights(node, features, "class")
        targets = w.shape[0]
        labels = ints(node, "classlabels_ints")
        how = text(node, "post_transform", "NONE")
        b = Body(node)
        x = rows_2d(b, b.as_float(0), node)
        scores = b.op("Gemm", x, b.const(w), b.const(_intercepts(node, targets)), transB=1)
        if targets == 1:
            positive, negative = (labels[1], labels[0]) if len(labels) == 2 else (1, 0)
            above = b.op("Greater", b.op("Squeeze", scores, b.const([1], np.int64)), b.const(0.0))
            label = b.op("Where", above, b.const(positive, np.int64), b.const(negative, np.int64))
            if how == "PROBIT":
                raise UnsupportedOpError(f"{node.describe()}: post_transform 'PROBIT' is not "
                                         "compiled by cuvil")
            if len(labels) == 2:  # onnxruntime adds the second class without a transform
                scores = b.op("Concat", b.op("Sub", b.const(1.0), scores), scores, axis=1)
            return b.finish(label, scores)
        if len(labels) != targets:
            raise ModelError(f"{node.describe()}: {targets} rows of coefficients but "
                             f"{len(labels)} classlabels_ints")
        best = b.op("ArgMax", scores, axis=1, keepdims=0)
        label = b.op("Gather", b.const(labels, np.int64), best, axis=0)
        return b.finish(label, post_transform(b, scores, how))


@register
class LinearRegressor(Expanded):
    op_type = "LinearRegressor"

    def expand(self, node: Node) -> onnx.FunctionProto:
        features, _ = matrix_input(node)
        w = _weights(node, features, "target")
        targets = int(node.attrs.get("targets", 1))
        if w.shape[0] != targets:
            raise ModelError(f"{node.describe()}: targets is {targets} but the coefficients make "
                             f"{w.shape[0]} rows of {features} features")
        b = Body(node)
        x = rows_2d(b, b.as_float(0), node)
        y = b.op("Gemm", x, b.const(w), b.const(_intercepts(node, targets)), transB=1)
        return b.finish(post_transform(b, y, text(node, "post_transform", "NONE")))


def _per_feature(node: Node, values: list[float], features: int, name: str) -> list[float]:
    if len(values) not in (1, features):
        raise ModelError(f"{node.describe()}: {name} has {len(values)} values; give one, or one "
                         f"per feature ({features})")
    return values


@register
class Scaler(Expanded):
    op_type = "Scaler"

    def expand(self, node: Node) -> onnx.FunctionProto:
        features, _ = matrix_input(node)
        offset = _per_feature(node, floats(node, "offset") or [0.0], features, "offset")
        scale = _per_feature(node, floats(node, "scale") or [1.0], features, "scale")
        b = Body(node)
        y = b.op("Mul", b.op("Sub", b.as_float(0), b.const(offset)), b.const(scale))
        return b.finish(y)


@register
class Normalizer(Expanded):
    """Each row divided by its max, L1 or L2 norm (onnxruntime's MAX takes the largest value,
    not the largest magnitude); a row whose norm is 0 stays as it is."""

    op_type = "Normalizer"

    def expand(self, node: Node) -> onnx.FunctionProto:
        matrix_input(node)
        norm = text(node, "norm", "MAX")
        b = Body(node)
        x = b.as_float(0)
        if norm == "MAX":
            denom = b.op("ReduceMax", x, axes=[-1], keepdims=1)
        elif norm == "L1":
            denom = b.op("ReduceL1", x, axes=[-1], keepdims=1)
        elif norm == "L2":
            denom = b.op("ReduceL2", x, axes=[-1], keepdims=1)
        else:
            raise ModelError(f"{node.describe()}: norm {norm!r} is not one of MAX, L1, L2")
        zero = b.op("Equal", denom, b.const(0.0))
        y = b.op("Where", zero, x, b.op("Div", x, denom))
        return b.finish(y)


@register
class Binarizer(Expanded):
    op_type = "Binarizer"

    def expand(self, node: Node) -> onnx.FunctionProto:
        x = node.inputs[0]
        if x is None:
            raise ModelError(f"{node.describe()}: input X is required")
        b = Body(node)
        threshold = b.cast(b.const(float(node.attrs.get("threshold", 0.0))), x.type.dtype)
        above = b.op("Greater", b.inputs[0], threshold)
        return b.finish(b.cast(above, x.type.dtype))


@register
class Imputer(Expanded):
    """Replaces `replaced_value_float` (NaN: every NaN) or `replaced_value_int64` by the
    imputed value of the element's column."""

    op_type = "Imputer"

    def expand(self, node: Node) -> onnx.FunctionProto:
        features, _ = matrix_input(node)
        x = node.inputs[0]
        assert x is not None
        values_f, values_i = floats(node, "imputed_value_floats"), ints(node, "imputed_value_int64s")
        if values_f:
            values: list[float] | list[int] = values_f
            replaced: float = float(node.attrs.get("replaced_value_float", 0.0))
        elif values_i:
            values, replaced = values_i, int(node.attrs.get("replaced_value_int64", 0))
        else:
            raise ModelError(f"{node.describe()}: neither imputed_value_floats nor "
                             "imputed_value_int64s is given")
        _per_feature(node, values, features, "the imputed values")  # type: ignore[arg-type]
        b = Body(node)
        dtype = x.type.dtype
        if np.isnan(replaced):
            if dtype.kind != "f":
                raise ModelError(f"{node.describe()}: X is {dtype}; NaN can only be replaced in "
                                 "float inputs")
            missing = b.op("IsNaN", b.inputs[0])
        else:
            missing = b.op("Equal", b.inputs[0], b.const(replaced, dtype))
        y = b.op("Where", missing, b.const(values, dtype), b.inputs[0])
        return b.finish(y)
