"""Operators that ONNX defines as functions of other operators (Attention, RMSNormalization,
RotaryEmbedding, Swish, CenterCropPad...). When cuvil has no kernel of its own for one, the
importer compiles the body that onnx's operator schema gives for it, specialised to the node's
attributes and input types, in place of the node."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
import onnx.defs

from cuvil.compiler.ir import TensorType, dim_str

__all__ = ["expandable", "function_body"]


def _schema(domain: str, op_type: str, opset: int) -> Any:
    """The schema, or None. Typed Any: onnx's stubs lack the function-body accessors used here."""
    try:
        return onnx.defs.get_schema(op_type, opset, "" if domain == "ai.onnx" else domain)
    except onnx.defs.SchemaError:
        return None


def _body_version(versions: Sequence[int], opset: int) -> int | None:
    """The newest body written for an opset no newer than the model's: a body uses the ops
    of the opset it was written for (LayerNormalization's changed when ReduceMean did)."""
    fitting = [v for v in versions if v <= opset]
    return max(fitting) if fitting else None


def expandable(domain: str, op_type: str, opset: int) -> bool:
    """Whether onnx defines this operator, at this opset, as a function of other operators."""
    schema = _schema(domain, op_type, opset)
    if schema is None:
        return False
    return (_body_version(schema.function_opset_versions, opset) is not None
            or _body_version(schema.context_dependent_function_opset_versions, opset) is not None)


def _type_proto(t: TensorType | None) -> onnx.TypeProto:
    if t is None:  # an omitted optional input
        return onnx.TypeProto()
    elem = onnx.helper.np_dtype_to_tensor_dtype(t.dtype)
    return onnx.helper.make_tensor_type_proto(
        elem, [d if isinstance(d, int) else str(dim_str(d)) for d in t.shape])


def function_body(pn: onnx.NodeProto, opset: int,
                  input_types: Sequence[TensorType | None]) -> onnx.FunctionProto | None:
    """The body of `pn` as onnx defines it for these inputs, with the node's attributes (or the
    schema's defaults) substituted for the body's attribute references; None when onnx defines
    none. The body's inputs and outputs are its formal names, in the schema's order."""
    schema = _schema(pn.domain, pn.op_type, opset)
    if schema is None:
        return None
    body = onnx.FunctionProto()
    version = _body_version(schema.context_dependent_function_opset_versions, opset)
    if version is not None:
        # the builder reads the node's attributes and the input element types
        data = schema.get_context_dependent_function_with_opset_version(
            version, pn.SerializeToString(), [_type_proto(t).SerializeToString() for t in input_types])
    else:
        version = _body_version(schema.function_opset_versions, opset)
        if version is None:
            return None
        data = schema.get_function_with_opset_version(version)
    if not data:
        return None
    body.ParseFromString(data)
    _substitute_attributes(body, pn, schema)
    return body


def _substitute_attributes(body: onnx.FunctionProto, pn: onnx.NodeProto,
                           schema: onnx.defs.OpSchema) -> None:
    """Resolve `ref_attr_name` attributes: the caller's value, else the schema's default; an
    attribute with neither is left out, as onnx's own function inliner does."""
    given = {a.name: a for a in pn.attribute}
    for a in body.attribute_proto:  # defaults declared by the body itself
        given.setdefault(a.name, a)
    for name, spec in schema.attributes.items():
        if name not in given and spec.default_value.type != onnx.AttributeProto.UNDEFINED:
            given[name] = spec.default_value
    for node in body.node:
        kept = []
        for a in node.attribute:
            if a.ref_attr_name:
                source = given.get(a.ref_attr_name)
                if source is None:
                    continue
                resolved = onnx.AttributeProto()
                resolved.CopyFrom(source)
                resolved.name = a.name
                kept.append(resolved)
            else:
                kept.append(a)
        del node.attribute[:]
        node.attribute.extend(kept)
