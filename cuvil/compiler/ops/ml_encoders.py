"""ai.onnx.ml encoders and feature plumbing: OneHotEncoder, LabelEncoder (integer and float
maps), ArrayFeatureExtractor, FeatureVectorizer; and ZipMap, which cuvil refuses with the
converter option that leaves it out.

Each compiles as a graph of standard ops (`_ml_graph`). Categories and keys given as strings
are refused: a cuvil library exchanges numeric arrays only.
"""

from __future__ import annotations

import numpy as np
import onnx

from cuvil.compiler.ir import Node
from cuvil.compiler.ops import attr, register
from cuvil.compiler.ops._ml_graph import Body, Expanded, floats, ints
from cuvil.errors import ModelError, UnsupportedOpError


def _no_strings(node: Node, *names: str) -> None:
    for name in names:
        value = node.attrs.get(name)
        if value is not None and (len(value) if not isinstance(value, np.ndarray)
                                  else value.dtype.kind in "OSU"):
            raise UnsupportedOpError(
                f"{node.describe()}: {name} holds strings; a cuvil library exchanges numeric "
                "arrays only. Encode the strings as integers before the model (e.g. with "
                "sklearn's OrdinalEncoder in Python) and convert the model on those integers")


@register
class OneHotEncoder(Expanded):
    """[..] -> [.., categories] floats: 1 where the value (truncated to int64, as onnxruntime
    reads floats) equals the category; an unknown value gives a row of zeros."""

    op_type = "OneHotEncoder"

    def expand(self, node: Node) -> onnx.FunctionProto:
        _no_strings(node, "cats_strings")
        cats = ints(node, "cats_int64s")
        if not cats:
            raise ModelError(f"{node.describe()}: cats_int64s names no categories")
        if int(node.attrs.get("zeros", 1)) == 0:
            raise UnsupportedOpError(f"{node.describe()}: zeros=0 (fail on unknown categories) "
                                     "is not compiled by cuvil; convert with zeros=1")
        b = Body(node)
        x = b.cast(b.inputs[0], np.int64)
        hit = b.op("Equal", b.op("Unsqueeze", x, b.const([-1], np.int64)), b.const(cats, np.int64))
        return b.finish(b.cast(hit, np.float32))


@register
class LabelEncoder(Expanded):
    """Maps each key to its value, anything else to the default (integer and float maps)."""

    op_type = "LabelEncoder"
    since = 2

    def expand(self, node: Node) -> onnx.FunctionProto:
        _no_strings(node, "keys_strings", "values_strings", "keys_tensor", "values_tensor")
        x = node.inputs[0]
        if x is None:
            raise ModelError(f"{node.describe()}: input X is required")
        if "keys_tensor" in node.attrs:
            keys = np.asarray(node.attrs["keys_tensor"]).ravel()
            values = np.asarray(node.attrs["values_tensor"]).ravel()
            default = np.asarray(node.attrs.get("default_tensor",
                                                np.zeros(1, values.dtype))).ravel()[0]
        else:
            if "keys_int64s" in node.attrs:
                keys = np.asarray(ints(node, "keys_int64s"), np.int64)
            else:
                keys = np.asarray(floats(node, "keys_floats"), np.float32)
            if "values_int64s" in node.attrs:
                values = np.asarray(ints(node, "values_int64s"), np.int64)
                default = np.int64(attr(node, "default_int64", -1))
            else:
                values = np.asarray(floats(node, "values_floats"), np.float32)
                default = np.float32(attr(node, "default_float", -0.0))
        if len(keys) != len(values) or not len(keys):
            raise ModelError(f"{node.describe()}: {len(keys)} keys and {len(values)} values; the "
                             "map needs as many of each, at least one")
        b = Body(node)
        xk = b.inputs[0] if x.type.dtype == keys.dtype else b.cast(b.inputs[0], keys.dtype)
        hit = b.op("Equal", b.op("Unsqueeze", xk, b.const([-1], np.int64)),
                   b.const(keys, keys.dtype))
        which = b.op("ArgMax", b.cast(hit, np.int32), axis=-1, keepdims=0)
        found = b.op("ReduceMax", b.cast(hit, np.int32), axes=[-1], keepdims=0)
        y = b.op("Where", b.cast(found, np.bool_), b.op("Gather", b.const(values, values.dtype),
                                                         which, axis=0),
                 b.const(default, values.dtype))
        return b.finish(y)


@register
class ArrayFeatureExtractor(Expanded):
    """X[..., indices]; a [C] input gives [1, len(indices)] as in onnxruntime."""

    op_type = "ArrayFeatureExtractor"

    def expand(self, node: Node) -> onnx.FunctionProto:
        x = node.inputs[0]
        if x is None or node.input(1) is None:
            raise ModelError(f"{node.describe()}: inputs X and Y (the indices) are required")
        b = Body(node)
        indices = b.op("Reshape", b.inputs[1], b.const([-1], np.int64))
        y = b.op("Gather", b.inputs[0], indices, axis=-1)
        if x.type.rank == 1:
            y = b.op("Unsqueeze", y, b.const([0], np.int64))
        return b.finish(y)


@register
class FeatureVectorizer(Expanded):
    """The inputs' columns side by side as floats: [N, sum(inputdimensions)]."""

    op_type = "FeatureVectorizer"

    def expand(self, node: Node) -> onnx.FunctionProto:
        dims = ints(node, "inputdimensions")
        if len(dims) != len(node.inputs):
            raise ModelError(f"{node.describe()}: inputdimensions has {len(dims)} entries for "
                             f"{len(node.inputs)} inputs")
        b = Body(node)
        parts = []
        for i, (v, d) in enumerate(zip(node.inputs, dims)):
            if v is None:
                raise ModelError(f"{node.describe()}: input {i} is missing")
            if v.type.shape[-1:] != (d,):
                raise UnsupportedOpError(f"{node.describe()}: input {i} {v.type} does not end in "
                                         f"its inputdimensions {d}; cuvil compiles inputs that do")
            x = b.inputs[i] if v.type.dtype == np.float32 else b.cast(b.inputs[i], np.float32)
            parts.append(b.op("Reshape", x, b.const([-1, d], np.int64)))
        return b.finish(b.op("Concat", *parts, axis=1) if len(parts) > 1 else parts[0])


@register
class ZipMap(Expanded):
    """Refused: its output is a sequence of maps, which a cuvil library cannot return."""

    op_type = "ZipMap"
    not_compiled = ("its output is a list of dicts; convert the classifier with skl2onnx's "
                    "zipmap=False (docs/ml.md)")

    def expand(self, node: Node) -> onnx.FunctionProto:
        raise ModelError(
            f"{node.describe()}: ZipMap turns the probabilities into a list of dicts, which a "
            "cuvil library cannot return (it returns numeric arrays). Convert the classifier "
            "without it: skl2onnx.to_onnx(model, X, options={id(model): {'zipmap': False}}) "
            "(for a Pipeline, the id of its final classifier), or onnxmltools' zipmap=False; "
            "the probabilities then come out as one [N, classes] array")
