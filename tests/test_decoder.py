"""A decoder-only transformer with a KV cache, end to end: the GPT-style model torch exported
(tests/data/gpt_kv.onnx, written by tests/data/make_gpt.py), its copy after onnxruntime's
transformer optimizer and its int4 weight-only copy (MatMulNBitsQuantizer), each compiled once
with its batch, sequence and past length symbolic, then driven by a greedy generation loop: a
prompt from an empty past, then one token per step, the presents fed back as the next step's
past. onnxruntime running the same file with the same loop is the oracle: the 32 tokens must
be the same, and the logits close at every step.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

import cuvil

sys.path.insert(0, str(Path(__file__).parent / "data"))
import make_llama

GPT = Path(__file__).parent / "data" / "gpt_kv.onnx"
HEADS, D, LAYERS = 4, 32, 2  # make_gpt.py's
TOKENS = 32
Step = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Decoder:
    """How a model names its token input, caches and logits."""

    ids: str
    past: list[str]
    present: list[str]
    kv: tuple[int, int]  # (kv heads, head size)
    mask: str | None = None  # an all-ones attention mask [batch, past + seq], if it takes one


GPT_NAMES = Decoder("ids", [f"past_{i}" for i in range(2 * LAYERS)],
                    [f"present_{i}" for i in range(2 * LAYERS)], (HEADS, D // HEADS))
LLAMA_LAYERS = [(n, kv) for n in range(make_llama.LAYERS) for kv in ("key", "value")]
LLAMA_NAMES = Decoder("input_ids", [f"past_key_values.{n}.{kv}" for n, kv in LLAMA_LAYERS],
                      [f"present.{n}.{kv}" for n, kv in LLAMA_LAYERS],
                      (make_llama.KV_HEADS, make_llama.HEAD), mask="attention_mask")


def greedy(step: Step, names: Decoder, prompt: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
    """TOKENS tokens after `prompt` [1, s], each the argmax of the last position's logits; the
    logits of every step."""
    past = [np.zeros((1, *names.kv[:1], 0, names.kv[1]), np.float32) for _ in names.past]
    ids, tokens, logits = prompt, [], []
    for _ in range(TOKENS):
        feeds = {names.ids: ids, **dict(zip(names.past, past))}
        if names.mask:
            feeds[names.mask] = np.ones((1, past[0].shape[2] + ids.shape[1]), np.int64)
        out = step(feeds)
        logits.append(out["logits"])
        tokens.append(int(out["logits"][0, -1].argmax()))
        ids, past = np.array([[tokens[-1]]], np.int64), [out[n] for n in names.present]
    return tokens, logits


def check_generation(model: onnx.ModelProto, names: Decoder = GPT_NAMES) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    compiled = cuvil.compile(model)
    outputs = [o.name for o in model.graph.output]
    prompt = np.random.default_rng(0).integers(0, 96, (1, 5)).astype(np.int64)
    want, want_logits = greedy(lambda feeds: dict(zip(outputs, session.run(None, dict(feeds)))),
                               names, prompt)
    got, got_logits = greedy(lambda feeds: compiled.run(dict(feeds)), names, prompt)
    assert got == want
    assert len(set(want)) > 3, "a degenerate model: the oracle repeats one token"
    for a, b in zip(got_logits, want_logits):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_torch_gpt_greedy_generation_matches_onnxruntime() -> None:
    check_generation(onnx.load(GPT))


def test_gpt_after_onnxruntime_optimizer_matches_onnxruntime(tmp_path: Path) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    optimized = optimize_model(str(GPT), model_type="gpt2", num_heads=HEADS, hidden_size=D)
    ops = collections.Counter(n.op_type for n in optimized.model.graph.node
                              if n.domain == "com.microsoft")
    # the residual Adds and LayerNorms fuse, and the fc bias with its exact GELU; the attention
    # (not Hugging Face's GPT-2 pattern) stays as standard ops. Fails when the optimizer changes.
    assert ops == {"SkipLayerNormalization": 2 * LAYERS, "BiasGelu": LAYERS}, ops
    check_generation(optimized.model)



def test_int4_weight_only_gpt_matches_onnxruntime() -> None:
    """MatMulNBitsQuantizer's defaults but blocks of 32 (the model's K are 32 and 128):
    onnxruntime, at accuracy_level 0, computes in float32 on the dequantized weights, as cuvil."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(GPT), block_size=32)
    quantizer.process()
    model = quantizer.model.model
    ops = collections.Counter(n.op_type for n in model.graph.node if n.domain == "com.microsoft")
    assert ops == {"MatMulNBits": 4 * LAYERS + 1}, ops  # every Linear: 4 per block and the head
    check_generation(model)


def test_llama_style_genai_model_matches_onnxruntime() -> None:
    """GroupQueryAttention with rotary, SimplifiedLayerNormalization and
    SkipSimplifiedLayerNormalization as onnxruntime-genai's builder writes them, the caches fed
    back, an attention mask growing each step."""
    check_generation(make_llama.llama_model(), LLAMA_NAMES)


def test_int4_llama_style_model_matches_onnxruntime() -> None:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(make_llama.llama_model(), block_size=32)
    quantizer.process()
    model = quantizer.model.model
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 7 * make_llama.LAYERS + 1
    check_generation(model, LLAMA_NAMES)
