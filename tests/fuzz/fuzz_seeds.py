"""Small valid ONNX models the fuzzers start from, and the mutations they apply to them.

Every seed is built with onnx.helper, passes onnx's checker and runs in onnxruntime. A mutation
is plain data, `(kind, a, b)` with two ints that pick what to change (taken modulo the number of
candidates), so a failing case found by hypothesis reads back as an `@example` and replays
exactly, whatever the seed model looks like.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
_rng = np.random.default_rng(0)


def _w(*shape: int) -> np.ndarray:
    return _rng.standard_normal(shape).astype(np.float32)


def _model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
           outputs: Sequence[onnx.ValueInfoProto], inits: dict[str, np.ndarray],
           opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "seed", list(inputs), list(outputs),
                              [numpy_helper.from_array(a, n) for n, a in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _vi(name: str, shape: Sequence[int | str], elem: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def elementwise() -> onnx.ModelProto:
    nodes = [helper.make_node("Add", ["x", "b"], ["t0"]),
             helper.make_node("Mul", ["t0", "x"], ["t1"]),
             helper.make_node("Relu", ["t1"], ["t2"]),
             helper.make_node("Sigmoid", ["t2"], ["t3"]),
             helper.make_node("Clip", ["t3", "lo", "hi"], ["y"])]
    return _model(nodes, [_vi("x", ["N", 4])], [_vi("y", ["N", 4])],
                  {"b": _w(4), "lo": np.array(0.1, np.float32), "hi": np.array(0.9, np.float32)})


def conv() -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "w", "c"], ["t"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              strides=[1, 2], dilations=[1, 1], group=1),
             helper.make_node("Relu", ["t"], ["y"])]
    return _model(nodes, [_vi("x", [1, 2, 5, 6])], [_vi("y", [1, 3, 5, 3])],
                  {"w": _w(3, 2, 3, 3), "c": _w(3)})


def matmul() -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"]),
             helper.make_node("Add", ["t", "b"], ["u"]),
             helper.make_node("Softmax", ["u"], ["y"], axis=-1)]
    return _model(nodes, [_vi("x", ["N", 3])], [_vi("y", ["N", 4])], {"w": _w(3, 4), "b": _w(4)})


def reshape_transpose() -> onnx.ModelProto:
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
             helper.make_node("Reshape", ["t", "shape"], ["r"]),
             helper.make_node("Gather", ["r", "idx"], ["y"], axis=1)]
    return _model(nodes, [_vi("x", [2, 3, 4])], [_vi("y", [4, 2])],
                  {"shape": np.array([4, -1], np.int64), "idx": np.array([5, 0], np.int64)})


def if_else() -> onnx.ModelProto:
    then = helper.make_graph([helper.make_node("Add", ["x", "one"], ["a"])], "then", [],
                             [_vi("a", ["N", 3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["b"])], "else", [],
                              [_vi("b", ["N", 3])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    return _model(nodes, [_vi("x", ["N", 3])], [_vi("y", ["N", 3])],
                  {"one": np.ones(3, np.float32), "zero": np.array(0, np.float32)})


def loop() -> onnx.ModelProto:
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Mul", ["acc_in", "half"], ["m"]),
         helper.make_node("Add", ["m", "x"], ["acc_out"])],
        "body",
        [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("acc_in", [3])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_out", [3])])
    nodes = [helper.make_node("Loop", ["trips", "go", "x"], ["y"], body=body)]
    return _model(nodes, [_vi("x", [3])], [_vi("y", [3])],
                  {"trips": np.array(3, np.int64), "go": np.array(True),
                   "half": np.array(0.5, np.float32)})


SEEDS: dict[str, Callable[[], onnx.ModelProto]] = {
    f.__name__: f for f in (elementwise, conv, matmul, reshape_transpose, if_else, loop)}


# -- graph-level mutations --------------------------------------------------------------------

def graphs(g: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every subgraph (If branches, Loop bodies), outermost first."""
    yield g
    for node in g.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                yield from graphs(attr.g)


def _pick(items: Sequence[Any], i: int) -> Any:
    return items[i % len(items)] if items else None


#: values that break assumptions: negative, zero, huge, beyond int64
_BAD_INTS = [-1, 0, 1, 2, -(2**31), 2**31, 2**62, 2**63 - 1, -(2**63), 7, 1000003]
_BAD_FLOATS = [float("nan"), float("inf"), -1.0, 0.0, 1e30, -1e-30]


def _bad_attribute(name: str, kind: int, value: int) -> AttributeProto:
    """An attribute of `name` with a type and value chosen by `kind` and `value`."""
    n = _BAD_INTS[value % len(_BAD_INTS)]
    makers: list[Callable[[], AttributeProto]] = [
        lambda: helper.make_attribute(name, n),
        lambda: helper.make_attribute(name, [n] * (value % 5)) if value % 5 else
        AttributeProto(name=name, type=AttributeProto.INTS),
        lambda: helper.make_attribute(name, _BAD_FLOATS[value % len(_BAD_FLOATS)]),
        lambda: helper.make_attribute(name, [1.5, -2.0][: value % 3]) if value % 3 else
        AttributeProto(name=name, type=AttributeProto.FLOATS),
        lambda: helper.make_attribute(name, "NOTSET" if value % 2 else ""),
        lambda: helper.make_attribute(name, numpy_helper.from_array(np.full(value % 4, n % 97,
                                                                            np.int64))),
        lambda: helper.make_attribute(name, helper.make_graph([], "empty", [], [])),
        lambda: AttributeProto(name=name, type=value % 15),  # a type with no value set
    ]
    return makers[kind % len(makers)]()


def mutate(model: onnx.ModelProto, kind: str, a: int, b: int) -> None:  # noqa: C901  (older than the rule: to split)
    """Apply one mutation in place. `a` picks the graph element, `b` what it becomes; a
    mutation with nothing to act on (no attribute to drop...) changes nothing."""
    if kind not in MUTATIONS:
        raise AssertionError(f"unknown mutation {kind!r}")
    g = _pick(list(graphs(model.graph)), b >> 8)
    nodes = list(g.node)
    node = _pick(nodes, a)
    if kind == "attribute" and node is not None:
        names = [x.name for x in node.attribute] + ["axis", "perm", "kernel_shape", "pads", "to",
                                                     "strides", "group", "keepdims", "bogus"]
        name = _pick(names, a >> 4)
        keep = [x for x in node.attribute if x.name != name]
        del node.attribute[:]
        node.attribute.extend([*keep, _bad_attribute(name, b, b >> 3)])
    elif kind == "drop_attribute" and node is not None and node.attribute:
        del node.attribute[a % len(node.attribute)]
    elif kind == "dangling_input" and node is not None and node.input:
        node.input[b % len(node.input)] = "nowhere" if b % 3 else ""
    elif kind == "cycle" and len(nodes) > 0 and node.input:
        # feed a node from its own output or a later node's
        later = _pick(nodes[nodes.index(node):], b)
        node.input[b % len(node.input)] = later.output[0]
    elif kind == "duplicate_output":
        if b % 2 and len(nodes) > 1:
            other = _pick([n for n in nodes if n is not node], b >> 1)
            other.output[0] = node.output[0]
        elif g.output:
            g.output.append(_pick(g.output, b))
    elif kind == "drop_node" and node is not None:
        g.node.remove(node)
    elif kind == "op_type" and node is not None:
        node.op_type = _pick(["Relu", "Add", "Conv", "MatMul", "Reshape", "Loop", "If", "Cast",
                              "Concat", "Split", "NoSuchOp", "Transpose", "Gather", "Slice"], b)
    elif kind == "drop_initializer" and g.initializer:
        del g.initializer[a % len(g.initializer)]
    elif kind == "initializer":
        _mutate_initializer(_pick(list(g.initializer), a), b)
    elif kind == "dim":
        _mutate_dim(_pick([*g.input, *g.output], a), a >> 4, b)
    elif kind == "dtype":
        vi = _pick([*g.input, *g.output], a)
        if vi is not None:
            vi.type.tensor_type.elem_type = b % 27
    elif kind == "opset":
        _mutate_opset(model, a, b)
    elif kind == "ir_version":
        model.ir_version = _pick([0, 1, 3, 4, 7, 8, 10, 11, 99, -1], b)
    elif kind == "graph_io":
        if b % 3 == 0 and g.input:
            del g.input[a % len(g.input)]
        elif b % 3 == 1 and g.output:
            del g.output[a % len(g.output)]
        else:
            g.input.append(_vi(f"extra{a % 3}", [b % 4]))


def _mutate_initializer(init: onnx.TensorProto | None, b: int) -> None:
    if init is None:
        return
    choice = b % 4
    if choice == 0:  # dims that do not match the data
        init.dims[:] = [_BAD_INTS[(b >> 2) % len(_BAD_INTS)] % (2**40), *list(init.dims)[1:]]
    elif choice == 1:  # another element type over the same bytes
        init.data_type = (b >> 2) % 27
    elif choice == 2:  # truncate the payload
        try:
            raw = init.raw_data or numpy_helper.to_array(init).tobytes()
        except ValueError:  # an earlier mutation broke it already
            raw = bytes(8)
        init.ClearField("float_data")
        init.ClearField("int64_data")
        init.ClearField("int32_data")
        init.raw_data = raw[: (b >> 2) % max(len(raw), 1)]
    else:  # an empty tensor of the same rank
        init.dims[:] = [0] * len(init.dims)


def _mutate_dim(vi: onnx.ValueInfoProto | None, axis: int, b: int) -> None:
    if vi is None or not vi.type.HasField("tensor_type"):
        return
    shape = vi.type.tensor_type.shape
    if b % 7 == 6:  # another rank
        shape.dim.add().dim_value = 2
        return
    if b % 7 == 5:
        vi.type.tensor_type.ClearField("shape")
        return
    if not shape.dim:
        return
    dim = shape.dim[axis % len(shape.dim)]
    value = [0, 1, 2**40, 2**62, -1, 2**63 - 1][(b >> 3) % 6]
    if b % 7 == 4:
        dim.dim_param = ["", "N", "?", "unk", "x y"][(b >> 3) % 5]
    else:
        dim.dim_value = value


def _mutate_opset(model: onnx.ModelProto, a: int, b: int) -> None:
    versions = [0, 1, 5, 6, 7, 9, 11, 13, 17, 18, 21, 23, 99, -3]
    choice = b % 4
    if choice == 0 and model.opset_import:
        model.opset_import[0].version = _pick(versions, a)
    elif choice == 1:
        model.opset_import.add(domain=_pick(["", "ai.onnx.ml", "com.microsoft", "x"], a),
                               version=_pick(versions, b >> 2))
    elif choice == 2 and model.opset_import:
        model.opset_import[0].domain = _pick(["ai.onnx", "x", "ai.onnx.ml"], a)
    else:
        del model.opset_import[:]


MUTATIONS = ["attribute", "drop_attribute", "dangling_input", "cycle", "duplicate_output",
             "drop_node", "op_type", "drop_initializer", "initializer", "dim", "dtype", "opset",
             "ir_version", "graph_io"]


def mutated(seed: str, mutations: Sequence[tuple[str, int, int]]) -> bytes:
    """The serialized seed model after the mutations, in order."""
    model = SEEDS[seed]()
    for kind, a, b in mutations:
        mutate(model, kind, a, b)
    return model.SerializeToString()


# -- byte-level mutations ---------------------------------------------------------------------

BYTE_MUTATIONS = ["flip", "set", "truncate", "delete", "insert", "duplicate"]


def mutated_bytes(data: bytes, mutations: Sequence[tuple[str, int, int]]) -> bytes:
    """`data` after byte flips, overwrites, a truncation, deletions, insertions or a repeated
    span; `a` picks the position, `b` the value or length."""
    buf = bytearray(data)
    for kind, a, b in mutations:
        if not buf:
            break
        pos = a % len(buf)
        if kind == "flip":
            buf[pos] ^= 1 << (b % 8)
        elif kind == "set":
            buf[pos] = b % 256
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "delete":
            del buf[pos:pos + 1 + b % 8]
        elif kind == "insert":
            buf[pos:pos] = bytes([b % 256]) * (1 + (b >> 8) % 8)
        elif kind == "duplicate":
            buf[pos:pos] = buf[pos:pos + 1 + b % 64]
        else:
            raise AssertionError(f"unknown byte mutation {kind!r}")
    return bytes(buf)
