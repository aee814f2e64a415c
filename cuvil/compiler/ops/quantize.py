"""Quantized tensors: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, and the
integer products MatMulInteger, ConvInteger, QLinearMatMul and QLinearConv.

Quantization follows the ONNX spec: q = saturate(round_half_even(x / scale) + zero_point),
x = (q - zero_point) * scale, with one scale (and zero point) per tensor, per slice along
`axis`, or per block of `block_size` elements along it (opset 21). The element types are
int8, uint8, int16 and uint16 (int32 for DequantizeLinear's input); int4, int2 and the
8/6/4-bit floats have no numpy dtype and stay out of scope.

The products sum (a - a_zero) * (b - b_zero) in int32, as onnxruntime does. QLinearMatMul
and QLinearConv then requantize: y = saturate(round(float(acc + bias) * a_scale * b_scale /
y_scale) + y_zero), with the multiplier formed in the scales' dtype (as the ONNX reference
does) and the product in float64 (exact for every int32 sum); on the int8 GEMM kernel (constant
weights packed at compile time, a B computed by the model packed per call) the kernel's
epilogue does it in float32, as onnxruntime does. Depthwise QLinearConvs run on the float32
depthwise kernel, whose sums of small integers are exact. passes/fuse_qdq.py rewrites the
DequantizeLinear -> Conv/MatMul/Gemm -> QuantizeLinear pattern of QDQ models into these two
ops, with an int32 bias for MatMul (`QLINEAR_BIAS_SLOT`) and a fused Relu (a lower bound of
y_zero on the result).

cuvil's own ops here: QuantizedAdd (a QDQ model's Add of two quantized tensors) and
LookupTable (its elementwise chains on one quantized tensor, passes/quantized_lookup.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, Value, numel, simplify_dim
from cuvil.compiler.kernels.byte_lookup import byte_lookup_function
from cuvil.compiler.kernels.byte_transpose import emit_byte_transpose
from cuvil.compiler.kernels.emitter import I8, I32, Emitter, View
from cuvil.compiler.kernels.int8_gemm import (
    GROUP,
    PACK_COLS,
    QEpilogue,
    QOperands,
    emit_parallel_int8_gemm,
    emit_parallel_int8_gemm_runtime_b,
)
from cuvil.compiler.ops import (
    UNCHECKED,
    Element,
    ElementFn,
    InferContext,
    Op,
    attr,
    broadcast_shapes,
    normalize_axis,
    register,
    required_input,
)
from cuvil.compiler.ops._conv_depthwise import (
    depthwise_scratch_bytes,
    lower_conv_depthwise,
    uses_direct_depthwise,
)
from cuvil.compiler.ops._dynamic_quantize_kernel import emit_dynamic_quantize
from cuvil.compiler.ops._window import Window, window
from cuvil.compiler.ops.conv import _walk_taps
from cuvil.compiler.ops.elementwise import _round_half_even, emit_elementwise
from cuvil.compiler.ops.gemm import FUSED_ACTIVATION
from cuvil.errors import ModelError, UnsupportedOpError

__all__ = ["INT8_PACKED", "LOOKUP_TABLE", "QLINEAR_BIAS_SLOT", "QLINEAR_POST_SLOT", "QUANT_DTYPES",
           "QuantLayout", "dequantize_array", "quant_layout", "weight_slot"]

F32 = ir.FloatType()
#: element types of quantized tensors cuvil compiles
QUANT_DTYPES = ("int8", "uint8", "int16", "uint16")
#: and of the integer products' operands
PRODUCT_DTYPES = ("int8", "uint8")
FLOAT_SCALES = ("float32", "float16", "float64")
#: input slot of QLinearMatMul's int32 bias (one per output column) that passes/fuse_qdq.py
#: adds; QLinearConv has one of its own there already (B)
QLINEAR_BIAS_SLOT = 8
#: input slot of a QLinearConv's second requantization that passes/fuse_qdq.py adds when it
#: takes a BatchNormalization between Q/DQ pairs after the conv: float32 [2, M], a scale and
#: a shift per channel, y = saturate(round((q - y_zero) * scale[m] + shift[m])) (the second
#: zero point is in the shift)
QLINEAR_POST_SLOT = 9
#: attribute passes/pack_int8_weights.py sets when the constant weight holds the int8 kernel's
#: packed blob (kernels/int8_gemm.py `pack_b_int8`, one per group for convolutions):
#: [the weight's dtype, row_sums (0/1), its ONNX shape...]; the node keeps its zero point
#: input, which the blob has folded in
INT8_PACKED = "cuvil.int8_packed"


def weight_slot(node: Node) -> int:
    """The input slot of an integer product's constant operand (B, or the conv weight)."""
    return 3 if node.op_type.startswith("QLinear") else 1


def _weight(node: Node) -> Value:
    """The weight operand as the ONNX model has it, also once its constant is packed."""
    w = required_input(node, weight_slot(node))
    packed = node.attrs.get(INT8_PACKED)
    if not packed:
        return w
    return Value(w.name, TensorType(np.dtype(packed[0]), tuple(int(d) for d in packed[2:])))


def _dtype_of(node: Node, name: str) -> np.dtype | None:
    """The element type an attribute (output_dtype, precision) names; None when unset."""
    code = int(attr(node, name, 0) or 0)
    if not code:
        return None
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code))
    except Exception:
        return None


def _unsupported_type(node: Node, what: str, code: int | str) -> UnsupportedOpError:
    name = onnx.TensorProto.DataType.Name(code) if isinstance(code, int) else code
    return UnsupportedOpError(f"{node.describe()}: {what} is {name}; cuvil compiles quantized "
                              f"tensors of {', '.join(QUANT_DTYPES)} only (int4, int2 and the "
                              "8-, 6- and 4-bit floats have no numpy dtype)")


# -- where each element finds its scale ------------------------------------------------------


@dataclass(frozen=True)
class QuantLayout:
    """axis None: one scale for the tensor; else one per index along `axis`, or per block of
    `block` indices along it (block > 0)."""

    axis: int | None
    block: int = 0


def quant_layout(node: Node, x: Value, scale: Value, zero: Value | None) -> QuantLayout:
    """The layout the scale's shape and the node's axis/block_size give; errors name the node."""
    rank = x.type.rank
    block = int(attr(node, "block_size", 0) or 0) if node.opset >= 21 else 0
    shape = tuple(scale.type.shape)
    one = ((), (1,))  # per tensor either way (onnxruntime's quantizer mixes them)
    zero_shape = shape if zero is None else tuple(zero.type.shape)
    if zero is not None and zero_shape != shape and not (zero_shape in one and shape in one):
        raise ModelError(f"{node.describe()}: the zero point {zero.type} and the scale "
                         f"{scale.type} must have the same shape")
    if not block and (shape == () or shape == (1,)):
        return QuantLayout(None)
    axis = normalize_axis(node, int(attr(node, "axis", 1)), rank)
    if block < 0:
        raise ModelError(f"{node.describe()}: block_size {block} must be positive")
    if not block:
        if len(shape) != 1 or shape[0] != x.type.shape[axis]:
            raise ModelError(f"{node.describe()}: a per-axis scale must be 1-D with one value "
                             f"per index of axis {axis} of {x.type}; it is {scale.type}")
        return QuantLayout(axis)
    want = list(x.type.shape)
    want[axis] = simplify_dim(sympy.ceiling(sympy.sympify(want[axis]) / block))
    if list(shape) != want:
        raise ModelError(f"{node.describe()}: a blocked scale (block_size {block}, axis {axis}) "
                         f"of {x.type} must have shape {want}; it is {scale.type}")
    return QuantLayout(axis, block)


def dequantize_array(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None,
                     layout: QuantLayout, dtype: np.dtype) -> np.ndarray:
    """DequantizeLinear at compile time (weights the QDQ pass does not fuse)."""
    s = np.asarray(scale, np.float32)
    z = np.zeros_like(s) if zero is None else np.asarray(zero, np.float32)
    if layout.axis is not None:
        if layout.block:
            s, z = (np.repeat(p, layout.block, axis=layout.axis) for p in (s, z))
            s, z = (p.take(range(q.shape[layout.axis]), axis=layout.axis) for p in (s, z))
        else:
            shape = [1] * q.ndim
            shape[layout.axis] = -1
            s, z = s.reshape(shape), z.reshape(shape)
    else:
        s, z = s.reshape(()), z.reshape(())
    return ((q.astype(np.float32) - z) * s).astype(dtype)


def _layout(node: Node) -> QuantLayout:
    return quant_layout(node, required_input(node, 0), required_input(node, 1), node.input(2))


def _shaped(k: Emitter, v: Value, rank: int, axis: int | None) -> Value:
    """A per-tensor or per-axis parameter as a value that broadcasts against the tensor."""
    shape: tuple[Dim, ...] = ()
    if axis is not None:
        dims: list[Dim] = [1] * rank
        dims[axis] = v.type.shape[0]
        shape = tuple(dims)
    shaped = Value(v.name, TensorType(v.type.dtype, shape))
    k.buffers[shaped] = k.buffers[v]
    return shaped


def _per_element(k: Emitter, out: Value, x: Value, params: Sequence[Value], layout: QuantLayout,
                 fn: ElementFn) -> None:
    """out[i] = fn([x[i], params' entries for i...])."""
    if not layout.block:
        form = _element(k, x, params, layout, fn)
        emit_elementwise(k, out, form.operands, form.fn, form.cost)
        return
    assert layout.axis is not None
    xv, yv = k.view(x), k.view(out)
    pv = [k.view(p) for p in params]
    with k.loops(xv.dims, name="q") as idx:
        pidx = list(idx)
        pidx[layout.axis] = k.b.sdiv(idx[layout.axis], k.i64(layout.block))
        k.store(yv, idx, fn(k, [k.load(xv, idx), *(k.load(p, pidx) for p in pv)]))


def _element(k: Emitter, x: Value, params: Sequence[Value], layout: QuantLayout,
             fn: ElementFn) -> Element:
    """`_per_element` as an `Element` (per tensor or per axis, not blocked)."""
    return Element([x, *(_shaped(k, p, x.type.rank, layout.axis) for p in params)], fn, 4)


# -- the arithmetic --------------------------------------------------------------------------


def _to_float(k: Emitter, v: ir.Value, src: np.dtype, ct: np.dtype) -> ir.Value:
    return k.convert(v, src, ct)


def saturate(k: Emitter, v: ir.Value, ct: np.dtype, dtype: np.dtype,
             zero: ir.Value | None = None, low: ir.Value | None = None) -> ir.Value:
    """round_half_even(v) + zero, clamped to dtype's range (and to >= `low`, an integer of
    dtype: a fused Relu), as an integer of `dtype`. NaN becomes the range's minimum."""
    r = _round_half_even(k, v)
    if zero is not None:
        r = k.b.fadd(r, k.convert(zero, dtype, ct))
    info = np.iinfo(dtype)
    lo = k.const(ct, float(info.min))
    hi = k.const(ct, float(info.max))
    if low is not None:
        lo = k.convert(low, dtype, ct)
    r = k.b.select(k.b.fcmp_unordered("<", r, lo), lo, r)
    r = k.b.select(k.b.fcmp_ordered(">", r, hi), hi, r)
    return k.convert(r, ct, dtype)


def _compute_dtype(*dtypes: np.dtype | None) -> np.dtype:
    return np.dtype("float64") if any(d is not None and d.name == "float64" for d in dtypes) \
        else np.dtype("float32")


# -- QuantizeLinear / DequantizeLinear -------------------------------------------------------


class _PerElement(Op):
    """QuantizeLinear and DequantizeLinear: `_body` gives the input, its scale and zero point
    (those present) and the per-element function; blocked scales run a loop of their own,
    the others `emit_elementwise`'s, alone or in a chain (`element`)."""

    def _body(self, node: Node) -> tuple[Value, list[Value], ElementFn]:
        raise NotImplementedError

    def fusable(self, node: Node) -> bool:
        return not _layout(node).block

    def element(self, node: Node, k: Emitter) -> Element:
        x, params, fn = self._body(node)
        return _element(k, x, params, _layout(node), fn)

    def lower(self, node: Node, k: Emitter) -> None:
        x, params, fn = self._body(node)
        _per_element(k, node.outputs[0], x, params, _layout(node), fn)


@register
class QuantizeLinear(_PerElement):
    op_type = "QuantizeLinear"
    since = 10
    dtypes = (*FLOAT_SCALES, "int32")

    def out_dtype(self, node: Node) -> np.dtype:
        zero = node.input(2)
        wanted = int(attr(node, "output_dtype", 0) or 0) if node.opset >= 21 else 0
        if zero is not None:
            dtype = zero.type.dtype
            if wanted and wanted != onnx.helper.np_dtype_to_tensor_dtype(dtype):
                raise ModelError(f"{node.describe()}: output_dtype {wanted} differs from the zero "
                                 f"point's dtype {dtype}")
        elif wanted:
            dtype = _dtype_of(node, "output_dtype")  # type: ignore[assignment]
            if dtype is None or dtype.name not in QUANT_DTYPES:
                raise _unsupported_type(node, "output_dtype", wanted)
        else:
            dtype = np.dtype("uint8")
        if dtype.name not in QUANT_DTYPES:
            raise _unsupported_type(node, "the zero point's dtype", dtype.name)
        return dtype

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x, scale, zero = required_input(node, 0), required_input(node, 1), node.input(2)
        quant_layout(node, x, scale, zero)
        return [TensorType(self.out_dtype(node), x.type.shape)]

    def _body(self, node: Node) -> tuple[Value, list[Value], ElementFn]:
        x, scale, zero = required_input(node, 0), required_input(node, 1), node.input(2)
        dtype = node.outputs[0].type.dtype
        ct = _compute_dtype(x.type.dtype, scale.type.dtype, _dtype_of(node, "precision"))

        def fn(k: Emitter, v: list[ir.Value]) -> ir.Value:
            q = k.b.fdiv(_to_float(k, v[0], x.type.dtype, ct),
                         _to_float(k, v[1], scale.type.dtype, ct))
            return saturate(k, q, ct, dtype, v[2] if zero is not None else None)

        return x, [p for p in (scale, zero) if p is not None], fn


@register
class DequantizeLinear(_PerElement):
    op_type = "DequantizeLinear"
    since = 10
    dtypes = (*QUANT_DTYPES, "int32")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x, scale, zero = required_input(node, 0), required_input(node, 1), node.input(2)
        if x.type.dtype.name not in self.dtypes:
            raise _unsupported_type(node, f"input {x.name!r}", x.type.dtype.name)
        if zero is not None and zero.type.dtype != x.type.dtype:
            raise ModelError(f"{node.describe()}: the zero point is {zero.type.dtype}, the input "
                             f"{x.type.dtype}; they must match")
        quant_layout(node, x, scale, zero)
        out = _dtype_of(node, "output_dtype") if node.opset >= 23 else None
        out = out or scale.type.dtype
        if out.name not in FLOAT_SCALES:
            raise ModelError(f"{node.describe()}: the output dtype {out} must be a float")
        return [TensorType(out, x.type.shape)]

    def _body(self, node: Node) -> tuple[Value, list[Value], ElementFn]:
        x, scale, zero = required_input(node, 0), required_input(node, 1), node.input(2)
        out = node.outputs[0].type.dtype
        ct = _compute_dtype(out, scale.type.dtype)

        def fn(k: Emitter, v: list[ir.Value]) -> ir.Value:
            d = _to_float(k, v[0], x.type.dtype, ct)
            if zero is not None:
                d = k.b.fsub(d, _to_float(k, v[2], x.type.dtype, ct))
            y = k.b.fmul(d, _to_float(k, v[1], scale.type.dtype, ct))
            return k.convert(y, ct, out)

        return x, [p for p in (scale, zero) if p is not None], fn


@register
class DynamicQuantizeLinear(Op):
    """uint8 with the scale and zero point that map [min(x, 0), max(x, 0)] onto [0, 255]."""

    op_type = "DynamicQuantizeLinear"
    since = 11
    dtypes = ("float32",)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        return [TensorType(np.dtype("uint8"), x.type.shape), TensorType(x.type.dtype, ()),
                TensorType(np.dtype("uint8"), ())]

    def lower(self, node: Node, k: Emitter) -> None:
        x = required_input(node, 0)
        y, y_scale, y_zero = node.outputs
        emit_dynamic_quantize(k, k.buffers[x], k.dim(x.type.numel), k.buffers[y],
                              k.buffers[y_scale], k.buffers[y_zero])


@register
class QuantizedAdd(Op):
    """cuvil's own: quantize(dequantize(a) + dequantize(b)) in one pass over the integers,
    what passes/fuse_qdq.py makes of a QDQ model's DequantizeLinear -> Add (-> Relu) ->
    QuantizeLinear (the residual sums of a ResNet). Inputs a, a_scale, a_zero, b, b_scale,
    b_zero, y_scale, y_zero (per tensor; absent zero points are 0); the float32 arithmetic is
    the three ops' own, so the result is theirs bit for bit."""

    op_type = "QuantizedAdd"
    domain = "cuvil"
    dtypes = PRODUCT_DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        a, b = required_input(node, 0), required_input(node, 3)
        _check_operand(node, a, "a")
        _check_operand(node, b, "b")
        for slot, what, dtypes in ((1, "a_scale", ("float32",)), (2, "a_zero", (a.type.dtype.name,)),
                                   (4, "b_scale", ("float32",)), (5, "b_zero", (b.type.dtype.name,)),
                                   (6, "y_scale", ("float32",)), (7, "y_zero", PRODUCT_DTYPES)):
            _check_param(node, node.input(slot), 1, what, dtypes)
        required_input(node, 6)
        y_zero = node.input(7)
        dtype = y_zero.type.dtype if y_zero is not None else np.dtype("uint8")
        return [TensorType(dtype, broadcast_shapes(node, ctx, a.type.shape, b.type.shape))]

    def fusable(self, node: Node) -> bool:
        return True

    def lower(self, node: Node, k: Emitter) -> None:
        form = self.element(node, k)
        emit_elementwise(k, node.outputs[0], form.operands, form.fn, form.cost)

    def element(self, node: Node, k: Emitter) -> Element:
        # constant parameters (a QDQ model's) go into the code: the loop then reads two
        # tensors and writes one, with no other pointer to check for overlap, and vectorizes
        constants = {i: v.const.reshape(-1)[0] for i in (1, 2, 4, 5, 6, 7)
                     if (v := node.input(i)) is not None and v.const is not None}
        loaded = [i for i in range(8) if node.input(i) is not None and i not in constants]
        slot = {i: n for n, i in enumerate(loaded)}
        dtype = node.outputs[0].type.dtype
        f32 = np.dtype("float32")
        relu = node.attrs.get(FUSED_ACTIVATION) == "relu"

        def fn(k: Emitter, v: list[ir.Value]) -> ir.Value:
            def param(i: int) -> ir.Value | None:
                if i in constants:
                    return k.const(required_input(node, i).type.dtype, constants[i].item())
                return v[slot[i]] if i in slot else None

            def real(x: int) -> ir.Value:  # DequantizeLinear's (q - zero) * scale
                q_dtype = required_input(node, x).type.dtype
                d = k.convert(v[slot[x]], q_dtype, f32)
                zero = param(x + 2)
                if zero is not None:
                    d = k.b.fsub(d, k.convert(zero, q_dtype, f32))
                return k.b.fmul(d, param(x + 1))

            y = k.b.fdiv(k.b.fadd(real(0), real(3)), param(6))
            zero = param(7)
            low = (zero if zero is not None else k.const(dtype, 0)) if relu else None
            return saturate(k, y, f32, dtype, zero, low)

        return Element([required_input(node, i) for i in loaded], fn, 6)


#: LookupTable's attribute: its 256 results, an int8 or uint8 array indexed by the input's
#: byte (x for uint8, x + 128 for int8)
LOOKUP_TABLE = "cuvil.table"
#: elements of one task of a LookupTable's parallel loop
LOOKUP_BLOCK = 1 << 14


@register
class LookupTable(Op):
    """cuvil's own: y = table[x] for an 8-bit x. passes/quantized_lookup.py makes it of a QDQ
    model's elementwise chains that read one 8-bit tensor (per-tensor scales) and end in a
    QuantizeLinear, a quantized Gelu or HardSwish: such a chain has only 256 possible
    results, which the compiler computes once."""

    op_type = "LookupTable"
    domain = "cuvil"
    dtypes = PRODUCT_DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        _check_operand(node, x, "x")
        table = node.attrs[LOOKUP_TABLE]
        if table.shape != (256,) or table.dtype.name not in PRODUCT_DTYPES:
            raise ModelError(f"{node.describe()}: its table must hold 256 int8 or uint8 "
                             f"results, not {table.dtype} {table.shape}")
        return [TensorType(table.dtype, x.type.shape)]

    def lower(self, node: Node, k: Emitter) -> None:
        # not fusable: a chain's loop would look bytes up one at a time, the kernel does 64
        x, y = required_input(node, 0), node.outputs[0]
        table = k.constant_table(node.attrs[LOOKUP_TABLE], "lookup")
        lookup = byte_lookup_function(k.module, k.target)
        flip = ir.Constant(I8, 0x80 if x.type.dtype == np.dtype("int8") else 0)
        n = k.dim(numel(x.type.shape))
        blocks = k.b.sdiv(k.b.add(n, k.i64(LOOKUP_BLOCK - 1)), k.i64(LOOKUP_BLOCK))
        with k.parallel_loop(blocks, cost=LOOKUP_BLOCK // 8, name="lookup") as block:
            b = k.b
            start = b.mul(block, k.i64(LOOKUP_BLOCK))
            count = b.sub(k.dim(numel(x.type.shape)), start)
            count = b.select(b.icmp_signed("<", count, k.i64(LOOKUP_BLOCK)), count,
                             k.i64(LOOKUP_BLOCK))
            b.call(lookup, [b.gep(table, [k.i64(0), k.i64(0)], source_etype=table.value_type),
                            b.gep(k.buffers[x], [start], source_etype=I8),
                            b.gep(k.buffers[y], [start], source_etype=I8), count, flip])


# -- integer products ------------------------------------------------------------------------


def _param(k: Emitter, v: Value | None, index: ir.Value, dtype: np.dtype) -> ir.Value | None:
    """Entry `index` of a per-row/column parameter (element 0 of a per-tensor one), converted
    to `dtype`; None when the parameter is absent."""
    if v is None:
        return None
    view = k.contiguous(k.buffers[v], v.type.dtype, (v.type.numel,))
    at = k.i64(0) if v.type.numel == 1 else index
    return k.convert(k.load(view, [at]), v.type.dtype, dtype)


def _check_param(node: Node, v: Value | None, count: Dim, what: str,
                 dtypes: Sequence[str]) -> None:
    """A scale or zero point: per tensor, or 1-D with `count` entries."""
    if v is None:
        return
    if v.type.dtype.name not in dtypes:
        raise ModelError(f"{node.describe()}: {what} {v.name!r} is {v.type.dtype}; expected "
                         f"{' or '.join(dtypes)}")
    shape = tuple(v.type.shape)
    if shape not in ((), (1,)) and shape != (count,):
        raise UnsupportedOpError(f"{node.describe()}: {what} {v.name!r} is {v.type}; cuvil "
                                 f"compiles one per tensor or a 1-D one of {count}")


def _check_operand(node: Node, v: Value, what: str) -> None:
    if v.type.dtype.name not in PRODUCT_DTYPES:
        raise UnsupportedOpError(f"{node.describe()}: {what} {v.name!r} is {v.type.dtype}; cuvil "
                                 "compiles integer products of int8 and uint8")


@dataclass(frozen=True)
class Requantize:
    """How an int32 sum becomes the output of a QLinear op: the scales (a's, b's per column
    or channel, y's), y's zero point, whether a Relu is fused."""

    a_scale: Value
    b_scale: Value
    y_scale: Value
    y_zero: Value | None
    relu: bool
    #: the second requantization (`QLINEAR_POST_SLOT`), or None
    post: Value | None = None

    def multiplier(self, k: Emitter, j: ir.Value) -> ir.Value:
        """a_scale * b_scale[j] / y_scale in the scales' dtype, widened to float64."""
        st = self.a_scale.type.dtype
        a = _param(k, self.a_scale, j, st)
        bs = _param(k, self.b_scale, j, st)
        y = _param(k, self.y_scale, j, st)
        assert a is not None and bs is not None and y is not None
        return k.convert(k.b.fdiv(k.b.fmul(a, bs), y), st, "float64")

    def store(self, k: Emitter, acc: ir.Value, j: ir.Value, dtype: np.dtype) -> ir.Value:
        f64 = np.dtype("float64")
        v = k.b.fmul(k.convert(acc, "int32", f64), self.multiplier(k, j))
        zero = _param(k, self.y_zero, j, dtype)
        low = zero if self.relu else None
        if self.relu and zero is None:
            low = k.const(dtype, 0)
        q = saturate(k, v, f64, dtype, zero, low)
        if self.post is None:
            return q
        # in float32 as the kernel's epilogue: (q - zero) * scale[j] + shift[j]
        f32 = np.dtype("float32")
        d = k.convert(q, dtype, f32)
        if zero is not None:
            d = k.b.fsub(d, k.convert(zero, dtype, f32))
        post = k.contiguous(k.buffers[self.post], f32, tuple(self.post.type.shape))
        y = k.b.fadd(k.b.fmul(d, k.load(post, [k.i64(0), j])), k.load(post, [k.i64(1), j]))
        return saturate(k, y, f32, dtype)


def _requantize(node: Node, a_scale: int, b_scale: int) -> Requantize:
    post = node.input(QLINEAR_POST_SLOT) if node.op_type == "QLinearConv" else None
    return Requantize(required_input(node, a_scale), required_input(node, b_scale),
                      required_input(node, 6), node.input(7),
                      node.attrs.get(FUSED_ACTIVATION) == "relu", post)


def _output_dtype(node: Node, a: Value) -> np.dtype:
    y_zero = node.input(7)
    return y_zero.type.dtype if y_zero is not None else a.type.dtype


def _matmul_shape(node: Node, ctx: InferContext, a: Value, b: Value) -> tuple[Dim, ...]:
    if a.type.rank < 2 or b.type.rank < 2:
        raise UnsupportedOpError(f"{node.describe()}: cuvil compiles integer products of "
                                 f"matrices (rank >= 2), not {a.type} x {b.type}")
    ctx.dims_equal(node, a.type.shape[-1], b.type.shape[-2], "inner dims of A and B")
    batch = broadcast_shapes(node, ctx, a.type.shape[:-2], b.type.shape[:-2])
    return (*batch, a.type.shape[-2], b.type.shape[-1])


def _batched(k: Emitter, v: View, batch: tuple[Dim, ...], idx: list[ir.Value]) -> View:
    """The matrix of [..., R, C] view `v` at index `idx` of the broadcast batch dims."""
    head = View(v.ptr, v.dtype, v.dims[:-2], v.strides[:-2], v.shape[:-2])
    hb = k.broadcast_to(head, batch)
    ptr = k.element_ptr(v, k.offset(hb, idx)) if idx else v.ptr
    return View(ptr, v.dtype, v.dims[-2:], v.strides[-2:], v.shape[-2:])


def emit_int_matmul(k: Emitter, a: View, b: View, a_zero: Value | None, b_zero: Value | None,
                    acc_row: Callable[[ir.Value], View], finish: Callable[[ir.Value], None],
                    bias: Value | None = None) -> None:
    """For each row i of a[M, K] @ b[K, N]: acc_row(i)[N] (int32) = bias + sum_p (a[i, p] -
    a_zero[i]) * (b[p, :] - b_zero[:]), then finish(i). The update runs along a row of b, so
    it vectorizes."""
    m, kk, n = a.dims[0], a.dims[1], b.dims[1]
    i32 = np.dtype("int32")
    with k.loop(m, name="m") as i:
        acc = acc_row(i)
        with k.loop(n, name="n0") as j:
            init = _param(k, bias, j, i32) if bias is not None else k.const(i32, 0)
            k.store(acc, [j], init)
        az = _param(k, a_zero, i, i32)
        with k.loop(kk, name="k") as p:
            av = k.convert(k.load(a, [i, p]), a.dtype, i32)
            if az is not None:
                av = k.b.sub(av, az)
            with k.loop(n, name="n") as j:
                bv = k.convert(k.load(b, [p, j]), b.dtype, i32)
                bz = _param(k, b_zero, j, i32)
                if bz is not None:
                    bv = k.b.sub(bv, bz)
                k.store(acc, [j], k.b.add(k.load(acc, [j]), k.b.mul(av, bv)))
        finish(i)


def _lower_matmul(node: Node, k: Emitter, a_val: Value, b_val: Value, a_zero: Value | None,
                  b_zero: Value | None, requant: Requantize | None,
                  bias: Value | None = None) -> None:
    """MatMulInteger (requant None: the sums go straight into y's rows) or QLinearMatMul (the
    sums of a row in scratch, then requantized into y)."""
    y_val = node.outputs[0]
    batch = tuple(y_val.type.shape[:-2])
    a, b, y = k.view(a_val), k.view(b_val), k.view(y_val)
    n = y_val.type.shape[-1]
    i32 = np.dtype("int32")
    with k.loops([k.dim(d) for d in batch], name="batch") as idx:
        am, bm, ym = (_batched(k, v, batch, idx) for v in (a, b, y))

        def acc_row(i: ir.Value, ym: View = ym) -> View:
            if requant is None:
                return k.contiguous(k.element_ptr(ym, k.b.mul(i, ym.strides[0])), i32, (n,))
            assert k.scratch is not None
            return k.contiguous(k.scratch, i32, (n,))

        def finish(i: ir.Value, ym: View = ym) -> None:
            if requant is None:
                return
            acc = acc_row(i)
            with k.loop(ym.dims[1], name="rq") as j:
                k.store(ym, [i, j], requant.store(k, k.load(acc, [j]), j, ym.dtype))

        emit_int_matmul(k, am, bm, a_zero, b_zero, acc_row, finish, bias)


@register
class MatMulInteger(Op):
    op_type = "MatMulInteger"
    since = 10
    dtypes = PRODUCT_DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        a, b = required_input(node, 0), _weight(node)
        _check_operand(node, a, "A")
        _check_operand(node, b, "B")
        out = _matmul_shape(node, ctx, a, b)
        _check_param(node, node.input(2), a.type.shape[-2], "a_zero_point", (a.type.dtype.name,))
        _check_param(node, node.input(3), b.type.shape[-1], "b_zero_point", (b.type.dtype.name,))
        return [TensorType(np.dtype("int32"), out)]

    def lower(self, node: Node, k: Emitter) -> None:
        if INT8_PACKED in node.attrs:
            _lower_packed_matmul(node, k)
            return
        _lower_matmul(node, k, required_input(node, 0), required_input(node, 1), node.input(2),
                      node.input(3), None)


@register
class QLinearMatMul(Op):
    op_type = "QLinearMatMul"
    since = 10
    dtypes = PRODUCT_DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        a, b = required_input(node, 0), _weight(node)
        _check_operand(node, a, "a")
        _check_operand(node, b, "b")
        out = _matmul_shape(node, ctx, a, b)
        n = b.type.shape[-1]
        scales = tuple({v.type.dtype.name for v in (node.input(1), node.input(4), node.input(6))
                        if v is not None})
        if len(scales) != 1 or scales[0] not in FLOAT_SCALES:
            raise ModelError(f"{node.describe()}: the scales must be floats of one dtype")
        for slot, count, what, dtype in ((1, 1, "a_scale", scales), (2, 1, "a_zero_point",
                                          (a.type.dtype.name,)), (4, n, "b_scale", scales),
                                         (5, n, "b_zero_point", (b.type.dtype.name,)),
                                         (6, 1, "y_scale", scales), (7, 1, "y_zero_point",
                                                                    PRODUCT_DTYPES)):
            _check_param(node, node.input(slot), count, what, dtype)
        _check_param(node, node.input(QLINEAR_BIAS_SLOT), n, "bias", ("int32",))
        return [TensorType(_output_dtype(node, a), out)]

    def scratch_bytes(self, node: Node) -> Dim:
        if INT8_PACKED in node.attrs:
            return _packed_matmul_bytes(node)
        if _runtime_b(node):
            kk, n = required_input(node, 3).type.shape[-2:]
            # B packed (its padding bounded above), then the multipliers
            return (kk + GROUP - 1) * (n + PACK_COLS - 1) + 8 * (n + PACK_COLS - 1) + 4 * n
        return 4 * node.outputs[0].type.shape[-1]

    def path(self, node: Node) -> str:
        return "int8 kernel" if INT8_PACKED in node.attrs or _runtime_b(node) else ""

    def lower(self, node: Node, k: Emitter) -> None:
        if INT8_PACKED in node.attrs:
            _lower_packed_matmul(node, k)
            return
        if _runtime_b(node):
            _lower_runtime_b_matmul(node, k)
            return
        _lower_matmul(node, k, required_input(node, 0), required_input(node, 3), node.input(2),
                      node.input(5), _requantize(node, 1, 4), node.input(QLINEAR_BIAS_SLOT))


# -- integer convolutions --------------------------------------------------------------------


def _conv_geometry(node: Node, ctx: InferContext, x: Value, w: Value) -> Window:
    if x.type.rank < 3 or w.type.rank != x.type.rank:
        raise ModelError(f"{node.describe()}: input {x.type} and weight {w.type} must both be "
                         "N x C x spatial... of the same rank")
    if not all(isinstance(d, int) for d in w.type.shape):
        raise ModelError(f"{node.describe()}: the weight shape must be static, got {w.type}")
    kernel = tuple(int(d) for d in w.type.shape[2:])
    if "kernel_shape" in node.attrs and tuple(node.attrs["kernel_shape"]) != kernel:
        raise ModelError(f"{node.describe()}: kernel_shape {list(node.attrs['kernel_shape'])} "
                         f"does not match the weight's spatial shape {list(kernel)}")
    return window(node, ctx, x.type.shape[2:], kernel)


def _conv_infer(node: Node, ctx: InferContext, x: Value, w: Value) -> tuple[Dim, ...]:
    _check_operand(node, x, "x")
    _check_operand(node, w, "w")
    group = int(attr(node, "group", 1))
    m, cw = (int(d) for d in w.type.shape[:2])
    if group < 1 or m % group:
        raise ModelError(f"{node.describe()}: {m} output channels do not split into {group} "
                         "groups")
    ctx.dims_equal(node, x.type.shape[1], cw * group, "input channels vs weight channels x group")
    win = _conv_geometry(node, ctx, x, w)
    return (x.type.shape[0], m, *win.out)


def _lower_conv(node: Node, k: Emitter, x_val: Value, w_val: Value, x_zero: Value | None,
                w_zero: Value | None, requant: Requantize | None, bias: Value | None) -> None:
    """Per image and output channel: the int32 sums of the output map (in y for ConvInteger,
    else in scratch), tap by tap along rows (`_walk_taps`: the inner loop vectorizes), then
    requantized into y. Padding reads nothing: a padded x equals x_zero, which adds 0."""
    y_val = node.outputs[0]
    win = _conv_geometry(node, UNCHECKED, x_val, w_val)
    x, w, y = k.view(x_val), k.view(w_val), k.view(y_val)
    group = int(attr(node, "group", 1))
    m, cg = int(w_val.type.shape[0]), int(w_val.type.shape[1])
    mg = m // group
    spatial = tuple(y_val.type.shape[2:])
    i32 = np.dtype("int32")
    b = k.b
    with k.loop(y.dims[0], name="n") as n, k.loop(m, name="m") as oc:
        if requant is None:
            base = k.element_ptr(y, k.offset(y, [n, oc, *[k.i64(0)] * len(spatial)]))
        else:
            assert k.scratch is not None
            base = k.scratch
        acc = k.contiguous(base, i32, spatial)
        init = _param(k, bias, oc, i32) if bias is not None else k.const(i32, 0)
        with k.loops(acc.dims, name="z") as o:
            k.store(acc, o, init)
        g = b.sdiv(oc, k.i64(mg))
        xz = _param(k, x_zero, k.i64(0), i32)
        wz = _param(k, w_zero, oc, i32)
        with k.loop(cg, name="c") as c:
            ic = b.add(b.mul(g, k.i64(cg)), c)
            with k.loops(win.kernel, name="kpos") as kpos:
                wv = k.convert(k.load(w, [oc, c, *kpos]), w.dtype, i32)
                if wz is not None:
                    wv = b.sub(wv, wz)

                def tap(o: list[ir.Value], i: list[ir.Value], wv: ir.Value = wv,
                        ic: ir.Value = ic) -> None:
                    xv = k.convert(k.load(x, [n, ic, *i]), x.dtype, i32)
                    if xz is not None:
                        xv = b.sub(xv, xz)
                    k.store(acc, o, b.add(k.load(acc, o), b.mul(wv, xv)))

                _walk_taps(k, win, kpos, y.dims[2:], x.dims[2:], tap)
        if requant is not None:
            with k.loops(acc.dims, name="rq") as o:
                k.store(y, [n, oc, *o], requant.store(k, k.load(acc, o), oc, y.dtype))


@register
class ConvInteger(Op):
    op_type = "ConvInteger"
    since = 10
    dtypes = PRODUCT_DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x, w = required_input(node, 0), _weight(node)
        out = _conv_infer(node, ctx, x, w)
        _check_param(node, node.input(2), 1, "x_zero_point", (x.type.dtype.name,))
        _check_param(node, node.input(3), out[1], "w_zero_point", (w.type.dtype.name,))
        return [TensorType(np.dtype("int32"), out)]

    def scratch_bytes(self, node: Node) -> Dim:
        return _packed_conv_bytes(node) if INT8_PACKED in node.attrs else 0

    def path(self, node: Node) -> str:
        return "int8 kernel" if INT8_PACKED in node.attrs else ""

    def lower(self, node: Node, k: Emitter) -> None:
        if INT8_PACKED in node.attrs:
            _lower_packed_conv(node, k)
            return
        _lower_conv(node, k, required_input(node, 0), required_input(node, 1), node.input(2),
                    node.input(3), None, None)


@register
class QLinearConv(Op):
    op_type = "QLinearConv"
    since = 10
    dtypes = PRODUCT_DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x, w = required_input(node, 0), _weight(node)
        out = _conv_infer(node, ctx, x, w)
        m = out[1]
        scales = ("float32",)
        for slot, count, what, dtype in ((1, 1, "x_scale", scales), (2, 1, "x_zero_point",
                                          (x.type.dtype.name,)), (4, m, "w_scale", scales),
                                         (5, m, "w_zero_point", (w.type.dtype.name,)),
                                         (6, 1, "y_scale", scales), (7, 1, "y_zero_point",
                                                                    PRODUCT_DTYPES),
                                         (8, m, "B", ("int32",))):
            _check_param(node, node.input(slot), count, what, dtype)
        post = node.input(QLINEAR_POST_SLOT)
        if post is not None and (post.type.dtype.name != "float32"
                                 or tuple(post.type.shape) != (2, m)):
            raise ModelError(f"{node.describe()}: its second requantization {post.name!r} is "
                             f"{post.type}; expected float32 [2, {m}]")
        return [TensorType(_output_dtype(node, x), out)]

    def scratch_bytes(self, node: Node) -> Dim:
        if INT8_PACKED in node.attrs:
            return _packed_conv_bytes(node)
        if (depthwise := _depthwise(node)) is not None:
            conv, _ = depthwise
            x, y = conv.inputs[0], conv.outputs[0]
            assert x is not None
            return 4 * numel(x.type.shape) + 4 * numel(y.type.shape) + \
                depthwise_scratch_bytes(conv)
        return 4 * numel(node.outputs[0].type.shape[2:])

    def path(self, node: Node) -> str:
        if INT8_PACKED in node.attrs:
            return "int8 kernel"
        return "depthwise" if _depthwise(node) is not None else ""

    def lower(self, node: Node, k: Emitter) -> None:
        if INT8_PACKED in node.attrs:
            _lower_packed_conv(node, k)
            return
        if (depthwise := _depthwise(node)) is not None:
            _lower_depthwise(node, k, *depthwise)
            return
        _lower_conv(node, k, required_input(node, 0), required_input(node, 3), node.input(2),
                    node.input(5), _requantize(node, 1, 4), node.input(8))


def _depthwise(node: Node) -> tuple[Node, np.ndarray] | None:
    """A depthwise QLinearConv as the float32 depthwise kernel's Conv (on x - x_zero, into
    float32 sums) and its weights w - w_zero as float32; None for other convs. The kernel's
    sums are exact: every partial sum is an integer of at most taps * 255 * max|w - w_zero|,
    which must stay below 2**24 (it does for 8-bit 3 x 3 to 7 x 7 kernels), so the result is
    the int32 sums' bit for bit."""
    x, w, w_zero = required_input(node, 0), required_input(node, 3), node.input(5)
    zero = np.zeros(1) if w_zero is None else w_zero.const
    if w.const is None or zero is None or x.type.rank < 3:
        return None
    f32 = np.dtype("float32")
    weights = w.const.astype(np.float64) - zero.astype(np.float64).reshape(
        -1, *[1] * (w.type.rank - 1))
    taps = int(np.prod(w.type.shape[2:]))
    if taps * 255 * float(np.abs(weights).max(initial=0)) >= 2 ** 24:
        return None
    attrs = {a: v for a, v in node.attrs.items() if a in _CONV_GEOMETRY}
    conv = Node("Conv", [Value(f"{x.name}.minus_zero", TensorType(f32, x.type.shape)),
                         Value(f"{w.name}.minus_zero", TensorType(f32, w.type.shape))],
                [Value(f"{node.name}.sums", TensorType(f32, node.outputs[0].type.shape))],
                attrs, name=node.name)
    return (conv, weights.astype(f32)) if uses_direct_depthwise(conv) else None


#: the attributes of a QLinearConv that place its window (the others are cuvil's fusions)
_CONV_GEOMETRY = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def _lower_depthwise(node: Node, k: Emitter, conv: Node, weights: np.ndarray) -> None:
    """x - x_zero as float32 into scratch, the float32 depthwise kernel's sums after it, then
    each sum plus the bias requantized into y."""
    x_val, y_val = required_input(node, 0), node.outputs[0]
    xf, wf = (v for v in conv.inputs if v is not None)
    sums = conv.outputs[0]
    b = k.b
    assert k.scratch is not None
    f32, i32 = np.dtype("float32"), np.dtype("int32")
    k.buffers[xf] = k.scratch
    k.buffers[sums] = b.gep(k.scratch, [k.dim(numel(x_val.type.shape))], source_etype=F32)
    table = k.constant_table(weights.reshape(-1), "weights")
    k.buffers[wf] = b.gep(table, [k.i64(0), k.i64(0)], source_etype=table.value_type)
    x_zero = node.input(2)

    def minus_zero(k: Emitter, v: list[ir.Value]) -> ir.Value:
        x = k.convert(v[0], x_val.type.dtype, f32)
        return x if x_zero is None else k.b.fsub(x, k.convert(v[1], x_val.type.dtype, f32))

    emit_elementwise(k, xf, [x_val] + ([] if x_zero is None else [x_zero]), minus_zero)
    scratch = k.scratch  # the kernel's own (a row of zeros) after the sums
    k.scratch = b.gep(k.buffers[sums], [k.dim(numel(y_val.type.shape))], source_etype=F32)
    lower_conv_depthwise(conv, k, _conv_geometry(node, UNCHECKED, x_val, required_input(node, 3)))
    k.scratch = scratch
    requant, bias = _requantize(node, 1, 4), node.input(8)
    m = y_val.type.shape[1]
    plane = numel(y_val.type.shape[2:])
    with k.parallel_loop(numel(y_val.type.shape[:2]), cost=plane, name="rq") as t:
        b = k.b
        oc = b.srem(t, k.dim(m))
        start = b.mul(t, k.dim(plane))
        add = _param(k, bias, oc, i32) if bias is not None else None
        s = k.contiguous(k.buffers[sums], f32, (numel(y_val.type.shape),))
        y = k.contiguous(k.buffers[y_val], y_val.type.dtype, (numel(y_val.type.shape),))
        with k.loop(b.add(start, k.dim(plane)), start=start, name="e") as e:
            acc = b.fptosi(k.load(s, [e]), I32)
            k.store(y, [e], requant.store(k, b.add(acc, add) if add is not None else acc, oc,
                                          y_val.type.dtype))


# -- on the int8 GEMM kernel (weights packed by passes/pack_int8_weights.py) -----------------


def _kernel_gemm(node: Node, k: Emitter, m: Dim, n: int, kk: int, a: ir.Value,
                 c: ir.Value, fused: QOperands | None = None) -> None:
    """c[m, n] = the product of a[m, kk] (rows of bytes) and the node's packed weight: int32
    sums, or the requantized bytes of a QLinear op with `fused` (`_fused_requantize`)."""
    i32 = np.dtype("int32")
    x = required_input(node, 0)
    a_zero = _param(k, node.input(2), k.i64(0), i32) or k.const(i32, 0)
    emit_parallel_int8_gemm(k, k.dim(m), k.i64(n), k.i64(kk), a, k.i64(kk), a_zero,
                            k.buffers[required_input(node, weight_slot(node))], c, k.i64(n),
                            a_signed=x.type.dtype.name == "int8",
                            row_sums=bool(node.attrs[INT8_PACKED][1]),
                            out=fused or QOperands())


#: scratch bytes of the multipliers of the fused requantization (one float32 per column),
#: rounded to a cache line
def _multiplier_bytes(n: int) -> int:
    return -(-4 * n // 64) * 64


def _runtime_b(node: Node) -> bool:
    """A QLinearMatMul whose B is computed by the model (attention's products of two
    activations), with float32 scales: on the int8 kernel, B packed per call."""
    b = node.input(3)
    return (node.op_type == "QLinearMatMul" and INT8_PACKED not in node.attrs
            and b is not None and b.const is None and b.type.rank >= 2
            and required_input(node, 0).type.rank >= 2 and _fuses_requantize(node))


def _lower_runtime_b_matmul(node: Node, k: Emitter) -> None:
    """For each matrix of the batch: B packed into scratch, then the kernel's product with A,
    requantized in its epilogue (the multipliers after the packed B)."""
    a_val, b_val, y_val = required_input(node, 0), required_input(node, 3), node.outputs[0]
    m, kk = a_val.type.shape[-2:]
    n = b_val.type.shape[-1]
    batch = tuple(y_val.type.shape[:-2])
    assert k.scratch is not None
    b = k.b
    kp = b.and_(b.add(k.dim(kk), k.i64(GROUP - 1)), k.i64(-GROUP))
    np_ = b.and_(b.add(k.dim(n), k.i64(PACK_COLS - 1)), k.i64(-PACK_COLS))
    mult = b.gep(k.scratch, [b.add(b.mul(kp, np_), b.mul(np_, k.i64(8)))], source_etype=I8)
    fused = _fused_requantize(node, k, n, mult)
    b_zero = node.input(5)
    if b_zero is None:
        zero = k.constant_table(np.zeros(1, np.int8), "b_zero")
        b_zero_ptr = b.gep(zero, [k.i64(0), k.i64(0)], source_etype=zero.value_type)
    else:
        b_zero_ptr = k.buffers[b_zero]
    i32 = np.dtype("int32")
    a_zero = _param(k, node.input(2), k.i64(0), i32) or k.const(i32, 0)
    a, bv, y = k.view(a_val), k.view(b_val), k.view(y_val)
    with k.loops([k.dim(d) for d in batch], name="batch") as idx:
        am, bm, ym = (_batched(k, v, batch, idx) for v in (a, bv, y))
        emit_parallel_int8_gemm_runtime_b(
            k, k.dim(m), k.dim(n), k.dim(kk), am.ptr, k.dim(kk), a_zero, bm.ptr, k.dim(n),
            b_zero_ptr, k.scratch, ym.ptr, k.dim(n), a_signed=a_val.type.dtype.name == "int8",
            b_signed=b_val.type.dtype.name == "int8",
            b_zero_per_column=b_zero is not None and b_zero.type.numel != 1, out=fused)


def _fuses_requantize(node: Node) -> bool:
    """Whether the kernel's epilogue requantizes the QLinear op: float32 scales (QLinearConv
    has no others; float16/float64 QLinearMatMul scales keep the float64 loop)."""
    return node.op_type.startswith("QLinear") and required_input(node, 1).type.dtype.name == \
        "float32"


def _fused_requantize(node: Node, k: Emitter, n: Dim, mult: ir.Value) -> QOperands:
    """The kernel's arguments for requantizing in its epilogue, as onnxruntime does: the
    multiplier a_scale * b_scale[j] / y_scale formed in float32 (into `mult`, n floats), the
    float32 product with (acc + bias[j]), rounded half to even, plus y's zero point."""
    requant = _requantize(node, 1, 4)
    f32, i32 = np.dtype("float32"), np.dtype("int32")
    view = k.contiguous(mult, f32, (n,))
    with k.loop(k.dim(n), name="mult") as j:
        a, bs, ys = (_param(k, v, j, f32) for v in (requant.a_scale, requant.b_scale,
                                                    requant.y_scale))
        assert a is not None and bs is not None and ys is not None
        k.store(view, [j], k.b.fdiv(k.b.fmul(a, bs), ys))
    bias = node.input(8)
    y_dtype = node.outputs[0].type.dtype.name
    table = k.buffers[requant.post] if requant.post is not None else None
    return QOperands(QEpilogue(y_dtype, "int32" if bias is not None else "none", requant.relu,
                               post=table is not None),
                     scale=mult, a_scale=ir.Constant(F32, 1.0),
                     bias=k.buffers[bias] if bias is not None else None,
                     c_zero=_param(k, requant.y_zero, k.i64(0), i32) or k.const(i32, 0),
                     post_scale=table,
                     post_shift=(k.b.gep(table, [k.i64(n)], source_etype=F32)
                                 if table is not None else None))


def _packed_matmul_bytes(node: Node) -> Dim:
    """QLinearMatMul's multipliers (fused), or its int32 sums before they are requantized."""
    if node.op_type != "QLinearMatMul":
        return 0
    if _fuses_requantize(node):
        return _multiplier_bytes(int(node.attrs[INT8_PACKED][-1]))
    return 4 * node.outputs[0].type.numel


def _lower_packed_matmul(node: Node, k: Emitter) -> None:
    """[..., M, K] x [K, N]: one product of all rows of A, into y (MatMulInteger, or
    QLinearMatMul requantized by the kernel) or into scratch, requantized into y."""
    a, y = required_input(node, 0), node.outputs[0]
    kk, n = (int(d) for d in node.attrs[INT8_PACKED][-2:])
    rows = numel(a.type.shape[:-1])
    if node.op_type == "MatMulInteger":
        _kernel_gemm(node, k, rows, n, kk, k.buffers[a], k.buffers[y])
        return
    assert k.scratch is not None
    if _fuses_requantize(node):
        fused = _fused_requantize(node, k, n, k.scratch)
        _kernel_gemm(node, k, rows, n, kk, k.buffers[a], k.buffers[y], fused)
        return
    _kernel_gemm(node, k, rows, n, kk, k.buffers[a], k.scratch)
    requant = _requantize(node, 1, 4)
    bias = node.input(QLINEAR_BIAS_SLOT)
    i32 = np.dtype("int32")
    acc = k.contiguous(k.scratch, i32, (rows, n))
    out = k.contiguous(k.buffers[y], y.type.dtype, (rows, n))
    with k.loops(acc.dims, name="rq") as (i, j):
        v = k.load(acc, [i, j])
        if bias is not None:
            v = k.b.add(v, _param(k, bias, j, i32))
        k.store(out, [i, j], requant.store(k, v, j, y.type.dtype))


#: positions per block of the transpose of a conv's products [P, M] into y's [M, P]
TRANSPOSE_BLOCK = 64


def _padded_spatial(node: Node) -> tuple[Window, tuple[Dim, ...], bool]:
    """The conv's window, x's spatial dims with the padding added (x's image copied as
    [spatial..., C] into scratch), and whether it is a pointwise product (1x1, stride 1, no
    padding: that copy is the product's A, no columns)."""
    x = required_input(node, 0)
    win = _conv_geometry(node, UNCHECKED, x, _weight(node))
    padded = tuple(simplify_dim(sympy.sympify(d) + b + e)
                   for d, b, e in zip(x.type.shape[2:], win.pads_begin, win.pads_end))
    pointwise = (all(d == 1 for d in win.kernel + win.strides)
                 and all(p == 0 for p in win.pads_begin + win.pads_end))
    return win, padded, pointwise


def _packed_conv_bytes(node: Node) -> Dim:
    """Scratch of one image: the multipliers (QLinearConv), the products [P, M] (int32, or
    bytes requantized by the kernel), x's padded image [spatial..., C], then the columns
    [P, K] (bytes)."""
    y = node.outputs[0]
    shape = node.attrs[INT8_PACKED][2:]
    m, taps = int(shape[0]), int(np.prod(shape[1:]))
    positions = numel(y.type.shape[2:])
    _, padded, pointwise = _padded_spatial(node)
    image = numel(padded) * int(shape[1])
    cols = 0 if pointwise else positions * taps
    x_spatial = tuple(required_input(node, 0).type.shape[2:])
    if not pointwise and padded != x_spatial:
        # x's image is transposed into the columns' space first, then copied into the padding
        unpadded = numel(x_spatial) * int(shape[1])
        cols = max(cols, unpadded) if isinstance(cols, int) and isinstance(unpadded, int) \
            else cols + unpadded
    if _fuses_requantize(node):
        return _multiplier_bytes(m) + positions * m + image + cols
    return positions * m * 4 + image + cols


def _lower_packed_conv(node: Node, k: Emitter) -> None:
    """Per image: x copied channels-last into [spatial + padding..., C] (the padding x's zero
    point, which adds 0), so that a column row, one output position's window, is a run of
    whole-C copies (one per kernel row when the last axis has no dilation: its taps are
    adjacent); the columns [P, K] (K in (kernel..., C) order, as passes/pack_int8_weights.py
    packs the weights) times the weights [K, M] into [P, M] (QLinearConv: requantized by the
    kernel), transposed into y[n]. A pointwise conv multiplies the copy itself."""
    x_val, y_val = required_input(node, 0), node.outputs[0]
    w = _weight(node)
    win, padded, pointwise = _padded_spatial(node)
    m, c_in = int(w.type.shape[0]), int(w.type.shape[1])
    kk = c_in * int(np.prod(win.kernel))
    x, y = k.view(x_val), k.view(y_val)
    spatial = tuple(y_val.type.shape[2:])
    positions = numel(spatial)
    i8 = ir.IntType(8)
    b = k.b
    assert k.scratch is not None
    fused = None
    products = k.scratch
    if _fuses_requantize(node):
        fused = _fused_requantize(node, k, m, k.scratch)
        products = b.gep(k.scratch, [k.i64(_multiplier_bytes(m))], source_etype=i8)
    sums_dtype = y_val.type.dtype if fused else np.dtype("int32")
    sums = k.contiguous(products, sums_dtype, (positions, m))
    image_ptr = b.gep(products, [b.mul(k.dim(positions), k.i64(m * sums_dtype.itemsize))],
                      source_etype=i8)
    image = k.contiguous(image_ptr, x_val.type.dtype, (*padded, c_in))
    cols_ptr = b.gep(image_ptr, [k.dim(numel(image.shape))], source_etype=i8)
    x_zero = _param(k, node.input(2), k.i64(0), x_val.type.dtype) or k.const(x_val.type.dtype, 0)
    requant = _requantize(node, 1, 4) if node.op_type == "QLinearConv" and not fused else None
    bias = node.input(8) if requant is not None else None
    # the taps of the last axis are one run when they are adjacent in the image
    run_axis = len(win.kernel) - 1 if win.dilations[-1] == 1 else len(win.kernel)
    run = c_in * (win.kernel[-1] if run_axis < len(win.kernel) else 1)
    in_spatial = tuple(x_val.type.shape[2:])
    unpadded = padded == in_spatial
    with k.loop(y.dims[0], name="n") as n:
        # x[n] as [C, S] transposed into [S, C]: straight into the image when it has no
        # padding, else into the columns' space, whose rows are then copied into the image
        x_image = k.element_ptr(x, k.offset(x, [n, *[k.i64(0)] * (len(x.dims) - 1)]))
        s_count = k.dim(numel(in_spatial))
        emit_byte_transpose(k, x_image, s_count, image_ptr if unpadded else cols_ptr, k.i64(c_in),
                            k.i64(c_in), s_count)
        if not unpadded:
            with k.loops(image.dims, name="fill") as idx:
                k.store(image, idx, x_zero)
            row = k.dim(in_spatial[-1])
            dense = k.contiguous(cols_ptr, x_val.type.dtype,
                                 (*in_spatial[:-1], in_spatial[-1] * c_in))
            with k.loops(x.dims[2:-1], name="row") as i:
                at = [b.add(v, k.dim(p)) for v, p in zip(i, win.pads_begin)]
                k.memcpy(k.element_ptr(image, k.offset(image, [*at, k.dim(win.pads_begin[-1]),
                                                               k.i64(0)])),
                         k.element_ptr(dense, k.offset(dense, [*i, k.i64(0)])),
                         b.mul(row, k.i64(c_in)))
        if pointwise:
            a_ptr = image_ptr
        else:
            a_ptr = cols_ptr
            walked = win.kernel[:run_axis]
            # rows of output positions spread over the threads
            with k.parallel_loop(k.dim(spatial[0]), cost=k.dim(numel(spatial[1:]) * kk),
                                 name="im2col", carry=[cols_ptr, image_ptr]) as o0:
                cols_at, image_at = k.carried
                bb = k.b
                image_v = k.contiguous(image_at, x_val.type.dtype, (*padded, c_in))
                out_pos = k.contiguous(cols_at, x_val.type.dtype, spatial)  # its strides flatten o
                kernel_pos = k.contiguous(cols_at, x_val.type.dtype, win.kernel)
                with k.loops([k.dim(d) for d in spatial[1:]], name="o") as rest, \
                        k.loops(walked, name="kpos") as kpos:
                    o = [o0, *rest]
                    taps = [*kpos, *[k.i64(0)] * (len(win.kernel) - len(walked))]
                    src = [bb.add(bb.mul(v, k.i64(s)), bb.mul(t, k.i64(d)))
                           for v, t, s, d in zip(o, taps, win.strides, win.dilations)]
                    dst = bb.add(bb.mul(k.offset(out_pos, o), k.i64(kk)),
                                 bb.mul(k.offset(kernel_pos, taps), k.i64(c_in)))
                    k.memcpy(bb.gep(cols_at, [dst], source_etype=i8),
                             k.element_ptr(image_v, k.offset(image_v, [*src, k.i64(0)])),
                             k.i64(run))
        _kernel_gemm(node, k, positions, m, kk, a_ptr, sums.ptr, fused)
        count = k.dim(positions)
        y_image = k.contiguous(b.gep(y.ptr, [b.mul(n, b.mul(count, k.i64(m)))],
                                     source_etype=y.elem), y.dtype, (positions, m))
        if fused:  # bytes: in vector tiles
            emit_byte_transpose(k, sums.ptr, k.i64(m), y_image.ptr, count, count, k.i64(m))
        else:
            _transpose_sums(k, sums, y_image, count, m, requant, bias)


def _transpose_sums(k: Emitter, sums: View, y_image: View, count: ir.Value, m: int,
                    requant: Requantize | None, bias: Value | None) -> None:
    """The int32 sums [P, M] into y's [M, P], requantized on the way for a QLinearConv whose
    kernel does not (`requant`), in blocks of positions whose rows of sums stay in L1 (the
    whole of [P, M] read column by column would come from L2 for every channel)."""
    b = k.b
    i32 = np.dtype("int32")
    with k.loop(k.floordiv(b.add(count, k.i64(TRANSPOSE_BLOCK - 1)),
                           k.i64(TRANSPOSE_BLOCK)), name="tb") as block:
        p0 = b.mul(block, k.i64(TRANSPOSE_BLOCK))
        size = k.minimum("int64", b.sub(count, p0), k.i64(TRANSPOSE_BLOCK))
        with k.loop(k.i64(m), name="oc") as oc, k.loop(size, name="t") as q:
            p = b.add(p0, q)
            v = k.load_at(sums, b.add(b.mul(p, k.i64(m)), oc))
            if requant is not None:
                if bias is not None:
                    v = b.add(v, _param(k, bias, oc, i32))
                v = requant.store(k, v, oc, y_image.dtype)
            k.store_at(y_image, b.add(b.mul(oc, count), p), v)
