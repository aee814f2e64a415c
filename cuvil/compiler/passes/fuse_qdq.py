"""Run QDQ models (onnxruntime's `quantize_static`) on integer products.

A QDQ model keeps its float ops and marks the tensors between them as quantized with a
QuantizeLinear -> DequantizeLinear pair; weights are DequantizeLinear nodes on integer
constants (the frontend keeps those as nodes for this pass, see frontend/fold_constants.py).
The rules below, each anchored on the QuantizeLinear that ends a pattern:

- product: DequantizeLinear(x) and DequantizeLinear(constant weight) -> Conv, MatMul or Gemm
  (with a bias, and a Relu the quantizer left in place) -> QuantizeLinear becomes
  QLinearConv or QLinearMatMul (ops/quantize.py): int32 sums, the bias in int32 at scale
  x_scale * w_scale, a requantize step and the Relu as a lower bound; a MatMul of two
  DequantizeLinears of activations (attention's) becomes a QLinearMatMul too;
- batchnorm: QLinearConv (made by the rule above) -> DequantizeLinear -> BatchNormalization
  -> QuantizeLinear, as the quantizer writes a model whose normalizations were not folded,
  becomes one QLinearConv with a second requantization of its bytes (`_fold_batchnorm`);
- add: DequantizeLinear(a) + DequantizeLinear(b) (-> Relu) -> QuantizeLinear becomes
  cuvil's QuantizedAdd, one pass over the integers (a ResNet's residual sums);
- data movement: DequantizeLinear -> MaxPool, Flatten, Reshape, Transpose, Squeeze or
  Unsqueeze -> QuantizeLinear with the same scale and zero point becomes that op on the
  integers (they commute with a monotone per-tensor map).

Everything else keeps its float op between a DequantizeLinear and a QuantizeLinear, which
compute as the spec says. DequantizeLinear nodes left on constants are folded at the end.
"""

from __future__ import annotations

import numpy as np

from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.ops.gemm import FUSED_ACTIVATION
from cuvil.compiler.ops.quantize import (
    QLINEAR_BIAS_SLOT,
    QLINEAR_POST_SLOT,
    QuantLayout,
    dequantize_array,
    quant_layout,
)
from cuvil.compiler.passes.eliminate_dead_code import eliminate_dead_code
from cuvil.compiler.passes.fold_batchnorm import batchnorm_affine
from cuvil.compiler.passes.rewrite import Rule, apply_rules, const_operand, pattern, sole_reader

__all__ = ["fuse_qdq"]

PRODUCT_DTYPES = ("int8", "uint8")
#: ops that only move elements (or take maxima): f(DQ(q)) = DQ(f(q)) per tensor
MOVERS = ("MaxPool", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze")


def _dq(v: Value | None) -> Node | None:
    """The DequantizeLinear producing v (int8/uint8, one scale per tensor or per axis)."""
    if v is None or v.producer is None:
        return None
    n = v.producer
    if n.op_type != "DequantizeLinear" or n.domain or n.attrs.get("block_size"):
        return None
    x = n.inputs[0]
    return n if x is not None and x.type.dtype.name in PRODUCT_DTYPES else None


def _per_tensor(v: Value | None) -> bool:
    return v is None or (v.const is not None and v.const.size == 1)


def _activation(dq: Node | None) -> bool:
    """A DequantizeLinear of an activation with constant per-tensor parameters."""
    return dq is not None and all(_per_tensor(dq.input(i)) for i in (1, 2)) \
        and dq.input(1) is not None


def _weights(dq: Node | None, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(q, scale, zero) of a constant weight quantized per tensor or per slice of `axis`."""
    if dq is None or any(const_operand(v) is None for v in dq.inputs):
        return None
    q, scale = dq.inputs[0], dq.inputs[1]
    assert q is not None and scale is not None and q.const is not None
    layout = quant_layout(dq, q, scale, dq.input(2))
    if layout.axis is not None and layout.axis != axis:
        return None
    zero = dq.input(2)
    z = zero.const if zero is not None and zero.const is not None else np.zeros((), q.const.dtype)
    return q.const, np.asarray(scale.const), np.asarray(z)


def _constant_dequantize(dq: Node | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                  QuantLayout] | None:
    """(q, scale, zero, layout) of a DequantizeLinear whose inputs are all constants."""
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain:
        return None
    x, scale, zero = dq.inputs[0], dq.input(1), dq.input(2)
    if x is None or x.const is None or scale is None or scale.const is None \
            or (zero is not None and zero.const is None):
        return None
    return (x.const, np.asarray(scale.const), zero.const if zero is not None else None,
            quant_layout(dq, x, scale, zero))


def _int32_bias(bias: Value | None, scale: np.ndarray, count: int) -> np.ndarray | None:
    """The bias in int32 at `scale` (x_scale * w_scale per channel): an int32
    DequantizeLinear at that scale gives its integers; a float bias is rounded to it. Zeros
    when there is no bias; None when it has another size or does not fit in int32."""
    if bias is None:
        return np.zeros(count, np.int32)
    quantized = _constant_dequantize(bias.producer)
    value = const_operand(bias)
    if quantized is not None:
        q, s, z, layout = quantized
        if (q.dtype == np.int32 and q.size == count and (z is None or not np.any(z))
                and np.allclose(np.broadcast_to(s.reshape(-1), (count,)), scale, rtol=1e-6,
                                atol=0)):
            return q.reshape(-1).astype(np.int32)
        value = dequantize_array(q, s, z, layout, np.dtype("float32"))
    if value is None or value.size not in (1, count):
        return None
    rounded = np.rint(np.broadcast_to(value.reshape(-1), (count,)).astype(np.float64) / scale)
    if np.any(np.abs(rounded) >= 2 ** 31):
        return None
    return np.asarray(rounded, dtype=np.int32)


def _quantizes_per_tensor(q: Node) -> bool:
    """A QuantizeLinear to int8/uint8 with a constant per-tensor scale and zero point."""
    return (_per_tensor(q.input(1)) and _per_tensor(q.input(2)) and q.input(1) is not None
            and q.outputs[0].type.dtype.name in PRODUCT_DTYPES)


def _through_relu(graph: Graph, q: Node) -> tuple[Value | None, Node, list[Node]]:
    """(what q quantizes, the node reading it, [the Relu]) past a Relu read only by q, which
    the quantizer leaves in place when it does not merge it into the range; else (q's
    input, q, [])."""
    x = q.inputs[0]
    if x is not None and x.producer is not None and x.producer.op_type == "Relu" \
            and not x.producer.domain and sole_reader(graph, x, q):
        return x.producer.inputs[0], x.producer, [x.producer]
    return x, q, []


def _fuse_product(graph: Graph, q: Node) -> Node | None:
    if not _quantizes_per_tensor(q):
        return None
    x, reader, gone = _through_relu(graph, q)
    relu = bool(gone)
    if x is None or x.producer is None or not sole_reader(graph, x, reader):
        return None
    prod = x.producer
    a_dq = _dq(prod.input(0))
    if prod.domain or not _activation(a_dq) or prod.outputs[0].type.dtype.name != "float32":
        return None
    assert a_dq is not None
    if prod.op_type == "Conv":
        made = _qlinear_conv(graph, prod, a_dq, q)
    elif prod.op_type in ("MatMul", "Gemm"):
        made = _qlinear_matmul(graph, prod, a_dq, q)
    else:
        return None
    if made is None:
        return None
    if relu:
        made.attrs[FUSED_ACTIVATION] = "relu"
    graph.replace_node(q, made)
    graph.remove_nodes([*gone, prod])
    return made


def _scale(v: Value | None) -> np.ndarray:
    assert v is not None and v.const is not None
    return np.asarray(v.const, np.float32).reshape(-1)


def _qlinear_conv(graph: Graph, conv: Node, a_dq: Node, q: Node) -> Node | None:
    w = _weights(_dq(conv.input(1)), axis=0)
    if w is None:
        return None
    wq, ws, wz = w
    m = wq.shape[0]
    bias = _int32_bias(conv.input(2), (_scale(a_dq.input(1)) * ws.reshape(-1)).astype(np.float32)
                       * np.ones(m, np.float32), m)
    if bias is None:
        return None
    inputs = [a_dq.inputs[0], a_dq.input(1), a_dq.input(2),
              graph.constant(wq, "w_quantized"), graph.constant(ws, "w_scale"),
              graph.constant(wz, "w_zero_point"), q.input(1), q.input(2),
              graph.constant(bias, "bias_quantized")]
    return Node("QLinearConv", inputs, [], dict(conv.attrs), name=conv.name, opset=conv.opset)


def _qlinear_matmul(graph: Graph, prod: Node, a_dq: Node, q: Node) -> Node | None:
    a, b = prod.inputs[0], prod.input(1)
    if a is None or b is None or a.type.rank < 2 or b.type.rank < 2:
        return None
    b_dq = _dq(b)
    if prod.op_type == "MatMul" and _activation(b_dq):  # attention's products
        assert b_dq is not None
        return Node("QLinearMatMul", [a_dq.inputs[0], a_dq.input(1), a_dq.input(2),
                                      b_dq.inputs[0], b_dq.input(1), b_dq.input(2), q.input(1),
                                      q.input(2)], [], {}, name=prod.name, opset=prod.opset)
    if b.type.rank != 2:
        return None
    trans_b = False
    if prod.op_type == "Gemm":
        attrs = prod.attrs
        if (a.type.rank != 2 or attrs.get("transA", 0) or float(attrs.get("alpha", 1.0)) != 1.0
                or float(attrs.get("beta", 1.0)) != 1.0):
            return None
        trans_b = bool(attrs.get("transB", 0))
    w = _weights(_dq(b), axis=0 if trans_b else 1)
    if w is None:
        return None
    wq, ws, wz = w
    if trans_b:
        wq = np.ascontiguousarray(wq.T)
    n = wq.shape[1]
    bias_in = prod.input(2) if prod.op_type == "Gemm" else None
    if bias_in is not None and tuple(bias_in.type.shape) not in ((n,), (1, n), (1,), ()):
        return None
    bias = None
    if bias_in is not None:
        bias = _int32_bias(bias_in, (_scale(a_dq.input(1)) * ws.reshape(-1)).astype(np.float32)
                           * np.ones(n, np.float32), n)
        if bias is None:
            return None
    inputs = [a_dq.inputs[0], a_dq.input(1), a_dq.input(2), graph.constant(wq, "w_quantized"),
              graph.constant(ws, "w_scale"), graph.constant(wz, "w_zero_point"), q.input(1),
              q.input(2)]
    if bias is not None:
        inputs.append(graph.constant(bias, "bias_quantized"))
    assert len(inputs) <= QLINEAR_BIAS_SLOT + 1
    return Node("QLinearMatMul", inputs, [], {}, name=prod.name, opset=prod.opset)


def _same_params(a: Node, b: Node) -> bool:
    """Both nodes have the same constant per-tensor scale and zero point."""
    for i in (1, 2):
        pa, pb = const_operand(a.input(i)), const_operand(b.input(i))
        if pa is None or pb is None or pa.size != 1 or pa.dtype != pb.dtype \
                or not np.array_equal(pa.reshape(-1), pb.reshape(-1)):
            return False
    return True


def _fuse_mover(graph: Graph, q: Node) -> Node | None:
    x = q.inputs[0]
    if x is None or x.producer is None or not sole_reader(graph, x, q):
        return None
    mover = x.producer
    dq = _dq(mover.input(0))
    if (mover.op_type not in MOVERS or mover.domain or len(mover.outputs) != 1 or dq is None
            or not _same_params(dq, q)):
        return None
    q_in = dq.inputs[0]
    if q_in is None or q_in.type.dtype != q.outputs[0].type.dtype:
        return None
    moved = Node(mover.op_type, [q_in, *mover.inputs[1:]], [], dict(mover.attrs),
                 name=mover.name, opset=mover.opset)
    graph.replace_node(q, moved)
    graph.remove_nodes([mover])
    return moved


def _float_param(v: Value | None) -> np.ndarray | None:
    """A float constant, or the value of a DequantizeLinear of constants (the quantizer
    quantizes a BatchNormalization's scale and bias as weights)."""
    if v is None:
        return None
    if v.const is not None:
        return v.const if v.type.dtype.kind == "f" else None
    quantized = _constant_dequantize(v.producer)
    if quantized is None:
        return None
    q, scale, zero, layout = quantized
    return dequantize_array(q, scale, zero, layout, np.dtype("float32"))


def _fold_batchnorm(graph: Graph, q: Node) -> Node | None:
    """QLinearConv -> DequantizeLinear -> BatchNormalization -> QuantizeLinear: the
    normalization's per-channel a * x + s and the second quantization become the conv's second
    requantization (ops/quantize.py `QLINEAR_POST_SLOT`), applied to its output bytes q while
    they are in registers: (q - zero) * (scale * a / q_scale) + s / q_scale + q_zero, the
    three ops' arithmetic with both roundings (the model's), so it agrees with onnxruntime's
    float BatchNormalization up to float rounding."""
    if not _quantizes_per_tensor(q) or q.input(2) is None:
        return None
    x = q.inputs[0]
    if x is None or x.producer is None or not sole_reader(graph, x, q):
        return None
    bn = x.producer
    normalized = bn.inputs[0]
    if bn.op_type != "BatchNormalization" or bn.domain or normalized is None:
        return None
    dq = _dq(normalized)
    if dq is None or not sole_reader(graph, normalized, bn):
        return None
    sums = dq.inputs[0]
    if sums is None or sums.producer is None or not sole_reader(graph, sums, dq):
        return None
    conv = sums.producer
    if conv.op_type != "QLinearConv" or conv.domain or FUSED_ACTIVATION in conv.attrs \
            or conv.input(QLINEAR_POST_SLOT) is not None \
            or conv.outputs[0].type.dtype != q.outputs[0].type.dtype:
        return None
    for mine, theirs in ((dq.input(1), conv.input(6)), (dq.input(2), conv.input(7))):
        pa, pb = const_operand(mine), const_operand(theirs)
        if pa is None or pb is None or not np.array_equal(pa.reshape(-1), pb.reshape(-1)):
            return None
    affine = batchnorm_affine(bn, _float_param)
    w = conv.input(3)
    if affine is None or w is None or w.const is None or affine[0].shape != (w.const.shape[0],):
        return None
    a, s = affine
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(s))):
        return None
    conv_scale = float(_scale(conv.input(6))[0])
    q_scale = float(_scale(q.input(1))[0])
    q_zero = float(np.asarray(const_operand(q.input(2))).reshape(-1)[0])
    post = np.stack([conv_scale * a / q_scale, s / q_scale + q_zero]).astype(np.float32)
    inputs = list(conv.inputs) + [None] * (QLINEAR_POST_SLOT - len(conv.inputs))
    made = Node("QLinearConv", [*inputs, graph.constant(post, "requantize_bn")], [],
                dict(conv.attrs), name=conv.name, opset=conv.opset)
    graph.replace_node(q, made)
    graph.remove_nodes([bn, dq, conv])
    return made


def _fuse_add(graph: Graph, q: Node) -> Node | None:
    """DequantizeLinear(a) + DequantizeLinear(b) (-> Relu) -> QuantizeLinear: one pass over
    the integers (ops/quantize.py QuantizedAdd), the residual sums of a QDQ ResNet."""
    if not _quantizes_per_tensor(q):
        return None
    x, reader, gone = _through_relu(graph, q)
    if x is None or x.producer is None or not sole_reader(graph, x, reader):
        return None
    add = x.producer
    if add.op_type != "Add" or add.domain or len(add.inputs) != 2 \
            or add.outputs[0].type.dtype.name != "float32":
        return None
    dqs = [_dq(v) for v in add.inputs]
    if not all(_activation(d) for d in dqs):
        return None
    operands: list[Value | None] = []
    for d in dqs:
        assert d is not None
        operands += [d.inputs[0], d.input(1), d.input(2)]
    made = Node("QuantizedAdd", [*operands, q.input(1), q.input(2)], [],
                {FUSED_ACTIVATION: "relu"} if gone else {}, name=add.name, domain="cuvil",
                opset=1)
    graph.replace_node(q, made)
    graph.remove_nodes([*gone, add])
    return made


def _fold_constant_dequantize(graph: Graph) -> None:
    """DequantizeLinear nodes of constants that no rule fused become float constants."""
    for node in list(graph.nodes):
        out = node.outputs[0] if node.outputs else None
        if (node.op_type != "DequantizeLinear" or node.domain or out is None
                or out in graph.outputs or any(v is not None and v.const is None
                                               for v in node.inputs)):
            continue
        x, scale, zero = node.inputs[0], node.inputs[1], node.input(2)
        assert x is not None and scale is not None and x.const is not None
        value = dequantize_array(x.const, np.asarray(scale.const),
                                 zero.const if zero is not None else None,
                                 quant_layout(node, x, scale, zero), out.type.dtype)
        graph.replace_uses(out, graph.constant(value, out.name))
        graph.remove_node(node)


QUANTIZE = pattern("QuantizeLinear", dtype=None)
RULES = (Rule("qlinear product", QUANTIZE, _fuse_product),
         Rule("batchnorm into the requantization", QUANTIZE, _fold_batchnorm),
         Rule("quantized add", QUANTIZE, _fuse_add),
         Rule("quantized data movement", QUANTIZE, _fuse_mover))


def fuse_qdq(graph: Graph) -> Graph:
    if not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.nodes):
        return graph
    apply_rules(graph, RULES)
    graph = eliminate_dead_code(graph)
    _fold_constant_dequantize(graph)
    return eliminate_dead_code(graph)
