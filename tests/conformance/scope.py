"""What the conformance suite holds cuvil to: the out-of-scope categories (each with its
reason), the inputs bound to constants before compiling, and the pass-rate targets.

This is the one place these facts live: the tests (`test_conformance.py`) and the report
(`scripts/gen_conformance.py` -> docs/conformance.md) both read it. A case outside every
category below is in scope, and an in-scope case that fails is a failure, never a skip.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass

import onnx

__all__ = [
    "CATEGORIES",
    "COMPILE_TIME_INPUTS",
    "TARGETS",
    "Category",
    "category",
    "classify",
    "compile_time_inputs",
]


@dataclass(frozen=True)
class Category:
    key: str
    title: str
    reason: str
    #: op types (any domain unless written "domain:Op") that put a case out of scope
    ops: tuple[str, ...] = ()
    #: operator domains that put a case out of scope
    domains: tuple[str, ...] = ()
    #: fnmatch patterns on case names (for cases the op alone does not decide)
    cases: tuple[str, ...] = ()
    #: ONNX tensor element types (TensorProto.DataType names) that put a case out of scope
    dtypes: tuple[str, ...] = ()
    #: non-tensor value kinds (TypeProto oneof names) that put a case out of scope
    kinds: tuple[str, ...] = ()


CATEGORIES: tuple[Category, ...] = (
    Category(
        "training",
        "Training-only operators",
        "cuvil compiles inference graphs. Optimizer updates and loss functions appear only in "
        "training graphs; BatchNormalization in training mode updates running statistics.",
        ops=("Adagrad", "Adam", "Momentum", "Gradient", "NegativeLogLikelihoodLoss",
             "SoftmaxCrossEntropyLoss"),
        domains=("ai.onnx.preview.training",),
        cases=("test_batchnorm_*_training_mode*", "test_gradient_*"),
    ),
    Category(
        "random",
        "Random generators",
        "Their outputs are random draws, and only numpy's generator reproduces the draws stored "
        "in the expected outputs (the cases say so). cuvil compiles these operators: "
        "tests/ops/test_random.py checks their distributions, and onnx's Bernoulli cases by "
        "shape and dtype. (Dropout in inference mode is in scope.)",
        ops=("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
             "Multinomial", "Bernoulli"),
        cases=("test_training_dropout*",),
    ),
    Category(
        "non-tensor",
        "Sequence, optional, map and string values",
        "A cuvil library takes and returns dense numeric arrays through a C ABI; sequences, "
        "optionals, maps and strings have no representation there.",
        ops=("SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
             "SequenceInsert", "SequenceLength", "SequenceMap", "SplitToSequence",
             "ConcatFromSequence", "Optional", "OptionalGetElement", "OptionalHasElement",
             "StringConcat", "StringNormalizer", "StringSplit", "RegexFullMatch"),
        dtypes=("STRING",),
        kinds=("sequence_type", "optional_type", "map_type", "sparse_tensor_type"),
    ),
    Category(
        "dtype",
        "Element types without a numpy dtype",
        "cuvil's runtime exchanges numpy arrays, and numpy has no native 8-bit, 4-bit or 2-bit "
        "floats or ints, nor bfloat16.",
        dtypes=("BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ",
                "FLOAT8E8M0", "FLOAT4E2M1", "INT4", "UINT4", "INT2", "UINT2",
                "COMPLEX64", "COMPLEX128"),
    ),
    Category(
        "outside",
        "Outside a tensor compiler",
        "Image file decoding and the experimental ai.onnx.preview domain. (The classical-ML "
        "domain ai.onnx.ml is in scope, but for its string-typed cases.)",
        ops=("ImageDecoder",),
        domains=("ai.onnx.preview",),
    ),
)

_BY_KEY = {c.key: c for c in CATEGORIES}

#: Inputs cuvil needs at compile time because they decide output shapes (or are parameters
#: exporters always write as constants). onnx's node tests feed them as graph inputs; the
#: suite binds them to their test value (`prepare(..., bind=...)`), as an exporter would
#: have written an initializer. Keys are op types, values the input indices.
COMPILE_TIME_INPUTS: dict[str, tuple[int, ...]] = {
    "AffineGrid": (1,),
    "BlackmanWindow": (0,),
    "CenterCropPad": (1,),
    "Clip": (1, 2),
    "Col2Im": (1, 2),
    "ConstantOfShape": (0,),
    "CumProd": (1,),
    "CumSum": (1,),
    "DFT": (1, 2),
    "Dropout": (1, 2),
    "Expand": (1,),
    "HammingWindow": (0,),
    "HannWindow": (0,),
    "MelWeightMatrix": (0, 1, 2, 3, 4),
    "MaxUnpool": (2,),
    "Loop": (0, 1),
    "OneHot": (1,),
    "Pad": (1, 2, 3),
    "Range": (0, 1, 2),
    "ReduceL1": (1,),
    "ReduceL2": (1,),
    "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,),
    "ReduceMax": (1,),
    "ReduceMean": (1,),
    "ReduceMin": (1,),
    "ReduceProd": (1,),
    "ReduceSum": (1,),
    "ReduceSumSquare": (1,),
    "Reshape": (1,),
    "Resize": (1, 2, 3),
    "Slice": (1, 2, 3, 4),
    "Split": (1,),
    "Squeeze": (1,),
    "STFT": (1, 3),
    "Tile": (1,),
    "TopK": (1,),
    "Trilu": (1,),
    "Unsqueeze": (1,),
    "Upsample": (1,),
}

#: pass-rate targets (fractions of in-scope cases); the CI gate fails below them
TARGETS: dict[str, float] = {
    "node": 0.90,
    "light": 1.0,
    "pytorch": 0.95,  # pytorch-converted and pytorch-operator together
}


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def _dtype_name(elem_type: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"dtype {elem_type}"


def _value_kinds(vi: onnx.ValueInfoProto) -> Iterator[tuple[str, str]]:
    """(kind, "") for the value's type kind, then (kind, element type name) for tensors."""
    t = vi.type
    kind = t.WhichOneof("value")
    if kind is None:
        return
    yield kind, ""
    if kind == "tensor_type":
        yield kind, _dtype_name(t.tensor_type.elem_type)


def _facts(model: onnx.ModelProto) -> tuple[set[str], set[str], set[str], set[str]]:
    """Ops ("Op" and "domain:Op"), domains, element types and value kinds the model uses."""
    ops: set[str] = set()
    domains: set[str] = set()
    dtypes: set[str] = set()
    kinds: set[str] = set()
    for g in _graphs(model.graph):
        for vi in [*g.input, *g.output, *g.value_info]:
            for kind, dt in _value_kinds(vi):
                kinds.add(kind)
                if dt:
                    dtypes.add(dt)
        for init in g.initializer:
            dtypes.add(_dtype_name(init.data_type))
        for node in g.node:
            domain = "" if node.domain == "ai.onnx" else node.domain
            ops.add(node.op_type)
            ops.add(f"{domain}:{node.op_type}")
            if domain:
                domains.add(domain)
            for attr in node.attribute:
                if node.op_type in ("Cast", "QuantizeLinear", "EyeLike", "RandomNormal",
                                    "RandomUniform", "BitCast") and attr.type == attr.INT and \
                        attr.name in ("to", "output_dtype", "dtype"):
                    dtypes.add(_dtype_name(attr.i))
                if attr.type == attr.TENSOR:
                    dtypes.add(_dtype_name(attr.t.data_type))
    return ops, domains, dtypes, kinds


def classify(model: onnx.ModelProto, name: str) -> Category | None:
    """The out-of-scope category of a test case (its model and name), or None if in scope."""
    ops, domains, dtypes, kinds = _facts(model)
    for cat in CATEGORIES:
        if (ops & set(cat.ops) or domains & set(cat.domains) or dtypes & set(cat.dtypes)
                or kinds & set(cat.kinds)
                or any(fnmatch.fnmatchcase(name, p) for p in cat.cases)):
            return cat
    return None


def category(key: str) -> Category:
    return _BY_KEY[key]


def compile_time_inputs(model: onnx.ModelProto) -> list[str]:
    """Graph inputs of `model` that feed an input listed in COMPILE_TIME_INPUTS."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    graph_inputs = {vi.name for vi in g.input} - inits
    bound: list[str] = []
    for node in g.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        for i in COMPILE_TIME_INPUTS.get(node.op_type, ()):
            if i < len(node.input) and node.input[i] in graph_inputs and node.input[i] not in bound:
                bound.append(node.input[i])
    return bound
