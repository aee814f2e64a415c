"""Build small ONNX models and compare cuvil against onnxruntime on them.

onnxruntime is the independent oracle: every op test runs the same model through both and
compares outputs. Nothing here knows how cuvil computes anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

import cuvil

DEFAULT_OPSET = 17


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, tuple[Any, Sequence[int | str]]],
    outputs: Mapping[str, Any],
    initializers: Mapping[str, np.ndarray] | None = None,
    opset: int = DEFAULT_OPSET,
) -> onnx.ModelProto:
    """A checked model: `inputs` name -> (dtype, shape), `outputs` name -> dtype."""
    graph = helper.make_graph(
        list(nodes),
        "test",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), list(s))
         for n, (t, s) in inputs.items()],
        [helper.make_empty_tensor_value_info(n) for n in outputs],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 8)
    # let onnx type the outputs (rank and dtype), as an exporter would
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for out in model.graph.output:
        want = helper.np_dtype_to_tensor_dtype(np.dtype(outputs[out.name]))
        assert out.type.tensor_type.elem_type == want, f"{out.name}: onnx infers another dtype"
    onnx.checker.check_model(model)
    return model


def run_ort(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, dict(feeds))


@functools.cache
def onnxruntime_int8_is_exact() -> bool:
    """Whether onnxruntime's uint8 x int8 products are exact on this CPU. Without VNNI (AVX2
    or AVX-512 alone: a Zen 3, a Skylake) its x86 kernels add pairs of byte products with
    vpmaddubsw, which saturates at int16: 255 * -128 twice is -65280, read as -32768.
    onnxruntime documents this (its quantization guide's `reduce_range`); cuvil's kernels
    widen to int16 first and are exact everywhere."""
    import onnxruntime as ort

    a = np.full((4, 64), 255, np.uint8)
    b = np.full((64, 16), -128, np.int8)
    model = make_model([helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
                       {"a": ("uint8", a.shape)}, {"y": np.int32}, {"b": b}, opset=13)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"a": a})[0]
    return bool(np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64)))


def int8_oracle(model: onnx.ModelProto) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """feeds -> outputs of an integer or QDQ model (standard ONNX domains only): onnxruntime's
    where its uint8 x int8 products are exact on this CPU (`onnxruntime_int8_is_exact`), else
    onnx's reference evaluator, whose numpy integer arithmetic is exact everywhere."""
    if onnxruntime_int8_is_exact():
        import onnxruntime as ort

        session = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        return lambda feeds: session.run(None, dict(feeds))
    return reference_oracle(model)


def reference_oracle(model: onnx.ModelProto) -> Callable[[Mapping[str, np.ndarray]],
                                                         list[np.ndarray]]:
    """feeds -> outputs by onnx's reference evaluator (a QDQ model computed as its ops say)."""
    from onnx.reference import ReferenceEvaluator
    from onnx.version_converter import convert_version

    # the evaluator implements the quantization ops from opset 19 on
    opset = max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    reference = ReferenceEvaluator(convert_version(model, 21) if opset < 21 else model)
    return lambda feeds: [np.asarray(r) for r in reference.run(None, dict(feeds))]


def assert_matches_ort(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    rtol: float = 1e-4,
    atol: float = 1e-5,
    inputs: Mapping[str, Sequence[int | str]] | None = None,
    compiled: Any = None,
) -> Any:
    """Compile `model` (unless `compiled` is given), run both, compare every output."""
    compiled = compiled or cuvil.compile(model, inputs=inputs)
    expected = run_ort(model, feeds)
    got = compiled.run(dict(feeds))
    names = [o.name for o in model.graph.output]
    assert len(expected) == len(names), f"onnxruntime gives {len(expected)} outputs for {names}"
    assert [info.name for info in compiled.outputs] == names, \
        f"cuvil declares outputs {[info.name for info in compiled.outputs]}, the model {names}"
    assert sorted(got) == sorted(names), f"cuvil returns {sorted(got)}, the model has {names}"
    for info, want in zip(compiled.outputs, expected):
        have = got[info.name]
        assert have.shape == want.shape, f"{info.name}: shape {have.shape} != {want.shape}"
        assert have.dtype == want.dtype, f"{info.name}: dtype {have.dtype} != {want.dtype}"
        if want.dtype.kind in "fc":
            np.testing.assert_allclose(have, want, rtol=rtol, atol=atol, err_msg=info.name)
        else:
            np.testing.assert_array_equal(have, want, err_msg=info.name)
    return compiled
