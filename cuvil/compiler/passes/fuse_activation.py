"""Fold a Relu into the float32 Conv or Gemm before it, applied in the GEMM kernel's epilogue
while the results are still in registers (one pass over memory instead of two)."""

from __future__ import annotations

from cuvil.compiler.ir import Graph
from cuvil.compiler.ops.gemm import FUSED_ACTIVATION


def _fusable(node) -> bool:
    if node.op_type == "Conv":
        return True
    # Gemm runs on the kernel (where the epilogue lives) with plain operands and alpha 1;
    # pack_gemm_weights has already turned constant transposed weights into plain ones
    return (node.op_type == "Gemm" and not node.attrs.get("transA", 0)
            and not node.attrs.get("transB", 0) and float(node.attrs.get("alpha", 1.0)) == 1.0)


def fuse_activation(graph: Graph) -> Graph:
    for relu in list(graph.nodes):
        if relu.op_type != "Relu" or relu.domain or relu.inputs[0] is None:
            continue
        x = relu.inputs[0]
        producer = x.producer
        if (producer is None or producer not in graph.nodes or not _fusable(producer)
                or FUSED_ACTIVATION in producer.attrs or x.type.dtype.name != "float32"
                or len(x.users) != 1 or x in graph.outputs):
            continue
        graph.absorb(producer, relu)
        producer.attrs = {**producer.attrs, FUSED_ACTIVATION: "Relu"}
    return graph
