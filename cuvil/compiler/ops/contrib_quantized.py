"""onnxruntime's quantized contrib operators (domain com.microsoft), as its quantizers and its
graph optimizer write them: DynamicQuantizeMatMul and MatMulIntegerToFloat (what onnxruntime
fuses quantize_dynamic's DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul chains into),
QGemm, QLinearAdd, QLinearMul, QLinearSigmoid, QLinearLeakyRelu, QLinearSoftmax,
QLinearConcat and QLinearGlobalAveragePool (quantize_static's QOperator format), and
QAttention and QEmbedLayerNormalization (quantize_dynamic of an optimized transformer) and
DynamicQuantizeLSTM (quantize_dynamic of an LSTM), with
the semantics of onnxruntime's operator documentation (ContribOperators.md).

Each compiles as standard ops (`Op.expand`). The products stay on integers: MatMulInteger
(which passes/pack_int8_weights.py puts on the int8 kernel when B is constant) followed by
the float scale multiply and bias. The elementwise ops are DequantizeLinear -> the float op
-> QuantizeLinear, which is what onnxruntime's lookup tables (Sigmoid, LeakyRelu) and MLAS
kernels (Add, Mul, pooling) compute up to the rounding of one float product, so the results
agree with onnxruntime's to within one quantization step.
"""

from __future__ import annotations

import numpy as np
import onnx

from cuvil.compiler.ir import Node
from cuvil.compiler.ops import attr, normalize_axis, register, required_input
from cuvil.compiler.ops._ml_graph import Body
from cuvil.compiler.ops.contrib import LAYER_NORM_EPSILON, MS, OPSET, Contrib
from cuvil.errors import ModelError, UnsupportedOpError

QUANTIZED = ("uint8", "int8")


def _finish(b: Body, *outputs: str) -> onnx.FunctionProto:
    return b.finish(*outputs, domains={MS: 1}, opset=OPSET)


def _given(node: Node, slot: int) -> bool:
    return node.input(slot) is not None


def _zero(b: Body, slot: int, like: int) -> str:
    """The zero point in `slot`, else a 0 of input `like`'s dtype (the ops' default)."""
    if _given(b.node, slot):
        return b.inputs[slot]
    return b.const(0, required_input(b.node, like).type.dtype)


def _dequantize(b: Body, x: int, scale: int, zero: int) -> str:
    return b.op("DequantizeLinear", b.inputs[x], b.inputs[scale], _zero(b, zero, x))


def _quantize(b: Body, y: str, scale: int, zero: int, like: int) -> str:
    return b.op("QuantizeLinear", y, b.inputs[scale], _zero(b, zero, like))


def _scaled(b: Body, acc: str, scale: str, bias: int | None, dtype: np.dtype) -> str:
    """float(acc) * scale (+ bias): the int32 sums of a product back in floats."""
    y = b.op("Mul", b.cast(acc, dtype), scale)
    return y if bias is None or not _given(b.node, bias) else b.op("Add", y, b.inputs[bias])


def _matmul_integer(b: Body, a: str, a_zero: str | None, bw: str, b_zero: int) -> str:
    inputs = [a, bw, a_zero or ""]
    if _given(b.node, b_zero):
        inputs.append(b.inputs[b_zero])
    while inputs[-1] == "":
        inputs.pop()
    return b.op("MatMulInteger", *inputs)


class QuantizedContrib(Contrib):
    dtypes = QUANTIZED


# -- products --------------------------------------------------------------------------------


@register
class DynamicQuantizeMatMul(Contrib):
    """A (float) quantized to uint8 as DynamicQuantizeLinear does, times the quantized B:
    MatMulInteger * (a_scale * b_scale) + bias; b_scale and b_zero_point may be per column."""

    op_type = "DynamicQuantizeMatMul"
    dtypes = ("float32",)

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        required_input(node, 1)
        required_input(node, 2)
        b = Body(node)
        q, a_scale, a_zero = b.outputs("DynamicQuantizeLinear", 3, b.inputs[0])
        acc = _matmul_integer(b, q, a_zero, b.inputs[1], 3)
        scale = b.op("Mul", a_scale, b.inputs[2])
        return _finish(b, _scaled(b, acc, scale, 4, np.dtype("float32")))


@register
class MatMulIntegerToFloat(QuantizedContrib):
    """MatMulInteger(A, B, a_zero_point, b_zero_point) * (a_scale * b_scale) + bias."""

    op_type = "MatMulIntegerToFloat"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        for slot in (1, 2, 3):
            required_input(node, slot)
        b = Body(node)
        a_zero = b.inputs[4] if _given(node, 4) else None
        acc = _matmul_integer(b, b.inputs[0], a_zero, b.inputs[1], 5)
        scale = b.op("Mul", b.inputs[2], b.inputs[3])
        return _finish(b, _scaled(b, acc, scale, 6, required_input(node, 2).type.dtype))


@register
class QGemm(QuantizedContrib):
    """alpha * (A' - a_zero)(B' - b_zero) * a_scale * b_scale + C (int32, in the product's
    scale), quantized with y_scale and y_zero_point when y_scale is given, else float."""

    op_type = "QGemm"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        for slot in (1, 2, 3, 4, 5):
            required_input(node, slot)
        b = Body(node)
        a, bw = b.inputs[0], b.inputs[3]
        for name, slot in (("transA", 0), ("transB", 3)):
            if attr(node, name, 0):
                if required_input(node, slot).type.rank != 2:
                    raise ModelError(f"{node.describe()}: {name} needs a 2-D operand")
                t = b.op("Transpose", b.inputs[slot], perm=[1, 0])
                a, bw = (t, bw) if slot == 0 else (a, t)
        acc = _matmul_integer(b, a, b.inputs[2], bw, 5)
        if _given(node, 6):
            acc = b.op("Add", acc, b.inputs[6])
        scale = b.op("Mul", b.inputs[1], b.inputs[4])
        alpha = float(attr(node, "alpha", 1.0))
        if alpha != 1.0:
            scale = b.op("Mul", scale, b.const(alpha))
        y = _scaled(b, acc, scale, None, np.dtype("float32"))
        if not _given(node, 7):
            return _finish(b, y)
        zero = b.inputs[8] if _given(node, 8) else b.const(0, np.uint8)
        return _finish(b, b.op("QuantizeLinear", y, b.inputs[7], zero))


@register
class QAttention(QuantizedContrib):
    """Attention of the dequantized input and weight (onnxruntime's integer product of the
    two, scaled, is the same sum in floats); the attention itself runs in float."""

    op_type = "QAttention"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        for slot in (1, 2, 3, 4):
            required_input(node, slot)
        b = Body(node)
        x = _dequantize(b, 0, 3, 6)
        w = _dequantize(b, 1, 4, 7)
        inputs = [x, w, b.inputs[2], b.inputs[5] if _given(node, 5) else "",
                  b.inputs[8] if _given(node, 8) else ""]
        while inputs[-1] == "":
            inputs.pop()
        attrs = {k: v for k, v in node.attrs.items()
                 if k in ("num_heads", "unidirectional", "mask_filter_value", "scale",
                          "past_present_share_buffer", "do_rotary")}
        # output and present (Attention computes present when K and V stack)
        return _finish(b, *b.outputs("Attention", 2, *inputs, domain=MS, **attrs))


@register
class QEmbedLayerNormalization(Contrib):
    """EmbedLayerNormalization of the dequantized tables, gamma and beta (constants in the
    models quantize_dynamic writes, so they dequantize once, at compile time)."""

    op_type = "QEmbedLayerNormalization"
    dtypes = ("int32",)  # of the word ids

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        b = Body(node)
        # table slot -> (scale slot, zero point slot); the segment table is optional
        tables = {2: (8, 13), 3: (9, 14), 4: (10, 15), 5: (11, 16), 6: (12, 17)}
        inputs = [b.inputs[0], b.inputs[1] if _given(node, 1) else ""]
        for slot, (scale, zero) in tables.items():
            if slot != 4 or _given(node, 4):
                required_input(node, scale)
                inputs.append(_dequantize(b, slot, scale, zero))
            else:
                inputs.append("")
        inputs.append(b.inputs[7] if _given(node, 7) else "")
        while inputs[-1] == "":
            inputs.pop()
        attrs = {"epsilon": float(attr(node, "epsilon", LAYER_NORM_EPSILON))}
        y, mask_index = b.outputs("EmbedLayerNormalization", 2, *inputs, domain=MS, **attrs)
        return _finish(b, y, mask_index)


@register
class DynamicQuantizeLSTM(Contrib):
    """An LSTM whose W [directions, input, 4*hidden] and R [directions, hidden, 4*hidden] are
    quantized (int8 or uint8, a scale and zero point per direction or per gate column), as
    quantize_dynamic writes LSTMs: the LSTM of the dequantized weights, transposed to the
    standard op's [directions, 4*hidden, ...] (constants, so once, at compile time).

    onnxruntime also quantizes the input and the hidden state to 8 bits before each product,
    so its outputs differ from the float model's by that rounding; cuvil's are the float
    model's for the dequantized weights, nearer the model that was quantized."""

    op_type = "DynamicQuantizeLSTM"
    dtypes = ("float32",)
    #: the standard LSTM's attributes, which this op shares
    ATTRIBUTES = ("activation_alpha", "activation_beta", "activations", "clip", "direction",
                  "hidden_size", "input_forget")

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        for slot in (1, 2, 8, 10):
            required_input(node, slot)
        b = Body(node)

        def gate_rows(weights: int, scale: int, zero: int) -> str:
            # the scale and zero point, [directions] or [directions, 4*hidden], broadcast
            # along the weights' middle axis
            shape = b.const([0, 1, -1], np.int64)
            w = b.cast(b.inputs[weights], np.float32)
            if _given(node, zero):
                w = b.op("Sub", w, b.op("Reshape", b.cast(b.inputs[zero], np.float32), shape))
            w = b.op("Mul", w, b.op("Reshape", b.inputs[scale], shape))
            return b.op("Transpose", w, perm=[0, 2, 1])

        inputs = [b.inputs[0], gate_rows(1, 8, 9), gate_rows(2, 10, 11)]
        inputs += [b.inputs[slot] if _given(node, slot) else "" for slot in range(3, 8)]
        while inputs[-1] == "":
            inputs.pop()
        attrs = {name: node.attrs[name] for name in self.ATTRIBUTES if name in node.attrs}
        return _finish(b, *b.outputs("LSTM", 3, *inputs, **attrs))


# -- elementwise -----------------------------------------------------------------------------


class _Binary(QuantizedContrib):
    """C = quantize(dequantize(A) <op> dequantize(B)) with C's scale and zero point."""

    float_op = ""

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        for slot in (1, 3, 4, 6):
            required_input(node, slot)
        b = Body(node)
        y = b.op(self.float_op, _dequantize(b, 0, 1, 2), _dequantize(b, 3, 4, 5))
        return _finish(b, _quantize(b, y, 6, 7, 0))


@register
class QLinearAdd(_Binary):
    op_type = "QLinearAdd"
    float_op = "Add"


@register
class QLinearMul(_Binary):
    op_type = "QLinearMul"
    float_op = "Mul"


class _Unary(QuantizedContrib):
    """Y = quantize(f(dequantize(X))): X, X_scale, X_zero_point, Y_scale, Y_zero_point."""

    def apply(self, b: Body, x: str) -> str:
        raise NotImplementedError

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        for slot in (1, 3):
            required_input(node, slot)
        b = Body(node)
        return _finish(b, _quantize(b, self.apply(b, _dequantize(b, 0, 1, 2)), 3, 4, 0))


@register
class QLinearSigmoid(_Unary):
    op_type = "QLinearSigmoid"

    def apply(self, b: Body, x: str) -> str:
        return b.op("Sigmoid", x)


@register
class QLinearLeakyRelu(_Unary):
    op_type = "QLinearLeakyRelu"

    def apply(self, b: Body, x: str) -> str:
        return b.op("LeakyRelu", x, alpha=float(attr(b.node, "alpha", 0.01)))


@register
class QLinearSoftmax(_Unary):
    """Softmax along `axis`; with `opset` below 13, over the dims from `axis` on, as Softmax
    was then."""

    op_type = "QLinearSoftmax"

    def apply(self, b: Body, x: str) -> str:
        node = b.node
        rank = required_input(node, 0).type.rank
        axis = normalize_axis(node, int(attr(node, "axis", -1)), rank)
        if int(attr(node, "opset", 13)) >= 13 or axis == rank - 1:
            return b.op("Softmax", x, axis=axis)
        rows = b.op("Flatten", x, axis=axis)
        return b.op("Reshape", b.op("Softmax", rows, axis=-1), b.op("Shape", x))


@register
class QLinearGlobalAveragePool(_Unary):
    """The mean over the spatial dims (after the channels, or before them with
    channels_last=1), keeping them as size 1."""

    op_type = "QLinearGlobalAveragePool"

    def apply(self, b: Body, x: str) -> str:
        rank = required_input(b.node, 0).type.rank
        if rank < 3:
            raise ModelError(f"{b.node.describe()}: X must be N x C x spatial... (or N x "
                             f"spatial... x C), got rank {rank}")
        if not attr(b.node, "channels_last", 0):
            return b.op("GlobalAveragePool", x)
        return b.op("ReduceMean", x, b.const(list(range(1, rank - 1)), np.int64), keepdims=1)


@register
class QLinearConcat(Contrib):
    """Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) per input: the dequantized
    inputs concatenated along `axis`, quantized with Y's scale and zero point."""

    op_type = "QLinearConcat"
    dtypes = QUANTIZED

    def expand(self, node: Node) -> onnx.FunctionProto:
        zero = required_input(node, 1)
        if zero.type.dtype.name not in QUANTIZED:
            raise UnsupportedOpError(f"{node.describe()}: Y_zero_point is {zero.type.dtype}; cuvil "
                                     f"compiles {node.op_type} for {', '.join(QUANTIZED)} only")
        if (len(node.inputs) - 2) % 3 or len(node.inputs) < 5:
            raise ModelError(f"{node.describe()}: inputs must be Y_scale, Y_zero_point, then "
                             f"(X, X_scale, X_zero_point) triples; it has {len(node.inputs)}")
        b = Body(node)
        parts = [_dequantize(b, i, i + 1, i + 2) for i in range(2, len(node.inputs), 3)]
        rank = required_input(node, 2).type.rank
        axis = normalize_axis(node, int(attr(node, "axis", 0)), rank)
        y = b.op("Concat", *parts, axis=axis)
        return _finish(b, b.op("QuantizeLinear", y, b.inputs[0], b.inputs[1]))
