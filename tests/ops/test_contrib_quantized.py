"""onnxruntime's quantized contrib ops (com.microsoft) against onnxruntime itself.

First in the models onnxruntime's own tools write: `quantize_dynamic` of an MLP, whose
DynamicQuantizeLinear -> MatMulInteger chains onnxruntime's graph optimizer fuses into
DynamicQuantizeMatMul; `quantize_dynamic` of a BERT-style encoder already fused by its
transformer optimizer (QAttention, QEmbedLayerNormalization); and `quantize_static` in the
QOperator format of a small CNN with Add, Mul, Sigmoid, Concat, GlobalAveragePool, LeakyRelu,
Softmax and Gemm, which become QLinear* ops and QGemm. Each test asserts which ops the tool
wrote, so it fails when the tool changes. Then one model of single-node cases for the
attributes and input forms those do not reach, compiled once. Quantized outputs agree within
one quantization step (1 in the integers).
"""

from __future__ import annotations

import collections
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from oracle import onnxruntime_int8_is_exact, run_ort

import cuvil
from cuvil.compiler.frontend import import_model
from cuvil.compiler.ops.quantize import INT8_PACKED
from cuvil.compiler.passes import run_passes

quantization = pytest.importorskip("onnxruntime.quantization")

sys.path.insert(0, str(Path(__file__).parent.parent / "data"))
from make_bert import bert_model, optimized_bert  # noqa: E402

MS = "com.microsoft"


def _ms_ops(model: onnx.ModelProto) -> dict[str, int]:
    return dict(collections.Counter(n.op_type for n in model.graph.node if n.domain == MS))


def _onnxruntime_optimized(source: Path, target: Path) -> onnx.ModelProto:
    """The model after onnxruntime's graph optimizer (the fusions its sessions run), saved."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(target)
    ort.InferenceSession(str(source), opts, providers=["CPUExecutionProvider"])
    return onnx.load(str(target))


def _on_int8_kernel(model: onnx.ModelProto) -> None:
    """The integer products of the expansions run on the int8 kernel (weights packed)."""
    nodes = run_passes(import_model(model)).nodes
    products = [n for n in nodes if n.op_type in ("MatMulInteger", "QLinearConv", "QLinearMatMul",
                                                  "DynamicQuantizeMatMul")]
    assert products and all(INT8_PACKED in n.attrs for n in products), \
        [(n.op_type, INT8_PACKED in n.attrs) for n in products]


def _float_model(name: str, nodes: list[onnx.NodeProto], x_shape: list[Any], y: str,
                 inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_quantize_dynamic_mlp_fused_into_dynamic_quantize_matmul(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    model = _float_model("mlp", nodes, ["batch", 24], "y",
                         {"w1": w(24, 32), "b1": w(32)[0] * np.ones(32, np.float32), "w2": w(32, 10)})
    onnx.save(model, tmp_path / "mlp.onnx")
    quantization.quantize_dynamic(str(tmp_path / "mlp.onnx"), str(tmp_path / "q.onnx"),
                                  weight_type=quantization.QuantType.QInt8)
    fused = _onnxruntime_optimized(tmp_path / "q.onnx", tmp_path / "fused.onnx")
    assert _ms_ops(fused) == {"DynamicQuantizeMatMul": 2}, _ms_ops(fused)
    _on_int8_kernel(fused)
    compiled = cuvil.compile(fused)
    for batch in (1, 6):
        x = rng.standard_normal((batch, 24)).astype(np.float32)
        want = run_ort(fused, {"x": x})[0]
        # A is quantized at run time: a different rounding of one element moves the output
        # by a step of A times one weight; allow 1% of the output's range
        np.testing.assert_allclose(compiled(x), want, rtol=0, atol=0.01 * float(np.ptp(want)))


def _uint8_lstm(float_model: onnx.ModelProto) -> onnx.ModelProto:
    """The LSTM as DynamicQuantizeLSTM with asymmetric uint8 weights, a scale and a zero point
    per direction (quantize_dynamic writes symmetric int8 weights, zero points 0, whatever
    weight type it is asked for)."""
    (lstm,) = float_model.graph.node
    tensors = {t.name: numpy_helper.to_array(t) for t in float_model.graph.initializer}
    inits = [float_model.graph.initializer[2]]  # B
    for name in ("W", "R"):
        w = tensors[name].transpose(0, 2, 1)  # [2, in, 4h]
        low, high = np.minimum(w.min(axis=(1, 2)), 0), np.maximum(w.max(axis=(1, 2)), 0)
        scale = ((high - low) / 255).astype(np.float32)
        zero = np.clip(np.round(-low / scale), 0, 255).astype(np.uint8)
        q = np.clip(np.round(w / scale[:, None, None]) + zero[:, None, None], 0, 255)
        q = q.astype(np.uint8)
        inits += [numpy_helper.from_array(q, f"{name}_quantized"),
                  numpy_helper.from_array(scale, f"{name}_scale"),
                  numpy_helper.from_array(zero, f"{name}_zero_point")]
    node = helper.make_node("DynamicQuantizeLSTM",
                            ["x", "W_quantized", "R_quantized", "B", *lstm.input[4:6], "", "",
                             "W_scale", "W_zero_point", "R_scale", "R_zero_point"],
                            list(lstm.output), domain=MS)
    node.attribute.extend(lstm.attribute)
    graph = helper.make_graph([node], "qlstm", float_model.graph.input, float_model.graph.output,
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14),
                                                    helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("quantizer", ["int8", "int8 per channel", "uint8 by hand"])
def test_quantize_dynamic_lstm(tmp_path: Path, quantizer: str) -> None:
    """A bidirectional LSTM with sequence lengths and an initial state, as quantize_dynamic
    writes it (DynamicQuantizeLSTM), and with uint8 weights whose zero points are not 0.
    cuvil runs the LSTM of the dequantized weights: exactly what onnxruntime's float LSTM
    gives for them; onnxruntime's own DynamicQuantizeLSTM also rounds the input and the hidden
    state to 8 bits, so cuvil must be as near the float model that was quantized as
    onnxruntime is."""
    hidden, size, rng = 24, 12, np.random.default_rng(3)
    weights = {"W": rng.standard_normal((2, 4 * hidden, size)) * 0.4,
               "R": rng.standard_normal((2, 4 * hidden, hidden)) * 0.3,
               "B": rng.standard_normal((2, 8 * hidden)) * 0.1}
    lstm = helper.make_node("LSTM", ["x", "W", "R", "B", "lens", "h0"], ["y", "y_h", "y_c"],
                            hidden_size=hidden, direction="bidirectional", clip=5.0)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", "batch", size]),
              helper.make_tensor_value_info("lens", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("h0", TensorProto.FLOAT, [2, "batch", hidden])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in (
        ("y", ["seq", 2, "batch", hidden]), ("y_h", [2, "batch", hidden]),
        ("y_c", [2, "batch", hidden]))]

    def model(tensors: dict[str, np.ndarray]) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in tensors.items()]
        m = helper.make_model(helper.make_graph([lstm], "lstm", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 14)])
        m.ir_version = 8
        return m

    if quantizer == "uint8 by hand":
        quantized = _uint8_lstm(model(weights))
    else:
        onnx.save(model(weights), tmp_path / "lstm.onnx")
        quantization.quantize_dynamic(str(tmp_path / "lstm.onnx"), str(tmp_path / "q.onnx"),
                                      weight_type=quantization.QuantType.QInt8,
                                      per_channel=quantizer.endswith("per channel"))
        quantized = onnx.load(str(tmp_path / "q.onnx"))
    assert _ms_ops(quantized) == {"DynamicQuantizeLSTM": 1}, _ms_ops(quantized)
    q = {t.name: numpy_helper.to_array(t) for t in quantized.graph.initializer}

    def dequantized(name: str) -> np.ndarray:  # [2, in, 4h] with [2] or [2, 4h] scales
        scale, zero = (q[f"{name}_{part}"].reshape(2, 1, -1) for part in ("scale", "zero_point"))
        w = (q[f"{name}_quantized"].astype(np.float32) - zero.astype(np.float32)) * scale
        return w.transpose(0, 2, 1)

    float_of_dequantized = model({"W": dequantized("W"), "R": dequantized("R"), "B": weights["B"]})
    compiled = cuvil.compile(quantized, inputs={"x": ("seq", "batch", size)})
    for seq, batch in ((1, 1), (9, 3)):
        feeds = {"x": rng.standard_normal((seq, batch, size)).astype(np.float32),
                 "lens": rng.integers(1, seq + 1, batch).astype(np.int32),
                 "h0": rng.standard_normal((2, batch, hidden)).astype(np.float32)}
        got = compiled.run(feeds)
        exact = run_ort(float_of_dequantized, feeds)
        rounded = run_ort(quantized, feeds)
        original = run_ort(model(weights), feeds)
        for name, want, ort_int8, ideal in zip(("y", "y_h", "y_c"), exact, rounded, original):
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5)
            # nearer the quantized model's float original than onnxruntime's int8 run (up to
            # a tenth of its error: the two roundings of the weights are the same)
            assert np.abs(got[name] - ideal).max() <= 1.1 * np.abs(ort_int8 - ideal).max(), name


def test_quantize_dynamic_optimized_bert(tmp_path: Path) -> None:
    """QEmbedLayerNormalization, QAttention and (after onnxruntime's fusions)
    DynamicQuantizeMatMul, as quantize_dynamic writes them for a transformer."""
    hidden, heads = 32, 4
    onnx.save(bert_model(layers=1, hidden=hidden, heads=heads, with_mask=True), tmp_path / "bert.onnx")
    optimized_bert(str(tmp_path / "bert.onnx"), str(tmp_path / "opt.onnx"), heads, hidden)
    quantization.quantize_dynamic(str(tmp_path / "opt.onnx"), str(tmp_path / "q.onnx"),
                                  weight_type=quantization.QuantType.QInt8,
                                  extra_options={"DefaultTensorType": TensorProto.FLOAT})
    fused = _onnxruntime_optimized(tmp_path / "q.onnx", tmp_path / "fused.onnx")
    ops = _ms_ops(fused)
    assert {k: ops.get(k) for k in ("QEmbedLayerNormalization", "QAttention",
                                    "DynamicQuantizeMatMul")} == \
        {"QEmbedLayerNormalization": 1, "QAttention": 1, "DynamicQuantizeMatMul": 3}, ops
    compiled = cuvil.compile(fused)
    rng = np.random.default_rng(1)
    batch, seq = 2, 9
    feeds = {"input_ids": rng.integers(0, 1000, (batch, seq)),
             "token_type_ids": rng.integers(0, 2, (batch, seq)),
             "attention_mask": (np.arange(seq) < np.array([[seq], [4]])).astype(np.int64)}
    want = run_ort(fused, feeds)[0]
    got = compiled.run(feeds)["encoded"]
    np.testing.assert_allclose(got, want, rtol=0, atol=0.01 * float(np.ptp(want)))


def _qoperator_cnn(rng: np.random.Generator) -> onnx.ModelProto:
    w = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("LeakyRelu", ["c1"], ["l1"], alpha=0.1),
             helper.make_node("Conv", ["l1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c2"], ["s2"]),
             helper.make_node("Mul", ["c2", "s2"], ["m2"]),
             helper.make_node("Add", ["m2", "l1"], ["a2"]),
             helper.make_node("Conv", ["a2", "w3"], ["c3"]),
             helper.make_node("Concat", ["a2", "c3"], ["cat"], axis=1),
             helper.make_node("GlobalAveragePool", ["cat"], ["gap"]),
             helper.make_node("Flatten", ["gap"], ["f"]),
             helper.make_node("Gemm", ["f", "w4", "b4"], ["g"], transB=1),
             helper.make_node("Softmax", ["g"], ["y"], axis=-1)]
    return _float_model("cnn", nodes, ["batch", 3, 8, 8], "y",
                        {"w1": w(8, 3, 3, 3), "w2": w(8, 8, 3, 3), "w3": w(4, 8, 1, 1),
                         "w4": w(5, 12), "b4": w(5)})


class _Calibration(quantization.CalibrationDataReader):
    def __init__(self, rng: np.random.Generator) -> None:
        self.batches = iter([{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}
                             for _ in range(4)])

    def get_next(self) -> dict | None:
        return next(self.batches, None)


def test_quantize_static_qoperator_cnn(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    onnx.save(_qoperator_cnn(rng), tmp_path / "cnn.onnx")
    quantization.quantize_static(str(tmp_path / "cnn.onnx"), str(tmp_path / "q.onnx"),
                                 _Calibration(rng), quant_format=quantization.QuantFormat.QOperator,
                                 activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8)
    model = onnx.load(str(tmp_path / "q.onnx"))
    assert _ms_ops(model) == dict.fromkeys((
        "QLinearLeakyRelu", "QLinearSigmoid", "QLinearMul", "QLinearAdd", "QLinearConcat",
        "QLinearGlobalAveragePool", "QGemm", "QLinearSoftmax"), 1), _ms_ops(model)
    _on_int8_kernel(model)
    # the output is the Softmax's quantized result, dequantized: its step is that scale
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    last = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    step = float(inits[last.input[1]])
    compiled = cuvil.compile(model)
    for batch in (1, 5):
        x = rng.standard_normal((batch, 3, 8, 8)).astype(np.float32)
        want = run_ort(model, {"x": x})[0]
        assert np.abs(compiled(x) - want).max() <= step * 1.001


# -- single nodes ---------------------------------------------------------------------------


@dataclass
class Case:
    """One com.microsoft node: `feeds` run-time inputs, `consts` weights ("" in `inputs` for
    an absent optional input)."""

    op_type: str
    inputs: list[str]
    attrs: dict[str, Any]
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    label: str = ""

    def out_dtype(self) -> int:
        """Y's zero point's dtype, else float for the products without one, else X's."""
        zero = self.consts.get("zy", self.consts.get("zc"))
        if zero is not None:
            return helper.np_dtype_to_tensor_dtype(zero.dtype)
        if self.op_type in ("MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QGemm"):
            return TensorProto.FLOAT
        return helper.np_dtype_to_tensor_dtype(next(iter(self.feeds.values())).dtype)


def _model(nodes: list[onnx.NodeProto], feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray],
           outputs: dict[str, np.ndarray | int]) -> onnx.ModelProto:
    """`outputs` name -> dtype code (for onnxruntime) or the expected array (for cuvil, whose
    checker wants output shapes)."""
    def out(n: str, t: np.ndarray | int) -> onnx.ValueInfoProto:
        if isinstance(t, np.ndarray):
            return helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(t.dtype), t.shape)
        return helper.make_tensor_value_info(n, t, None)

    graph = helper.make_graph(
        nodes, "cases",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in feeds.items()],
        [out(n, t) for n, t in outputs.items()],
        [numpy_helper.from_array(a, n) for n, a in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def _check(cases: list[Case]) -> None:
    """Each case on onnxruntime alone, then all of them compiled as one model by cuvil."""
    nodes, feeds, consts, expected = [], {}, {}, {}
    for i, c in enumerate(cases):
        p = lambda n, i=i: f"c{i}_{n}" if n else ""  # noqa: E731
        node = helper.make_node(c.op_type, [p(n) for n in c.inputs], [p("y")], name=f"case{i}",
                                domain=MS, **c.attrs)
        f = {p(n): a for n, a in c.feeds.items()}
        k = {p(n): a for n, a in c.consts.items()}
        expected[p("y")] = run_ort(_model([node], f, k, {p("y"): c.out_dtype()}), f)[0]
        nodes.append(node)
        feeds.update(f)
        consts.update(k)
    got = cuvil.compile(_model(nodes, feeds, consts, expected)).run(feeds)
    failures = []
    for i, c in enumerate(cases):
        want, have = expected[f"c{i}_y"], got[f"c{i}_y"]
        try:
            assert have.shape == want.shape and have.dtype == want.dtype, (have.dtype, have.shape)
            if want.dtype.kind == "f":
                np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)
            else:  # within one quantization step
                diff = np.abs(have.astype(np.int32) - want.astype(np.int32))
                assert diff.max() <= 1, f"{(diff > 0).sum()} differ, by up to {diff.max()}"
        except AssertionError as exc:
            failures.append(f"{c.label or c.op_type} {c.attrs}: {str(exc)[:400]}")
    assert not failures, "\n".join(failures)


rng = np.random.default_rng(7)


def u8(*shape: int) -> np.ndarray:
    return rng.integers(0, 256, shape).astype(np.uint8)


def s8(*shape: int) -> np.ndarray:
    return rng.integers(-128, 128, shape).astype(np.int8)


def s8_weights(*shape: int) -> np.ndarray:
    """int8 weights of products with uint8 activations: the whole range where onnxruntime's
    uint8 x int8 products are exact on this CPU, else [-64, 63], where its saturating pair
    sums (x86 without VNNI, oracle.onnxruntime_int8_is_exact) cannot overflow."""
    if onnxruntime_int8_is_exact():
        return s8(*shape)
    return rng.integers(-64, 64, shape).astype(np.int8)


def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def scalar(value: float | int, dtype: Any = np.float32) -> np.ndarray:
    return np.array(value, dtype)


def test_single_nodes() -> None:
    scales = {"sa": scalar(0.02), "sb": scalar(0.05), "sc": scalar(0.04)}
    cases = [
        # products: per-column scales and zero points, bias, absent zero points
        Case("MatMulIntegerToFloat", ["a", "b", "sa", "sb", "za", "zb", "bias"], {},
             {"a": u8(2, 3, 16)}, {"b": s8_weights(16, 6), "sa": scalar(0.03), "sb": f32(6, scale=0.01) ** 2,
                                   "za": scalar(120, np.uint8), "zb": s8(6), "bias": f32(6)}),
        Case("MatMulIntegerToFloat", ["a", "b", "sa", "sb"], {}, {"a": s8(5, 7)},
             {"b": s8(7, 3), "sa": scalar(0.1), "sb": scalar(0.02)}, label="no zero points"),
        Case("DynamicQuantizeMatMul", ["a", "b", "sb", "zb", "bias"], {}, {"a": f32(4, 9)},
             {"b": u8(9, 5), "sb": f32(5, scale=0.1) ** 2, "zb": u8(5), "bias": f32(5)}),
        Case("DynamicQuantizeMatMul", ["a", "b", "sb"], {}, {"a": f32(1, 3, 12)},
             {"b": s8_weights(12, 4), "sb": scalar(0.01)}, label="3-D A, no zero point"),
        Case("QGemm", ["a", "sa", "za", "b", "sb", "zb", "c", "sy", "zy"],
             {"transA": 1, "transB": 1, "alpha": 0.5},
             {"a": u8(10, 3)}, {"sa": scalar(0.02), "za": scalar(128, np.uint8),
                                "b": s8_weights(4, 10),
                                "sb": scalar(0.01), "zb": scalar(0, np.int8),
                                "c": rng.integers(-5000, 5000, 4).astype(np.int32),
                                "sy": scalar(0.01), "zy": scalar(125, np.uint8)}, label="QGemm quantized"),
        Case("QGemm", ["a", "sa", "za", "b", "sb", "zb"], {}, {"a": s8(3, 6)},
             {"sa": scalar(0.05), "za": scalar(2, np.int8), "b": s8(6, 4),
              "sb": f32(4, scale=0.1) ** 2, "zb": s8(4)}, label="QGemm float, per-column B"),
        # elementwise: broadcasting, int8, an absent zero point
        Case("QLinearAdd", ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], {},
             {"a": u8(2, 3, 4), "b": u8(4)},
             {**scales, "za": scalar(100, np.uint8), "zb": scalar(7, np.uint8),
              "zc": scalar(130, np.uint8)}),
        # (onnxruntime's type inference refuses absent A and B zero points)
        Case("QLinearAdd", ["a", "sa", "za", "b", "sb", "zb", "sc"], {},
             {"a": u8(3, 5), "b": u8(3, 1)},
             {**scales, "za": scalar(90, np.uint8), "zb": scalar(140, np.uint8)},
             label="QLinearAdd without C's zero point"),
        Case("QLinearMul", ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], {},
             {"a": s8(2, 6), "b": s8(2, 6)},
             {**scales, "za": scalar(-4, np.int8), "zb": scalar(9, np.int8), "zc": scalar(0, np.int8)}),
        Case("QLinearSigmoid", ["x", "sx", "zx", "sy", "zy"], {}, {"x": s8(3, 7)},
             {"sx": scalar(0.05), "zx": scalar(-10, np.int8), "sy": scalar(1 / 256),
              "zy": scalar(-128, np.int8)}),
        Case("QLinearLeakyRelu", ["x", "sx", "zx", "sy", "zy"], {}, {"x": u8(4, 5)},
             {"sx": scalar(0.1), "zx": scalar(128, np.uint8), "sy": scalar(0.06),
              "zy": scalar(20, np.uint8)}, label="LeakyRelu default alpha"),
        Case("QLinearLeakyRelu", ["x", "sx", "zx", "sy", "zy"], {"alpha": 0.3}, {"x": s8(4, 5)},
             {"sx": scalar(0.1), "zx": scalar(3, np.int8), "sy": scalar(0.07),
              "zy": scalar(-30, np.int8)}),
        Case("QLinearSoftmax", ["x", "sx", "zx", "sy", "zy"], {"axis": 1, "opset": 13},
             {"x": u8(2, 6, 3)}, {"sx": scalar(0.1), "zx": scalar(128, np.uint8),
                                  "sy": scalar(1 / 256), "zy": scalar(0, np.uint8)}),
        Case("QLinearSoftmax", ["x", "sx", "zx", "sy", "zy"], {"axis": 1, "opset": 12},
             {"x": s8(2, 4, 3)}, {"sx": scalar(0.08), "zx": scalar(0, np.int8),
                                  "sy": scalar(1 / 256), "zy": scalar(-128, np.int8)},
             label="QLinearSoftmax over the dims from axis (opset 12)"),
        Case("QLinearGlobalAveragePool", ["x", "sx", "zx", "sy", "zy"], {"channels_last": 1},
             {"x": u8(2, 5, 3, 4)}, {"sx": scalar(0.05), "zx": scalar(100, np.uint8),
                                     "sy": scalar(0.03), "zy": scalar(110, np.uint8)}),
        Case("QLinearGlobalAveragePool", ["x", "sx", "zx", "sy", "zy"], {}, {"x": s8(1, 3, 7)},
             {"sx": scalar(0.05), "zx": scalar(-5, np.int8), "sy": scalar(0.01),
              "zy": scalar(0, np.int8)}, label="QLinearGlobalAveragePool 1-D, int8"),
        Case("QLinearConcat", ["sy", "zy", "a", "sa", "za", "b", "sb", "zb", "c", "sc", "zc"],
             {"axis": -1}, {"a": u8(2, 3), "b": u8(2, 1), "c": u8(2, 4)},
             {"sy": scalar(0.05), "zy": scalar(128, np.uint8), "sa": scalar(0.05),
              "za": scalar(128, np.uint8), "sb": scalar(0.11), "zb": scalar(3, np.uint8),
              "sc": scalar(0.02), "zc": scalar(200, np.uint8)}),
    ]
    _check(cases)
