"""Every pass of the pipeline on a small model it rewrites: the graph as the pass receives it
(the pipeline run up to the stage before) and as it leaves it, in the IR's text form
(passes/ir_text.py), both written out by hand; and each model compiled against onnxruntime,
so that the graphs shown are ones that compute the right answer. fold_batchnorm,
pack_gemm_weights and fuse_epilogue are walked through in test_ir_text.py."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import numpy_helper
from oracle import run_ort

import cuvil
from cuvil.compiler.frontend.importer import import_model
from cuvil.compiler.passes import PIPELINE, STAGES, run_passes
from cuvil.compiler.passes.ir_text import graph_text

#: the passes test_ir_text.py walks through on its Conv -> BatchNormalization -> Relu block
IN_TEST_IR_TEXT = ("fold_batchnorm", "pack_gemm_weights", "fuse_epilogue")

rng = np.random.default_rng(0)


def _f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _scalar(x: float) -> np.ndarray:
    return np.array(x, np.float32)


@dataclass
class Case:
    """A model in ONNX's text syntax (onnx.parser) with its initializers, the graph before
    and after the pass, the compile settings, and how close to onnxruntime it must be."""
    onnx_text: str
    weights: dict[str, np.ndarray]
    before: str
    after: str
    settings: dict[str, str] = field(default_factory=dict)
    atol: float = 1e-5

    def model(self) -> onnx.ModelProto:
        m = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]>\n' + self.onnx_text)
        m.graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in self.weights.items())
        return m


QDQ_MATMUL = """
g (float[batch, 16] x) => (float[batch, 8] y) {
  q = QuantizeLinear(x, s, z)
  d = DequantizeLinear(q, s, z)
  wd = DequantizeLinear(w, ws, wz)
  m = MatMul(d, wd)
  mq = QuantizeLinear(m, s2, z)
  y = DequantizeLinear(mq, s2, z)
}"""
QDQ_WEIGHTS = {"s": _scalar(0.05), "s2": _scalar(0.25), "z": np.array(128, np.uint8),
                   "w": rng.integers(-127, 128, (16, 8)).astype(np.int8), "ws": _scalar(0.01),
                   "wz": np.array(0, np.int8)}
# fuse_qdq: the quantize -> dequantize -> MatMul -> quantize pattern becomes a QLinearMatMul on
# the bytes; the weight's DequantizeLinear (kept as a node for this pass) goes with it
QDQ_FUSED = """\
graph g
  input  %x: float32[batch, 16]
  const  %s: float32[] = [0.05]
  const  %z: uint8[] = [128]
  %q: uint8[batch, 16] = QuantizeLinear(%x, %s, %z)
  const  %w: int8[16, 8] (128 bytes)
  const  %ws: float32[] = [0.01]
  const  %wz: int8[] = [0]
  const  %s2: float32[] = [0.25]
  %mq: uint8[batch, 8] = QLinearMatMul(%q, %s, %z, %w, %ws, %wz, %s2, %z)
  %y: float32[batch, 8] = DequantizeLinear(%mq, %s2, %z)
  output %y"""

DYNAMIC_MATMUL = """
g (float[batch, 16] x) => (float[batch, 8] y) {
  q, qs, qz = DynamicQuantizeLinear(x)
  i = MatMulInteger(q, w, qz, wz)
  f = Cast<to=1>(i)
  s = Mul(qs, ws)
  m = Mul(f, s)
  y = Add(m, b)
}"""
DYNAMIC_WEIGHTS = {"w": rng.integers(0, 256, (16, 8)).astype(np.uint8), "wz": np.array(128, np.uint8),
                       "ws": _scalar(0.01), "b": np.arange(-4, 4, dtype=np.float32) / 4}
# fuse_dynamic_quantize: MatMulInteger -> Cast -> Mul -> Add is one DynamicQuantizeMatMul on x,
# B packed for the int8 kernel (its zero point folded in: 0), b_scale and the bias per column;
# the DynamicQuantizeLinear and the scale's Mul are left for eliminate_dead_code
DYNAMIC_FUSED = """\
graph g
  input  %x: float32[batch, 16]
  %q: uint8[batch, 16], %qs: float32[], %qz: uint8[] = DynamicQuantizeLinear(%x)
  const  %ws: float32[] = [0.01]
  %s: float32[] = Mul(%qs, %ws)
  const  %w_int8_panels: uint8[768] (768 bytes)
  const  %w_scale: float32[8] = [0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01]
  const  %w_bias: float32[8] = [-1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75]
  %y: float32[batch, 8] = DynamicQuantizeMatMul(int8 kernel)(%x, %w_int8_panels, %w_scale, \
%w_bias) {cuvil.int8_packed=["uint8", 0, 16, 8]}
  output %y"""

CASES = {
    # a Sigmoid between a dequantize and a quantize is a function of one byte: a table
    "quantized_lookup": Case("""
g (float[batch, 16] x) => (float[batch, 16] y) {
  q = QuantizeLinear(x, s, z)
  d = DequantizeLinear(q, s, z)
  h = Sigmoid(d)
  hq = QuantizeLinear(h, s2, z)
  y = DequantizeLinear(hq, s2, z)
}""", {"s": _scalar(0.05), "s2": _scalar(1 / 256), "z": np.array(0, np.uint8)}, """\
graph g
  input  %x: float32[batch, 16]
  const  %s: float32[] = [0.05]
  const  %z: uint8[] = [0]
  %q: uint8[batch, 16] = QuantizeLinear(%x, %s, %z)
  %d: float32[batch, 16] = DequantizeLinear(%q, %s, %z)
  %h: float32[batch, 16] = Sigmoid(%d)
  const  %s2: float32[] = [0.00390625]
  %hq: uint8[batch, 16] = QuantizeLinear(%h, %s2, %z)
  %y: float32[batch, 16] = DequantizeLinear(%hq, %s2, %z)
  output %y""", """\
graph g
  input  %x: float32[batch, 16]
  const  %s: float32[] = [0.05]
  const  %z: uint8[] = [0]
  %q: uint8[batch, 16] = QuantizeLinear(%x, %s, %z)
  %hq: uint8[batch, 16] = LookupTable(%q) {cuvil.table=<uint8[256]>}
  const  %s2: float32[] = [0.00390625]
  %y: float32[batch, 16] = DequantizeLinear(%hq, %s2, %z)
  output %y""", atol=1 / 256),
    "fuse_qdq": Case(QDQ_MATMUL, QDQ_WEIGHTS, """\
graph g
  input  %x: float32[batch, 16]
  const  %s: float32[] = [0.05]
  const  %z: uint8[] = [128]
  %q: uint8[batch, 16] = QuantizeLinear(%x, %s, %z)
  %d: float32[batch, 16] = DequantizeLinear(%q, %s, %z)
  const  %w: int8[16, 8] (128 bytes)
  const  %ws: float32[] = [0.01]
  const  %wz: int8[] = [0]
  %wd: float32[16, 8] = DequantizeLinear(%w, %ws, %wz)
  %m: float32[batch, 8] = MatMul(%d, %wd)
  const  %s2: float32[] = [0.25]
  %mq: uint8[batch, 8] = QuantizeLinear(%m, %s2, %z)
  %y: float32[batch, 8] = DequantizeLinear(%mq, %s2, %z)
  output %y""", QDQ_FUSED, atol=0.25),
    "fuse_dynamic_quantize": Case(DYNAMIC_MATMUL, DYNAMIC_WEIGHTS, """\
graph g
  input  %x: float32[batch, 16]
  %q: uint8[batch, 16], %qs: float32[], %qz: uint8[] = DynamicQuantizeLinear(%x)
  const  %w: uint8[16, 8] (128 bytes)
  const  %wz: uint8[] = [128]
  %i: int32[batch, 8] = MatMulInteger(%q, %w, %qz, %wz)
  %f: float32[batch, 8] = Cast(%i) {to=1}
  const  %ws: float32[] = [0.01]
  %s: float32[] = Mul(%qs, %ws)
  %m: float32[batch, 8] = Mul(%f, %s)
  const  %b: float32[8] = [-1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75]
  %y: float32[batch, 8] = Add(%m, %b)
  output %y""", DYNAMIC_FUSED, atol=1e-4),
    # the QLinearMatMul's int8 B in the kernel's panels ([K, N] padded to whole panels); the
    # node keeps B's ONNX dtype, zero point and shape for its shape rule
    "pack_int8_weights": Case(QDQ_MATMUL, QDQ_WEIGHTS, QDQ_FUSED, """\
graph g
  input  %x: float32[batch, 16]
  const  %s: float32[] = [0.05]
  const  %z: uint8[] = [128]
  %q: uint8[batch, 16] = QuantizeLinear(%x, %s, %z)
  const  %w_int8_panels: uint8[768] (768 bytes)
  const  %ws: float32[] = [0.01]
  const  %wz: int8[] = [0]
  const  %s2: float32[] = [0.25]
  %mq: uint8[batch, 8] = QLinearMatMul(int8 kernel)(%q, %s, %z, %w_int8_panels, %ws, %wz, %s2, \
%z) {cuvil.int8_packed=["int8", 0, 16, 8]}
  %y: float32[batch, 8] = DequantizeLinear(%mq, %s2, %z)
  output %y""", atol=0.25),
    # what fuse_dynamic_quantize left unread goes
    "eliminate_dead_code": Case(DYNAMIC_MATMUL, DYNAMIC_WEIGHTS, DYNAMIC_FUSED, """\
graph g
  input  %x: float32[batch, 16]
  const  %w_int8_panels: uint8[768] (768 bytes)
  const  %w_scale: float32[8] = [0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01]
  const  %w_bias: float32[8] = [-1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75]
  %y: float32[batch, 8] = DynamicQuantizeMatMul(int8 kernel)(%x, %w_int8_panels, %w_scale, \
%w_bias) {cuvil.int8_packed=["uint8", 0, 16, 8]}
  output %y""", atol=1e-4),
    # float16 in, float16 out; in between float32 (the weight converted at compile time)
    "widen_float16": Case("""
g (float16[batch, 16] x) => (float16[batch, 8] y) {
  m = MatMul(x, w)
  y = Relu(m)
}""", {"w": _f32(16, 8).astype(np.float16)}, """\
graph g
  input  %x: float16[batch, 16]
  const  %w: float16[16, 8] (256 bytes)
  %m: float16[batch, 8] = MatMul(%x, %w)
  %y: float16[batch, 8] = Relu(%m)
  output %y""", """\
graph g
  input  %x: float16[batch, 16]
  %x_f32: float32[batch, 16] = Cast(%x) {to=1}  # x_f32
  const  %w_f32: float32[16, 8] (512 bytes)
  %m_f32: float32[batch, 8] = MatMul(%x_f32, %w_f32)
  %y_f32: float32[batch, 8] = Relu(%m_f32)
  %y: float16[batch, 8] = Cast(%y_f32) {to=10}  # y_to_f16
  output %y""", atol=1e-2),
    # attention's scores as an Einsum: a MatMul by k transposed
    "einsum_as_matmul": Case("""
g (float[batch, 4, 10, 8] q, float[batch, 4, 12, 8] k) => (float[batch, 4, 10, 12] y) {
  y = Einsum<equation="bhqd,bhkd->bhqk">(q, k)
}""", {}, """\
graph g
  input  %q: float32[batch, 4, 10, 8]
  input  %k: float32[batch, 4, 12, 8]
  %y: float32[batch, 4, 10, 12] = Einsum(%q, %k) {equation="bhqd,bhkd->bhqk"}
  output %y""", """\
graph g
  input  %q: float32[batch, 4, 10, 8]
  input  %k: float32[batch, 4, 12, 8]
  %y_b_t: float32[batch, 4, 8, 12] = Transpose(%k) {perm=[0, 1, 3, 2]}  # y_b_transpose
  %y: float32[batch, 4, 10, 12] = MatMul(%q, %y_b_t)  # y
  output %y"""),
    # scores, scale, softmax and the second product as one node
    "fuse_attention": Case("""
g (float[batch, 4, 10, 8] q, float[batch, 4, 8, 10] kt, float[batch, 4, 10, 8] v)
  => (float[batch, 4, 10, 8] y) {
  s = MatMul(q, kt)
  t = Mul(s, c)
  p = Softmax<axis=-1>(t)
  y = MatMul(p, v)
}""", {"c": _scalar(0.35)}, """\
graph g
  input  %q: float32[batch, 4, 10, 8]
  input  %kt: float32[batch, 4, 8, 10]
  input  %v: float32[batch, 4, 10, 8]
  %s: float32[batch, 4, 10, 10] = MatMul(%q, %kt)
  const  %c: float32[] = [0.35]
  %t: float32[batch, 4, 10, 10] = Mul(%s, %c)
  %p: float32[batch, 4, 10, 10] = Softmax(%t) {axis=-1}
  %y: float32[batch, 4, 10, 8] = MatMul(%p, %v)
  output %y""", """\
graph g
  input  %q: float32[batch, 4, 10, 8]
  input  %kt: float32[batch, 4, 8, 10]
  input  %v: float32[batch, 4, 10, 8]
  %y: float32[batch, 4, 10, 8] = Attention(%q, %kt, %v) {cuvil.scale=0.3499999940395355, \
cuvil.scale_op="Mul"}
  output %y"""),
    # a 1x1 conv of a 1x1 map (a squeeze-excite layer, its Relu already fused) as a Gemm over
    # rows, W^T packed for it; Flatten and Reshape are views
    "fully_connected_convs": Case("""
g (float[batch, 8, 1, 1] x) => (float[batch, 4, 1, 1] z) {
  y = Conv(x, w, b)
  z = Relu(y)
}""", {"w": _f32(4, 8, 1, 1), "b": np.arange(4, dtype=np.float32)}, """\
graph g
  input  %x: float32[batch, 8, 1, 1]
  const  %w: float32[4, 8, 1, 1] (128 bytes)
  const  %b: float32[4] = [0, 1, 2, 3]
  %z: float32[batch, 4, 1, 1] = Conv+Relu(%x, %w, %b) {cuvil.activation_params=[], \
cuvil.fused_activation="Relu"}
  output %z""", """\
graph g
  input  %x: float32[batch, 8, 1, 1]
  %x_rows: float32[batch, 8] = Flatten(%x) {axis=1}  # _rows
  const  %w_panels: float32[8, 4] (128 bytes)
  const  %b: float32[4] = [0, 1, 2, 3]
  %z_rows: float32[batch, 4] = Gemm+Relu(%x_rows, %w_panels, %b) {cuvil.activation_params=[], \
cuvil.fused_activation="Relu", cuvil.packed_weights=1}
  const  %z_shape: int64[4] = [0, 4, 1, 1]
  %z: float32[batch, 4, 1, 1] = Reshape(%z_rows, %z_shape)  # _maps
  output %z"""),
    "fuse_elementwise": Case("""
g (float[batch, 16] x) => (float[batch, 16] y) {
  a = Mul(x, s)
  b = Add(a, t)
  y = Tanh(b)
}""", {"s": _f32(16), "t": _f32(16)}, """\
graph g
  input  %x: float32[batch, 16]
  const  %s: float32[16] (64 bytes)
  %a: float32[batch, 16] = Mul(%x, %s)
  const  %t: float32[16] (64 bytes)
  %b: float32[batch, 16] = Add(%a, %t)
  %y: float32[batch, 16] = Tanh(%b)
  output %y""", """\
graph g
  input  %x: float32[batch, 16]
  const  %s: float32[16] (64 bytes)
  const  %t: float32[16] (64 bytes)
  %y: float32[batch, 16] = Fused(Mul+Add+Tanh)(%x, %s, %t) {cuvil.steps=[["Mul", "", 17, {}, \
[0, 1]], ["Add", "", 17, {}, [-1, 2]], ["Tanh", "", 17, {}, [-2]]]}
  output %y"""),
    # a 3x3 conv of 64 channels over 28x28: F(4x4, 3x3), its U computed by the compiler
    # (pack_gemm_weights left its weight as it was for this)
    "winograd_weights": Case("""
g (float[1, 64, 28, 28] x) => (float[1, 64, 28, 28] y) {
  y = Conv<pads=[1, 1, 1, 1]>(x, w)
}""", {"w": _f32(64, 64, 3, 3) / 8}, """\
graph g
  input  %x: float32[1, 64, 28, 28]
  const  %w: float32[64, 64, 3, 3] (147456 bytes)
  %y: float32[1, 64, 28, 28] = Conv(%x, %w) {pads=[1, 1, 1, 1]}
  output %y""", """\
graph g
  input  %x: float32[1, 64, 28, 28]
  const  %w: float32[64, 64, 3, 3] (147456 bytes)
  %y: float32[1, 64, 28, 28] = Conv(winograd)(%x, %w) {cuvil.winograd_tile=4, \
cuvil.winograd_u_stored=1, pads=[1, 1, 1, 1]}
  output %y""", atol=1e-4),
    # precision = "bf16": the Gemm's packed float32 panels become bf16 ones (two per float32
    # element of the blob), the weight's shape kept in the attribute
    "bf16_weights": Case("""
g (float[batch, 64] x) => (float[batch, 32] y) {
  y = Gemm(x, w, b)
}""", {"w": _f32(64, 32), "b": _f32(32)}, """\
graph g
  input  %x: float32[batch, 64]
  const  %w_panels: float32[64, 32] (8192 bytes)
  const  %b: float32[32] (128 bytes)
  %y: float32[batch, 32] = Gemm(%x, %w_panels, %b) {cuvil.packed_weights=1}
  output %y""", """\
graph g
  input  %x: float32[batch, 64]
  const  %w_panels_bf16: float32[1024] (4096 bytes)
  const  %b: float32[32] (128 bytes)
  %y: float32[batch, 32] = Gemm(bf16)(%x, %w_panels_bf16, %b) {cuvil.bf16_weights=[64, 32]}
  output %y""", settings={"precision": "bf16"}, atol=0.1),
}


def test_every_pass_of_the_pipeline_is_walked_through() -> None:
    assert sorted([*CASES, *IN_TEST_IR_TEXT]) == sorted(p.__name__ for p in PIPELINE)


@pytest.mark.parametrize("name", list(CASES))
def test_the_graph_before_and_after_the_pass_reads_as_expected(name: str) -> None:
    case = CASES[name]
    graph = import_model(case.model(), None, "g")
    for setting, value in case.settings.items():
        setattr(graph, setting, value)
    graph = run_passes(graph, until=STAGES[STAGES.index(name) - 1])
    assert graph_text(graph) == case.before
    run = getattr(importlib.import_module(f"cuvil.compiler.passes.{name}"), name)
    assert graph_text(run(graph)) == case.after


@pytest.mark.parametrize("name", list(CASES))
def test_the_model_as_compiled_matches_onnxruntime(name: str) -> None:
    case = CASES[name]
    model = case.model()
    feeds = {}
    for info in model.graph.input:
        dims = [d.dim_value or 3 for d in info.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
        feeds[info.name] = np.random.default_rng(1).standard_normal(dims).astype(dtype)
    compiled = cuvil.compile(model, **case.settings)
    (want,) = run_ort(model, feeds)
    got = compiled.run(feeds)[model.graph.output[0].name]
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=case.atol)
