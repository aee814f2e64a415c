"""Models onnxruntime refuses are refused by cuvil too, with an error naming what is wrong."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cuvil
from cuvil.errors import ModelError


def relu_model(x_type: int = TensorProto.FLOAT, y_type: int = TensorProto.FLOAT,
               shape: list[int | str] | None = None, opset: int = 17,
               outputs: bool = True) -> onnx.ModelProto:
    shape = [2, 3] if shape is None else shape
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu",
        [helper.make_tensor_value_info("x", x_type, shape)],
        [helper.make_tensor_value_info("y", y_type, shape)] if outputs else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def ort_refuses(model: onnx.ModelProto) -> bool:
    """onnxruntime will not load the model, or not run it on an input of its declared shape."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x = session.get_inputs()[0]
        session.run(None, {x.name: np.zeros(x.shape, np.float32)})
    except Exception:
        return True
    return False


CASES = {
    "element type 0": (relu_model(x_type=TensorProto.UNDEFINED),
                       ["input 'x'", "element type 0", "UNDEFINED", "re-export"]),
    "opset newer than onnx knows": (relu_model(opset=99),
                                    ["opset 99", f"up to {onnx.defs.onnx_opset_version()}"]),
    "no outputs": (relu_model(outputs=False), ["declares no outputs"]),
    "output declared int64": (relu_model(y_type=TensorProto.INT64),
                              ["output 'y'", "declared INT64", "computes float32"]),
    "dim beyond any address space": (relu_model(shape=[2**63 - 1]),
                                     ["input 'x'", str(2**63 - 1), "address space"]),
}


@pytest.mark.parametrize(("model", "parts"), CASES.values(), ids=CASES.keys())
def test_refused_like_onnxruntime(model: onnx.ModelProto, parts: list[str]) -> None:
    assert ort_refuses(model)
    with pytest.raises(ModelError) as info:
        cuvil.compile(model)
    for part in parts:
        assert part in str(info.value)


def test_intermediates_beyond_any_address_space_are_refused() -> None:
    # each tensor fits, but three of them live at once do not: refused before code is built
    n = 2**44  # float32: 2**46 bytes each
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"]),
         helper.make_node("Abs", ["x"], ["c"]), helper.make_node("Sum", ["a", "b", "c"], ["y"])],
        "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelError, match=r"intermediate tensors need \d+ bytes"):
        cuvil.compile(model)


def test_newest_opset_onnx_knows_still_compiles() -> None:
    opset = min(onnx.defs.onnx_opset_version(), 22)  # onnxruntime's newest may trail onnx's
    compiled = cuvil.compile(relu_model(opset=opset))
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    np.testing.assert_array_equal(compiled.run({"x": x})["y"], np.maximum(x, 0))
