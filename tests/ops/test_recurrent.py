"""LSTM, GRU and RNN against onnxruntime, onnx's reference evaluator (float64) and the ONNX
backend node test cases, plus a CRNN exported from PyTorch.

Random cases are batched: one model holds many independent recurrent nodes (each with its own
inputs and weights), compiled once by cuvil and run by onnxruntime as a whole, at several
values of the symbolic sequence and batch dims. onnxruntime runs GRU and RNN with layout 0
only, so its copy of the model computes layout-1 nodes with layout 0 between Transposes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import cuvil
from cuvil.errors import ModelError, UnsupportedOpError

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
PER_DIRECTION = {"LSTM": 3, "GRU": 2, "RNN": 1}
#: activation -> (takes alpha, takes beta); the values drawn keep the recurrences bounded
ACTIVATIONS = {
    "Sigmoid": (False, False), "Tanh": (False, False), "Relu": (False, False),
    "Affine": (True, True), "LeakyRelu": (True, False), "ThresholdedRelu": (True, False),
    "ScaledTanh": (True, True), "HardSigmoid": (True, True), "Elu": (True, False),
    "Softsign": (False, False), "Softplus": (False, False),
}
#: the activations drawn for LSTM/GRU gates (f): bounded ones, since a gate above 1 makes the
#: states grow exponentially and the comparison turns into one of overflow behaviours
BOUNDED = ("Sigmoid", "HardSigmoid", "Tanh", "Softsign", "ScaledTanh")
DATA = Path(__file__).parent.parent / "data"


@dataclass
class Case:
    op: str
    node: onnx.NodeProto
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    #: run-time inputs: name -> (dtype, shape with "seq"/"batch" symbols, kind)
    feeds: dict[str, tuple[Any, list[Any], str]] = field(default_factory=dict)


def random_case(rng: np.random.Generator, i: int, dtype: Any = np.float32, opset: int = 22,  # noqa: C901  (older than the rule: to split)
                static: tuple[int, int] | None = None, op: str | None = None,
                hidden: int | None = None, isize: int | None = None, exotic: bool = True,
                lengths: bool = True, const: bool | None = None, **overrides: Any) -> Case:
    """One recurrent node with random attributes, optional inputs and requested outputs.

    With `static` = (seq, batch) the shapes are fixed and sequence_lens may be a constant;
    otherwise they use the symbols "seq" and "batch". `exotic` allows clip, input_forget and
    non-default activations; `lengths` allows sequence_lens; `const` makes the weights constant
    (True) or run-time inputs (False), else either at random. `overrides` set attributes.
    """
    op = op or str(rng.choice(list(GATES)))
    g = GATES[op]
    hidden = hidden or int(rng.integers(1, 9))
    isize = isize or int(rng.integers(1, 7))
    direction = str(rng.choice(["forward", "reverse", "bidirectional"]))
    dirs = 2 if direction == "bidirectional" else 1
    layout = int(rng.integers(0, 2)) if opset >= 14 else 0
    seq, batch = static if static else ("seq", "batch")
    p = f"c{i}_"
    attrs: dict[str, Any] = {"hidden_size": hidden, "direction": direction}
    if opset >= 14 and (layout or rng.random() < 0.2):
        attrs["layout"] = layout
    if exotic and rng.random() < 0.3:
        attrs["clip"] = float(rng.uniform(0.5, 3.0))
    if exotic and op == "LSTM" and rng.random() < 0.3:
        attrs["input_forget"] = 1
    if op == "GRU" and rng.random() < 0.5:
        attrs["linear_before_reset"] = 1
    attrs.update(overrides)
    direction = attrs["direction"]
    dirs = 2 if direction == "bidirectional" else 1
    layout = attrs.get("layout", 0)
    if exotic and rng.random() < 0.4:
        names, alphas, betas = [], [], []
        for j in range(PER_DIRECTION[op] * dirs):
            gate = op != "RNN" and j % PER_DIRECTION[op] == 0
            name = str(rng.choice(list(BOUNDED if gate else ACTIVATIONS)))
            names.append(name)
            takes_a, takes_b = ACTIVATIONS[name]
            # some alphas/betas are left out so the defaults are exercised too
            if takes_a and rng.random() < 0.8:
                alphas.append(float(rng.uniform(0.1, 1.0)))
            if takes_b and rng.random() < 0.8:
                betas.append(float(rng.uniform(-0.5, 0.5)))
        attrs["activations"] = names
        if alphas:
            attrs["activation_alpha"] = alphas
        if betas:
            attrs["activation_beta"] = betas

    case = Case(op, helper.make_node("Identity", [], []))
    scale = 1.0 / np.sqrt(max(hidden, isize))

    def weight(name: str, shape: tuple[int, ...], const: bool) -> str:
        arr = (rng.standard_normal(shape) * scale).astype(dtype)
        if const:
            case.inits.append(numpy_helper.from_array(arr, p + name))
        else:
            case.feeds[p + name] = (dtype, list(shape), "weight")
        return p + name

    x_shape = [seq, batch, isize] if layout == 0 else [batch, seq, isize]
    case.feeds[p + "X"] = (dtype, x_shape, "data")
    const_weights = rng.random() < 0.7 if const is None else const
    ins = [p + "X", weight("W", (dirs, g * hidden, isize), const_weights),
           weight("R", (dirs, g * hidden, hidden), const_weights)]
    ins.append(weight("B", (dirs, 2 * g * hidden), const_weights) if rng.random() < 0.7 else "")
    if lengths and rng.random() < 0.5:
        if static and rng.random() < 0.5:
            lens = rng.integers(0, static[0] + 1, size=static[1]).astype(np.int32)
            case.inits.append(numpy_helper.from_array(lens, p + "lens"))
        else:
            case.feeds[p + "lens"] = (np.int32, [batch], "lens")
        ins.append(p + "lens")
    else:
        ins.append("")
    state = [dirs, batch, hidden] if layout == 0 else [batch, dirs, hidden]
    n_states = 2 if op == "LSTM" else 1
    for s in range(n_states):
        if rng.random() < 0.5:
            case.feeds[p + f"init{s}"] = (dtype, state, "data")
            ins.append(p + f"init{s}")
        else:
            ins.append("")
    if op == "LSTM":
        ins.append(weight("P", (dirs, 3 * hidden), const_weights) if rng.random() < 0.5 else "")
    while ins and not ins[-1]:
        ins.pop()

    n_out = 3 if op == "LSTM" else 2
    wanted = [bool(rng.random() < 0.6) for _ in range(n_out)]
    if not any(wanted):
        wanted[int(rng.integers(0, n_out))] = True
    outs = [p + o if w else "" for o, w in zip(["Y", "Y_h", "Y_c"], wanted)]
    while not outs[-1]:
        outs.pop()
    case.outputs = [o for o in outs if o]
    case.node = helper.make_node(op, ins, outs, name=f"case{i}", **attrs)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for name, (dt, shape, _) in case.feeds.items():
        t = helper.np_dtype_to_tensor_dtype(np.dtype(dt)) if dt is np.int32 else elem
        case.inputs.append(helper.make_tensor_value_info(name, t, shape))
    return case


def batchwise_as_seqwise(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The same computation with layout 0 between Transposes (onnxruntime runs GRU and RNN
    only with layout 0; the transposes make it an oracle for layout 1 too)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if not attrs.get("layout", 0):
        return [node]
    attrs["layout"] = 0
    attrs = {k: v.decode() if isinstance(v, bytes) else
             [x.decode() for x in v] if isinstance(v, list) and v and isinstance(v[0], bytes) else v
             for k, v in attrs.items()}
    nodes, ins, outs = [], list(node.input), []
    for i in (0, 5, 6):  # X and the initial states: batch first -> batch second
        if i < len(ins) and ins[i]:
            nodes.append(helper.make_node("Transpose", [ins[i]], [ins[i] + "_t"], perm=[1, 0, 2]))
            ins[i] += "_t"
    post = []
    for i, name in enumerate(node.output):
        if not name:
            outs.append("")
            continue
        outs.append(name + "_t")
        perm = [2, 0, 1, 3] if i == 0 else [1, 0, 2]
        post.append(helper.make_node("Transpose", [name + "_t"], [name], perm=perm))
    nodes.append(helper.make_node(node.op_type, ins, outs, name=node.name, **attrs))
    return nodes + post


def build(cases: list[Case], opset: int = 22, oracle: bool = False) -> onnx.ModelProto:
    """The model cuvil compiles, or (`oracle`) the equivalent one onnxruntime runs."""
    nodes = [n for c in cases for n in (batchwise_as_seqwise(c.node) if oracle else [c.node])]
    graph = helper.make_graph(
        nodes, "recurrent",
        [v for c in cases for v in c.inputs],
        [helper.make_empty_tensor_value_info(o) for c in cases for o in c.outputs],
        [t for c in cases for t in c.inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset <= 17 else 10
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model


def make_feeds(rng: np.random.Generator, cases: list[Case], seq: int, batch: int) -> dict[str, np.ndarray]:
    feeds = {}
    for c in cases:
        for name, (dtype, shape, kind) in c.feeds.items():
            concrete = [{"seq": seq, "batch": batch}.get(d, d) if isinstance(d, str) else d
                        for d in shape]
            if kind == "lens":
                feeds[name] = rng.integers(0, seq + 1, size=concrete).astype(np.int32)
            elif kind == "weight":
                fan = max(concrete[-1], 1)
                feeds[name] = (rng.standard_normal(concrete) / np.sqrt(fan)).astype(dtype)
            else:
                feeds[name] = rng.standard_normal(concrete).astype(dtype)
    return feeds


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime's outputs for `model` (made with ``build(..., oracle=True)``)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def compare(cases: list[Case], got: dict[str, np.ndarray], want: dict[str, np.ndarray],
            rtol: float, atol: float, where: str) -> list[str]:
    failures = []
    for c in cases:
        for o in c.outputs:
            try:
                assert got[o].shape == want[o].shape, f"shape {got[o].shape} != {want[o].shape}"
                assert got[o].dtype == want[o].dtype, f"dtype {got[o].dtype} != {want[o].dtype}"
                np.testing.assert_allclose(got[o], want[o], rtol=rtol, atol=atol)
            except AssertionError as exc:
                node = helper.printable_node(c.node)
                failures.append(f"{where}: {o} of {node}: {' '.join(str(exc).split())[:400]}")
    return failures


# -- random cases against onnxruntime ----------------------------------------------------


@pytest.mark.parametrize("opset", [22, *(pytest.param(o, marks=pytest.mark.slow) for o in (14, 7))])
def test_random_symbolic(opset: int) -> None:
    """One compiled model, many random nodes, checked at several (seq, batch) sizes."""
    rng = np.random.default_rng(opset)
    cases = [random_case(rng, i, opset=opset) for i in range(24 if opset == 22 else 10)]
    model, oracle = build(cases, opset), build(cases, opset, oracle=True)
    compiled = cuvil.compile(model)
    failures = []
    for seq, batch in [(1, 1), (4, 3), (9, 2)]:
        feeds = make_feeds(rng, cases, seq, batch)
        failures += compare(cases, compiled.run(feeds), run_ort(oracle, feeds), 1e-4, 1e-5,
                            f"seq={seq} batch={batch}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


def test_random_static_with_constant_lengths() -> None:
    rng = np.random.default_rng(1)
    cases = [random_case(rng, i, static=(5, 3)) for i in range(16)]
    model, oracle = build(cases), build(cases, oracle=True)
    compiled = cuvil.compile(model)
    feeds = make_feeds(rng, cases, 5, 3)
    failures = compare(cases, compiled.run(feeds), run_ort(oracle, feeds), 1e-4, 1e-5, "static")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


def test_float64() -> None:
    """float64 against onnx's reference evaluator (onnxruntime has float32 kernels only; the
    reference knows no activations, clip, input_forget or sequence_lens)."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(2)
    cases = [random_case(rng, i, dtype=np.float64, op=["LSTM", "GRU", "RNN"][i % 3], exotic=False,
                         lengths=False) for i in range(9)]
    model = build(cases)
    compiled = cuvil.compile(model)
    ref = ReferenceEvaluator(model)
    for seq, batch in [(1, 2), (6, 3)]:
        feeds = make_feeds(rng, cases, seq, batch)
        want = dict(zip(ref.output_names, ref.run(None, feeds)))
        failures = compare(cases, compiled.run(feeds), want, 1e-10, 1e-12, f"seq={seq}")
        assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


def test_larger_shapes() -> None:
    """Hidden and input sizes past the vector width, a long sequence, and batches below and
    past the GEMM kernel's row tile (the vectorized and tiled paths)."""
    rng = np.random.default_rng(3)
    cases = [random_case(rng, i, op=op, hidden=h, isize=n, exotic=False)
             for i, (op, h, n) in enumerate([("LSTM", 37, 21), ("GRU", 33, 40), ("RNN", 64, 17),
                                             ("LSTM", 16, 64), ("GRU", 20, 9)])]
    cases.append(random_case(rng, 5, op="GRU", hidden=24, isize=8, exotic=False,
                             linear_before_reset=0, direction="bidirectional"))
    model, oracle = build(cases), build(cases, oracle=True)
    compiled = cuvil.compile(model)
    failures = []
    for seq, batch in [(40, 4), (12, 13)]:
        feeds = make_feeds(rng, cases, seq, batch)
        failures += compare(cases, compiled.run(feeds), run_ort(oracle, feeds), 1e-4, 1e-5,
                            f"seq={seq} batch={batch}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


@pytest.mark.parametrize("const", [True, False], ids=["packed", "runtime_weights"])
def test_recurrent_kernel_panels(const: bool) -> None:
    """Hidden sizes around the packed panels of the per-step kernel (64 columns: whole panels,
    a partial last panel, gates called one by one when hidden is not a multiple of 64), at
    batches hitting its 4-, 2- and 1-row tiles and the GEMM kernel's whole row tiles (13 rows:
    past AVX-512's 12), each with blocks of one and of several panels; both directions,
    sequence_lens, both GRU reset modes; on one thread and with a single direction's units
    split over two. With run-time weights, the same nodes on the unpacked fallback."""
    rng = np.random.default_rng(4)
    shapes = [("LSTM", 64, 30, {"direction": "bidirectional"}),
              ("LSTM", 70, 12, {"direction": "reverse"}),
              ("GRU", 128, 16, {"linear_before_reset": 0}),
              ("GRU", 96, 20, {"linear_before_reset": 0, "direction": "bidirectional"}),
              ("GRU", 100, 8, {"linear_before_reset": 1}),
              ("RNN", 65, 10, {"direction": "forward"})]
    cases = [random_case(rng, i, op=op, hidden=h, isize=n, exotic=False, const=const, **attrs)
             for i, (op, h, n, attrs) in enumerate(shapes)]
    model, oracle = build(cases), build(cases, oracle=True)
    compiled = cuvil.compile(model)
    failures = []
    for seq, batch in [(7, 1), (5, 7), (3, 10), (3, 13)]:
        feeds = make_feeds(rng, cases, seq, batch)
        want = run_ort(oracle, feeds)
        for threads in (1, 2):
            compiled.num_threads = threads
            failures += compare(cases, compiled.run(feeds), want, 1e-4, 1e-5,
                                f"seq={seq} batch={batch} threads={threads}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


# -- errors ------------------------------------------------------------------------------


def _simple(op: str, **attrs: Any) -> onnx.ModelProto:
    g, h, i = GATES[op], 4, 3
    rng = np.random.default_rng(0)
    node = helper.make_node(op, ["X", "W", "R", "", "lens"], ["Y"], hidden_size=h, **attrs)
    graph = helper.make_graph(
        [node], "m",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["seq", "batch", i]),
         helper.make_tensor_value_info("lens", onnx.TensorProto.INT32, ["batch"])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.standard_normal((1, g * h, i)).astype(np.float32), "W"),
         numpy_helper.from_array(rng.standard_normal((1, g * h, h)).astype(np.float32), "R")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def test_sequence_lens_out_of_range_is_an_error() -> None:
    m = cuvil.compile(_simple("GRU"))
    x = np.zeros((3, 2, 3), np.float32)
    for bad in ([4, 1], [1, -1]):
        with pytest.raises(ValueError, match="GRU"):
            m.run({"X": x, "lens": np.array(bad, np.int32)})
    y = m.run({"X": x, "lens": np.array([3, 0], np.int32)})["Y"]
    assert y.shape == (3, 1, 2, 4)


def test_unknown_activation_is_unsupported() -> None:
    with pytest.raises(UnsupportedOpError, match="Gelu"):
        cuvil.compile(_simple("RNN", activations=["Gelu"]))


def test_hidden_size_from_r() -> None:
    """Without the (optional) hidden_size attribute the size comes from R; onnxruntime needs
    the attribute, so it runs the same node with it."""
    rng = np.random.default_rng(5)
    case = random_case(rng, 0, op="LSTM", hidden=6, isize=4)
    oracle = build([case], oracle=True)
    for attr in list(case.node.attribute):
        if attr.name == "hidden_size":
            case.node.attribute.remove(attr)
    compiled = cuvil.compile(build([case]))
    feeds = make_feeds(rng, [case], 5, 2)
    failures = compare([case], compiled.run(feeds), run_ort(oracle, feeds), 1e-4, 1e-5, "no hidden_size")
    assert not failures, "\n".join(failures)


def test_float16_is_unsupported() -> None:
    rng = np.random.default_rng(6)
    with pytest.raises(UnsupportedOpError, match="float16"):
        cuvil.compile(build([random_case(rng, 0, dtype=np.float16, op="GRU")]))


def test_wrong_activation_count_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="activations"):
        cuvil.compile(_simple("LSTM", activations=["Sigmoid", "Tanh"]))


# -- the ONNX backend node tests ---------------------------------------------------------


def _backend_cases() -> list[Any]:
    """The cases `onnx.backend.test.case.node.collect_testcases` gives for these ops, without
    importing (and running) every other op's generators: importing a node module runs its
    exports, which register the cases in the package's list."""
    import importlib

    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in ("lstm", "gru", "rnn"):
            importlib.import_module(f"onnx.backend.test.case.node.{module}")
    return [c for c in node._NodeTestCases if c.model.graph.node[0].op_type in GATES]


BACKEND = _backend_cases()


def test_backend_cases_found() -> None:
    assert len(BACKEND) >= 18


def _merged(cases: list[Any]) -> tuple[onnx.ModelProto, dict[str, np.ndarray],
                                       list[tuple[Any, str, np.ndarray]]]:
    """All backend cases as one model (names prefixed per case), its feeds, and for each
    expected output its case and prefixed name: one compile instead of one per case."""
    nodes, inputs, outputs, feeds, expected = [], [], [], {}, []
    for i, case in enumerate(cases):
        g = case.model.graph
        p = f"b{i}_"
        for n in g.node:
            nodes.append(helper.make_node(n.op_type, [p + x if x else "" for x in n.input],
                                          [p + x if x else "" for x in n.output], name=p + n.name,
                                          domain=n.domain))
            nodes[-1].attribute.extend(n.attribute)
        (ins, outs), = case.data_sets
        for vi, arr in zip(g.input, ins):
            inputs.append(helper.make_tensor_value_info(p + vi.name, vi.type.tensor_type.elem_type,
                                                        list(arr.shape)))
            feeds[p + vi.name] = arr
        for vi, arr in zip(g.output, outs):
            outputs.append(helper.make_tensor_value_info(p + vi.name, vi.type.tensor_type.elem_type,
                                                         list(arr.shape)))
            expected.append((case, p + vi.name, arr))
    opset = max(op.version for c in cases for op in c.model.opset_import if op.domain in ("", "ai.onnx"))
    model = helper.make_model(helper.make_graph(nodes, "backend", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = max(c.model.ir_version for c in cases)
    return model, feeds, expected


def test_backend_node_cases() -> None:
    """Every LSTM/GRU/RNN case of onnx's backend node tests (18 in onnx 1.23), compiled
    together, each output within the case's own rtol/atol."""
    model, feeds, expected = _merged(BACKEND)
    got = cuvil.compile(model).run(feeds)
    failed = set()
    for case, name, want in expected:
        try:
            np.testing.assert_allclose(got[name], want, rtol=case.rtol, atol=case.atol)
        except AssertionError as exc:
            failed.add(f"{case.name}: {' '.join(str(exc).split())[:300]}")
    assert not failed, f"{len(failed)} of {len(BACKEND)} cases fail:\n" + "\n".join(sorted(failed))


# -- a CRNN exported from PyTorch --------------------------------------------------------


def test_crnn_from_pytorch() -> None:
    """Conv/ReLU/MaxPool features -> sequence (Shape/Gather/Concat/Reshape) -> bidirectional
    LSTM (initial states from ConstantOfShape) -> MatMul classifier, at several batch sizes and
    image widths with one compile (see tests/data/make_crnn.py)."""
    model = onnx.load(str(DATA / "crnn.onnx"))
    compiled = cuvil.compile(model)
    rng = np.random.default_rng(4)
    for batch, width in [(1, 40), (3, 100), (2, 8), (1, 4)]:
        image = rng.standard_normal((batch, 1, 32, width)).astype(np.float32)
        want = run_ort(model, {"image": image})["logits"]
        have = compiled(image)
        assert have.shape == want.shape == (width // 4, batch, 11)
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-5)
