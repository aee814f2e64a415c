"""The ops of decoder-only language models (cuvil/compiler/ops/contrib_decoder.py) against
onnxruntime: MatMulNBits as onnxruntime's MatMulNBitsQuantizer writes it, and
GroupQueryAttention, RotaryEmbedding and SimplifiedLayerNormalization as onnxruntime-genai's
model builder writes them, each a single node with random inputs (test_contrib.py's `check`:
onnxruntime runs each node alone, cuvil all of them compiled as one model).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from oracle import run_ort
from test_contrib import Case, _model, _prefixed, check, f32, rng

import cuvil
from cuvil.errors import CuvilError

quantizer = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")

# -- MatMulNBits -----------------------------------------------------------------------------

K, N = 80, 24  # K is not a multiple of the blocks below but 16: the last block is padded
#: (bits, block_size, is_symmetric) of the quantizer, one MatMul each
CONFIGS = [(4, 32, False), (4, 16, True), (4, 128, False), (8, 32, False)]


def quantized_model(accuracy_level: int | None) -> onnx.ModelProto:
    """One MatMul per config on x [batch, 3, K], each quantized by MatMulNBitsQuantizer (as a
    model of its own: the quantizer applies one config to a whole model), joined in one graph."""
    weight_rng = np.random.default_rng(1)  # the same weights for each accuracy level
    nodes, weights = [], []
    for i, (bits, block, symmetric) in enumerate(CONFIGS):
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"mm{i}")], "nbits",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3, K])],
            [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, ["batch", 3, N])],
            [numpy_helper.from_array(weight_rng.standard_normal((K, N)).astype(np.float32), f"w{i}")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        q = quantizer.MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=symmetric,
                                           accuracy_level=accuracy_level)
        q.process()
        nodes += q.model.model.graph.node
        weights += q.model.model.graph.initializer
    graph = helper.make_graph(
        nodes, "nbits", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3, K])],
        [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, ["batch", 3, N])
         for i in range(len(CONFIGS))], weights)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17),
                                                                 helper.make_opsetid("com.microsoft", 1)])


@pytest.fixture(scope="module")
def nbits() -> tuple[onnx.ModelProto, cuvil.CompiledModel]:
    model = quantized_model(None)
    ops = [(n.op_type, {a.name: helper.get_attribute_value(a) for a in n.attribute})
           for n in model.graph.node]
    # the quantizer's output as this test expects it (fails when the tool writes another form)
    assert ops == [("MatMulNBits", {"K": K, "N": N, "bits": bits, "block_size": block})
                   for bits, block, _ in CONFIGS], ops
    zero_points = [len(n.input) == 4 for n in model.graph.node]
    assert zero_points == [not symmetric for _, _, symmetric in CONFIGS]
    return model, cuvil.compile(model)


def test_matmul_nbits_as_the_quantizer_writes_it(nbits: tuple[onnx.ModelProto, cuvil.CompiledModel]) -> None:
    model, compiled = nbits
    x = f32(2, 3, K)
    # accuracy_level unset: onnxruntime dequantizes the weights to float32 too
    for got, want in zip(compiled(x), run_ort(model, {"x": x})):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_matmul_nbits_accuracy_level_4_within_activation_rounding(
        nbits: tuple[onnx.ModelProto, cuvil.CompiledModel]) -> None:
    """With accuracy_level 4 onnxruntime rounds x to int8 per block of block_size along K
    (scale: the block's largest |x| / 127); cuvil keeps x in float32, so the two differ by at
    most half a step of x per term: |W| (onnxruntime's own weights, read by a product with the
    identity) times those half steps."""
    model, compiled = nbits
    level4 = quantized_model(4)
    assert all(helper.get_attribute_value(a) == 4 for n in level4.graph.node for a in n.attribute
               if a.name == "accuracy_level")
    x = f32(2, 3, K)
    identity = np.repeat(np.eye(K, dtype=np.float32)[:, None, :], 3, axis=1)  # [K, 3, K]
    for i, (got, want, w) in enumerate(zip(compiled(x), run_ort(level4, {"x": x}),
                                           run_ort(model, {"x": identity}))):
        block = CONFIGS[i][1]
        padded = np.pad(np.abs(x), [(0, 0), (0, 0), (0, -K % block)]).reshape(2, 3, -1, block)
        half_step = np.repeat(padded.max(-1) / 127 / 2, block, axis=-1)[..., :K]
        bound = half_step @ np.abs(w[:, 0]) + 1e-4
        assert np.all(np.abs(got - want) <= bound), f"config {CONFIGS[i]}"
        assert np.abs(got - want).max() > 0, "onnxruntime did not round the activations"


def nbits_cases() -> list[Case]:
    """Forms the quantizer does not write: float zero points, a bias, 2-D input, 2 bits."""
    blocks, k, n = 3, 40, 5
    packed = rng.integers(0, 256, (n, blocks, 8)).astype(np.uint8)
    scales = rng.uniform(0.1, 0.3, (n, blocks)).astype(np.float32)
    attrs = {"K": k, "N": n, "bits": 4, "block_size": 16}
    return [
        Case("MatMulNBits", ["x", "b", "s", "z"], attrs, {"x": f32(4, k)},
             {"b": packed, "s": scales, "z": f32(n, blocks)}, label="float zero points"),
        Case("MatMulNBits", ["x", "b", "s", "z", "", "bias"], attrs, {"x": f32(2, 3, k)},
             {"b": packed, "s": scales.ravel(), "z": rng.integers(0, 256, n * 2).astype(np.uint8),
              "bias": f32(n)}, label="bias, flat scales and zero points"),
        Case("MatMulNBits", ["x", "b", "s", "z"], {**attrs, "bits": 2}, {"x": f32(4, k)},
             {"b": packed[:, :, :4], "s": scales, "z": rng.integers(0, 256, (n, 1)).astype(np.uint8)},
             label="2 bits"),
    ]


# -- RotaryEmbedding, SimplifiedLayerNormalization --------------------------------------------

B, HEADS, HEAD, POSITIONS = 2, 4, 16, 32  # onnxruntime rotates heads of 16k in GQA


def caches(rotary: int) -> dict[str, np.ndarray]:
    angles = np.arange(POSITIONS)[:, None] / 10000.0 ** (np.arange(rotary // 2) / (rotary // 2))
    return {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}


def positions(s: int) -> np.ndarray:
    return rng.integers(0, POSITIONS - 1, (B, s)).astype(np.int64)


def rotary_cases() -> list[Case]:
    cases = []
    for s in (5, 1):
        inputs = ["x", "pos", "cos", "sin"]
        hidden = {"x": f32(B, s, HEADS * HEAD), "pos": positions(s)}
        cases += [
            Case("RotaryEmbedding", inputs, {"num_heads": HEADS}, hidden, caches(HEAD), label=f"3-D, s={s}"),
            Case("RotaryEmbedding", inputs, {"interleaved": 1}, hidden, caches(HEAD),
                 label=f"interleaved, heads from the caches, s={s}"),
            Case("RotaryEmbedding", inputs, {}, {"x": f32(B, HEADS, s, HEAD), "pos": positions(s)},
                 caches(HEAD), label=f"4-D, s={s}"),
            Case("RotaryEmbedding", inputs, {"num_heads": HEADS, "rotary_embedding_dim": 4, "interleaved": 1},
                 {"x": f32(B, s, HEADS * HEAD), "pos": np.array([7], np.int64)}, caches(4),
                 label=f"partial, first position, s={s}"),
        ]
    return cases


def rms_cases() -> list[Case]:
    return [
        Case("SimplifiedLayerNormalization", ["x", "g"], {"epsilon": 1e-3}, {"x": f32(B, 5, 16)},
             {"g": f32(16)}, outputs=[("y", np.float32), ("inv", np.float32)], domain=""),
        Case("SimplifiedLayerNormalization", ["x", "g"], {"axis": 1}, {"x": f32(B, 3, 4)},
             {"g": f32(3, 4)}, domain="", label="axis 1"),
    ]


# -- GroupQueryAttention -----------------------------------------------------------------------

KV_HEADS = 2
GQA_OUT = [("y", np.float32), ("present_k", np.float32), ("present_v", np.float32)]


def gqa(s: int, past: int, lengths: list[int] | None = None, attrs: dict | None = None,
        packed: bool = False, rotary: bool = False, label: str = "") -> Case:
    """A step of `s` tokens after `past` cached ones (each row's total: `lengths`, default
    past + s); past 0 means the first prompt, without past inputs. onnxruntime takes several
    tokens after a past in a batch of one only."""
    batch = 1 if s > 1 and past else B
    lengths = lengths or [past + s] * batch
    feeds = {"seqlens": np.array([n - 1 for n in lengths], np.int32),
             "total": np.array(max(lengths), np.int32)}
    if packed:
        feeds["q"] = f32(batch, s, (HEADS + 2 * KV_HEADS) * HEAD)
        inputs = ["q", "", ""]
    else:
        feeds.update(q=f32(batch, s, HEADS * HEAD), k=f32(batch, s, KV_HEADS * HEAD),
                     v=f32(batch, s, KV_HEADS * HEAD))
        inputs = ["q", "k", "v"]
    if past:
        feeds.update(pk=f32(batch, KV_HEADS, past, HEAD), pv=f32(batch, KV_HEADS, past, HEAD))
        inputs += ["pk", "pv"]
    else:
        inputs += ["", ""]
    inputs += ["seqlens", "total"]
    consts = {}
    if rotary:
        inputs += ["cos", "sin"]
        consts = caches(HEAD)
    return Case("GroupQueryAttention", inputs,
                {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "do_rotary": int(rotary), **(attrs or {})},
                feeds, consts, outputs=GQA_OUT, label=label)


def gqa_cases() -> list[Case]:
    return [
        gqa(5, 0, label="first prompt"),
        gqa(3, 4, label="3 tokens after 4"),
        gqa(1, 6, label="one token after 6"),
        gqa(1, 6, packed=True, rotary=True, label="packed QKV, rotary"),
        gqa(4, 3, rotary=True, attrs={"rotary_interleaved": 1, "scale": 0.2}, label="interleaved rotary"),
        gqa(5, 0, rotary=True, label="first prompt, rotary"),
        gqa(3, 6, attrs={"local_window_size": 3}, label="local window"),
        gqa(3, 6, attrs={"softcap": 2.0}, label="softcap"),
        gqa(1, 6, lengths=[7, 4], label="rows of 7 and 4 in a past buffer of 6"),
        gqa(1, 5, lengths=[6, 3], rotary=True, label="rows of 6 and 3, rotary"),
    ]


def test_decoder_nodes_match_onnxruntime() -> None:
    check(nbits_cases() + rotary_cases() + rms_cases() + gqa_cases(), rtol=1e-4, atol=1e-4)


def test_refused_forms_name_the_node() -> None:
    case = gqa(1, 2, attrs={"smooth_softmax": 1})
    node, feeds, consts, _ = _prefixed([case])[0]
    outs = {f"c0_{n}": np.zeros(1, np.float32) for n, _ in GQA_OUT}
    with pytest.raises(CuvilError, match=r"case0.*smooth_softmax"):
        cuvil.compile(_model([node], feeds, consts, outs))
