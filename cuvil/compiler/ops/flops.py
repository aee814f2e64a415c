"""Floating-point operations of a node, counted from its IR shapes for the profiler.

Only the ops whose time is dominated by multiply-adds are counted (two operations each, the
convention of papers and of vendors' peak figures): convolutions, matrix products (the
integer ones too), Einsum and the recurrent cells. Every other op counts 0 and the profiler
shows no GFLOP/s for it: a count of "one per element" would say little about an op bound by
memory traffic.
Symbolic dims stay sympy expressions; the signature carries them as Python expressions
that the runtime evaluates with each call's dims.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy

from cuvil.compiler.ir import Dim, Node, numel, simplify_dim


def _shape(node: Node, index: int) -> tuple[Dim, ...]:
    value = node.inputs[index]
    assert value is not None, f"{node.describe()}: input {index} is required"  # by the op's infer
    return value.type.shape


#: ops/gemm.py's BF16_WEIGHTS: the shape of a weight stored as packed bf16
_BF16_WEIGHTS = "cuvil.bf16_weights"


def _conv(node: Node) -> Dim:
    # each output element sums C/group x kernel products: numel(W) / M of them (counted as a
    # direct convolution also when it runs as a Winograd one)
    w = tuple(node.attrs.get(_BF16_WEIGHTS, ())) or _shape(node, 1)
    return numel(node.outputs[0].type.shape) * numel(w[1:])


def _integer_conv(node: Node) -> Dim:
    # ConvInteger, QLinearConv: as _conv, with the weight's ONNX shape also once it is packed
    from cuvil.compiler.ops.quantize import INT8_PACKED, weight_slot

    packed = node.attrs.get(INT8_PACKED)
    w = tuple(packed[2:]) if packed else _shape(node, weight_slot(node))
    return numel(node.outputs[0].type.shape) * numel(w[1:])


def _conv_transpose(node: Node) -> Dim:
    # each input element scatters into M/group x kernel outputs: numel(W) / C of them
    w = _shape(node, 1)
    return numel(_shape(node, 0)) * numel(w[1:])


def _gemm(node: Node) -> Dim:
    a = _shape(node, 0)
    k = a[0] if node.attrs.get("transA", 0) else a[1]
    return numel(node.outputs[0].type.shape) * k


def _matmul(node: Node) -> Dim:
    return numel(node.outputs[0].type.shape) * _shape(node, 0)[-1]


def _recurrent(node: Node) -> Dim:
    # per step and batch row: every gate's input weights (W) and recurrent weights (R)
    # R may be stored in padded panels (recurrent.py packs it): count dirs x gates x hidden
    # rows of `hidden` weights, the rows read from W's size (input x those rows, either layout)
    x = _shape(node, 0)
    w, r = _shape(node, 1), _shape(node, 2)
    hidden = node.attrs.get("hidden_size", r[-1])
    rows = numel(w) // x[2]
    return x[0] * x[1] * (numel(w) + rows * hidden)


def _einsum(node: Node) -> Dim:
    from cuvil.compiler.ops.einsum import parse_equation

    shapes = [v.type.shape for v in node.inputs if v is not None]
    eq = parse_equation(node, [len(s) for s in shapes])
    size: dict[str, Dim] = {}
    for term, shape in zip(eq.inputs, shapes):
        for label, d in zip(term, shape):
            if size.get(label, 1) == 1:  # a dim of 1 broadcasts against the others
                size[label] = d
    return numel(node.outputs[0].type.shape) * numel(size[lab] for lab in eq.summed)


_MULTIPLY_ADDS: dict[str, Callable[[Node], Dim]] = {
    "Conv": _conv, "DeformConv": _conv, "ConvTranspose": _conv_transpose,
    "Gemm": _gemm, "MatMul": _matmul, "Einsum": _einsum,
    "LSTM": _recurrent, "GRU": _recurrent, "RNN": _recurrent,
}


def _attention(node: Node) -> Dim:
    # ops/attention.py: scores [..., s, t] of d terms each, then [..., s, dv] of t terms each
    out, d, t = node.outputs[0].type.shape, _shape(node, 0)[-1], _shape(node, 1)[-1]
    return numel(out[:-1]) * t * d + numel(out) * t


#: products of ops keyed by domain too: integer products (A is input 0 in each; the weight may
#: be a packed blob), their integer multiply-adds counted as float ones, and cuvil's attention
_DOMAIN_PRODUCTS: dict[tuple[str, str], Callable[[Node], Dim]] = {
    ("", "MatMulInteger"): _matmul, ("", "QLinearMatMul"): _matmul,
    ("", "ConvInteger"): _integer_conv, ("", "QLinearConv"): _integer_conv,
    ("cuvil", "DynamicQuantizeMatMul"): _matmul,
    ("cuvil", "Attention"): _attention,
}


def node_flops(node: Node) -> Dim:
    """2 x the node's multiply-adds (an int, or a sympy expression over symbolic dims); 0 for
    ops that are not counted."""
    count = _MULTIPLY_ADDS.get(node.op_type) if not node.domain else None
    count = count or _DOMAIN_PRODUCTS.get((node.domain, node.op_type))
    if count is None:
        return 0
    return simplify_dim(2 * sympy.sympify(count(node)))


__all__ = ["node_flops"]
