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


def vi(name: str, elem: int = TensorProto.FLOAT, shape: list[int | str] | None = None
       ) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, [2, 3] if shape is None else shape)


def model_of(nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray] | None = None,
             opsets: tuple[int, ...] = (17,), y: onnx.ValueInfoProto | None = None
             ) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [vi("x")], [y or vi("y")],
                              [onnx.numpy_helper.from_array(a, n) for n, a in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", v) for v in opsets])
    model.ir_version = 8
    return model


def with_import(model: onnx.ModelProto, domain: str, version: int) -> onnx.ModelProto:
    model.opset_import.append(helper.make_opsetid(domain, version))
    return model


def if_model(then_type: int = TensorProto.FLOAT, known: bool = False) -> onnx.ModelProto:
    """An If whose then_branch declares `then_type` for the float it computes; its condition is
    a constant (the importer inlines the branch) or computed from x at run time."""
    then = helper.make_graph([helper.make_node("Neg", ["x"], ["a"])], "then", [], [vi("a", then_type)])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["b"])], "else", [], [vi("b")])
    cond = ([] if known else [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
                              helper.make_node("Less", ["s", "zero"], ["c"])])
    return model_of([*cond, helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                    {"c": np.array(True)} if known else {"zero": np.array(1, np.float32)})


def loop_model(acc_type: int = TensorProto.FLOAT, twice: bool = False) -> onnx.ModelProto:
    """A Loop of 3 trips adding x to a carried value; its body declares `acc_type` for that
    float, and with `twice` lists it twice among its outputs (for one Loop output)."""
    acc = vi("acc_out", acc_type)
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["acc_in", "x"], ["acc_out"])], "body",
        [vi("i", TensorProto.INT64, []), vi("cond_in", TensorProto.BOOL, []), vi("acc_in")],
        [vi("cond_out", TensorProto.BOOL, []), acc, *([acc] if twice else [])])
    return model_of([helper.make_node("Loop", ["trips", "go", "x"], ["y"], body=body)],
                    {"trips": np.array(3, np.int64), "go": np.array(True)})


def variadic_model(op: str) -> onnx.ModelProto:
    """`op` (Concat, Sum...) reading x and an empty name, an omitted input it cannot have."""
    attrs = {"axis": 1} if op == "Concat" else {}
    return model_of([helper.make_node(op, ["x", ""], ["y"], **attrs)])


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
    # found by tests/fuzz/test_fuzz_graph.py
    "If branch output declared int32": (if_model(TensorProto.INT32),
                                        ["output 'a'", "then_branch", "declared INT32",
                                         "computes float32", "fix the declaration"]),
    "inlined If branch output declared int32": (if_model(TensorProto.INT32, known=True),
                                                ["output 'a'", "then_branch", "If node 'y'",
                                                 "declared INT32", "computes float32"]),
    "Loop body output declared int64": (loop_model(TensorProto.INT64),
                                        ["output 'acc_out'", "body", "declared INT64",
                                         "computes float32"]),
    "Loop body listing an output twice": (loop_model(twice=True),
                                          ["node 'y' (Loop)", "3 outputs", "1 node outputs",
                                           "one output more than the node"]),
    "two default-domain imports, the last unreleased": (
        model_of([helper.make_node("Relu", ["x"], ["y"])], opsets=(17, 99)),
        ["opset 99", "more than once", "keep one import"]),
    "two default-domain imports, the first unreleased": (
        model_of([helper.make_node("Relu", ["x"], ["y"])], opsets=(99, 17)),
        ["opset 99", "more than once"]),
    "an ai.onnx.ml opset newer than onnx knows": (
        with_import(model_of([helper.make_node("Relu", ["x"], ["y"])]), "ai.onnx.ml", 99),
        ["domain 'ai.onnx.ml'", "opset 99", "up to"]),
    "Concat input with the empty name": (variadic_model("Concat"),
                                         ["node 'y' (Concat)", "empty name as input 1",
                                          "'inputs'", "cannot be left out"]),
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
    # (softmaxes, which no pass fuses away)
    n = 2**44  # float32: 2**46 bytes each
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["a"]), helper.make_node("LogSoftmax", ["x"], ["b"]),
         helper.make_node("Softmax", ["a"], ["c"]), helper.make_node("Sum", ["a", "b", "c"], ["y"])],
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


def test_an_empty_name_among_variadic_inputs_is_refused() -> None:
    # not shown to onnxruntime: it crashes (SIGSEGV) on this Sum
    with pytest.raises(ModelError, match=r"node 'y' \(Sum\) has an empty name as input 1"):
        cuvil.compile(variadic_model("Sum"))


def test_empty_names_of_optional_inputs_still_compile() -> None:
    clip = helper.make_node("Clip", ["x", "", "hi"], ["y"])
    model = model_of([clip], {"hi": np.array(1, np.float32)})
    assert not ort_refuses(model)
    x = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(cuvil.compile(model).run({"x": x})["y"], np.minimum(x, 1))


# what onnxruntime accepts keeps compiling, and computes what onnxruntime computes

def test_of_two_default_domain_imports_the_last_holds_as_in_onnxruntime() -> None:
    # ReduceSum takes its axes as an attribute up to opset 12, as an input from 13
    reduce = helper.make_node("ReduceSum", ["x"], ["y"], axes=[1], keepdims=1)
    model = model_of([reduce], opsets=(13, 12), y=vi("y", shape=[2, 1]))
    assert not ort_refuses(model)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(cuvil.compile(model).run({"x": x})["y"], x.sum(1, keepdims=True))
    # at 13 the axes attribute is not allowed: refused, as by onnxruntime
    last_13 = model_of([reduce], opsets=(12, 13), y=vi("y", shape=[2, 1]))
    assert ort_refuses(last_13)
    with pytest.raises(ModelError, match="axes"):
        cuvil.compile(last_13)


def test_a_wrong_declared_output_shape_compiles_to_the_shape_onnxruntime_computes() -> None:
    # onnxruntime warns ("Error merging shape info") and returns the computed shape
    import onnxruntime as ort

    model = model_of([helper.make_node("Concat", ["x", "x"], ["y"], axis=1)], y=vi("y", shape=[2, 2]))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    compiled = cuvil.compile(model)
    assert [tuple(o.shape) for o in compiled.outputs] == [(2, 6)]
    np.testing.assert_array_equal(compiled.run({"x": x})["y"], want)


@pytest.mark.parametrize("model", [if_model(), if_model(known=True), loop_model()],
                         ids=["If", "inlined If", "Loop"])
def test_subgraphs_declaring_their_types_right_still_compile(model: onnx.ModelProto) -> None:
    import onnxruntime as ort

    x = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(cuvil.compile(model).run({"x": x})["y"], want)
