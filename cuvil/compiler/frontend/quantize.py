"""Post-training static quantization (`quantize = "int8"`): a float ONNX model -> a QDQ model.

The work is onnxruntime's (`onnxruntime.quantization`), needed at build time only: its
`quant_pre_process` runs symbolic shape inference and onnxruntime's basic graph optimizations
(Conv-BatchNormalization folding among them), then `quantize_static` runs the model on the
calibration feeds to read each activation's range and writes QuantizeLinear/DequantizeLinear
pairs: int8 activations (asymmetric, zero point from the range), symmetric per-output-channel
int8 weights, int32 biases. cuvil then compiles that QDQ model as any other ONNX model.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import onnx

from cuvil.compiler.frontend.calibration import (
    CalibrationSource,
    Feeds,
    input_specs,
    read_calibration,
)
from cuvil.compiler.frontend.loader import load_onnx
from cuvil.errors import ConfigError, MissingDependencyError, ModelError

__all__ = [
    "ONNXRUNTIME_REQUIREMENT",
    "QuantizeSettings",
    "Quantized",
    "quantize_model",
    "quantize_with_reference",
]

#: what the build backend asks the frontend to install for a model with quantize = "int8"
ONNXRUNTIME_REQUIREMENT = "onnxruntime>=1.17"
# calibration-method (cuvil.config._ORT_METHODS) -> onnxruntime's CalibrationMethod
_ORT_METHODS = {"minmax": "MinMax", "percentile": "Percentile", "entropy": "Entropy"}

Log = Callable[[str], None]


@dataclass(frozen=True)
class QuantizeSettings:
    """What `quantize = "int8"` is told: the calibration source and the keys beside it."""

    calibration: CalibrationSource
    method: str = "minmax"
    keep_float: tuple[str, ...] = ()
    # folders a "module:function" calibration entry point is imported from first
    search_path: tuple[Path, ...] = field(default=())


@dataclass(frozen=True)
class Quantized:
    float_model: onnx.ModelProto  # after pre-processing: what the QDQ model was made from
    qdq_model: onnx.ModelProto
    feeds: list[Feeds]  # the calibration feeds, checked


def quantize_model(source: str | Path | onnx.ModelProto, settings: QuantizeSettings,
                   pins: Mapping[str, Sequence[int | str]] | None = None,
                   log: Log | None = None) -> onnx.ModelProto:
    """The QDQ model of `source`, calibrated on `settings.calibration`."""
    return quantize_with_reference(source, settings, pins, log).qdq_model


def quantize_with_reference(source: str | Path | onnx.ModelProto, settings: QuantizeSettings,
                            pins: Mapping[str, Sequence[int | str]] | None = None,
                            log: Log | None = None) -> Quantized:
    """The QDQ model with the float model it was made from and the calibration feeds (what
    `cuvil inspect --quantization` compares)."""
    say = log or (lambda _message: None)
    quantization = _onnxruntime_quantization()
    if settings.method not in _ORT_METHODS:
        raise ConfigError(f"calibration method {settings.method!r} is not one of "
                          f"{', '.join(_ORT_METHODS)}; choose one of them")
    model, label = load_onnx(source)
    feeds = read_calibration(settings.calibration, input_specs(model, pins, label),
                             search_path=settings.search_path)
    nodes, op_types = _keep_float(model, settings.keep_float, label)
    say(f"cuvil: quantizing {label} to int8 on {len(feeds)} calibration feeds "
        f"({settings.method} ranges)")

    class Reader(quantization.CalibrationDataReader):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            self._feeds = iter(feeds)

        def get_next(self) -> Feeds | None:
            return next(self._feeds, None)

    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    quantizable = sorted((set(QDQRegistry) | set(QLinearOpsRegistry)) - set(op_types))
    with tempfile.TemporaryDirectory(prefix="cuvil-quantize-") as tmp:
        original, prepared, output = (Path(tmp) / n for n in ("in.onnx", "pre.onnx", "qdq.onnx"))
        large = model.ByteSize() > 1 << 30  # protobuf's 2 GiB limit: weights in a side file
        onnx.save_model(model, original, save_as_external_data=large)
        printed = io.StringIO()  # onnxruntime prints its calibration progress to stdout
        try:
            with contextlib.redirect_stdout(printed):
                _pre_process(quantization, original, prepared, large, say)
                _flatten_gemm_biases(prepared, large)
                quantization.quantize_static(
                    str(prepared), str(output), Reader(),
                    quant_format=quantization.QuantFormat.QDQ,
                    op_types_to_quantize=quantizable,
                    per_channel=True,
                    activation_type=quantization.QuantType.QInt8,
                    weight_type=quantization.QuantType.QInt8,
                    nodes_to_exclude=list(nodes),
                    calibrate_method=getattr(quantization.CalibrationMethod,
                                             _ORT_METHODS[settings.method]),
                    use_external_data_format=large,
                    extra_options={"WeightSymmetric": True},
                )
        except Exception as exc:  # onnxruntime's own errors: a model its quantizer cannot take
            raise ModelError(f"{label}: onnxruntime's quantizer failed ({type(exc).__name__}: "
                              f"{exc}); keep the failing layers in float with keep-float, or "
                              'set quantize = "none"') from exc
        for line in printed.getvalue().splitlines():
            if line.strip():
                say(f"cuvil: onnxruntime: {line.strip()}")
        prepared_model, qdq = onnx.load(str(prepared)), onnx.load(str(output))
    # the package is the user's model: its session reports that model's producer and metadata
    # (the quantizer writes its own: "onnx.quantize", {"onnx.infer": "onnxruntime.quant"})
    qdq.producer_name, qdq.producer_version = model.producer_name, model.producer_version
    del qdq.metadata_props[:]
    qdq.metadata_props.extend(model.metadata_props)
    return Quantized(prepared_model, qdq, feeds)


def _pre_process(quantization: Any, original: Path, prepared: Path, large: bool, say: Log) -> None:
    """onnxruntime's pre-processing; its symbolic shape inference gives up on some exports
    (torch's attention with symbolic batch and sequence: "Incomplete symbolic shape
    inference"), and then onnx's own shape inference, which it also runs, is enough."""
    run = quantization.shape_inference.quant_pre_process
    cwd = os.getcwd()
    os.chdir(original.parent)  # it leaves temporary files in the working directory when it fails
    try:
        try:
            run(str(original), str(prepared), save_as_external_data=large)
        except Exception as exc:  # onnxruntime raises a bare Exception here
            say(f"cuvil: onnxruntime's symbolic shape inference failed ({exc}); pre-processing "
                "with onnx's shape inference only")
            run(str(original), str(prepared), save_as_external_data=large, skip_symbolic_shape=True)
    finally:
        os.chdir(cwd)


def _flatten_gemm_biases(path: Path, large: bool) -> None:
    """Reshape Gemm biases of shape [1, N] (MatMul + Add as exporters such as skl2onnx write
    them, fused into Gemm by the pre-processing) to [N]: the same sum by broadcasting, and the
    shape onnxruntime's per-channel quantizer expects (it fails on a 2-d bias)."""
    model = onnx.load(str(path))
    weights = {t.name: t for t in model.graph.initializer}
    uses: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    changed = False
    for node in model.graph.node:
        bias = weights.get(node.input[2]) if node.op_type == "Gemm" and len(node.input) > 2 else None
        if bias is not None and len(bias.dims) == 2 and bias.dims[0] == 1 and uses[bias.name] == 1:
            bias.dims[:] = [bias.dims[1]]  # the data is laid out the same
            changed = True
    if changed:
        onnx.save_model(model, str(path), save_as_external_data=large)


def _keep_float(model: onnx.ModelProto, entries: Sequence[str],
                label: str) -> tuple[list[str], list[str]]:
    """keep-float's entries split into node names and op types; each must name one."""
    names = {n.name for n in model.graph.node if n.name}
    types = {n.op_type for n in model.graph.node}
    nodes, op_types = [], []
    for entry in entries:
        if entry in names:
            nodes.append(entry)
        elif entry in types:
            op_types.append(entry)
        else:
            close = difflib.get_close_matches(entry, sorted(names | types), n=3)
            guess = f" (close: {', '.join(map(repr, close))})" if close else ""
            raise ConfigError(f"{label}: keep-float entry {entry!r} is neither a node name nor an op "
                              f"type of the model{guess}; `cuvil inspect MODEL` lists its operators")
    return nodes, op_types


def _onnxruntime_quantization() -> Any:
    try:
        import onnxruntime.quantization as quantization
        import onnxruntime.quantization.shape_inference  # noqa: F401 - the submodule used above
    except ImportError as exc:
        raise MissingDependencyError(
            f'quantize = "int8" needs onnxruntime at build time (its quantizer makes the int8 '
            f"model; the wheel does not depend on it), and it cannot be imported ({exc}); install "
            f"it: python -m pip install \"{ONNXRUNTIME_REQUIREMENT}\" (pip wheel asks for it by "
            "itself, through the build backend's requirements)") from None
    return quantization
