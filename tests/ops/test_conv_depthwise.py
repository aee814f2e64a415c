"""The direct depthwise convolution kernel (ops/_conv_depthwise.py) against onnxruntime: kernel
sizes 3 to 7 and 1-D, strides 1 to 3, explicit, asymmetric and automatic pads, dilations,
channel multipliers 1 and 2, inputs smaller than the kernel, rows wider and narrower than a
vector, batch 2 and symbolic batch and spatial dims, bias, and the fused epilogue (residual,
Relu, HardSwish, Clip). Each model is also checked to run the direct kernel, not im2col + GEMM.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from batch_oracle import Case, check_cases
from onnx import helper
from oracle import assert_matches_ort, make_model

from cuvil.compiler.codegen.module import build_module
from cuvil.compiler.frontend import import_model
from cuvil.compiler.ops._conv_depthwise import uses_direct_depthwise
from cuvil.compiler.passes import run_passes
from cuvil.compiler.passes.plan_memory import plan_memory

RNG = np.random.default_rng(8)


def depthwise_case(channels: int, spatial: list, kernel: list[int], multiplier: int = 1,
                   bias: bool = True, batch: int | str = 1, **attrs: object) -> Case:
    case = Case("Conv", ["x", "w", "b"] if bias else ["x", "w"], {"group": channels, **attrs},
                feeds={"x": ("float32", [batch, channels, *spatial])},
                consts={"w": RNG.standard_normal([channels * multiplier, 1, *kernel])
                        .astype(np.float32)})
    if bias:
        case.consts["b"] = RNG.standard_normal(channels * multiplier).astype(np.float32)
    return case


def kernels_of(model: onnx.ModelProto) -> tuple[int, int]:
    """(direct depthwise loops, GEMM kernels) in the module cuvil generates for the model
    (AVX-512 features, so the widest vectors)."""
    graph = run_passes(import_model(model, None, "m"))
    text = build_module(graph, plan_memory(graph), "m", "0" * 64, "x86_64-unknown-linux-gnu", "",
                        features="+avx512f,+avx2,+fma")
    return (len(re.findall(r'define internal void @"node\d+_Conv\.dw', text)),
            len(re.findall(r'define internal void @"cuvil\.gemm', text)))


GEOMETRIES = [
    # 2-D: kernel, spatial, attributes
    ([3, 3], [12, 40], {"pads": [1, 1, 1, 1]}),
    ([3, 3], [23, 41], {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ([5, 5], [14, 37], {"pads": [2, 2, 2, 2]}),
    ([5, 5], [15, 35], {"pads": [2, 2, 2, 2], "strides": [2, 2]}),
    ([7, 7], [9, 30], {"pads": [3, 3, 3, 3]}),
    ([3, 3], [7, 7], {"pads": [1, 1, 1, 1]}),
    ([3, 3], [11, 19], {"pads": [0, 1, 2, 1]}),  # asymmetric
    ([3, 3], [10, 33], {"pads": [2, 0, 0, 2]}),
    ([3, 3], [9, 26], {}),  # no padding
    ([5, 5], [13, 34], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ([4, 4], [8, 21], {"auto_pad": "SAME_LOWER"}),
    ([3, 3], [8, 20], {"auto_pad": "VALID", "strides": [1, 2]}),
    ([3, 3], [12, 36], {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    ([3, 3], [13, 50], {"pads": [1, 3, 1, 3], "strides": [3, 3], "dilations": [1, 2]}),
    ([5, 5], [2, 3], {"pads": [2, 2, 2, 2]}),  # smaller than the kernel
    ([7, 7], [3, 3], {"pads": [3, 3, 3, 3]}),
    ([3, 3], [1, 1], {"pads": [1, 1, 1, 1]}),
    ([3, 3], [4, 5], {"pads": [4, 0, 3, 5]}),  # pads larger than the kernel
    ([1, 1], [6, 18], {}),
    # 1-D
    ([3], [50], {"pads": [1, 1]}),
    ([5], [47], {"auto_pad": "SAME_UPPER", "strides": [2]}),
    ([3], [40], {"pads": [2, 2], "dilations": [2]}),
    ([7], [5], {"pads": [3, 1]}),
]


@pytest.mark.parametrize("multiplier", [1, 2])
def test_geometries_against_onnxruntime(multiplier):
    cases = [depthwise_case(3, spatial, kernel, multiplier, bias=i % 3 != 2,
                            batch=2 if i % 4 == 0 else 1, **attrs)
             for i, (kernel, spatial, attrs) in enumerate(GEOMETRIES)]
    model = check_cases(cases)
    assert model is not None
    assert kernels_of(_batched(cases)) == (len(cases), 0)


def test_symbolic_batch_and_spatial_dims():
    cases = [depthwise_case(4, ["_h", "_w"], [3, 3], batch="n", pads=[1, 1, 1, 1]),
             depthwise_case(4, ["_h", "_w"], [5, 5], batch="n", strides=[2, 2],
                            auto_pad="SAME_UPPER"),
             depthwise_case(2, [9, "_w"], [3, 3], 2, batch="n", strides=[2, 1],
                            pads=[0, 1, 2, 1]),
             depthwise_case(3, ["_w"], [3], batch="n", pads=[2, 1], dilations=[2])]
    check_cases(cases, sizes=({"n": 1, "_h": 7, "_w": 7}, {"n": 2, "_h": 20, "_w": 45},
                              {"n": 3, "_h": 3, "_w": 2}))
    assert kernels_of(_batched(cases)) == (len(cases), 0)


def _batched(cases: list[Case]) -> onnx.ModelProto:
    from batch_oracle import build

    return build(cases)


@pytest.mark.parametrize("activation", ["Relu", "HardSwish", "Clip"])
def test_fused_residual_and_activation(activation):
    c = 8
    w = RNG.standard_normal((c, 1, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(c).astype(np.float32)
    act_inputs = ["s", "lo", "hi"] if activation == "Clip" else ["s"]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=c, pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["y", "r"], ["s"]),
             helper.make_node(activation, act_inputs, ["out"])]
    inits = {"w": w, "b": b, "lo": np.float32(0.0), "hi": np.float32(6.0)}
    if activation != "Clip":
        del inits["lo"], inits["hi"]
    model = make_model(nodes, {"x": (np.float32, ["n", c, 19, 21]),
                               "r": (np.float32, ["n", c, 19, 21])}, {"out": np.float32}, inits)
    graph = run_passes(import_model(model, None, "m"))
    assert [n.op_type for n in graph.nodes] == ["Conv"], "the Add and activation are fused"
    assert uses_direct_depthwise(graph.nodes[0])
    assert kernels_of(model) == (1, 0)
    for n in (1, 2):
        feeds = {"x": RNG.standard_normal((n, c, 19, 21)).astype(np.float32) * 3,
                 "r": RNG.standard_normal((n, c, 19, 21)).astype(np.float32) * 3}
        assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-5)


def test_strided_fused_hardswish_without_bias():
    c = 5
    w = RNG.standard_normal((c, 1, 5, 5)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], group=c, pads=[2, 2, 2, 2],
                              strides=[2, 2]),
             helper.make_node("HardSwish", ["y"], ["out"])]
    model = make_model(nodes, {"x": (np.float32, [2, c, 33, 34])}, {"out": np.float32}, {"w": w})
    assert kernels_of(model) == (1, 0)
    assert_matches_ort(model, {"x": RNG.standard_normal((2, c, 33, 34)).astype(np.float32) * 4})


def test_other_convolutions_keep_the_gemm_path():
    """Groups of several input channels, large multipliers, 3-D, more than 64 taps and strides
    along the row above 4 are not depthwise for this kernel."""
    cases = [
        Case("Conv", ["x", "w"], {"group": 2}, feeds={"x": ("float32", [1, 4, 6, 6])},
             consts={"w": RNG.standard_normal((2, 2, 3, 3)).astype(np.float32)}),
        depthwise_case(2, [6, 6], [3, 3], multiplier=8),
        depthwise_case(2, [4, 4, 4], [3, 3, 3]),
        depthwise_case(2, [9, 9], [9, 9], pads=[1, 1, 1, 1]),
        depthwise_case(2, [9, 31], [3, 3], strides=[1, 5]),
    ]
    check_cases(cases)
    direct, gemm = kernels_of(_batched(cases))
    assert direct == 0 and gemm >= 1
