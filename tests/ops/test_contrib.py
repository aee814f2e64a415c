"""onnxruntime's contrib ops (com.microsoft) against onnxruntime itself.

First as onnxruntime's transformer optimizer writes them: a BERT-style encoder built with
onnx.helper (tests/data/make_bert.py) goes through `optimize_model(model_type="bert")`; the
test checks that the fused ops are there (so it fails when the optimizer stops fusing), then
compiles the optimized model with symbolic batch and sequence and compares it with
onnxruntime running the same optimized model. Then one model of single-node cases for the
attributes and input forms the optimizer path does not reach, compiled once; onnxruntime has
no CPU kernel for BiasSoftmax and BiasAdd, which are checked against numpy.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from oracle import run_ort

import cuvil
from cuvil.errors import CuvilError

sys.path.insert(0, str(Path(__file__).parent.parent / "data"))
from make_bert import bert_model, optimized_bert

MS = "com.microsoft"
HIDDEN, HEADS = 32, 4


def _bert_feeds(rng: np.random.Generator, batch: int, seq: int, mask: bool) -> dict[str, np.ndarray]:
    feeds = {"input_ids": rng.integers(0, 1000, (batch, seq)),
             "token_type_ids": rng.integers(0, 2, (batch, seq))}
    if mask:  # right padding of a different length per row (row 0 has none)
        lengths = np.maximum(seq - 3 * np.arange(batch), 1)
        feeds["attention_mask"] = (np.arange(seq) < lengths[:, None]).astype(np.int64)
    return feeds


@pytest.mark.parametrize("with_mask, options, fused", [
    # the default: the mask becomes EmbedLayerNormalization's mask_index, read by Attention
    (True, {}, {"EmbedLayerNormalization": 1, "Attention": 2, "SkipLayerNormalization": 4,
                "BiasGelu": 1, "FastGelu": 1}),
    # the raw 2-D mask, MultiHeadAttention after the projections, Gelu without its bias
    pytest.param(True, {"attention_mask_format": 1, "use_multi_head_attention": True,
                        "enable_bias_gelu": False},
                 {"EmbedLayerNormalization": 1, "MultiHeadAttention": 2, "SkipLayerNormalization": 4,
                  "Gelu": 1, "FastGelu": 1}, marks=pytest.mark.slow),
    # one layer (compiles faster): the Gelu forms are covered above
    (False, {}, {"EmbedLayerNormalization": 1, "Attention": 1, "SkipLayerNormalization": 2,
                 "BiasGelu": 1}),
], ids=["mask-index", "raw-mask-mha", "no-mask"])
def test_bert_optimized_by_onnxruntime(tmp_path: Path, with_mask: bool, options: dict[str, Any],
                                       fused: dict[str, int]) -> None:
    source = tmp_path / "bert.onnx"
    layers = 2 if with_mask else 1
    onnx.save(bert_model(layers=layers, hidden=HIDDEN, heads=HEADS, with_mask=with_mask), str(source))
    path = tmp_path / "bert-optimized.onnx"
    optimized = optimized_bert(str(source), str(path), HEADS, HIDDEN, **options)
    ops = collections.Counter(n.op_type for n in optimized.graph.node if n.domain == MS)
    assert dict(ops) == fused, f"onnxruntime's optimizer fused {dict(ops)}"

    compiled = cuvil.compile(path)
    assert compiled.inputs[0].shape == ("batch", "seq")
    rng = np.random.default_rng(1)
    for batch, seq in [(1, 7), (3, 16)]:
        feeds = _bert_feeds(rng, batch, seq, with_mask)
        want = run_ort(optimized, feeds)[0]
        got = compiled.run(feeds)["encoded"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# -- single nodes ---------------------------------------------------------------------------


@dataclass
class Case:
    """One com.microsoft node: `feeds` run-time inputs, `consts` weights (None for an absent
    optional input), outputs with their dtypes; `numpy` computes the expected outputs where
    onnxruntime has no CPU kernel."""

    op_type: str
    inputs: Sequence[str | None]
    attrs: dict[str, Any]
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: Sequence[tuple[str, Any]] = (("y", np.float32),)
    numpy: Callable[..., list[np.ndarray]] | None = None
    label: str = ""
    domain: str = MS


def _model(nodes: list[onnx.NodeProto], feeds: Mapping[str, np.ndarray],
           consts: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray | Any]) -> onnx.ModelProto:
    """`outputs` name -> dtype (the shape left to the runtime) or an array of the output's
    dtype and shape (a model for cuvil, whose checker wants output shapes)."""
    def out(n: str, t: Any) -> onnx.ValueInfoProto:
        if isinstance(t, np.ndarray):
            return helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(t.dtype), t.shape)
        return helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), None)

    graph = helper.make_graph(
        nodes, "contrib",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in feeds.items()],
        [out(n, t) for n, t in outputs.items()],
        [numpy_helper.from_array(a, n) for n, a in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def _prefixed(cases: Sequence[Case]) -> list[tuple[onnx.NodeProto, dict, dict, dict]]:
    """Each case's node, feeds, consts and outputs (name -> dtype) with names prefixed c<i>_."""
    out = []
    for i, c in enumerate(cases):
        def p(n: str | None, i: int = i) -> str:
            return f"c{i}_{n}" if n else ""
        node = helper.make_node(c.op_type, [p(n) for n in c.inputs], [p(n) for n, _ in c.outputs],
                                name=f"case{i}", domain=c.domain, **c.attrs)
        out.append((node, {p(n): a for n, a in c.feeds.items()}, {p(n): a for n, a in c.consts.items()},
                    {p(n): t for n, t in c.outputs if n}))
    return out


def check(cases: Sequence[Case], rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Every case's expected outputs (onnxruntime on the node alone, or numpy), then all the
    cases compiled as one model by cuvil, compared output by output."""
    parts = _prefixed(cases)
    expected: dict[str, np.ndarray] = {}
    for c, (node, feeds, consts, outs) in zip(cases, parts):
        if c.numpy is not None:
            values = {**c.feeds, **c.consts}
            want = c.numpy(*[values[n] if n else None for n in c.inputs])
        else:
            want = run_ort(_model([node], feeds, consts, outs), feeds)
        expected.update(zip(outs, want))
    feeds = {k: v for _, f, _, _ in parts for k, v in f.items()}
    model = _model([n for n, _, _, _ in parts], feeds,
                   {k: v for _, _, c, _ in parts for k, v in c.items()}, expected)
    got = cuvil.compile(model).run(feeds)
    failures = []
    for c, (_, _, _, outs) in zip(cases, parts):
        for name in outs:
            try:
                assert got[name].shape == expected[name].shape, \
                    f"shape {got[name].shape} != {expected[name].shape}"
                np.testing.assert_allclose(got[name], expected[name], rtol=rtol, atol=atol)
            except AssertionError as exc:
                failures.append(f"{c.label or c.op_type} {c.attrs} output {name}: {str(exc)[:400]}")
    assert not failures, "\n".join(failures)


rng = np.random.default_rng(7)


def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def i32(values: Any) -> np.ndarray:
    return np.asarray(values, np.int32)


B, S, D, N = 2, 5, 8, 2
raw_mask = i32([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]])


def attention_cases() -> list[Case]:
    w, bias = f32(D, 3 * D, scale=0.5), f32(3 * D, scale=0.1)
    x = {"x": f32(B, S, D)}
    qkv = {"w": w, "bias": bias}
    # a small mask_filter_value keeps the masked keys visible in the softmax, so that which
    # keys are masked (and how often) shows in the outputs
    soft = {"num_heads": N, "mask_filter_value": -3.0}
    return [
        Case("Attention", ["x", "w", "bias", "m"], soft, {**x, "m": raw_mask}, qkv, label="raw 2-D"),
        Case("Attention", ["x", "w", "bias", "m"], {**soft, "scale": 0.3},
             {**x, "m": rng.integers(0, 2, (B, S, S)).astype(np.int32)}, qkv, label="3-D, scale"),
        Case("Attention", ["x", "w", "bias", "m"], {**soft, "unidirectional": 1},
             {**x, "m": i32([4, 5, 0, 1])}, qkv, label="end/start, causal"),
        Case("Attention", ["x", "w", "", "m"], {"num_heads": N}, {**x, "m": i32([3, 5])}, {"w": w},
             label="key lengths, no bias"),
        Case("Attention", ["x", "w", "bias", "m", "past"], {**soft, "unidirectional": 1},
             {**x, "m": rng.integers(0, 2, (B, 3 + S)).astype(np.int32), "past": f32(2, B, N, 3, D // N)},
             qkv, outputs=[("y", np.float32), ("present", np.float32)], label="past, present"),
        Case("Attention", ["x", "w", "bias", "", "", "ab"], {"num_heads": N, "qkv_hidden_sizes": [8, 8, 4]},
             {**x, "ab": f32(1, N, S, S)}, {"w": f32(D, 20, scale=0.5), "bias": f32(20)},
             label="attention_bias, smaller V"),
    ]


def multihead_cases() -> list[Case]:
    L = 3
    q, k, v = f32(B, S, D), f32(B, L, D), f32(B, L, D)
    return [
        Case("MultiHeadAttention", ["q", "k", "v", "bias", "m"], {"num_heads": N, "scale": 0.5},
             {"q": q, "k": k, "v": v, "m": i32([2, 3])}, {"bias": f32(3 * D)}, label="cross, lengths"),
        Case("MultiHeadAttention", ["q", "k", "v", "", "m", "ab"],
             {"num_heads": N, "mask_filter_value": -2.0},
             {"q": q, "k": f32(B, N, L, D // N), "v": f32(B, N, L, D // N),
              "m": i32([[1, 0, 1], [0, 1, 1]]), "ab": f32(B, 1, S, L)}, label="[b, n, t, h] key and value"),
        Case("MultiHeadAttention", ["q", "k", "v", "", "m", "", "pk", "pv"],
             {"num_heads": N, "unidirectional": 1, "mask_filter_value": -2.0},
             {"q": q, "k": f32(B, S, D), "v": f32(B, S, D),
              "m": rng.integers(0, 2, (B, 4 + S)).astype(np.int32),
              "pk": f32(B, N, 4, D // N), "pv": f32(B, N, 4, D // N)},
             outputs=[("y", np.float32), ("present_k", np.float32), ("present_v", np.float32)],
             label="past, present, causal"),
    ]


def normalization_cases() -> list[Case]:
    vocab, positions = 30, 12
    ids = rng.integers(0, vocab, (B, S)).astype(np.int32)
    tables = {"word": f32(vocab, D), "pos": f32(positions, D), "gamma": f32(D), "beta": f32(D)}
    return [
        Case("SkipLayerNormalization", ["x", "skip", "gamma"], {},
             {"x": f32(B, S, D), "skip": f32(B, S, D)}, {"gamma": f32(D)},
             outputs=[("y", np.float32), ("mean", np.float32), ("inv", np.float32), ("sum", np.float32)],
             label="no beta, every output"),
        Case("SkipLayerNormalization", ["x", "skip", "gamma", "beta", "bias"], {"epsilon": 0.1},
             {"x": f32(B, S, D), "skip": f32(S, D)}, {"gamma": f32(D), "beta": f32(D), "bias": f32(D)},
             label="2-D skip, epsilon"),
        Case("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma", "bias"], {"epsilon": 0.01},
             {"x": f32(B, S, D), "skip": f32(B, S, D)}, {"gamma": f32(D), "bias": f32(D)},
             outputs=[("y", np.float32), ("", None), ("inv", np.float32), ("sum", np.float32)]),
        Case("EmbedLayerNormalization", ["ids", "", "word", "pos", "", "gamma", "beta", "mask", "pids"],
             {"epsilon": 1e-5}, {"ids": ids, "mask": i32([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
                                 "pids": rng.integers(0, positions, (B, S)).astype(np.int32)}, tables,
             outputs=[("y", np.float32), ("mask_index", np.int32), ("sum", np.float32)],
             label="position ids, no segments"),
        Case("EmbedLayerNormalization", ["ids", "seg", "word", "pos", "segemb", "gamma", "beta"], {},
             {"ids": ids, "seg": rng.integers(0, 2, (B, S)).astype(np.int32)},
             {**tables, "segemb": f32(2, D)}, outputs=[("y", np.float32), ("mask_index", np.int32)],
             label="no mask"),
    ]


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    flat = x.reshape(int(np.prod(x.shape[:axis])), -1)
    e = np.exp(flat - flat.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).reshape(x.shape)


def elementwise_cases() -> list[Case]:
    x = f32(B, S, D)
    return [
        Case("Gelu", ["x"], {}, {"x": x}),
        Case("BiasGelu", ["x", "b"], {}, {"x": x}, {"b": f32(D)}),
        Case("FastGelu", ["x"], {}, {"x": x}, label="FastGelu without bias"),
        Case("QuickGelu", ["x"], {}, {"x": x}),
        Case("QuickGelu", ["x"], {"alpha": 1.0}, {"x": x}),
        Case("FusedMatMul", ["a", "b"], {"transA": 1, "alpha": 0.5}, {"a": f32(3, 4, 6), "b": f32(4, 5)}),
        Case("FusedMatMul", ["a", "b"], {"transB": 1, "transBatchA": 1},
             {"a": f32(4, 2, 3, 6), "b": f32(2, 3, 5, 6)}, label="transBatchA"),
        Case("FusedMatMul", ["a", "b"], {"transBatchB": 1, "transA": 1},
             {"a": f32(3, 6, 4), "b": f32(6, 3, 5)}, label="transBatchB"),
        Case("BiasSoftmax", ["x", "b"], {"axis": 3, "is_inner_broadcast": 0},
             {"x": f32(B, N, S, S)}, {"b": f32(S, S)}, label="BiasSoftmax outer",
             numpy=lambda x, b: [_softmax(x + b, 3)]),
        Case("BiasSoftmax", ["x", "b"], {"axis": 3, "is_inner_broadcast": 1},
             {"x": f32(B, N, S, S)}, {"b": f32(B, S)}, label="BiasSoftmax inner",
             numpy=lambda x, b: [_softmax(x + b[:, None, None, :], 3)]),
        Case("BiasSoftmax", ["x", "b"], {"is_inner_broadcast": 0},
             {"x": f32(B, N, S)}, {"b": f32(N, S)}, label="BiasSoftmax axis 1",
             numpy=lambda x, b: [_softmax(x + b, 1)]),
        Case("BiasAdd", ["x", "b", "skip"], {}, {"x": x, "skip": f32(B, S, D)}, {"b": f32(D)},
             numpy=lambda x, b, skip: [x + b + skip]),
    ]


def test_contrib_nodes_match_onnxruntime() -> None:
    check(attention_cases() + multihead_cases() + normalization_cases() + elementwise_cases())


def test_unsupported_attribute_names_the_node() -> None:
    case = Case("Attention", ["x", "w"], {"num_heads": N, "do_rotary": 1}, {"x": f32(B, S, D)},
                {"w": f32(D, 3 * D)})
    node, feeds, consts, _ = _prefixed([case])[0]
    with pytest.raises(CuvilError, match=r"case0.*do_rotary"):
        cuvil.compile(_model([node], feeds, consts, {"c0_y": np.zeros((B, S, D), np.float32)}))
