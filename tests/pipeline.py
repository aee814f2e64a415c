"""The compiler's pipeline as tests see it: the profiler's op label of each node a model
compiles to, and the model compiled with one pass left out (what that pass changes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx

import cuvil
import cuvil.compiler.passes as passes
from cuvil.compiler.driver import _node_profile
from cuvil.compiler.frontend import import_model
from cuvil.compiler.ir import Graph
from cuvil.compiler.passes import run_passes


def op_labels(model: onnx.ModelProto) -> list[str]:
    """"Conv+Relu", "Fused(Mul+Add)"... for the nodes the passes leave, in order."""
    return [_node_profile(n)["op"] for n in run_passes(import_model(model)).nodes]


def compile_without(model: onnx.ModelProto, left_out: Callable[[Graph], Graph]) -> Any:
    """`cuvil.compile(model)` with the pass `left_out` taken out of the pipeline."""
    saved = passes.PIPELINE
    passes.PIPELINE = tuple(p for p in saved if p is not left_out)
    try:
        return cuvil.compile(model)
    finally:
        passes.PIPELINE = saved
