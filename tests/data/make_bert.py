"""A BERT-style encoder built with onnx.helper alone (no torch), in the form Hugging Face's
BERT export writes it, so that onnxruntime's transformer optimizer
(`onnxruntime.transformers.optimizer.optimize_model`) fuses it into com.microsoft ops:

- embeddings: word, token type and position Gathers (positions sliced from a [1, 512]
  constant by the sequence length), summed, then LayerNormalization ->
  EmbedLayerNormalization;
- self-attention: Q, K, V MatMul + Add, Reshape to heads, Transpose (K straight to
  [b, h, d, s]), MatMul, Div by sqrt(head size), Add of the extended mask
  (1 - mask) * -10000, Softmax, MatMul, Transpose, Reshape -> Attention;
- output projections MatMul + Add, residual Add, LayerNormalization ->
  SkipLayerNormalization (the bias folded in);
- feed-forward MatMul + Add + GELU: the erf form -> BiasGelu, the tanh form -> FastGelu
  (with its bias), chosen per layer by `gelu`.

Used by tests/ops/test_contrib.py and the optimized-BERT benchmark (benchmarks/zoo.py).
Weights are random and seeded; ids are int64 as exporters write them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
MAX_POSITIONS = 512


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, value: np.ndarray, hint: str = "c") -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, *shape: int, scale: float = 0.05, hint: str = "w") -> str:
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32), hint)

    def op(self, op_type: str, *inputs: str, **attrs: object) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def linear(self, x: str, n_in: int, n_out: int) -> str:
        return self.op("Add", self.op("MatMul", x, self.weight(n_in, n_out)),
                       self.weight(n_out, scale=0.02, hint="b"))

    def layer_norm(self, x: str, hidden: int) -> str:
        gamma = self.const((1 + self.rng.standard_normal(hidden) * 0.1).astype(np.float32))
        beta = self.weight(hidden, scale=0.1)
        return self.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=1e-12)

    def scalar(self, value: float) -> str:
        return self.const(np.array(value, np.float32))

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, np.int64))


def bert_model(layers: int = 2, hidden: int = 32, heads: int = 4, vocab: int = 1000,
               with_mask: bool = True, gelu: Sequence[str] = ("erf", "tanh"),
               token_types: int = 2, seed: int = 0) -> onnx.ModelProto:
    """Inputs input_ids, token_type_ids (and attention_mask) [batch, seq] int64; output
    `encoded` [batch, seq, hidden]. Layer i uses the GELU form gelu[i % len(gelu)]."""
    b = _Builder(seed)
    head = hidden // heads
    word = b.op("Gather", b.weight(vocab, hidden, scale=0.5), "input_ids")
    kind = b.op("Gather", b.weight(token_types, hidden, scale=0.5), "token_type_ids")
    seq_len = b.op("Unsqueeze", b.op("Gather", b.op("Shape", "input_ids"), b.const(np.array(1, np.int64))),
                   b.ints(0))
    positions = b.op("Slice", b.const(np.arange(MAX_POSITIONS, dtype=np.int64)[None]),
                     b.ints(0), seq_len, b.ints(1), b.ints(1))
    pos = b.op("Gather", b.weight(MAX_POSITIONS, hidden, scale=0.5), positions)
    x = b.layer_norm(b.op("Add", b.op("Add", word, kind), pos), hidden)

    extended = None
    if with_mask:
        wide = b.op("Cast", b.op("Unsqueeze", b.op("Unsqueeze", "attention_mask", b.ints(1)), b.ints(2)),
                    to=TensorProto.FLOAT)
        extended = b.op("Mul", b.op("Sub", b.scalar(1.0), wide), b.scalar(-10000.0))

    to_heads = b.ints(0, 0, heads, head)
    for i in range(layers):
        q = b.op("Transpose", b.op("Reshape", b.linear(x, hidden, hidden), to_heads), perm=[0, 2, 1, 3])
        k = b.op("Transpose", b.op("Reshape", b.linear(x, hidden, hidden), to_heads), perm=[0, 2, 3, 1])
        v = b.op("Transpose", b.op("Reshape", b.linear(x, hidden, hidden), to_heads), perm=[0, 2, 1, 3])
        scores = b.op("Div", b.op("MatMul", q, k), b.scalar(float(np.sqrt(head))))
        if extended is not None:
            scores = b.op("Add", scores, extended)
        context = b.op("MatMul", b.op("Softmax", scores, axis=-1), v)
        merged = b.op("Reshape", b.op("Transpose", context, perm=[0, 2, 1, 3]), b.ints(0, 0, hidden))
        x = b.layer_norm(b.op("Add", b.linear(merged, hidden, hidden), x), hidden)

        h = b.linear(x, hidden, 4 * hidden)
        if gelu[i % len(gelu)] == "erf":  # 0.5 * x * (1 + erf(x / sqrt 2)), as BERT writes it
            erf = b.op("Erf", b.op("Div", h, b.scalar(1.4142135381698608)))
            g = b.op("Mul", b.op("Mul", h, b.op("Add", erf, b.scalar(1.0))), b.scalar(0.5))
        else:  # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))), as GPT-2 writes it
            cube = b.op("Mul", b.scalar(0.044715), b.op("Pow", h, b.scalar(3.0)))
            inner = b.op("Mul", b.op("Add", h, cube), b.scalar(0.7978845834732056))
            g = b.op("Mul", b.op("Mul", b.scalar(0.5), h), b.op("Add", b.scalar(1.0), b.op("Tanh", inner)))
        x = b.layer_norm(b.op("Add", b.linear(g, 4 * hidden, hidden), x), hidden)
    b.nodes.append(helper.make_node("Identity", [x], ["encoded"], name="encoded"))

    ids = ["input_ids", "token_type_ids"] + (["attention_mask"] if with_mask else [])
    graph = helper.make_graph(
        b.nodes, "bert",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in ids],
        [helper.make_tensor_value_info("encoded", TensorProto.FLOAT, ["batch", "seq", hidden])],
        b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def optimized_bert(source: str, target: str, heads: int, hidden: int, **options: object) -> onnx.ModelProto:
    """Write to `target` the model at `source` after onnxruntime's transformer optimizer (its
    Python fusions only, opt_level 0), as its save_model_to_file writes it (which adds the
    com.microsoft opset import); `options` set FusionOptions fields. Returns the saved model."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    fusion = FusionOptions("bert")
    for key, value in options.items():
        setattr(fusion, key, value)
    optimized = optimize_model(source, model_type="bert", num_heads=heads, hidden_size=hidden,
                               optimization_options=fusion, opt_level=0)
    optimized.save_model_to_file(target)
    return onnx.load(target)
