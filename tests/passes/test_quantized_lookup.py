"""quantized_lookup: which QDQ chains on one 8-bit tensor become a LookupTable (and which stay
as they are), and the compiled model against onnxruntime running the chain as written, over
every byte the input can hold, at two values of a symbolic dim."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from oracle import make_model, run_ort
from pipeline import op_labels

import cuvil

F32 = np.float32


def every_byte(dtype: type, rows: int) -> np.ndarray:
    """Each of the 256 values of `dtype` at least once, then random ones, [rows, 256]."""
    info = np.iinfo(dtype)
    all_ = np.arange(info.min, info.max + 1).astype(dtype)
    rng = np.random.default_rng(rows)
    return np.stack([all_] + [rng.permutation(all_) for _ in range(rows - 1)])


def check(model, names=("y",), dtype=np.int8, mismatches: int = 0) -> None:
    """Within one quantization step of onnxruntime everywhere, and equal to it on all but
    `mismatches` of the 256 inputs (ties after a transcendental op, rounded by another erf
    or exp than onnxruntime's; the table takes correctly rounded ones)."""
    compiled = cuvil.compile(model)
    for rows in (3, 1):
        q = every_byte(dtype, rows)
        got = compiled.run({"q": q})
        for name, want in zip(names, run_ort(model, {"q": q})):
            diff = np.abs(got[name].astype(int) - want.astype(int))
            assert got[name].dtype == want.dtype and diff.max() <= 1, name
            assert np.count_nonzero(diff[0]) <= mismatches, (name, np.count_nonzero(diff[0]))


def qdq(op: str, src: str, dst: str, scale: str, zero: str) -> onnx.NodeProto:
    return helper.make_node(op, [src, scale, zero], [dst])


def gelu(dtype: type) -> tuple[list, dict]:
    """A BERT's Gelu as quantize_static writes it: every float op between a DequantizeLinear
    and a QuantizeLinear, the constants 1 and 0.5 quantized too (DequantizeLinear nodes on
    constants), x read twice."""
    z = dtype(3 if dtype == np.int8 else 131)
    nodes = [qdq("DequantizeLinear", "q", "x", "s", "z"),
             helper.make_node("Div", ["x", "root2"], ["d"]),
             helper.make_node("Erf", ["d"], ["e"]),
             qdq("QuantizeLinear", "e", "eq", "se", "z"), qdq("DequantizeLinear", "eq", "ed", "se", "z"),
             qdq("DequantizeLinear", "one_q", "one", "one_s", "z"),
             helper.make_node("Add", ["ed", "one"], ["a"]),
             qdq("QuantizeLinear", "a", "aq", "sa", "z"), qdq("DequantizeLinear", "aq", "ad", "sa", "z"),
             helper.make_node("Mul", ["x", "ad"], ["m"]),
             qdq("QuantizeLinear", "m", "mq", "sm", "z"), qdq("DequantizeLinear", "mq", "md", "sm", "z"),
             qdq("DequantizeLinear", "half_q", "half", "half_s", "z"),
             helper.make_node("Mul", ["md", "half"], ["h"]),
             qdq("QuantizeLinear", "h", "y", "sy", "z")]
    consts = {"s": np.array(0.041, F32), "z": np.array(z), "root2": np.array(np.sqrt(2), F32),
              "se": np.array(2 / 255, F32), "sa": np.array(2 / 255, F32),
              "sm": np.array(0.05, F32), "sy": np.array(0.027, F32),
              "one_q": np.array(z + 100, dtype), "one_s": np.array(0.01, F32),
              "half_q": np.array(z + 50, dtype), "half_s": np.array(0.01, F32)}
    return nodes, consts


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_a_quantized_gelu_becomes_one_table(dtype) -> None:
    nodes, consts = gelu(dtype)
    model = make_model(nodes, {"q": (dtype, ["rows", 256])}, {"y": dtype}, consts, opset=13)
    assert op_labels(model) == ["LookupTable"]
    check(model, dtype=dtype, mismatches=3)


def test_hardswish_and_sigmoid_at_opset_21() -> None:
    nodes = [qdq("DequantizeLinear", "q", "x", "s", "z"),
             helper.make_node("HardSwish", ["x"], ["hs"]),
             qdq("QuantizeLinear", "hs", "y", "s2", "z2"),
             qdq("DequantizeLinear", "q", "x2", "s", "z"),
             helper.make_node("Sigmoid", ["x2"], ["sg"]),
             qdq("QuantizeLinear", "sg", "y2", "s3", "z2")]
    consts = {"s": np.array(0.05, F32), "z": np.array(120, np.uint8),
              "s2": np.array(0.03, F32), "s3": np.array(1 / 256, F32), "z2": np.array(0, np.uint8)}
    model = make_model(nodes, {"q": (np.uint8, ["rows", 256])},
                       {"y": np.uint8, "y2": np.uint8}, consts, opset=21)
    assert op_labels(model) == ["LookupTable", "LookupTable"]
    check(model, names=("y", "y2"), dtype=np.uint8, mismatches=2)


def test_what_stays_as_it_is() -> None:
    # a product of two 8-bit tensors, a per-channel scale, a float result: no table; a
    # chain through an 8-bit value the graph returns (y_mid) is two tables of x
    nodes = [qdq("DequantizeLinear", "q", "x", "s", "z"),
             qdq("DequantizeLinear", "p", "xp", "s", "z"),
             helper.make_node("Mul", ["x", "xp"], ["m"]),
             qdq("QuantizeLinear", "m", "y_two", "s", "z"),
             helper.make_node("DequantizeLinear", ["q", "s_axis", "z_axis"], ["xa"], axis=1),
             helper.make_node("Relu", ["xa"], ["r"]),
             qdq("QuantizeLinear", "r", "y_axis", "s", "z"),
             helper.make_node("Neg", ["x"], ["y_float"]),
             helper.make_node("Tanh", ["x"], ["t"]),
             qdq("QuantizeLinear", "t", "y_mid", "s_t", "z"),
             qdq("DequantizeLinear", "y_mid", "td", "s_t", "z"),
             helper.make_node("Mul", ["td", "k"], ["tk"]),
             qdq("QuantizeLinear", "tk", "y_end", "s", "z")]
    consts = {"s": np.array(0.05, F32), "z": np.array(-2, np.int8), "k": np.array(-3.5, F32),
              "s_t": np.array(1 / 127, F32), "s_axis": np.linspace(0.01, 0.1, 256).astype(F32),
              "z_axis": np.zeros(256, np.int8)}
    outputs = {"y_two": np.int8, "y_axis": np.int8, "y_float": F32, "y_mid": np.int8,
               "y_end": np.int8}
    model = make_model(nodes, {"q": (np.int8, ["rows", 256]), "p": (np.int8, ["rows", 256])},
                       outputs, consts, opset=13)
    # x's DequantizeLinear stays for the Mul of two tensors and the Neg, beside the tables
    assert op_labels(model) == ["DequantizeLinear", "Fused(DequantizeLinear+Mul+QuantizeLinear)",
                                "Fused(DequantizeLinear+Relu+QuantizeLinear)", "Neg",
                                "LookupTable", "LookupTable"]
    compiled = cuvil.compile(model)
    q = every_byte(np.int8, 2)
    feeds = {"q": q, "p": np.roll(q, 7, axis=1)}
    got = compiled.run(feeds)
    for name, want in zip(outputs, run_ort(model, feeds)):
        assert np.abs(got[name].astype(float) - want.astype(float)).max() <= (
            1e-6 if want.dtype == F32 else 1), name
