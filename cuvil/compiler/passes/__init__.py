"""Graph rewrites between the frontend and codegen, each in its own module.

A pass edits the graph only through `Graph`'s editing methods (`set_input`, `replace_uses`,
`replace_node`, `absorb`, `remove_nodes`...), which keep every value's users and producer
exact. With ``CUVIL_VERIFY_IR=1`` (the test suite sets it) `run_passes` checks the IR's
invariants (`Graph.verify`) on the graph it is given and after every pass.
"""

from __future__ import annotations

import os

from cuvil.compiler.ir import Graph, IRError
from cuvil.compiler.passes.bf16_weights import bf16_weights
from cuvil.compiler.passes.einsum_as_matmul import einsum_as_matmul
from cuvil.compiler.passes.eliminate_dead_code import eliminate_dead_code
from cuvil.compiler.passes.fold_batchnorm import fold_batchnorm
from cuvil.compiler.passes.fully_connected_convs import fully_connected_convs
from cuvil.compiler.passes.fuse_attention import fuse_attention
from cuvil.compiler.passes.fuse_dynamic_quantize import fuse_dynamic_quantize
from cuvil.compiler.passes.fuse_elementwise import fuse_elementwise
from cuvil.compiler.passes.fuse_epilogue import fuse_epilogue
from cuvil.compiler.passes.fuse_qdq import fuse_qdq
from cuvil.compiler.passes.pack_gemm_weights import pack_gemm_weights
from cuvil.compiler.passes.pack_int8_weights import pack_int8_weights
from cuvil.compiler.passes.quantized_lookup import quantized_lookup
from cuvil.compiler.passes.rewrite_bodies import rewrite_bodies
from cuvil.compiler.passes.widen_float16 import widen_float16
from cuvil.compiler.passes.winograd_weights import winograd_weights
from cuvil.errors import ConfigError

#: the pipeline, in order (constant folding runs inside the frontend, which needs constants
#: to type shape inputs)
PIPELINE = (quantized_lookup, fuse_qdq, fuse_dynamic_quantize, pack_int8_weights,
            eliminate_dead_code, widen_float16, fold_batchnorm, einsum_as_matmul, fuse_attention,
            pack_gemm_weights,
            fuse_epilogue, fully_connected_convs, fuse_elementwise, winograd_weights,
            bf16_weights)

#: passes of the pipeline that If/Loop/Scan bodies skip, and why; every other pass runs on
#: each body too (`SUBGRAPH_PIPELINE`)
TOP_LEVEL_ONLY = {
    quantized_lookup: "it follows producers, which for a body may lie outside it",
    fuse_qdq: "it follows producers, which for a body may lie outside it",
    fuse_dynamic_quantize: "it follows producers, which for a body may lie outside it",
    widen_float16: "not yet tested on bodies (their float16 ops run as float16)",
    fold_batchnorm: "it follows producers, which for a body may lie outside it",
    fuse_attention: "it follows producers, which for a body may lie outside it",
    fuse_epilogue: "not yet tested on bodies (their Conv and Gemm lowerings run unfused)",
    fully_connected_convs: "it follows fuse_epilogue (bodies' 1x1-map convs stay convs)",
    fuse_elementwise: "it follows fuse_epilogue (bodies' elementwise ops run one by one)",
    winograd_weights: "its convs' weights are derived by the model's run, which bodies lack",
    bf16_weights: "the model's precision is the top-level graph's",
}
SUBGRAPH_PIPELINE = tuple(p for p in PIPELINE if p not in TOP_LEVEL_ONLY)


def run_subgraph_passes(graph: Graph) -> Graph:
    """`SUBGRAPH_PIPELINE` over every If/Loop/Scan body in `graph`, innermost first."""
    return rewrite_bodies(graph, SUBGRAPH_PIPELINE)


#: environment variable switching IR verification on (any value but "" and "0")
VERIFY_ENV = "CUVIL_VERIFY_IR"


def verify_enabled() -> bool:
    return os.environ.get(VERIFY_ENV, "") not in ("", "0")


#: the stages `run_passes` can stop after (`cuvil inspect --ir --after`): the frontend's graph,
#: the passes over If/Loop/Scan bodies, then each pass of the pipeline
STAGES = ("frontend", "bodies", *(p.__name__ for p in PIPELINE))


def run_passes(graph: Graph, verify: bool | None = None, until: str | None = None) -> Graph:
    """Run the pipeline, or its stages up to `until` (one of STAGES); `verify` (default:
    `CUVIL_VERIFY_IR`) checks the graph before the first pass (the frontend's output) and
    after each."""
    if until is not None and until not in STAGES:
        raise ConfigError(f"no pass named {until!r}; the stages are {', '.join(STAGES)}")
    check = verify_enabled() if verify is None else verify
    if check:
        _verify(graph, "the frontend")
    if until == "frontend":
        return graph
    graph = run_subgraph_passes(graph)
    if check:
        _verify(graph, "the passes over If/Loop/Scan bodies")
    if until == "bodies":
        return graph
    for p in PIPELINE:
        graph = p(graph)
        if check:
            _verify(graph, f"pass {p.__name__}")
        if until == p.__name__:
            break
    return graph


def _verify(graph: Graph, after: str) -> None:
    try:
        graph.verify()
    except IRError as exc:
        raise IRError(f"after {after}: {exc}") from exc
