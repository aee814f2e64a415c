"""How far the int8 model strays from float, layer by layer (`cuvil inspect --quantization`).

The float model (as pre-processed for quantization) and its QDQ model both run in onnxruntime
on the calibration feeds, with every layer's output exposed and graph optimizations off (so the
QDQ model computes exactly what its QuantizeLinear/DequantizeLinear pairs say). A layer's int8
value is its output after its QuantizeLinear -> DequantizeLinear pair, which is what the next
layer reads. Errors are summed over all feeds: relative error ||q - f|| / ||f|| and the
signal-to-noise ratio 10 log10(sum f^2 / sum (q - f)^2) in dB; for outputs with a class axis
(the last, of size > 1) also the share of samples whose top-1 class agrees.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from cuvil.compiler.frontend.quantize import QuantizeSettings, quantize_with_reference

__all__ = ["LayerError", "QuantizationReport", "quantization_report"]


@dataclass(frozen=True)
class LayerError:
    node: str  # the node's name (or its output's, for a nameless node)
    op_type: str
    tensor: str  # the float tensor compared
    int8: bool  # whether the node runs on quantized inputs in the QDQ model
    relative_error: float
    snr_db: float
    top1_agreement: float | None = None  # graph outputs with a class axis only


@dataclass(frozen=True)
class QuantizationReport:
    label: str
    method: str
    feeds: int
    samples: int
    layers: list[LayerError]
    outputs: list[LayerError]

    def table(self) -> str:
        width = max([len(e.node) for e in self.layers + self.outputs] + [10])
        title = (f"{self.label}: int8 against float on {self.samples} calibration samples "
                 f"({self.feeds} feeds, {self.method} ranges)")
        header = f"{'rel. error':>10} {'SNR dB':>8}"
        lines = [title, f"  {'layer':<{width}}  {'op':<18} {'int8':<5} {header}"]
        for e in self.layers:
            lines.append(f"  {e.node:<{width}}  {e.op_type:<18} {'yes' if e.int8 else 'no':<5} "
                         f"{e.relative_error:>10.4f} {e.snr_db:>8.1f}")
        lines.append(f"  {'output':<{width}}  {'':<18} {'':<5} {header}  top-1 agreement")
        for e in self.outputs:
            agree = "" if e.top1_agreement is None else f"  {100 * e.top1_agreement:.2f}%"
            lines.append(f"  {e.node:<{width}}  {'':<18} {'':<5} {e.relative_error:>10.4f} "
                         f"{e.snr_db:>8.1f}{agree}")
        return "\n".join(lines)


class _Sums:
    def __init__(self) -> None:
        self.signal = self.noise = 0.0
        self.agree = self.rows = 0

    def add(self, reference: np.ndarray, value: np.ndarray, classes: bool) -> None:
        f, q = reference.astype(np.float64), value.astype(np.float64)
        self.signal += float(np.sum(f * f))
        self.noise += float(np.sum((q - f) ** 2))
        if classes:
            self.agree += int(np.sum(f.argmax(-1) == q.argmax(-1)))
            self.rows += f[..., 0].size

    def error(self, node: str, op_type: str, tensor: str, int8: bool) -> LayerError:
        relative = math.sqrt(self.noise / self.signal) if self.signal else (
            0.0 if not self.noise else math.inf)
        snr = 10 * math.log10(self.signal / self.noise) if self.noise else math.inf
        top1 = self.agree / self.rows if self.rows else None
        return LayerError(node, op_type, tensor, int8, relative, snr, top1)


def quantization_report(source: str | Path | onnx.ModelProto, settings: QuantizeSettings,
                        pins: Mapping[str, Sequence[int | str]] | None = None,
                        label: str | None = None) -> QuantizationReport:
    quantized = quantize_with_reference(source, settings, pins)
    reference, qdq = quantized.float_model, quantized.qdq_model
    producers = {o: n for n in qdq.graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in qdq.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def after_qdq(tensor: str) -> str | None:
        """The QDQ model's tensor holding `tensor` as the next layer reads it."""
        for q in consumers.get(tensor, []):
            if q.op_type == "QuantizeLinear":
                for dq in consumers.get(q.output[0], []):
                    if dq.op_type == "DequantizeLinear":
                        return str(dq.output[0])
        return tensor if tensor in producers else None

    outputs = [o.name for o in reference.graph.output]
    float_producers = {o: n for n in reference.graph.node for o in n.output}
    layers = []  # (node, op type, float tensor, QDQ tensor, runs on int8)
    for node in qdq.graph.node:  # its layers: onnxruntime folds some (Relu) into their producer
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for tensor in node.output:
            matched = after_qdq(tensor)
            if tensor not in float_producers or matched is None or tensor in outputs:
                continue
            # int8 when every input is dequantized (weights too): else it computes in float
            int8 = all(producers.get(i) is not None and producers[i].op_type == "DequantizeLinear"
                       for i in node.input if i)
            folded = float_producers[tensor].op_type
            op = node.op_type if folded == node.op_type else f"{node.op_type}+{folded}"
            layers.append((node.name or tensor, op, tensor, matched, int8))
    float_run = _session(reference, [t for _, _, t, _, _ in layers] + outputs)
    qdq_run = _session(qdq, [m for _, _, _, m, _ in layers] + outputs)
    sums = [_Sums() for _ in layers]
    output_sums = [_Sums() for _ in outputs]
    samples = 0
    for feed in quantized.feeds:
        f = float_run(feed)
        q = qdq_run(feed)
        first = next(iter(feed.values()))
        samples += len(first) if first.ndim else 1
        for acc, (_, _, tensor, matched, _) in zip(sums, layers):
            acc.add(f[tensor], q[matched], classes=False)
        for acc, name in zip(output_sums, outputs):
            acc.add(f[name], q[name], classes=_has_classes(f[name]))
    return QuantizationReport(
        label or (str(source) if isinstance(source, (str, Path)) else source.graph.name or "model"),
        settings.method, len(quantized.feeds), samples,
        [acc.error(node, op, t, int8) for acc, (node, op, t, _, int8) in zip(sums, layers)],
        [acc.error(name, "", name, True) for acc, name in zip(output_sums, outputs)])


def _has_classes(value: np.ndarray) -> bool:
    return value.dtype.kind == "f" and value.ndim >= 2 and value.shape[-1] > 1


def _session(model: onnx.ModelProto, tensors: list[str]) -> Any:
    """A function feed -> {tensor: array} for every name in `tensors`, exposed as outputs."""
    import onnxruntime

    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    present = {o.name for o in exposed.graph.output}
    names = list(dict.fromkeys(tensors))
    for name in names:
        if name not in present:
            exposed.graph.output.append(onnx.ValueInfoProto(name=name))
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(exposed.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])

    def run(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, dict(feed))))

    return run
