"""Dense-weight copies of the onnx package's light models (onnx/backend/test/data/light/).

The originals store every weight as a `ConstantOfShape` splat of 0.02: every logit comes out
equal and the softmax is flat (0.001 everywhere), so a comparison on them proves little, and
splat weights may let an engine take paths real weights do not. `dense_copy` writes a copy
whose splats are dense seeded random initializers, scaled per layer so that activations keep
their size through 50+ layers, with the last layer scaled so that the softmax is far from
flat. The conformance tests (tests/conformance) and the benchmark suite (benchmarks/zoo.py)
both use these copies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
#: the light models' short names -> their file in LIGHT (without .onnx)
MODELS = {"alexnet": "light_bvlc_alexnet", **{n: f"light_{n}" for n in (
    "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
    "vgg19", "zfnet512")}}

#: a weight reaches the op that reads it through these (Caffe2's exports reshape some)
_PASS_THROUGH = ("Unsqueeze", "Reshape")
#: ops between the last Conv/Gemm and the logits that commute with scaling (f(s x) = s f(x), s > 0)
_HOMOGENEOUS = ("Relu", "GlobalAveragePool", "AveragePool", "MaxPool", "Reshape", "Flatten", "Dropout",
                "Squeeze")
#: spread of the logits the last layer is scaled to: over 1000 classes the largest softmax
#: probability is then about 0.04-0.2, against 0.001 when flat
LOGIT_STD = 2.0


def dense_copy(source: Path, path: Path) -> Path:
    """`path`, written from light model `source` unless it is there already (the copy is the
    same for the same source: seeded)."""
    if not path.exists():
        model = dense_model(source)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        onnx.save(model, str(partial))
        partial.replace(path)  # whole or absent, should two processes make it at once
    return path


def dense_model(source: Path) -> onnx.ModelProto:
    """`source` with every ConstantOfShape weight replaced by a dense seeded random initializer
    of the same name; the rest of the graph as it is. The last Conv/Gemm is then scaled so that
    the logits spread by LOGIT_STD, and the softmax is checked not to be flat. Weights are
    initializers only (IR version 4: the old exporter's habit of listing them as graph inputs
    too would make them overridable, so not constants, for onnxruntime)."""
    model = onnx.load(str(source))
    graph = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, slot))
    rng = np.random.default_rng(0)
    values: dict[str, np.ndarray] = {}
    for node in [n for n in graph.node if n.op_type == "ConstantOfShape"]:
        name = node.output[0]
        reader, slot = readers[name][0]
        while reader.op_type in _PASS_THROUGH and slot == 0:
            reader, slot = readers[reader.output[0]][0]
        residual = any(r.op_type in ("Sum", "Add") for r, _ in readers.get(reader.output[0], []))
        values[name] = _dense_value(reader, slot, tuple(int(d) for d in inits[node.input[0]]), rng,
                                    residual)
    kept = [n for n in graph.node if n.op_type != "ConstantOfShape"]
    used = {i for n in kept for i in n.input}
    weights = [t for t in graph.initializer if t.name in used]
    weights += [numpy_helper.from_array(v, name) for name, v in values.items()]
    data = [vi for vi in graph.input if vi.name not in inits and vi.name not in values]
    del graph.node[:], graph.initializer[:], graph.input[:]
    graph.node.extend(kept)
    graph.initializer.extend(weights)
    graph.input.extend(data)
    model.ir_version = max(model.ir_version, 4)
    _scale_last_layer(model)
    return model


def _dense_value(node: onnx.NodeProto, slot: int, shape: tuple[int, ...], rng: np.random.Generator,
                 residual: bool) -> np.ndarray:
    """Random values of a sensible scale for input `slot` of `node`: He-scaled weights (a ReLU
    network's activations then keep their size layer after layer), small biases,
    normalizations near the identity (variances positive); a BatchNormalization that ends a
    residual branch (`residual`) scales by about 0.2, else each block would double the
    activations' variance (ResNet-50's would reach 4e4, ShuffleNet's 1e6)."""
    op = node.op_type
    if op == "BatchNormalization" and slot == 1 and residual:
        return rng.uniform(0.16, 0.24, shape).astype(np.float32)
    if op in ("Conv", "Gemm") and slot == 1:
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        fan_in = int(np.prod(shape[1:])) if op == "Conv" else shape[-1] if trans_b else shape[-2]
        return rng.standard_normal(shape, np.float32) * np.float32(np.sqrt(2.0 / fan_in))
    if (op in ("Conv", "Gemm") and slot == 2) or op == "Add" or (op == "BatchNormalization"
                                                                  and slot in (2, 3)):
        return rng.normal(0.0, 0.05, shape).astype(np.float32)  # biases, BN's shift and mean
    if op in ("Mul", "BatchNormalization"):  # scales, BN's scale and variance
        return rng.uniform(0.8, 1.2, shape).astype(np.float32)
    raise ValueError(f"no rule for a weight read by {op} input {slot} (node {node.name!r})")


def random_feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    """Standard normal float32 values for the model's data inputs (a free dim taken as 1)."""
    rng = np.random.default_rng(seed)
    weights = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name not in weights:
            shape = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def spread_problem(outputs: np.ndarray) -> str | None:
    """None when a model's class outputs are far from flat, else what is wrong with them: not
    finite, or the largest probability under 10 times the flat 1/n, or the entropy within 1
    nat of the flat log(n) (logits spread by LOGIT_STD take about LOGIT_STD**2 / 2 off it).
    Outputs that are no distribution are logits (DenseNet-121's graph ends before its
    softmax), and are judged by their softmax."""
    p = np.asarray(outputs, np.float64).reshape(-1)
    if not np.all(np.isfinite(p)):
        return "the outputs are not all finite"
    if p.min() < 0 or abs(p.sum() - 1) > 1e-3:
        p = np.exp(p - p.max())
        p /= p.sum()
    entropy = float(-(p * np.log(np.maximum(p, 1e-300))).sum())
    if p.max() < 10 / p.size or entropy > np.log(p.size) - 1:
        return (f"the softmax is nearly flat: largest probability {p.max():.3g} over {p.size} "
                f"classes, entropy {entropy:.3f} (flat: {np.log(p.size):.3f})")
    return None


def _scale_last_layer(model: onnx.ModelProto) -> None:
    """Scale the weight and bias of the Conv/Gemm the logits come from so that the logits of a
    random input spread by LOGIT_STD; check the resulting softmax is not flat. One onnxruntime
    run finds the scale: what lies between that layer and the logits is homogeneous, so the
    scaled model's logits are the scale times these."""
    import onnxruntime as ort

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    output = graph.output[0].name
    last = producer[output]
    logits = last.input[0] if last.op_type == "Softmax" else output
    layer = producer[logits]
    while layer.op_type in _HOMOGENEOUS:
        layer = producer[layer.input[0]]
    if layer.op_type not in ("Conv", "Gemm"):
        raise ValueError(f"the logits {logits!r} come from {layer.op_type}, not a Conv or Gemm")

    if logits != output:
        graph.output.append(onnx.ValueInfoProto(name=logits))
    try:
        options = ort.SessionOptions()
        # a probe of one run: optimizing (and prepacking) VGG-19's weights would take longer
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        values = session.run([logits], random_feeds(model, seed=1))[0].reshape(-1).astype(np.float64)
    finally:
        if logits != output:
            del graph.output[-1]
    scale = LOGIT_STD / max(float(values.std()), 1e-30)
    by_name = {t.name: t for t in graph.initializer}
    for name in layer.input[1:3]:
        while name not in by_name:  # a weight reshaped on its way
            name = producer[name].input[0]
        tensor = by_name[name]
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(scale), name))
    problem = spread_problem(values * scale)  # judged as logits
    if problem:
        raise ValueError(f"dense weights for {graph.name!r}: {problem}")
