"""Spectral ops (DFT, STFT) against onnxruntime, or onnx's reference evaluator where
onnxruntime is wrong (a one-sided inverse DFT of odd length); many cases per compile.

Lengths cover powers of two, mixed radices (12, 30), primes (7, 13) and symbolic lengths
(whose twiddle table is computed at run time).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper
from oracle import assert_matches_ort

import cuvil
from cuvil.errors import ModelError

F32 = np.float32


def _dft(shape, *, attrs=None, length=None, axis=None, dtype=F32, oracle="ort", label=""):
    """A DFT-20 case (axis as input 2) on input x of `shape`."""
    consts = {}
    inputs = ["x", "", ""]
    if length is not None:
        consts["n"] = np.array(length, np.int64)
        inputs[1] = "n"
    if axis is not None:
        consts["axis"] = np.array(axis, np.int64)
        inputs[2] = "axis"
    while inputs and not inputs[-1]:
        inputs.pop()
    return Case("DFT", inputs, attrs or {}, feeds={"x": (dtype, shape)}, consts=consts,
                oracle=oracle, label=label)


def test_dft_opset20_lengths_axes_and_directions() -> None:
    cases = [
        _dft([3, 16, 1], axis=1),                                  # radix 2, real
        _dft([2, 12, 2], axis=1),                                  # 2*2*3, complex
        _dft([2, 3, 30, 2], axis=-2),                              # 2*3*5
        _dft([13, 4, 1], axis=0),                                  # prime, first axis
        _dft([2, 7, 5, 2], axis=1, attrs={"inverse": 1}),          # prime, inverse
        _dft([2, 8, 3, 1], axis=1, attrs={"inverse": 1}),          # inverse of a real input
        _dft([2, 10, 1], axis=1, attrs={"onesided": 1}),           # rfft, even
        _dft([2, 9, 3, 1], axis=1, attrs={"onesided": 1}),         # rfft, odd
        _dft([2, 6, 3, 2], axis=1, attrs={"inverse": 1, "onesided": 1}),  # irfft, default length
        _dft([2, 6, 2], length=16, axis=1),                        # zero-padded
        _dft([2, 20, 2], length=8, axis=1),                        # truncated
        _dft([4, 10, 1], length=12, axis=1, attrs={"onesided": 1}),
        _dft([2, 5, 2], length=8, axis=1, attrs={"inverse": 1, "onesided": 1}),
        _dft([5, 6, 2]),                                           # default axis -2
        _dft([2, 12, 2], axis=1, dtype=np.float64),
    ]
    check_cases(cases, opset=20, rtol=1e-4, atol=1e-4)


def test_long_static_length_fills_its_table_at_run_time() -> None:
    from cuvil.compiler.ops.spectral import MAX_TABLE

    n = 2 * MAX_TABLE
    check_cases([_dft([1, n, 1], axis=1, attrs={"onesided": 1}),
                 _dft([1, 3 * MAX_TABLE // 4, 2], length=n, axis=1, attrs={"inverse": 1})],
                opset=20, rtol=1e-3, atol=2e-2)


def test_dft_opset17_axis_attribute() -> None:
    cases = [
        Case("DFT", ["x"], {}, feeds={"x": (F32, [2, 10, 1])}),   # default axis 1
        Case("DFT", ["x"], {"axis": 2}, feeds={"x": (F32, [2, 3, 8, 2])}),
        Case("DFT", ["x"], {"axis": -2, "inverse": 1}, feeds={"x": (F32, [2, 3, 6, 2])}),
        Case("DFT", ["x", "n"], {"axis": 1, "onesided": 1}, feeds={"x": (F32, [3, 7, 1])},
             consts={"n": np.array(7, np.int64)}),
    ]
    check_cases(cases, opset=17, rtol=1e-4, atol=1e-4)


def test_one_sided_inverse_of_odd_length_against_the_reference() -> None:
    # onnxruntime 1.32 returns wrong values for an odd dft_length here; onnx's reference
    # evaluator (numpy's irfft) is the oracle
    cases = [
        _dft([2, 5, 3, 2], length=9, axis=1, attrs={"inverse": 1, "onesided": 1},
             oracle="reference"),
        _dft([4, 2], length=7, axis=0, attrs={"inverse": 1, "onesided": 1}, oracle="reference"),
    ]
    check_cases(cases, opset=20, rtol=1e-4, atol=1e-5)


def test_dft_float16_against_the_reference() -> None:
    check_cases([_dft([2, 8, 2], axis=1, dtype=np.float16, oracle="reference"),
                 _dft([3, 6, 1], axis=1, attrs={"onesided": 1}, dtype=np.float16,
                      oracle="reference")],
                opset=20, rtol=1e-2, atol=2e-2)


def test_symbolic_lengths_one_compile_several_sizes() -> None:
    cases = [
        _dft(["b", "n", 2], axis=1),                               # symbolic DFT length
        _dft(["b", "n", 1], axis=1, attrs={"onesided": 1}),
        _dft(["b", 6, "_w", 2], axis=1, attrs={"inverse": 1}),     # symbolic outer/inner dims
        _dft(["b", "n", 2], length=8, axis=1),                     # static length, symbolic input
    ]
    sizes = [{"b": 1, "n": 16, "_w": 3}, {"b": 2, "n": 15, "_w": 1}, {"b": 3, "n": 11, "_w": 2}]
    check_cases(cases, opset=20, sizes=sizes, rtol=1e-4, atol=1e-4)


def test_stft_of_a_symbolic_signal_length() -> None:
    # onnx's shape inference leaves the frame count unknown, so the output is declared by hand
    g = helper.make_graph(
        [helper.make_node("STFT", ["x", "step", "", "len"], ["y"], name="spec")], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", "n", 1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", "frames", 5, 2])],
        [onnx.numpy_helper.from_array(np.array(3, np.int64), "step"),
         onnx.numpy_helper.from_array(np.array(8, np.int64), "len")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    compiled = cuvil.compile(model)
    rng = np.random.default_rng(1)
    for b, n in [(1, 8), (2, 15), (3, 31)]:
        assert_matches_ort(model, {"x": rng.standard_normal((b, n, 1)).astype(F32)},
                           rtol=1e-4, atol=1e-4, compiled=compiled)


def test_stft_windows_lengths_and_sides() -> None:
    def stft(signal, step, window=None, length=None, attrs=None, dtype=F32):
        inputs, consts, feeds = ["x", "step"], {"step": np.array(step, np.int64)}, {"x": (dtype, signal)}
        if window is not None:
            feeds["w"] = (dtype, [window])
        inputs.append("w" if window is not None else "")
        if length is not None:
            consts["len"] = np.array(length, np.int64)
            inputs.append("len")
        while not inputs[-1]:
            inputs.pop()
        return Case("STFT", inputs, attrs or {}, feeds=feeds, consts=consts)

    cases = [
        stft([1, 64, 1], 8, length=16),
        stft([2, 64, 1], 8, window=16),                            # window from the input
        stft([2, 50, 1], 5, window=12, length=12),
        stft([2, 40, 1], 7, length=9, attrs={"onesided": 0}),
        stft([1, 40, 2], 4, length=10, attrs={"onesided": 0}),     # complex signal
        stft([2, 33, 1], 4, window=10, dtype=np.float64),
    ]
    check_cases(cases, opset=17, rtol=1e-4, atol=1e-4)


def test_onnx_backend_dft_and_stft() -> None:
    tests = [t for t in backend_cases("dft", ["DFT"]) + backend_cases("stft", ["STFT"])
             # the expected imaginary part of bin 5 is float32 rounding noise (1.9e-7, where
             # the exact value is 0) under atol=1e-7: only numpy's own float32 FFT reproduces it
             if "inverse" not in t.name]
    # DFT's axis / dft_length and STFT's frame_step / frame_length are graph inputs there:
    # bind them to their test values, as an exporter writes them as constants
    check_backend_cases([_bind_scalars(t) for t in tests])


def _bind_scalars(t):
    """The test with its integer scalar inputs turned into initializers."""
    model = onnx.ModelProto()
    model.CopyFrom(t.model)
    g = model.graph
    inputs, outputs = t.data_sets[0]
    keep, data = [], []
    for vi, a in zip(list(g.input), inputs):
        a = np.asarray(onnx.numpy_helper.to_array(a) if isinstance(a, onnx.TensorProto) else a)
        if a.dtype.kind == "i":
            g.initializer.append(onnx.numpy_helper.from_array(a, vi.name))
        else:
            keep.append(vi)
            data.append(a)
    del g.input[:]
    g.input.extend(keep)

    return SimpleNamespace(name=t.name, rtol=t.rtol, atol=t.atol, model=model,
                           data_sets=[(data, outputs)])


# -- errors --------------------------------------------------------------------------------


def _single(op, inputs, attrs, x_shape, consts, opset, x_dtype=onnx.TensorProto.FLOAT):
    g = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], name="spec", **attrs)], "g",
        [helper.make_tensor_value_info("x", x_dtype, x_shape)],
        [helper.make_tensor_value_info("y", x_dtype, [f"y{i}" for i in range(len(x_shape) + 1)])],
        [onnx.numpy_helper.from_array(np.asarray(v), n) for n, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("op,inputs,attrs,shape,consts,opset,message", [
    ("DFT", ["x"], {"axis": 2}, [2, 8, 2], {}, 17, "axis 2 is out of range"),
    ("DFT", ["x", "", "a"], {}, [2, 8, 3], {"a": np.array(1)}, 20, "last dim is 3"),
    ("DFT", ["x", "n", "a"], {}, [2, 8, 1], {"a": np.array(1), "n": np.array(0)}, 20,
     "dft_length is 0"),
    ("DFT", ["x", "", "a"], {"onesided": 1}, [2, 8, 2], {"a": np.array(1)}, 20,
     "one-sided forward DFT takes a real input"),
    ("DFT", ["x", "", "a"], {"inverse": 2}, [2, 8, 2], {"a": np.array(1)}, 20, "must be 0 or 1"),
    ("STFT", ["x", "s", "", "l"], {}, [1, 8, 1], {"s": np.array(2), "l": np.array(16)}, 17,
     "longer than the signal"),
    ("STFT", ["x", "s", "w", "l"], {}, [1, 32, 1],
     {"s": np.array(2), "w": np.ones(8, np.float32), "l": np.array(16)}, 17,
     "window's length must equal frame_length"),
    ("STFT", ["x", "s"], {}, [1, 32, 1], {"s": np.array(0)}, 17, "frame_step is 0"),
])
def test_bad_inputs_name_the_node(op, inputs, attrs, shape, consts, opset, message) -> None:
    with pytest.raises(ModelError, match=message) as info:
        cuvil.compile(_single(op, inputs, attrs, shape, consts, opset))
    assert "'spec'" in str(info.value)


def test_run_time_dft_length_is_rejected() -> None:
    g = helper.make_graph(
        [helper.make_node("DFT", ["x", "n"], ["y"], name="spec", axis=1)], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8, 1]),
         helper.make_tensor_value_info("n", onnx.TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["a", "b", "c"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(cuvil.errors.UnsupportedOpError, match=r"dft_length.*compile time"):
        cuvil.compile(m)
