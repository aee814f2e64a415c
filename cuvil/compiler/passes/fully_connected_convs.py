"""Convolutions of 1x1 maps by 1x1 kernels, [N, C, 1, 1] -> [N, M, 1, 1] (the fully connected
layers of squeeze-excite blocks), as Gemm: one row per image, which at batch 1 is the
matrix-vector kernel's case (kernels/gemv.py, streaming the weight once), where the
conv lowering would run a product W[M, C] @ x[C, 1] of a single column per image.

Runs after fuse_epilogue, so the conv's fused activation moves to the Gemm; convs with a fused
residual stay convs. pack_gemm_weights leaves these convs' weights in ONNX's layout
(`is_fully_connected`): this pass stores W^T [C, M] as `pack_b` panels for the Gemm. The
Flatten before and the Reshape after are views: they cost no code.
"""

from __future__ import annotations

import numpy as np

from cuvil.compiler.ir import Graph, Node, TensorType, Value
from cuvil.compiler.kernels.gemm import pack_b
from cuvil.compiler.ops.gemm import (
    ACTIVATION_PARAMS,
    FUSED_ACTIVATION,
    PACKED_WEIGHTS,
    RESIDUAL_SLOT,
)

#: opsets the new nodes are read at (their inputs and attributes are spelled as these have them)
FLATTEN_OPSET, GEMM_OPSET, RESHAPE_OPSET = 13, 13, 14


def is_fully_connected(conv: Node) -> bool:
    """A float32 Conv with one group, a constant 1x1 kernel and no padding over a 1x1 map
    (strides and dilations then change nothing: the output is 1x1 too)."""
    x, w = conv.input(0), conv.input(1)
    if conv.op_type != "Conv" or conv.domain or x is None or w is None or w.const is None:
        return False
    spatial = x.type.shape[2:]
    return (x.type.rank >= 3 and all(isinstance(d, int) and d == 1 for d in spatial)
            and all(d == 1 for d in w.const.shape[2:]) and int(conv.attrs.get("group", 1)) == 1
            and not any(conv.attrs.get("pads", ()))
            and w.const.dtype == np.float32 and conv.outputs[0].type.dtype == np.float32)


def fully_connected_convs(graph: Graph) -> Graph:
    for conv in list(graph.nodes):
        if is_fully_connected(conv) and conv.input(RESIDUAL_SLOT) is None:
            _as_gemm(graph, conv)
    return graph


def _as_gemm(graph: Graph, conv: Node) -> None:
    x, w, bias = conv.inputs[0], conv.inputs[1], conv.input(2)
    assert x is not None and w is not None and w.const is not None
    out = conv.outputs[0]
    n, c = x.type.shape[:2]
    m = w.const.shape[0]
    rows = graph.value(f"{x.name}_rows", TensorType(x.type.dtype, (n, c)))
    graph.insert_before(conv, Node("Flatten", [x], [rows], {"axis": 1},
                                   name=f"{conv.name}_rows", opset=FLATTEN_OPSET))
    panels = graph.constant(pack_b(np.ascontiguousarray(w.const.reshape(m, c).T)),
                            f"{w.name}_panels")
    product = graph.value(f"{out.name}_rows", TensorType(out.type.dtype, (n, m)))
    attrs = {key: conv.attrs[key] for key in (FUSED_ACTIVATION, ACTIVATION_PARAMS)
             if key in conv.attrs}
    operands: list[Value | None] = [rows, panels, bias] if bias is not None else [rows, panels]
    graph.insert_before(conv, Node("Gemm", operands,
                                   [product], {**attrs, PACKED_WEIGHTS: 1}, name=conv.name,
                                   opset=GEMM_OPSET))
    shape = graph.constant(np.array([0, m] + [1] * (x.type.rank - 2), np.int64),
                           f"{out.name}_shape")
    graph.replace_node(conv, Node("Reshape", [product, shape], [], {},
                                  name=f"{conv.name}_maps", opset=RESHAPE_OPSET))
