"""fuse_gelu: exact GELU spelled out with Erf becomes one Gelu node (the graph after the pass),
with the numbers of the unfused model in onnxruntime; near misses stay as they are."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper
from oracle import assert_matches_ort, make_model

from cuvil.compiler.frontend import import_model
from cuvil.compiler.passes import run_passes

rng = np.random.default_rng(9)


def gelu_model(spelling: str, sqrt2: float = math.sqrt(2), extra_user: bool = False):
    """`spelling`: which of the exporters' orders of the five nodes."""
    mk = helper.make_node
    consts = {"sqrt2": np.array(sqrt2, np.float32), "inv_sqrt2": np.array(1 / sqrt2, np.float32),
              "one": np.array(1.0, np.float32), "half": np.array(0.5, np.float32),
              "two": np.array(2.0, np.float32)}
    scaled = (mk("Mul", ["inv_sqrt2", "x"], ["d"]) if spelling == "mul-scale"
              else mk("Div", ["x", "sqrt2"], ["d"]))
    nodes = [scaled, mk("Erf", ["d"], ["e"]), mk("Add", ["one", "e"], ["a"])]
    if spelling in ("torch", "mul-scale"):  # (x * (1 + erf)) * 0.5
        nodes += [mk("Mul", ["x", "a"], ["m"]), mk("Mul", ["m", "half"], ["y"])]
    elif spelling == "half-first":  # (x * 0.5) * (1 + erf)
        nodes += [mk("Mul", ["half", "x"], ["m"]), mk("Mul", ["a", "m"], ["y"])]
    elif spelling == "half-of-sum":  # x * ((1 + erf) * 0.5)
        nodes += [mk("Mul", ["a", "half"], ["m"]), mk("Mul", ["x", "m"], ["y"])]
    elif spelling == "div-two":  # (x * (1 + erf)) / 2
        nodes += [mk("Mul", ["a", "x"], ["m"]), mk("Div", ["m", "two"], ["y"])]
    outputs = {"y": np.float32}
    if extra_user:
        outputs["e"] = np.float32
    return make_model(nodes, {"x": (np.float32, ["b", 40])}, outputs, consts)


def ops(model) -> list[str]:
    return [n.op_type for n in run_passes(import_model(model)).nodes]


def check_numbers(model) -> None:
    compiled = None
    for b in (1, 300):
        x = (rng.standard_normal((b, 40)) * 3).astype(np.float32)
        compiled = assert_matches_ort(model, {"x": x}, compiled=compiled)


@pytest.mark.parametrize("spelling", ["torch", "mul-scale", "half-first", "half-of-sum", "div-two"])
def test_gelu_is_recognized(spelling) -> None:
    model = gelu_model(spelling)
    assert ops(model) == ["Gelu"]
    check_numbers(model)


@pytest.mark.parametrize("kwargs", [{"spelling": "torch", "sqrt2": 1.5},
                                    {"spelling": "torch", "extra_user": True}])
def test_near_misses_stay(kwargs) -> None:
    model = gelu_model(**kwargs)
    assert "Gelu" not in ops(model) and "Erf" in ops(model)
    check_numbers(model)
