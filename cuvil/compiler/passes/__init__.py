"""Graph rewrites between the frontend and codegen, each in its own module."""

from __future__ import annotations

from cuvil.compiler.ir import Graph
from cuvil.compiler.passes.eliminate_dead_code import eliminate_dead_code
from cuvil.compiler.passes.fold_batchnorm import fold_batchnorm
from cuvil.compiler.passes.fuse_activation import fuse_activation
from cuvil.compiler.passes.fuse_gelu import fuse_gelu
from cuvil.compiler.passes.fuse_matmul_bias import fuse_matmul_bias
from cuvil.compiler.passes.pack_gemm_weights import pack_gemm_weights

#: the pipeline, in order (constant folding runs inside the frontend, which needs constants
#: to type shape inputs)
PIPELINE = (eliminate_dead_code, fold_batchnorm, pack_gemm_weights, fuse_matmul_bias, fuse_gelu,
            fuse_activation)


def run_passes(graph: Graph) -> Graph:
    for p in PIPELINE:
        graph = p(graph)
    return graph
