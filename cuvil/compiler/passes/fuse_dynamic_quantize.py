"""Run dynamically quantized products (onnxruntime's `quantize_dynamic`) as one node each.

`quantize_dynamic` writes every MatMul with a constant B as

    DynamicQuantizeLinear(x) -> q, a_scale, a_zero
    MatMulInteger(q, B, a_zero, b_zero) -> Cast(float) -> Mul(., Mul(a_scale, b_scale))
    [-> Add(., bias)]

(and onnxruntime's contrib DynamicQuantizeMatMul / MatMulIntegerToFloat expand to the same).
Run as written, each step is a pass over memory: the int32 sums, their float copy, the
scaled copy, the biased one. This pass replaces the chain from MatMulInteger to the last Mul
or Add with cuvil's DynamicQuantizeMatMul (ops/dynamic_matmul.py) on x itself, with B packed
for the int8 kernel, b_scale and the bias as per-column float32 constants: the kernel's
epilogue does the rest in registers. The DynamicQuantizeLinear stays for any other reader
(the dead code pass drops it otherwise).

The chain must be the one above: B a constant 2-D int8/uint8 matrix with a constant zero
point per tensor or per column, the zero point of A the DynamicQuantizeLinear's, b_scale a
float32 constant per tensor or per column, the bias a float32 constant per column, and every
intermediate read only by the next step.
"""

from __future__ import annotations

import numpy as np

from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.kernels.int8_gemm import pack_b_int8
from cuvil.compiler.ops.quantize import INT8_PACKED
from cuvil.compiler.passes.rewrite import const_operand, sole_reader

__all__ = ["fuse_dynamic_quantize"]

FLOAT = 1  # onnx.TensorProto.FLOAT


def _sole(graph: Graph, v: Value, op_type: str) -> Node | None:
    """v's only reader when it is a default-domain `op_type` node."""
    if not v.users:
        return None
    reader = v.users[0]
    if reader.op_type != op_type or reader.domain or not sole_reader(graph, v, reader):
        return None
    return reader


def _other(node: Node, v: Value) -> Value | None:
    """The other input of a binary node, one of whose inputs is v."""
    a, b = node.input(0), node.input(1)
    if len(node.inputs) != 2 or a is None or b is None:
        return None
    return b if a is v else a if b is v else None


def _per_column(v: Value | None, n: int) -> np.ndarray | None:
    """A float32 constant per tensor or per column (shape (), (1,), (N,), (1, N)) as N floats."""
    c = const_operand(v)
    if c is None or c.dtype != np.float32 or c.size not in (1, n) \
            or (c.ndim > 1 and c.shape[:-1] != (1,) * (c.ndim - 1)):
        return None
    return np.ascontiguousarray(np.broadcast_to(c.reshape(-1), (n,)), np.float32)


def _b_scale(mul: Node, dql: Node, n: int) -> np.ndarray | None:
    """b_scale per column, when `mul` is Mul(a_scale, b_scale) on the DynamicQuantizeLinear's
    scale."""
    if mul.op_type != "Mul" or mul.domain:
        return None
    return _per_column(_other(mul, dql.outputs[1]), n)


def _fuse(graph: Graph, mmi: Node) -> bool:
    a, w_val = mmi.input(0), mmi.input(1)
    dql = a.producer if a is not None else None
    if (dql is None or dql.op_type != "DynamicQuantizeLinear" or dql.domain or w_val is None
            or mmi.input(2) is not dql.outputs[2] or len(dql.outputs) != 3):
        return False
    x, w = dql.inputs[0], const_operand(w_val)
    if x is None or x.type.dtype.name != "float32" or x.type.rank < 2 or w is None \
            or w.ndim != 2 or w.dtype not in (np.int8, np.uint8):
        return False
    n = int(w.shape[1])
    b_zero = mmi.input(3)
    zero = const_operand(b_zero) if b_zero is not None else np.zeros((), w.dtype)
    if zero is None or zero.size not in (1, n):
        return False
    acc = mmi.outputs[0]
    cast = _sole(graph, acc, "Cast")
    if cast is None or int(cast.attrs.get("to", 0)) != FLOAT:
        return False
    mul = _sole(graph, cast.outputs[0], "Mul")
    scale_in = _other(mul, cast.outputs[0]) if mul is not None else None
    if mul is None or scale_in is None or scale_in.producer is None \
            or tuple(mul.outputs[0].type.shape) != tuple(acc.type.shape):
        return False
    scale = _b_scale(scale_in.producer, dql, n)
    if scale is None:
        return False
    last, bias = mul, None
    add = _sole(graph, mul.outputs[0], "Add")
    if add is not None and tuple(add.outputs[0].type.shape) == tuple(acc.type.shape):
        bias = _per_column(_other(add, mul.outputs[0]), n)
        if bias is not None:
            last = add
    packed = pack_b_int8(w, zero)
    inputs: list[Value | None] = [x, graph.constant(packed.data, f"{w_val.name}_int8_panels"),
              graph.constant(scale, f"{w_val.name}_scale")]
    if bias is not None:
        inputs.append(graph.constant(bias, f"{w_val.name}_bias"))
    fused = Node("DynamicQuantizeMatMul", inputs, [],
                 {INT8_PACKED: [w.dtype.name, int(packed.row_sums), *w.shape]},
                 name=mmi.name, domain="cuvil", opset=1)
    graph.replace_node(last, fused)
    graph.remove_nodes([n for n in (mul, cast, mmi) if n is not last])
    return True


def fuse_dynamic_quantize(graph: Graph) -> Graph:
    for node in list(graph.nodes):
        if node.op_type == "MatMulInteger" and not node.domain and INT8_PACKED not in node.attrs:
            _fuse(graph, node)
    return graph
