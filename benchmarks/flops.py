"""Floating-point operations of one run of an ONNX model, counted from its graph.

Only the ops that dominate the arithmetic count: Conv, ConvTranspose, Gemm, MatMul (batched
too), Einsum and the recurrent LSTM/GRU/RNN, each as 2 x its multiply-adds (biases,
activations, pooling and normalisation are left out, as papers and vendors count).

    python benchmarks/flops.py     # the hand cross-checks on a convolution and attention scores
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, shape_inference

_COUNTED = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Einsum", "LSTM", "GRU", "RNN")


def _pinned(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    pinned = onnx.ModelProto()
    pinned.CopyFrom(model)
    for vi in pinned.graph.input:
        if vi.name in shapes:
            dims = vi.type.tensor_type.shape.dim
            for dim, size in zip(dims, shapes[vi.name]):
                dim.Clear()
                dim.dim_value = int(size)
    del pinned.graph.value_info[:]
    for vi in pinned.graph.output:  # old zoo models declare some output shapes wrongly
        vi.type.tensor_type.ClearField("shape")
    return pinned


def _known_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    graph = model.graph
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape") and all(
                d.HasField("dim_value") for d in dims):
            shapes[vi.name] = [d.dim_value for d in dims]
    for node in graph.node:  # Constant nodes: shape inference does not always record them
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            shapes.setdefault(node.output[0], list(node.attribute[0].t.dims))
    return shapes


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(helper.get_attribute_value(a))
    return default


def _node_flops(node: onnx.NodeProto, shape: dict[str, list[int]]) -> int | None:
    """2 x multiply-adds of one node; None when a needed shape is unknown."""
    op, ins, outs = node.op_type, node.input, node.output
    if op not in _COUNTED:
        return 0
    try:
        return _counted(node, op, ins, outs, shape)
    except KeyError:
        return None


def _counted(node: onnx.NodeProto, op: str, ins: Sequence[str], outs: Sequence[str],
             shape: dict[str, list[int]]) -> int:
    if op == "Conv":  # each output element: (C/groups) x kernel multiply-adds
        return 2 * math.prod(shape[outs[0]]) * math.prod(shape[ins[1]][1:])
    if op == "ConvTranspose":  # each input element scatters into (M/groups) x kernel outputs
        return 2 * math.prod(shape[ins[0]]) * math.prod(shape[ins[1]][1:])
    if op == "Gemm":
        a = shape[ins[0]]
        k = a[0] if _attr(node, "transA", 0) else a[1]
        return 2 * math.prod(shape[outs[0]]) * k
    if op == "MatMul":  # batched too: each output element is a K-long dot product
        return 2 * math.prod(shape[outs[0]]) * shape[ins[0]][-1]
    if op == "Einsum":
        equation = next(a.s.decode() for a in node.attribute if a.name == "equation")
        return einsum_flops(equation, [shape[i] for i in ins], shape[outs[0]])
    # recurrent: X [seq, batch, in] (layout 0) or [batch, seq, in]; W [dirs, gates*H, in],
    # R [dirs, gates*H, H]: every step multiplies the input and the hidden state by both
    x, w, r = shape[ins[0]], shape[ins[1]], shape[ins[2]]
    steps_and_batch = x[0] * x[1]
    dirs, gates_h = w[0], w[1]
    return 2 * steps_and_batch * dirs * gates_h * (w[2] + r[2])


def einsum_flops(equation: str, inputs: Sequence[Sequence[int]], output: Sequence[int]) -> int:
    """2 x the multiply-adds of an Einsum of two or more operands: each output element sums a
    product over every label that is in the inputs but not the output ("bhqd,bhkd->bhqk": d).
    One operand (a transpose, trace or sum) multiplies nothing: 0."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) < 2:
        return 0
    sizes: dict[str, int] = {}
    for term, dims in zip(terms, inputs):  # labels before "..." count from the left, after from the right
        before, _, after = term.partition("...")
        placed = [*zip(before, dims), *zip(reversed(after), reversed(list(dims)))]
        for label, size in placed:
            sizes[label] = max(sizes.get(label, 1), int(size))  # broadcast: 1 against n is n
    letters = lhs.replace(",", "").replace(".", "")
    kept = set(rhs) if arrow else {c for c in letters if letters.count(c) == 1}  # implicit output
    summed = math.prod(sizes[c] for c in set(letters) - kept)
    return 2 * (len(terms) - 1) * math.prod(output) * summed


def _needed(node: onnx.NodeProto) -> list[str]:
    return [*node.input[:3], node.output[0]] if node.op_type in _COUNTED else []


def _run_shapes(model: onnx.ModelProto, names: set[str],
                feeds: Mapping[str, np.ndarray]) -> dict[str, list[int]]:
    """Shapes of some intermediate tensors from one onnxruntime run that outputs them."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in sorted(names))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    return {n: list(v.shape) for n, v in zip(sorted(names), session.run(sorted(names), dict(feeds)))}


def count_flops(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> tuple[int, bool]:
    """FLOPs of one run on these inputs, and whether every counted node had its shapes.

    Shapes come from onnx's shape inference; those it cannot resolve (a Reshape to a
    computed shape, say) from one onnxruntime run that outputs the tensors in question.
    """
    inferred = shape_inference.infer_shapes(
        _pinned(model, {k: v.shape for k, v in feeds.items()}), data_prop=True)
    known = _known_shapes(inferred)
    missing = {n for node in inferred.graph.node if _node_flops(node, known) is None
               for n in _needed(node) if n and n not in known}
    if missing:
        known.update(_run_shapes(model, missing, feeds))
    total, complete = 0, True
    for node in inferred.graph.node:
        flops = _node_flops(node, known)
        if flops is None:
            complete = False
        else:
            total += flops
    return total, complete


def _cross_check() -> None:
    """ResNet-50's first layer by hand: 64 filters of 3x7x7 over a 112x112 output."""
    from onnx import TensorProto, numpy_helper

    w = numpy_helper.from_array(np.zeros((64, 3, 7, 7), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[3] * 4, strides=[2, 2])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    by_hand = 2 * (64 * 112 * 112) * (3 * 7 * 7)  # 236,027,904 per image
    for batch in (1, 8):
        counted, complete = count_flops(model, {"x": np.zeros((batch, 3, 224, 224), np.float32)})
        assert complete and counted == batch * by_hand, (counted, batch * by_hand)
    print(f"conv 3->64 7x7/2 at 224x224: {by_hand / 1e9:.4f} GFLOP per image, counted the same")

    # attention scores of 12 heads, 128 positions, 64 per head: as Einsum and as batched MatMul
    by_hand = 2 * 12 * 128 * 128 * 64
    q = np.zeros((1, 12, 128, 64), np.float32)
    nodes = {"Einsum": helper.make_node("Einsum", ["q", "k"], ["s"], equation="bhqd,bhkd->bhqk"),
             "MatMul": helper.make_node("MatMul", ["q", "k"], ["s"])}
    for op, node in nodes.items():
        k_shape = [1, 12, 128, 64] if op == "Einsum" else [1, 12, 64, 128]
        graph = helper.make_graph(
            [node], op, [helper.make_tensor_value_info("q", TensorProto.FLOAT, list(q.shape)),
                         helper.make_tensor_value_info("k", TensorProto.FLOAT, k_shape)],
            [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        counted, complete = count_flops(model, {"q": q, "k": np.zeros(k_shape, np.float32)})
        assert complete and counted == by_hand, (op, counted, by_hand)
    print(f"attention scores 12 x 128 x 128 x 64 as Einsum and as batched MatMul: "
          f"{by_hand / 1e9:.4f} GFLOP, counted the same")


if __name__ == "__main__":
    _cross_check()
