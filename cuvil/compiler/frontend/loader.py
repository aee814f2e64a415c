"""Read an ONNX model safely: external data kept inside the model's folder, the checker run,
old opsets upgraded. Every failure is a ModelError naming the file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx

from cuvil.errors import ModelError, not_a_regular_file

__all__ = ["check_and_upgrade", "default_opset", "load_onnx"]

#: models older than this are upgraded with onnx's version converter first
MIN_OPSET = 7
UPGRADE_TO = 13


def load_onnx(source: str | Path | onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """Read a model file (or take a ModelProto); return it with a label for error messages."""
    if isinstance(source, onnx.ModelProto):
        label = source.graph.name or "<model>"
        external = [t.name for t in _tensors(source) if _uses_external_data(t)]
        if external:
            raise ModelError(
                f"{label}: tensors {external[:5]} keep their data in external files, which a "
                "ModelProto cannot locate; pass the path of the .onnx file instead (its external "
                "data is read from the model's folder), or load it with onnx.load(path)"
            )
        _check_text(source, label)
        return source, label
    path = Path(source)
    label = str(source)
    kind = not_a_regular_file(path)
    if kind is not None:
        raise ModelError(f"{label}: no such model file" if kind == "missing" else
                         f"{label}: is {kind}, not a model file; give the path of the .onnx file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelError(f"{label}: cannot read the model file: {exc.strerror or exc}") from None
    if not data:
        raise ModelError(f"{label}: the file is empty; re-export the model")
    model = onnx.ModelProto()
    fmt = _format_of(path)
    try:
        if fmt in (None, "protobuf"):
            model.ParseFromString(data)
        else:  # onnx's text formats (.onnxtxt, .textproto, .json...), chosen by extension
            model = onnx.load_model_from_string(data, format=fmt)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise ModelError(
            f"{label}: not a readable ONNX model ({type(exc).__name__}); the file may be "
            "truncated or not an .onnx file: re-export it"
        ) from None
    if not model.HasField("graph") or not model.ir_version:
        raise ModelError(
            f"{label}: not an ONNX model (no graph or IR version in it); the file may be "
            "truncated or not an .onnx file: re-export it"
        )
    _check_text(model, label)
    _load_external_data(model, path, label)
    return model, label


def _check_text(model: onnx.ModelProto, label: str) -> None:
    """Refuse names that are not UTF-8: protobuf hands such a string field over as bytes,
    which nothing downstream expects (and onnx's checker lets through)."""
    where = _bytes_in_string_field(model, "model")
    if where is not None:
        raise ModelError(f"{label}: {where} is not valid UTF-8 text; the file is damaged or was "
                         "written by a broken exporter: re-export it")


def _bytes_in_string_field(message: Any, path: str) -> str | None:
    """The path of the first string field holding bytes, in `message` and the messages in it."""
    for field, value in message.ListFields():
        is_message = field.type == field.TYPE_MESSAGE
        if not is_message and field.type != field.TYPE_STRING:
            continue  # tensors' numbers: not walked, could be millions
        repeated = getattr(field, "is_repeated", None)
        if repeated is None:  # protobuf before 5.28
            repeated = field.label == field.LABEL_REPEATED
        for index, item in enumerate(value if repeated else [value]):
            if is_message:
                at = f"{path}.{field.name}" + (f"[{index}]" if repeated else "")
                found = _bytes_in_string_field(item, at)
                if found is not None:
                    return found
            elif isinstance(item, bytes):
                return f"{path}.{field.name} {item!r}"
    return None


def _format_of(path: Path) -> str | None:
    try:
        return onnx.serialization.registry.get_format_from_file_extension(path.suffix)
    except Exception:  # older onnx without the registry: binary protobuf only
        return None


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def _tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor that may hold data: initializers and tensor attributes, in all subgraphs."""
    for g in _graphs(model.graph):
        yield from g.initializer
        for sparse in g.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors


def _uses_external_data(t: onnx.TensorProto) -> bool:
    return t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL


def _load_external_data(model: onnx.ModelProto, path: Path, label: str) -> None:
    """Read each external tensor's bytes from a file inside the model's folder, or fail."""
    base = path.parent.resolve()
    sizes: dict[Path, int] = {}
    for t in _tensors(model):
        if not _uses_external_data(t):
            continue
        what = f"{label}: tensor {t.name!r}"
        info = _external_entries(t, what)
        location = info.get("location", "")
        target = _external_file(location, base, path, what)
        if target not in sizes:
            try:
                sizes[target] = target.stat().st_size
            except OSError as exc:
                raise ModelError(f"{what}: cannot read external data {location!r}: "
                                 f"{exc.strerror or exc}; copy the file next to the model"
                                 ) from None
        size = sizes[target]
        offset, length = _external_extent(t, info, what)
        if length is None:
            length = size - offset
        if offset > size or offset + length > size:
            raise ModelError(
                f"{what}: the external data file {location!r} has {size} bytes, but the model "
                f"reads {length} bytes at offset {offset} from it (truncated or replaced "
                "file?); copy the complete file next to the model"
            )
        try:
            with open(target, "rb") as f:
                f.seek(offset)
                raw = f.read(length)
        except OSError as exc:
            raise ModelError(f"{what}: cannot read external data {location!r}: "
                             f"{exc.strerror or exc}") from None
        if len(raw) != length:
            raise ModelError(f"{what}: external data {location!r} ended early (read {len(raw)} of "
                             f"{length} bytes); copy the complete file next to the model")
        t.raw_data = raw
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT


def _external_entries(t: onnx.TensorProto, what: str) -> dict[str, str]:
    """The tensor's external_data entries as a dict; a key given twice is refused (readers
    differ on which one holds)."""
    info: dict[str, str] = {}
    for e in t.external_data:
        if e.key in info:
            raise ModelError(f"{what}: its external data gives {e.key!r} twice "
                             f"({info[e.key]!r} and {e.value!r}); keep one and re-save the model")
        info[e.key] = e.value
    return info


def _external_file(location: str, base: Path, path: Path, what: str) -> Path:
    """The regular file inside the model's folder that `location` names, or a ModelError."""
    if not location:
        raise ModelError(f"{what} is stored externally but names no file (empty location); "
                         "re-export the model")
    if "\0" in location:
        raise ModelError(f"{what}: its external data location {location!r} holds a NUL byte, "
                         "which no file name can; re-export the model")
    try:
        # resolve() follows symlinks too: a link inside the folder to a file outside is refused
        target = (base / location).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise ModelError(f"{what}: its external data location {location!r} cannot be followed "
                         f"({getattr(exc, 'strerror', None) or exc}); copy the data file next "
                         "to the model") from None
    if target != base and base not in target.parents:
        raise ModelError(
            f"{what} points to external data {location!r} outside the model's folder; "
            "cuvil reads weights only from files next to the model: copy the file there "
            "and re-save the model with a relative location"
        )
    if Path(location).is_absolute():  # inside the folder, but no other machine has that path
        raise ModelError(
            f"{what}: its external data location {location!r} is an absolute path; ONNX reads "
            "locations relative to the model's folder (onnxruntime refuses absolute ones): "
            f"re-save the model with location {target.relative_to(base).as_posix()!r}"
        )
    kind = not_a_regular_file(target)
    if kind == "missing":
        raise ModelError(
            f"{what} needs the external data file {location!r}, which is missing (looked "
            f"next to the model, in {path.parent.name or '.'}/); copy it next to the model"
        )
    if kind is not None:
        raise ModelError(f"{what}: its external data {location!r} is {kind}, not a file; "
                         "copy the data file next to the model")
    return target


#: bits per element of the types numpy holds in more bits than they take in a file
_PACKED_BITS: dict[int, int] = {
    onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4, onnx.TensorProto.FLOAT4E2M1: 4,
    onnx.TensorProto.INT2: 2, onnx.TensorProto.UINT2: 2}


def _byte_size(t: onnx.TensorProto) -> int | None:
    """The bytes the tensor's dims and type take, None for types of no fixed size."""
    if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        bits = _PACKED_BITS.get(t.data_type) or 8 * onnx.helper.tensor_dtype_to_np_dtype(
            t.data_type).itemsize
    except (KeyError, ValueError, TypeError):  # a type this onnx does not know
        return None
    count = 1
    for d in t.dims:
        count *= d
    return (count * bits + 7) // 8 if count >= 0 else None


def _external_extent(t: onnx.TensorProto, info: dict[str, str], what: str
                     ) -> tuple[int, int | None]:
    """The offset and length the entries give (ASCII digits only, as onnxruntime reads them);
    a missing length is the tensor's size, as in onnxruntime (None for a type of no fixed
    size: read to the file's end)."""
    numbers = {}
    for key in ("offset", "length"):
        value = info.get(key)
        if value is not None and not (value.isascii() and value.isdigit()):
            raise ModelError(f"{what}: its external data {key} {value!r} is not a number of "
                             "bytes (digits 0-9 only); re-export the model")
        numbers[key] = None if value is None else int(value)
    expected = _byte_size(t)
    length = numbers["length"]
    if length is not None and expected is not None and length != expected:
        raise ModelError(
            f"{what}: its external data length is {length} bytes, but its dims "
            f"{list(t.dims)} of {onnx.TensorProto.DataType.Name(t.data_type)} take "
            f"{expected}; fix the tensor's 'length' entry or its dims, or re-export the model"
        )
    return numbers["offset"] or 0, expected if length is None else length


#: ops onnxruntime registers in the default domain as its own (contrib) kernels, which its
#: tools write there (onnxruntime-genai's model builder) and onnx's checker does not know
ONNXRUNTIME_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model, or a copy with onnxruntime's default-domain ops in com.microsoft, where the
    checker accepts ops it does not define."""
    nodes = [i for i, n in enumerate(model.graph.node)
             if n.domain in ("", "ai.onnx") and n.op_type in ONNXRUNTIME_DEFAULT_DOMAIN_OPS]
    if not nodes:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for i in nodes:
        copy.graph.node[i].domain = "com.microsoft"
    if all(imp.domain != "com.microsoft" for imp in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return copy


def check_and_upgrade(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    try:
        onnx.checker.check_model(_checkable(model))
    except Exception as exc:
        raise ModelError(f"{label}: the ONNX checker rejects the model: {exc}") from None
    opset = default_opset(model)
    newest = _newest_opsets()
    # every import is checked, not only the one in effect, and of every domain onnx defines,
    # used or not: onnxruntime refuses a model that lists an unreleased opset anywhere
    for imp in model.opset_import:
        domain = "" if imp.domain == "ai.onnx" else imp.domain
        if domain in newest and imp.version > newest[domain]:
            what = f"domain {imp.domain!r}" if domain else "the default domain"
            raise ModelError(
                f"{label}: the model imports opset {imp.version} of {what}, newer than any "
                f"this onnx {onnx.__version__} defines (up to {newest[domain]}); re-export it "
                f"with an opset <= {newest[domain]}, or upgrade onnx"
                + (" (it also imports the default domain more than once: keep one import)"
                   if not domain and _default_imports(model) > 1 else "")
            )
    # a graph of other domains only (an ai.onnx.ml model) has no default opset to upgrade
    if opset < MIN_OPSET and _default_imports(model):
        model = _per_channel_prelu_slopes(model)
        try:
            model = onnx.version_converter.convert_version(model, UPGRADE_TO)
        except Exception as exc:
            raise ModelError(
                f"{label}: opset {opset} is too old and onnx's version converter could not "
                f"upgrade it to {UPGRADE_TO} ({exc}); re-export the model with a newer opset"
            ) from None
    return model


def _per_channel_prelu_slopes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Before opset 7, PRelu applied a slope of C values per channel (axis 1), as Caffe2 did
    and old PyTorch exports assume; from opset 7 it broadcasts numpy-style, which the version
    converter does not account for. Reshape such slopes to [C, 1, ...] before upgrading (in a
    copy: the caller's ModelProto stays as it was)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    inits = {t.name: t for t in model.graph.initializer}
    ranks = {}
    for vi in [*model.graph.input, *model.graph.value_info]:
        if vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
    for node in model.graph.node:
        if node.op_type != "PRelu" or len(node.input) != 2 or node.input[1] not in inits:
            continue
        slope, rank = inits[node.input[1]], ranks.get(node.input[0], 0)
        if len(slope.dims) == 1 and slope.dims[0] > 1 and rank > 2:
            per_channel = onnx.TensorProto()
            per_channel.CopyFrom(slope)
            per_channel.name = f"{slope.name}_per_channel"
            per_channel.dims[:] = [slope.dims[0]] + [1] * (rank - 2)
            if per_channel.name not in inits:
                model.graph.initializer.append(per_channel)
                inits[per_channel.name] = per_channel
                if model.ir_version < 4:  # initializers were graph inputs too
                    model.graph.input.append(onnx.helper.make_tensor_value_info(
                        per_channel.name, per_channel.data_type, per_channel.dims))
            node.input[1] = per_channel.name
    return model


def _newest_opsets() -> dict[str, int]:
    """The newest opset onnx defines per domain ("" the default one)."""
    try:
        return {d: int(hi) for d, (_, hi) in onnx.defs.C.schema_version_map().items()}
    except AttributeError:  # an onnx without the map: the default domain only
        return {"": onnx.defs.onnx_opset_version()}


def default_opset(model: onnx.ModelProto) -> int:
    """The default domain's opset; of several imports of it the last holds, as in onnxruntime
    (and in the importer's per-domain table)."""
    versions = [int(imp.version) for imp in model.opset_import if imp.domain in ("", "ai.onnx")]
    return versions[-1] if versions else 1


def _default_imports(model: onnx.ModelProto) -> int:
    return sum(imp.domain in ("", "ai.onnx") for imp in model.opset_import)
