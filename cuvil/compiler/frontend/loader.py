"""Read an ONNX model safely: external data kept inside the model's folder, the checker run,
old opsets upgraded. Every failure is a ModelError naming the file."""

from __future__ import annotations

from pathlib import Path

import onnx

from cuvil.errors import ModelError

__all__ = ["check_and_upgrade", "default_opset", "load_onnx"]

#: models older than this are upgraded with onnx's version converter first
MIN_OPSET = 7
UPGRADE_TO = 13


def load_onnx(source: str | Path | onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """Read a model file (or take a ModelProto); return it with a label for error messages."""
    if isinstance(source, onnx.ModelProto):
        return source, source.graph.name or "<model>"
    path = Path(source)
    label = str(source)
    if not path.is_file():
        raise ModelError(f"{label}: no such model file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise ModelError(
            f"{label}: not a readable ONNX model ({type(exc).__name__}: {exc}); the file may be "
            "truncated or not an .onnx file: re-export it"
        ) from None
    _load_external_data(model, path, label)
    return model, label


def _load_external_data(model: onnx.ModelProto, path: Path, label: str) -> None:
    base = path.parent.resolve()
    tensors = [t for t in onnx.external_data_helper._get_all_tensors(model)
               if onnx.external_data_helper.uses_external_data(t)]
    for t in tensors:
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        target = (base / location).resolve()
        if base not in target.parents:
            raise ModelError(
                f"{label}: tensor {t.name!r} points to external data {location!r} outside the "
                "model's folder; keep weight files next to the model"
            )
        if not target.is_file():
            raise ModelError(
                f"{label}: tensor {t.name!r} needs external data file {location!r}, which is "
                f"missing (looked in the model's folder); copy it next to the model"
            )
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else target.stat().st_size - offset
        if offset + length > target.stat().st_size:
            raise ModelError(f"{label}: external data {location!r} of tensor {t.name!r} is "
                             "shorter than the model says (truncated file?)")
        with open(target, "rb") as f:
            f.seek(offset)
            t.raw_data = f.read(length)
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT


def check_and_upgrade(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"{label}: the ONNX checker rejects the model: {exc}") from None
    opset = default_opset(model)
    if opset < MIN_OPSET:
        try:
            model = onnx.version_converter.convert_version(model, UPGRADE_TO)
        except Exception as exc:
            raise ModelError(
                f"{label}: opset {opset} is too old and onnx's version converter could not "
                f"upgrade it to {UPGRADE_TO} ({exc}); re-export the model with a newer opset"
            ) from None
    return model


def default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


