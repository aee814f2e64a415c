"""Fold an inference BatchNormalization into the Conv, Gemm or MatMul with constant weights
that feeds it (and nothing else), so the layer's weights and bias carry the normalization.

BatchNormalization is y = x * a + s per channel, with a = scale / sqrt(var + eps) and
s = B - mean * a. A layer whose output channel c is a linear function of its weights row c
(plus bias c) absorbs it: weights row c times a[c], bias c becomes bias[c] * a[c] + s[c].
The folded constants are computed in float64 and stored in the weights' dtype.

A Mul or Add of a constant with one value per output channel (or one for all) is the same
affine map with s = 0 or a = 1: exporters write a normalization's scale and shift that way
(onnx's light Inception-v2: Conv -> BatchNormalization -> Mul -> Add -> Relu), and folded,
the Relu after them fuses into the convolution's epilogue.

A BatchNormalization that no producer absorbs (after a Concat, an Add, a pooling) becomes a
Mul and an Add of per-channel constants, which fuse_elementwise runs in one pass together with
the elementwise ops around them.

Each fold below says how one producer op absorbs (a, s); rewrite rules (passes/rewrite.py)
find the patterns (producer -> BatchNormalization, Mul or Add, the producer's output read by
nothing else) and rewire.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.passes.rewrite import Rule, apply_rules, pattern, producer

__all__ = ["batchnorm_affine", "fold_batchnorm"]


def _const_float(v: Value | None) -> np.ndarray | None:
    if v is None or v.const is None or v.type.dtype.kind != "f":
        return None
    return v.const


def batchnorm_affine(bn: Node, value: Callable[[Value | None], np.ndarray | None] = _const_float
                     ) -> tuple[np.ndarray, np.ndarray] | None:
    """(a, s) of an inference BatchNormalization whose per-channel parameters `value` gives
    (default: float constants; passes/fuse_qdq.py also takes dequantized ones)."""
    if bn.domain or len(bn.outputs) != 1 or len(bn.inputs) != 5:
        return None
    if bn.opset >= 14 and bn.attrs.get("training_mode", 0):
        return None
    if bn.opset < 9 and not bn.attrs.get("spatial", 1):
        return None  # per-activation parameters do not map onto output channels
    params = [value(v) for v in bn.inputs[1:5]]
    if any(p is None or p.ndim != 1 for p in params):
        return None
    scale, bias, mean, var = (np.asarray(p, dtype=np.float64) for p in params)
    eps = float(bn.attrs.get("epsilon", 1e-5))
    a = scale / np.sqrt(var + eps)
    return a, bias - mean * a


def _replace_input(graph: Graph, node: Node, i: int, array: np.ndarray, name: str) -> None:
    """Make input i of `node` a new constant (the old one may be shared with other nodes)."""
    graph.set_input(node, i, graph.constant(array, name))


def _fold_into_conv(graph: Graph, conv: Node, a: np.ndarray, s: np.ndarray) -> Node | None:
    w = _const_float(conv.input(1))
    b = conv.input(2)
    if w is None or w.shape[0] != a.shape[0] or (b is not None and _const_float(b) is None):
        return None
    bias = np.zeros(a.shape) if b is None else np.asarray(b.const, dtype=np.float64)
    w_name = conv.inputs[1].name  # type: ignore[union-attr]
    scaled = w.astype(np.float64) * a.reshape((-1,) + (1,) * (w.ndim - 1))
    _replace_input(graph, conv, 1, scaled.astype(w.dtype), f"{w_name}_bn")
    _replace_input(graph, conv, 2, (bias * a + s).astype(w.dtype), f"{w_name}_bn_bias")
    return conv


def _fold_into_gemm(graph: Graph, gemm: Node, a: np.ndarray, s: np.ndarray) -> Node | None:
    w = _const_float(gemm.input(1))
    c = gemm.input(2)
    if w is None or w.ndim != 2 or (c is not None and _const_float(c) is None):
        return None
    trans_b = bool(gemm.attrs.get("transB", 0))
    n = w.shape[0] if trans_b else w.shape[1]
    if n != a.shape[0]:
        return None
    beta = float(gemm.attrs.get("beta", 1.0))
    if c is None or beta == 0.0:
        c_arr = np.zeros(a.shape)
    else:
        c_arr = beta * np.asarray(c.const, dtype=np.float64)
        if c_arr.ndim > 2 or np.broadcast_shapes(c_arr.shape, a.shape)[-1] != n:
            return None
    w_name = gemm.inputs[1].name  # type: ignore[union-attr]
    scaled = w.astype(np.float64) * (a[:, None] if trans_b else a[None, :])
    _replace_input(graph, gemm, 1, scaled.astype(w.dtype), f"{w_name}_bn")
    _replace_input(graph, gemm, 2, (c_arr * a + s).astype(w.dtype), f"{w_name}_bn_bias")
    gemm.attrs = {**gemm.attrs, "beta": 1.0}
    return gemm


def _fold_into_matmul(graph: Graph, mm: Node, a: np.ndarray, s: np.ndarray) -> Node | None:
    """[M, K] @ [K, N] + BatchNormalization -> Gemm with scaled weights and a bias."""
    x, w = mm.input(0), _const_float(mm.input(1))
    if x is None or x.type.rank != 2 or w is None or w.ndim != 2 or w.shape[1] != a.shape[0]:
        return None
    gemm = Node("Gemm", [x, mm.inputs[1]], [], {}, name=mm.name, opset=mm.opset)
    graph.replace_node(mm, gemm)
    return _fold_into_gemm(graph, gemm, a, s)


#: producer op type -> fold: absorb (a, s) into the producer (returning the node that now
#: computes the normalized output), or leave the graph unchanged and return None
FOLDS: dict[str, Callable[[Graph, Node, np.ndarray, np.ndarray], Node | None]] = {
    "Conv": _fold_into_conv,
    "Gemm": _fold_into_gemm,
    "MatMul": _fold_into_matmul,
}


def _fold(graph: Graph, bn: Node) -> Node | None:
    x = bn.inputs[0]
    prod = producer(graph, x, FOLDABLE, bn)
    if x is None or prod is None or x.type.dtype != bn.outputs[0].type.dtype:
        return None
    affine = batchnorm_affine(bn)
    folded = FOLDS[prod.op_type](graph, prod, *affine) if affine is not None else None
    if folded is None:
        return None
    graph.absorb(folded, bn)
    return folded


def _channels(prod: Node) -> tuple[int, int] | None:
    """(axis, count) of the channels of the producer's output that its weights rows make."""
    out = prod.outputs[0].type
    w = prod.input(1)
    if w is None or w.const is None or out.rank < 2:
        return None
    if prod.op_type == "Conv":
        return 1, int(w.const.shape[0])
    if prod.op_type == "Gemm":
        return 1, int(w.const.shape[0] if prod.attrs.get("transB", 0) else w.const.shape[1])
    return out.rank - 1, int(w.const.shape[-1])


def _per_channel(c: np.ndarray, prod: Node) -> np.ndarray | None:
    """The constant operand c of a Mul or Add after `prod` as one float64 per output channel,
    when broadcasting it against the output varies along the channel axis only and leaves
    the output's shape as it is."""
    found = _channels(prod)
    rank = prod.outputs[0].type.rank
    if found is None or c.ndim > rank or c.dtype != prod.outputs[0].type.dtype \
            or not np.all(np.isfinite(c)):
        return None
    axis, count = found
    shape = (1,) * (rank - c.ndim) + c.shape
    if any(d != 1 for i, d in enumerate(shape) if i != axis) or shape[axis] not in (1, count):
        return None
    return np.broadcast_to(c.astype(np.float64).reshape(-1), (count,))


def _fold_scale_or_shift(graph: Graph, node: Node) -> Node | None:
    """Mul or Add of a per-channel constant (`_per_channel`) after a foldable producer."""
    if len(node.inputs) != 2:
        return None
    first, second = node.inputs
    for x, c in ((first, second), (second, first)):
        prod = producer(graph, x, FOLDABLE, node)
        if prod is None or c is None or c.const is None or x is c:
            continue
        if x.type != node.outputs[0].type:  # type: ignore[union-attr]
            return None
        values = _per_channel(c.const, prod)
        if values is None:
            return None
        ones, zeros = np.ones(values.shape), np.zeros(values.shape)
        affine = (values, zeros) if node.op_type == "Mul" else (ones, values)
        folded = FOLDS[prod.op_type](graph, prod, *affine)
        if folded is None:
            return None
        graph.absorb(folded, node)
        return folded
    return None


def _as_scale_shift(graph: Graph, bn: Node) -> Node | None:
    """A BatchNormalization no producer absorbs, as a Mul and an Add of per-channel
    constants: fuse_elementwise then runs them in one pass with the elementwise ops around
    them (DenseNet normalizes each concatenation: Concat -> BatchNormalization -> Mul -> Add
    -> Relu, two passes over the tensor as BatchNormalization and Fused(Mul+Add+Relu))."""
    x, y = bn.inputs[0], bn.outputs[0]
    affine = batchnorm_affine(bn)
    # float32 and float64 (float16 constants would round a and s: its lowering computes
    # in float32)
    if affine is None or x is None or x.type != y.type or x.type.dtype.kind != "f" \
            or x.type.dtype.itemsize < 4 or x.type.rank < 2:
        return None
    shape = (-1,) + (1,) * (x.type.rank - 2)  # along axis 1, the channels
    name = bn.name or y.name
    scale, shift = (graph.constant(c.reshape(shape).astype(x.type.dtype), f"{name}_{what}")
                    for c, what in zip(affine, ("scale", "shift")))
    scaled = graph.value(f"{name}_scaled", x.type)
    add = graph.replace_node(bn, Node("Add", [scaled, shift], [], name=f"{name}_shift",
                                      opset=bn.opset))
    graph.insert_before(add, Node("Mul", [x, scale], [scaled], name=f"{name}_scale",
                                  opset=bn.opset))
    return add


FOLDABLE = pattern(*FOLDS, dtype=None)
RULES = (Rule("batchnorm", pattern("BatchNormalization", dtype=None), _fold),
         Rule("scale-shift", pattern("Mul", "Add", dtype=None), _fold_scale_or_shift),
         Rule("batchnorm-as-scale-shift", pattern("BatchNormalization", dtype=None),
              _as_scale_shift))


def fold_batchnorm(graph: Graph) -> Graph:
    return apply_rules(graph, RULES)
