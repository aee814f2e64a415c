"""Check many small single-node cases with one compile: each case becomes an independent
subgraph of one model (names prefixed per case), compiled once by cuvil and compared output by
output against onnxruntime (or onnx's reference evaluator, for cases onnxruntime gets wrong).

A compile costs about a second whatever the model's size, so batching keeps op tests fast
while still covering many shapes and attributes. A failure names the case and its attributes.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

import cuvil
from cuvil.compiler.driver import compile_in_process

DEFAULT_OPSET = 17


@dataclass
class Case:
    """One node and its own inputs: run-time `feeds` and constant `consts`, named in `inputs`
    (None or "" for an absent optional input)."""

    op_type: str
    inputs: list[str | None]
    attrs: dict[str, Any]
    #: name -> (dtype, shape); shapes may hold str (symbolic) dims
    feeds: dict[str, tuple[Any, Sequence[int | str]]] = field(default_factory=dict)
    #: name -> array stored in the model (constant weights, pads...)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=lambda: ["y"])
    #: "ort" or "reference" (onnx.reference.ReferenceEvaluator)
    oracle: str = "ort"
    #: attributes the oracle's node gets instead of `attrs`: an equivalent spelling of the same
    #: computation (explicit pads for an auto_pad the oracle gets wrong, say)
    oracle_attrs: dict[str, Any] | None = None
    label: str = ""
    #: a function (rng, dtype, shape) -> array making this case's run-time inputs
    data: Any = None

    def describe(self) -> str:
        shapes = {n: list(s) for n, (_, s) in self.feeds.items()}
        shapes.update({n: list(a.shape) for n, a in self.consts.items()})
        return f"{self.label or self.op_type} {self.attrs} shapes={shapes}"


def _prefixed(i: int, name: str) -> str:
    return f"c{i}_{name}"


def build(cases: Sequence[Case], opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    nodes, inputs, inits, outputs = [], [], [], []
    for i, c in enumerate(cases):
        ins = [_prefixed(i, n) if n else "" for n in c.inputs]
        outs = [_prefixed(i, n) if n else "" for n in c.outputs]
        nodes.append(helper.make_node(c.op_type, ins, outs, name=f"case{i}", **c.attrs))
        for n, (dtype, shape) in c.feeds.items():
            shape = [f"c{i}_{d}" if isinstance(d, str) and d.startswith("_") else d for d in shape]
            inputs.append(helper.make_tensor_value_info(
                _prefixed(i, n), helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape))
        for n, a in c.consts.items():
            inits.append(numpy_helper.from_array(np.asarray(a), _prefixed(i, n)))
        outputs += [helper.make_empty_tensor_value_info(o) for o in outs if o]
    graph = helper.make_graph(nodes, "cases", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 8 if opset <= 17 else 10)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model


def _case_model(model: onnx.ModelProto, case: Case, i: int) -> onnx.ModelProto:
    """The subgraph of case i alone, as the oracle runs it."""
    prefix = f"c{i}_"
    g = model.graph
    nodes = [n for n in g.node if n.name == f"case{i}"]
    if case.oracle_attrs is not None:
        nodes = [helper.make_node(n.op_type, n.input, n.output, name=n.name, **case.oracle_attrs)
                 for n in nodes]
    graph = helper.make_graph(
        nodes, "case",
        [v for v in g.input if v.name.startswith(prefix)],
        # no output shapes: onnx's shape inference is wrong in corners the oracle gets right
        [helper.make_tensor_value_info(v.name, v.type.tensor_type.elem_type, None)
         for v in g.output if v.name.startswith(prefix)],
        [t for t in g.initializer if t.name.startswith(prefix)],
    )
    m = helper.make_model(graph, opset_imports=model.opset_import)
    m.ir_version = model.ir_version
    return m


def _oracle(case: Case, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    if case.oracle == "reference":
        from onnx.reference import ReferenceEvaluator

        return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, dict(feeds))]
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, dict(feeds))


def default_data(rng: np.random.Generator, dtype: Any, shape: Sequence[int]) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-5, 6, size=shape).astype(dtype)


def check_cases(
    cases: Sequence[Case],
    *,
    sizes: Sequence[Mapping[str, int]] = ({},),
    opset: int = DEFAULT_OPSET,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
    inputs: Mapping[str, Sequence[int | str]] | None = None,
    threads: Sequence[int | None] = (None,),
    cpu: str = "native",
) -> Any:
    """Compile all `cases` as one model and compare with the oracle at every binding in `sizes`,
    run with each cap on its threads in `threads` (None: the whole pool), compiled for `cpu`
    (x86-64-v3: the AVX2 copy's kernels, e.g. int8 without VNNI, on a CPU that has it).

    Symbolic dims are the str dims of the cases' feeds; `sizes` gives their values per run (a
    dim named "_h" is private to its case: it becomes "c<i>__h" in the model, bound by "_h").
    """
    model = build(cases, opset)
    compiled = compile_in_process(model, inputs=inputs, cpu=cpu)
    assert [o.name for o in compiled.outputs] == [o.name for o in model.graph.output], \
        "cuvil declares other outputs than the model"
    rng = np.random.default_rng(seed)
    failures = []
    for binding, cap in itertools.product(sizes, threads):
        compiled.num_threads = cap
        feeds: dict[str, np.ndarray] = {}
        for i, c in enumerate(cases):
            for n, (dtype, shape) in c.feeds.items():
                concrete = [binding[d] if isinstance(d, str) else d for d in shape]
                feeds[_prefixed(i, n)] = (c.data or default_data)(rng, dtype, concrete)
        got = compiled.run(feeds)
        for i, c in enumerate(cases):
            sub = _case_model(model, c, i)
            names = [v.name for v in sub.graph.input]
            want = _oracle(c, sub, {n: feeds[n] for n in names})
            assert len(want) == len(sub.graph.output), f"case {i}: the oracle gives {len(want)} outputs"
            for out, expected in zip([v.name for v in sub.graph.output], want):
                have = got[out]
                try:
                    assert have.shape == expected.shape, f"shape {have.shape} != {expected.shape}"
                    assert have.dtype == expected.dtype, f"dtype {have.dtype} != {expected.dtype}"
                    if expected.dtype.kind == "f":
                        np.testing.assert_allclose(have, expected, rtol=rtol, atol=atol)
                    else:
                        np.testing.assert_array_equal(have, expected)
                except AssertionError as exc:
                    msg = re.sub(r"\s+", " ", str(exc))[:600]
                    failures.append(f"case {i} {c.describe()} at {dict(binding)}, threads "
                                    f"{cap or 'all'}: output {out}: {msg}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)
    return compiled


# -- onnx's backend node tests, batched the same way ------------------------------------------


def backend_cases(module: str, op_types: Sequence[str]) -> list[Any]:
    """The backend node test cases (`onnx.backend.test.case.node.<module>`) whose single node
    is one of `op_types`. Importing the one module runs only its generators, which is much
    faster than `collect_testcases()`."""
    import importlib
    import warnings

    from onnx.backend.test.case import node as cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module(f"onnx.backend.test.case.node.{module}")
    return [c for c in cases._NodeTestCases
            if len(c.model.graph.node) == 1 and c.model.graph.node[0].op_type in op_types]


def _merged(tests: Sequence[Any]) -> onnx.ModelProto:
    """One model holding every test's graph, each value renamed with a t<i>_ prefix."""
    nodes, inputs, outputs, inits = [], [], [], []
    for i, t in enumerate(tests):
        g = t.model.graph

        def rename(name: str, i: int = i) -> str:
            return f"t{i}_{name}" if name else ""

        for n in g.node:
            m = onnx.NodeProto()
            m.CopyFrom(n)
            m.name = f"t{i}_{n.name or n.op_type}"
            m.input[:] = [rename(x) for x in n.input]
            m.output[:] = [rename(x) for x in n.output]
            nodes.append(m)
        init_names = {x.name for x in g.initializer}
        for vi in g.input:
            if vi.name not in init_names:
                v = onnx.ValueInfoProto()
                v.CopyFrom(vi)
                v.name = rename(vi.name)
                inputs.append(v)
        for vi in g.output:
            v = onnx.ValueInfoProto()
            v.CopyFrom(vi)
            v.name = rename(vi.name)
            outputs.append(v)
        for x in g.initializer:
            y = onnx.TensorProto()
            y.CopyFrom(x)
            y.name = rename(x.name)
            inits.append(y)
    first = tests[0].model
    graph = helper.make_graph(nodes, "backend", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=first.opset_import)
    model.ir_version = max(t.model.ir_version for t in tests)
    return model


def check_backend_cases(tests: Sequence[Any], values: bool = True) -> None:
    """Compile the tests' graphs together (one model per opset) and compare every output with
    the expected data onnx ships, at each test's own rtol/atol (`values=False`: its shape and
    dtype only, for random draws)."""
    groups: dict[tuple[tuple[str, int], ...], list[Any]] = {}
    for t in tests:
        key = tuple(sorted((o.domain, o.version) for o in t.model.opset_import))
        groups.setdefault(key, []).append(t)
    failures = []
    for group in groups.values():
        compiled = cuvil.compile(_merged(group))
        for j in range(max(len(t.data_sets) for t in group)):
            feeds, expected = {}, {}
            for i, t in enumerate(group):
                g = t.model.graph
                init_names = {x.name for x in g.initializer}
                names = [vi.name for vi in g.input if vi.name not in init_names]
                inputs, outputs = t.data_sets[min(j, len(t.data_sets) - 1)]
                feeds.update({f"t{i}_{n}": _array(a) for n, a in zip(names, inputs)})
                expected.update({f"t{i}_{vi.name}": (t, _array(a)) for vi, a in zip(g.output, outputs)})
            got = compiled.run(feeds)
            for name, (t, want) in expected.items():
                have = got[name]
                try:
                    assert have.shape == want.shape, f"shape {have.shape} != {want.shape}"
                    assert have.dtype == want.dtype, f"dtype {have.dtype} != {want.dtype}"
                    if values:
                        np.testing.assert_allclose(have, want, rtol=t.rtol, atol=t.atol)
                except AssertionError as exc:
                    msg = re.sub(r"\s+", " ", str(exc))[:400]
                    failures.append(f"{t.name}: output {name}: {msg}")
    assert not failures, f"{len(failures)} backend cases fail:\n" + "\n".join(failures)


def _array(a: Any) -> np.ndarray:
    return numpy_helper.to_array(a) if isinstance(a, onnx.TensorProto) else np.asarray(a)
