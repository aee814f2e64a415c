"""epilogue fusion of a Relu: the graph after the pass, and the fused model's numbers against
onnxruntime on the unfused model."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from oracle import assert_matches_ort, make_model

from cuvil.compiler.frontend import import_model
from cuvil.compiler.ops.gemm import ACTIVATION_PARAMS, FUSED_ACTIVATION
from cuvil.compiler.passes import run_passes

rng = np.random.default_rng(7)


def conv_relu(extra_user: bool = False, relu_is_output: bool = False):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"])]
    outputs = {"r": np.float32}
    if extra_user:
        nodes.append(helper.make_node("Neg", ["c"], ["n"]))
        outputs["n"] = np.float32
    if relu_is_output:
        outputs["c"] = np.float32
    return make_model(nodes, {"x": (np.float32, ["batch", 3, 9, 7])}, outputs,
                      {"w": rng.standard_normal((5, 3, 3, 3)).astype(np.float32),
                       "b": rng.standard_normal(5).astype(np.float32)})


def gemm_relu(trans_b: int):
    w = rng.standard_normal((6, 11) if trans_b else (11, 6)).astype(np.float32)
    return make_model([helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=trans_b),
                       helper.make_node("Relu", ["g"], ["r"])],
                      {"x": (np.float32, ["batch", 11])}, {"r": np.float32},
                      {"w": w, "b": rng.standard_normal(6).astype(np.float32)})


def conv_transpose_relu():
    # planes large enough for several tasks and chunks (ops/_conv_transpose.py)
    return make_model([helper.make_node("ConvTranspose", ["x", "w", "b"], ["t"], strides=[2, 2],
                                        pads=[1, 1, 1, 1]),
                       helper.make_node("Relu", ["t"], ["r"])],
                      {"x": (np.float32, ["batch", 6, 19, 23])}, {"r": np.float32},
                      {"w": rng.standard_normal((6, 20, 4, 4)).astype(np.float32),
                       "b": rng.standard_normal(20).astype(np.float32)})


def ops(model) -> list[tuple[str, str | None]]:
    graph = run_passes(import_model(model))
    return [(n.op_type, n.attrs.get(FUSED_ACTIVATION)) for n in graph.nodes]


@pytest.mark.parametrize("model", [conv_relu(), gemm_relu(0), gemm_relu(1),
                                   conv_transpose_relu()],
                         ids=["conv", "gemm", "gemm-transB", "conv-transpose"])
def test_relu_is_fused(model) -> None:
    assert ops(model) == [(model.graph.node[0].op_type, "Relu")]
    batch = 3
    shape = [batch, *[d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:]]]
    feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
    compiled = assert_matches_ort(model, feeds)
    feeds = {"x": rng.standard_normal([1, *shape[1:]]).astype(np.float32)}
    assert_matches_ort(model, feeds, compiled=compiled)


@pytest.mark.parametrize("kwargs", [{"extra_user": True}, {"relu_is_output": True}])
def test_relu_stays_when_its_input_is_needed(kwargs) -> None:
    model = conv_relu(**kwargs)
    assert ops(model)[:2] == [("Conv", None), ("Relu", None)]
    assert_matches_ort(model, {"x": rng.standard_normal((2, 3, 9, 7)).astype(np.float32)})


def test_the_fused_node_produces_the_relus_output() -> None:
    """The pass alone on a built graph: Gemm + Relu + reader -> Gemm{Relu} + reader, the
    Relu's output (a graph output's name) now produced by the Gemm."""
    from irbuild import build, structure

    from cuvil.compiler.passes.fuse_epilogue import fuse_epilogue

    w = rng.standard_normal((11, 6)).astype(np.float32)
    g = build("""
        x: float32[batch, 11]
        g = Gemm(x, w)
        r = Relu(g)
        n = Neg(r)
        return r, n
    """, w=w)
    r = g.outputs[0]
    fuse_epilogue(g)
    g.verify()
    assert structure(g) == [(f"%0 = Gemm(x, const[11, 6]) {{'{ACTIVATION_PARAMS}': (), "
                            f"'{FUSED_ACTIVATION}': 'Relu'}}"),
                            "%1 = Neg(%0)", "return %0, %1"]
    assert r.producer is g.nodes[0] and g.nodes[0].outputs == [r]
