"""Winograd convolutions (ops/_conv_winograd.py) against onnxruntime: odd image sizes (partial
tiles), pads 0 / 1 / asymmetric / auto_pad, bias or none, batch 2 and a symbolic batch,
images split into several blocks and tile rows wider than a vector, a fused residual and
Relu; and that these convolutions do take the Winograd path (the compiled graph says so).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from oracle import assert_matches_ort, make_model

import cuvil
from cuvil.compiler.frontend import import_model
from cuvil.compiler.ops._conv_winograd import WINOGRAD_TILE
from cuvil.compiler.passes import run_passes

#: F(4x4, 3x3) rounds more than a direct sum (about 1e-5 of the output's range here)
TOL = {"rtol": 1e-4, "atol": 2e-4}

#: (input channels, output channels, height, width, Conv attributes, bias)
LAYERS = [
    (17, 20, 19, 23, {"pads": [1, 1, 1, 1]}, True),
    (16, 16, 21, 18, {}, False),  # no padding
    (16, 24, 17, 22, {"pads": [2, 0, 1, 3]}, True),  # asymmetric
    (16, 16, 18, 15, {"auto_pad": "SAME_UPPER"}, False),
    (20, 16, 16, 17, {"auto_pad": "SAME_LOWER", "kernel_shape": [3, 3]}, True),
    (16, 16, 14, 70, {"pads": [1, 1, 1, 1]}, True),  # 18 tiles a row: more than one vector
    (64, 32, 61, 58, {"pads": [1, 1, 1, 1]}, True),  # several blocks, the last one short
]


def _weights(rng: np.random.Generator, m: int, c: int) -> np.ndarray:
    return (rng.standard_normal((m, c, 3, 3)) * np.sqrt(2 / (9 * c))).astype(np.float32)


def _layers_model(batch: int | str):
    rng = np.random.default_rng(0)
    nodes, inputs, outputs, consts = [], {}, {}, {}
    for i, (c, m, h, w, attrs, bias) in enumerate(LAYERS):
        consts[f"w{i}"] = _weights(rng, m, c)
        ins = [f"x{i}", f"w{i}"]
        if bias:
            consts[f"b{i}"] = rng.standard_normal(m).astype(np.float32)
            ins.append(f"b{i}")
        nodes.append(helper.make_node("Conv", ins, [f"y{i}"], **attrs))
        inputs[f"x{i}"] = (np.float32, [batch, c, h, w])
        outputs[f"y{i}"] = np.float32
    return make_model(nodes, inputs, outputs, consts)


def _feeds(model, batch: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in model.graph.input:
        dims = [d.dim_value or batch for d in v.type.tensor_type.shape.dim]
        feeds[v.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _winograd_convs(model) -> list[bool]:
    graph = run_passes(import_model(model, None, "m"))
    return [WINOGRAD_TILE in n.attrs for n in graph.nodes if n.op_type == "Conv"]


@pytest.mark.parametrize("batch", [1, 2])
def test_layers_match_onnxruntime(batch: int) -> None:
    model = _layers_model(batch)
    assert _winograd_convs(model) == [True] * len(LAYERS)
    assert_matches_ort(model, _feeds(model, batch), **TOL)


def test_symbolic_batch() -> None:
    model = _layers_model("n")
    assert _winograd_convs(model) == [True] * len(LAYERS)
    compiled = cuvil.compile(model)
    for batch in (1, 3):
        assert_matches_ort(model, _feeds(model, batch, seed=batch), compiled=compiled, **TOL)


def test_fused_residual_and_relu() -> None:
    """Conv -> Add(skip) -> Relu, as in a ResNet block: the epilogue runs after the output
    transform (the product alone is not the conv's output)."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = make_model(nodes, {"x": (np.float32, ["n", 32, 23, 29])}, {"y": np.float32},
                       {"w": _weights(rng, 32, 32), "b": rng.standard_normal(32).astype(np.float32)})
    graph = run_passes(import_model(model, None, "m"))
    (conv,) = graph.nodes
    assert conv.attrs[WINOGRAD_TILE] == 4 and conv.attrs["cuvil.fused_activation"] == "Relu"
    assert conv.input(3) is not None  # the residual
    compiled = cuvil.compile(model)
    for batch in (1, 2):
        assert_matches_ort(model, _feeds(model, batch), compiled=compiled, **TOL)


@pytest.mark.parametrize("case", [
    {"c": 3, "attrs": {"pads": [1, 1, 1, 1]}},  # too few channels to pay
    {"c": 32, "attrs": {"pads": [1, 1, 1, 1], "strides": [2, 2]}},
    {"c": 32, "attrs": {"pads": [2, 2, 2, 2], "dilations": [2, 2]}},
    {"c": 32, "attrs": {"pads": [1, 1, 1, 1], "group": 2}},
    {"c": 32, "size": 7, "attrs": {"pads": [1, 1, 1, 1]}},  # 4 tiles
])
def test_other_convs_keep_im2col(case: dict) -> None:
    c, size, attrs = case["c"], case.get("size", 20), case["attrs"]
    rng = np.random.default_rng(3)
    w = _weights(rng, 32, c // attrs.get("group", 1))
    model = make_model([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)],
                       {"x": (np.float32, [1, c, size, size])}, {"y": np.float32}, {"w": w})
    assert _winograd_convs(model) == [False]
