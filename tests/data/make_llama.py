"""A Llama-style decoder in the form onnxruntime-genai's model builder writes it (float32,
CPU), built with onnx.helper alone: the ops GroupQueryAttention (rotary inside, from cos and
sin caches), SimplifiedLayerNormalization (default domain) and SkipSimplifiedLayerNormalization,
seqlens_k and total_sequence_length computed from the attention mask as the builder does.

Inputs `input_ids` [batch, seq] (int64), `attention_mask` [batch, total] (int64), per layer
`past_key_values.<l>.key` / `.value` [batch, kv heads, past, head]; outputs `logits`
[batch, seq, vocab] and `present.<l>.key` / `.value`. Weights are random and seeded.
Used by tests/test_decoder.py.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB, HEADS, KV_HEADS, HEAD, LAYERS, FFN, POSITIONS = 96, 4, 2, 16, 2, 128, 128
D = HEADS * HEAD
MS = "com.microsoft"


def llama_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []

    def weight(name: str, *shape: int, scale: float | None = None) -> str:
        s = scale if scale is not None else 1.0 / np.sqrt(shape[0])
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * s).astype(np.float32), name))
        return name

    def gamma(name: str) -> str:
        inits.append(numpy_helper.from_array((1 + 0.1 * rng.standard_normal(D)).astype(np.float32), name))
        return name

    angles = np.arange(POSITIONS)[:, None] / 10000.0 ** (np.arange(HEAD // 2) / (HEAD // 2))
    inits += [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
              numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache"),
              numpy_helper.from_array(np.array([1], np.int64), "one"),
              numpy_helper.from_array(np.array(1, np.int64), "one_scalar")]
    nodes = [
        helper.make_node("Gather", [weight("embed", VOCAB, D, scale=1.0), "input_ids"], ["h0"]),
        helper.make_node("ReduceSum", ["attention_mask", "one"], ["mask_sum"], keepdims=0),
        helper.make_node("Sub", ["mask_sum", "one"], ["seqlens_k_64"]),
        helper.make_node("Cast", ["seqlens_k_64"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
        helper.make_node("Gather", ["mask_shape", "one_scalar"], ["total_64"], axis=0),
        helper.make_node("Cast", ["total_64"], ["total_sequence_length"], to=TensorProto.INT32),
        helper.make_node("SimplifiedLayerNormalization", ["h0", gamma("ln0")], ["x0"], epsilon=1e-6),
    ]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB])]
    x, residual = "x0", "h0"
    for n in range(LAYERS):
        past = [f"past_key_values.{n}.{kv}" for kv in ("key", "value")]
        present = [f"present.{n}.{kv}" for kv in ("key", "value")]
        inputs += [helper.make_tensor_value_info(p, TensorProto.FLOAT, ["batch", KV_HEADS, "past", HEAD])
                   for p in past]
        outputs += [helper.make_tensor_value_info(p, TensorProto.FLOAT, ["batch", KV_HEADS, "present", HEAD])
                    for p in present]
        nodes += [
            helper.make_node("MatMul", [x, weight(f"wq{n}", D, D)], [f"q{n}"]),
            helper.make_node("MatMul", [x, weight(f"wk{n}", D, KV_HEADS * HEAD)], [f"k{n}"]),
            helper.make_node("MatMul", [x, weight(f"wv{n}", D, KV_HEADS * HEAD)], [f"v{n}"]),
            helper.make_node("GroupQueryAttention",
                             [f"q{n}", f"k{n}", f"v{n}", *past, "seqlens_k", "total_sequence_length",
                              "cos_cache", "sin_cache"], [f"attn{n}", *present], domain=MS,
                             num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1),
            helper.make_node("MatMul", [f"attn{n}", weight(f"wo{n}", D, D)], [f"o{n}"]),
            helper.make_node("SkipSimplifiedLayerNormalization", [f"o{n}", residual, gamma(f"ln_mlp{n}")],
                             [f"xm{n}", "", "", f"rm{n}"], domain=MS, epsilon=1e-6),
            helper.make_node("MatMul", [f"xm{n}", weight(f"wg{n}", D, FFN)], [f"gate{n}"]),
            helper.make_node("MatMul", [f"xm{n}", weight(f"wu{n}", D, FFN)], [f"up{n}"]),
            helper.make_node("Sigmoid", [f"gate{n}"], [f"sg{n}"]),
            helper.make_node("Mul", [f"gate{n}", f"sg{n}"], [f"silu{n}"]),
            helper.make_node("Mul", [f"silu{n}", f"up{n}"], [f"act{n}"]),
            helper.make_node("MatMul", [f"act{n}", weight(f"wd{n}", FFN, D)], [f"down{n}"]),
            helper.make_node("SkipSimplifiedLayerNormalization",
                             [f"down{n}", f"rm{n}", gamma(f"ln{n + 1}")], [f"x{n + 1}", "", "", f"h{n + 1}"],
                             domain=MS, epsilon=1e-6),
        ]
        x, residual = f"x{n + 1}", f"h{n + 1}"
    nodes.append(helper.make_node("MatMul", [x, weight("lm_head", D, VOCAB)], ["logits"]))
    graph = helper.make_graph(nodes, "llama", inputs, outputs, inits)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17),
                                                                 helper.make_opsetid(MS, 1)])
