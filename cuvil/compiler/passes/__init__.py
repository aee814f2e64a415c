"""Graph rewrites between the frontend and codegen, each in its own module."""

from __future__ import annotations

from cuvil.compiler.ir import Graph
from cuvil.compiler.passes.eliminate_dead_code import eliminate_dead_code
from cuvil.compiler.passes.fold_batchnorm import fold_batchnorm
from cuvil.compiler.passes.fuse_activation import fuse_activation
from cuvil.compiler.passes.pack_gemm_weights import pack_gemm_weights
from cuvil.compiler.passes.rewrite_bodies import rewrite_bodies

#: the pipeline, in order (constant folding runs inside the frontend, which needs constants
#: to type shape inputs)
PIPELINE = (eliminate_dead_code, fold_batchnorm, pack_gemm_weights, fuse_activation)

#: passes of the pipeline that If/Loop/Scan bodies skip, and why; every other pass runs on
#: each body too (`SUBGRAPH_PIPELINE`)
TOP_LEVEL_ONLY = {
    fold_batchnorm: "it follows producers, which for a body may lie outside it",
    fuse_activation: "not yet tested on bodies (their Conv and Gemm lowerings run unfused)",
}
SUBGRAPH_PIPELINE = tuple(p for p in PIPELINE if p not in TOP_LEVEL_ONLY)


def run_subgraph_passes(graph: Graph) -> Graph:
    """`SUBGRAPH_PIPELINE` over every If/Loop/Scan body in `graph`, innermost first."""
    return rewrite_bodies(graph, SUBGRAPH_PIPELINE)


def run_passes(graph: Graph) -> Graph:
    graph = run_subgraph_passes(graph)
    for p in PIPELINE:
        graph = p(graph)
    return graph
