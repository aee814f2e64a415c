"""fuse_elementwise: which chains become one Fused node (and which stay apart), and the compiled
model against onnxruntime running the unfused model, at two values of the symbolic batch;
fusing changes no bit of the result (the same model compiled without the pass)."""

from __future__ import annotations

import numpy as np
from onnx import helper
from oracle import assert_matches_ort, make_model, run_ort
from pipeline import compile_without, op_labels

import cuvil
import cuvil.compiler.passes as passes

rng = np.random.default_rng(5)
F32 = np.float32


def check(model, feeds_of, **tol) -> None:
    """Against onnxruntime at batch 5 and 1, and bit for bit against the unfused model."""
    compiled, plain = cuvil.compile(model), compile_without(model, passes.fuse_elementwise)
    for batch in (5, 1):
        feeds = feeds_of(batch)
        assert_matches_ort(model, feeds, compiled=compiled, **tol)
        got, want = compiled.run(feeds), plain.run(feeds)
        for name in got:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def floats(batch: int, c: int = 37) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((batch, c)).astype(F32) * 3}


def test_silu_and_a_broadcast_bias_run_as_one_loop() -> None:
    # x is read by two members (a DAG, not a chain); the bias broadcasts along the batch
    nodes = [helper.make_node("Mul", ["x", "k"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["a"]),
             helper.make_node("Sigmoid", ["a"], ["s"]),
             helper.make_node("Mul", ["a", "s"], ["silu"]),
             helper.make_node("Mul", ["silu", "x"], ["y"])]
    model = make_model(nodes, {"x": (F32, ["batch", 37])}, {"y": F32},
                       {"k": np.array(0.7, F32), "bias": rng.standard_normal(37).astype(F32)})
    assert op_labels(model) == ["Fused(Mul+Add+Sigmoid+Mul+Mul)"]
    check(model, floats)


def test_bool_and_integer_steps() -> None:
    # a comparison's bool feeds Where; an int32 Cast and back (what is stored between steps
    # is each step's output type)
    nodes = [helper.make_node("Greater", ["x", "zero"], ["pos"]),
             helper.make_node("Mul", ["x", "slope"], ["neg"]),
             helper.make_node("Where", ["pos", "x", "neg"], ["w"]),
             helper.make_node("Cast", ["w"], ["i"], to=6),
             helper.make_node("Cast", ["i"], ["y"], to=1)]
    model = make_model(nodes, {"x": (F32, ["batch", 37])}, {"y": F32},
                       {"zero": np.array(0, F32), "slope": np.array(0.1, F32)})
    assert op_labels(model) == ["Fused(Greater+Mul+Where+Cast+Cast)"]
    check(model, floats)


def test_what_stays_apart() -> None:
    # a value the graph also returns ends a chain; so does one of a smaller shape than the
    # chain's (it would be computed once per element of the larger); Softmax is no member
    nodes = [helper.make_node("Mul", ["b", "k"], ["small"]),          # [37]: broadcast below
             helper.make_node("Add", ["x", "small"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Neg", ["r"], ["out1"]),                  # a graph output
             helper.make_node("Exp", ["out1"], ["e"]),
             helper.make_node("Softmax", ["e"], ["sm"]),
             helper.make_node("Sqrt", ["sm"], ["y"])]
    model = make_model(nodes, {"x": (F32, ["batch", 37]), "b": (F32, [37])},
                       {"out1": F32, "y": F32}, {"k": np.array(2.0, F32)})
    assert op_labels(model) == ["Mul", "Fused(Add+Relu+Neg)", "Exp", "Softmax", "Sqrt"]
    check(model, lambda batch: {**floats(batch), "b": rng.standard_normal(37).astype(F32)})


def test_quantize_dequantize_chains() -> None:
    # a QDQ model's float op between Q/DQ pairs: int8 in, int8 out, the scales per channel
    # (with one scale per tensor the chain is a table: passes/quantized_lookup.py);
    # onnxruntime and cuvil may round a value at a tie differently after erf
    c = 24
    scale = rng.uniform(0.01, 0.05, c).astype(F32)
    zero = rng.integers(-5, 5, c).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["x"], axis=1),
             helper.make_node("Div", ["x", "r2"], ["d"]),
             helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("QuantizeLinear", ["e", "s2", "z2"], ["y"])]
    model = make_model(nodes, {"q": (np.int8, ["batch", c, 5])}, {"y": np.int8},
                       {"s": scale, "z": zero, "r2": np.array(1.4142135, F32),
                        "s2": np.array(0.01, F32), "z2": np.array(-3, np.int8)}, opset=13)
    assert op_labels(model) == ["Fused(DequantizeLinear+Div+Erf+QuantizeLinear)"]
    compiled, plain = cuvil.compile(model), compile_without(model, passes.fuse_elementwise)
    for batch in (6, 1):
        q = rng.integers(-128, 128, (batch, c, 5)).astype(np.int8)
        want = run_ort(model, {"q": q})[0].astype(int)
        got = compiled.run({"q": q})["y"]
        assert np.abs(got.astype(int) - want).max() <= 1
        np.testing.assert_array_equal(got, plain.run({"q": q})["y"])
