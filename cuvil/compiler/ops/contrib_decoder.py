"""The ops of decoder-only language models as onnxruntime's tools write them: MatMulNBits
(block-wise int4/int8 weights, from `onnxruntime.quantization.matmul_nbits_quantizer` and
onnxruntime-genai's model builder), and the builder's Llama-style ops RotaryEmbedding,
GroupQueryAttention (com.microsoft) and SimplifiedLayerNormalization (which onnxruntime
implements as a contrib kernel of the default domain), with the semantics of onnxruntime's
operator documentation (docs/ContribOperators.md) and its CPU kernels.

Each compiles as a graph of standard ops (`Op.expand`), as contrib.py's do. MatMulNBits
computes in float32: its quantized weights are constants, so the importer folds their
unpacking and dequantization ((q - zero point) * scale per block) into one float32 weight at
compile time, and the product is a float32 MatMul on cuvil's GEMM. onnxruntime computes the
same for accuracy_level 0 (the quantizer's default); with accuracy_level 4 it also rounds the
activations to int8 per block, which cuvil does not: its results are then the closer ones to
the float model.
"""

from __future__ import annotations

import numpy as np
import onnx

from cuvil.compiler.ir import Node
from cuvil.compiler.ops import attr, register, required_input
from cuvil.compiler.ops._ml_graph import Body
from cuvil.compiler.ops.contrib import OPSET, Contrib, _heads_attr, _ints, _refuse, _static
from cuvil.errors import ModelError, UnsupportedOpError

#: onnxruntime's default (contrib_defs.cc) for SimplifiedLayerNormalization
RMS_EPSILON = 1e-5


def _finish(b: Body, *outputs: str) -> onnx.FunctionProto:
    return b.finish(*outputs, opset=OPSET)


# -- MatMulNBits -----------------------------------------------------------------------------


def _unpack(b: Body, packed: str, bits: int, rows: int, count: int) -> str:
    """uint8 [rows, bytes] holding `bits`-bit values, the first in the low bits of each byte
    -> [rows, count] of them (uint8)."""
    if bits == 8:
        return b.op("Slice", packed, _ints(b, 0), _ints(b, count), _ints(b, 1))
    mask = b.const(np.uint8((1 << bits) - 1), np.uint8)
    parts = [b.op("Unsqueeze", b.op("BitwiseAnd", b.op("BitShift", packed, b.const(np.uint8(s), np.uint8),
                                                        direction="RIGHT"), mask), _ints(b, -1))
             for s in range(0, 8, bits)]
    flat = b.op("Reshape", b.op("Concat", *parts, axis=-1), _ints(b, rows, -1))
    return b.op("Slice", flat, _ints(b, 0), _ints(b, count), _ints(b, 1))


@register
class MatMulNBits(Contrib):
    """A [..., K] times B [K, N] stored quantized: B [N, K blocks, block bytes] holds each
    column's block_size values per block, `bits` (2, 4 or 8) per value, low bits first;
    scales [N, K blocks] (or flat); zero_points packed as B (uint8, [N, ceil(blocks * bits /
    8)]) or of the scales' dtype and shape, default 2^(bits - 1); bias [N]. The product runs
    in float32 on the weights dequantized at compile time (see the module's docstring)."""

    op_type = "MatMulNBits"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        if node.input(4) is not None:
            raise UnsupportedOpError(f"{node.describe()}: input g_idx (act-order column groups) is not "
                                     "compiled by cuvil; quantize without act_order")
        k, n = int(attr(node, "K")), int(attr(node, "N"))
        bits, block = int(attr(node, "bits", 4)), int(attr(node, "block_size"))
        if bits not in (2, 4, 8):
            raise UnsupportedOpError(f"{node.describe()}: bits={bits}; cuvil compiles 2, 4 and 8")
        blocks = -(-k // block)
        weights = required_input(node, 1)
        if weights.type.dtype != np.uint8 or weights.type.shape != (n, blocks, block * bits // 8):
            raise ModelError(f"{node.describe()}: B must be uint8 [N, K blocks, block bytes] = "
                             f"[{n}, {blocks}, {block * bits // 8}] for K={k}, N={n}, bits={bits}, "
                             f"block_size={block}; got {weights.type}")
        required_input(node, 2)
        b = Body(node)
        x = b.inputs
        q = b.cast(_unpack(b, b.op("Reshape", x[1], _ints(b, n * blocks, -1)), bits, n * blocks, block),
                   np.float32)  # [N * blocks, block]
        zero_point = node.input(3)
        if zero_point is None:
            zero = b.const(float(1 << (bits - 1)))
        elif zero_point.type.dtype == np.uint8:
            zp = b.op("Reshape", x[3], _ints(b, n, -1))
            zero = b.op("Reshape", b.cast(_unpack(b, zp, bits, n, blocks), np.float32), _ints(b, -1, 1))
        else:
            zero = b.op("Reshape", x[3], _ints(b, -1, 1))
        w = b.op("Mul", b.op("Sub", q, zero), b.op("Reshape", x[2], _ints(b, -1, 1)))
        w = b.op("Slice", b.op("Reshape", w, _ints(b, n, -1)), _ints(b, 0), _ints(b, k), _ints(b, 1))
        y = b.op("MatMul", x[0], b.op("Transpose", w, perm=[1, 0]))
        if node.input(5) is not None:
            y = b.op("Add", y, x[5])
        return _finish(b, y)


# -- normalization ---------------------------------------------------------------------------


@register
class SimplifiedLayerNormalization(Contrib):
    """RMS normalization: X / sqrt(mean(X^2) + epsilon) * scale over the axes from `axis` on;
    the second output is the inverse root mean square. onnxruntime registers it in the default
    domain (a contrib kernel, not an ONNX operator), where the model builder writes it."""

    op_type = "SimplifiedLayerNormalization"
    domain = ""

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        rank = required_input(node, 0).type.rank
        required_input(node, 1)
        axis = int(attr(node, "axis", -1))
        if not -rank <= axis < rank:
            raise ModelError(f"{node.describe()}: axis {axis} is out of range for a rank-{rank} input")
        b = Body(node)
        x = b.inputs[0]
        square_mean = b.op("ReduceMean", b.op("Mul", x, x), _ints(b, *range(axis % rank, rank)),
                           keepdims=1)
        eps = float(attr(node, "epsilon", RMS_EPSILON))
        inv = b.op("Reciprocal", b.op("Sqrt", b.op("Add", square_mean, b.const(eps))))
        return _finish(b, b.op("Mul", b.op("Mul", x, inv), b.inputs[1]), inv)


# -- rotary embeddings -----------------------------------------------------------------------


def _rotate(b: Body, x: str, cos: str, sin: str, head: int, rotary: int, interleaved: bool) -> str:
    """x [b, ., ., head] (4-D) with its first `rotary` values rotated by the angles whose cos and sin
    ([..., rotary / 2], broadcast) are given: pairs (i, i + rotary / 2), or (2i, 2i + 1) when
    interleaved; the values after them pass through."""
    half = rotary // 2
    if interleaved:  # [..., half, 2]: the pairs side by side
        pairs = b.op("Reshape", b.op("Slice", x, _ints(b, 0), _ints(b, rotary), _ints(b, -1)),
                     _ints(b, 0, 0, 0, half, 2))
        first, second = b.outputs("Split", 2, pairs, axis=-1)
        cos, sin = (b.op("Unsqueeze", t, _ints(b, -1)) for t in (cos, sin))
    else:
        first, second = (b.op("Slice", x, _ints(b, lo), _ints(b, lo + half), _ints(b, -1))
                         for lo in (0, half))
    out = [b.op("Sub", b.op("Mul", first, cos), b.op("Mul", second, sin)),
           b.op("Add", b.op("Mul", second, cos), b.op("Mul", first, sin))]
    rotated = b.op("Concat", *out, axis=-1)
    if interleaved:
        rotated = b.op("Reshape", rotated, _ints(b, 0, 0, 0, rotary))
    if rotary == head:
        return rotated
    rest = b.op("Slice", x, _ints(b, rotary), _ints(b, head), _ints(b, -1))
    return b.op("Concat", rotated, rest, axis=-1)


def _angles(b: Body, positions: str, cos_slot: int, axis: int) -> tuple[str, str]:
    """cos and sin of the rotation at `positions` [b, s] (rows of the caches), with an axis of 1
    inserted at `axis` to broadcast over the heads."""
    def rows(slot: int) -> str:
        return b.op("Unsqueeze", b.op("Gather", b.inputs[slot], positions, axis=0), _ints(b, axis))

    return rows(cos_slot), rows(cos_slot + 1)


def _rotary_dim(node: Node, cos_slot: int, head: int) -> int:
    half = _static(node, required_input(node, cos_slot).type.shape[-1], "the cos cache's last dim")
    required_input(node, cos_slot + 1)
    if 2 * half > head:
        raise ModelError(f"{node.describe()}: the caches rotate {2 * half} values, more than the "
                         f"head size {head}")
    return 2 * half


@register
class RotaryEmbedding(Contrib):
    """Rotary position embeddings of input [b, s, hidden] (heads of hidden / num_heads, or of
    twice the caches' width without num_heads) or [b, n, s, head]; position_ids [b, s], or
    [1]: the first position of every row; cos_cache and sin_cache [positions, rotary / 2];
    interleaved, rotary_embedding_dim (with num_heads) and num_heads."""

    op_type = "RotaryEmbedding"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        _refuse(node, ("is_packed_batching",))
        if float(attr(node, "scale", 1.0)) != 1.0:
            raise UnsupportedOpError(f"{node.describe()}: attribute scale={attr(node, 'scale')} is not "
                                     "compiled by cuvil (it compiles RotaryEmbedding with scale 1)")
        x, ids = required_input(node, 0), required_input(node, 1)
        if x.type.rank not in (3, 4) or ids.type.rank not in (1, 2):
            raise ModelError(f"{node.describe()}: input must be [b, s, hidden] or [b, n, s, head] and "
                             f"position_ids [b, s] or [1]; got {x.type} and {ids.type}")
        heads = int(attr(node, "num_heads", 0))
        rotary = int(attr(node, "rotary_embedding_dim", 0))
        last = _static(node, x.type.shape[-1], "the input's last dim")
        if x.type.rank == 4:
            head = last
        elif heads:
            head = last // heads
        elif rotary:
            raise ModelError(f"{node.describe()}: rotary_embedding_dim needs num_heads for a 3-D input")
        else:
            head = 2 * _static(node, required_input(node, 2).type.shape[-1], "the cos cache's last dim")
        if last % head:
            raise ModelError(f"{node.describe()}: hidden size {last} is not a multiple of the head "
                             f"size {head}")
        cached = _rotary_dim(node, 2, head)
        if rotary and rotary != cached:
            raise ModelError(f"{node.describe()}: rotary_embedding_dim {rotary} but the caches rotate "
                             f"{cached} values (their last dim is half of it)")
        rotary = cached
        b = Body(node)
        seq_axis = 1 if x.type.rank == 3 else 2
        positions = b.inputs[1]
        if ids.type.rank == 1:  # the first position: the row's positions follow it
            seq = b.op("Gather", b.op("Shape", b.inputs[0]), b.const(seq_axis, np.int64), axis=0)
            steps = b.op("Range", b.const(0, np.int64), seq, b.const(1, np.int64))
            positions = b.op("Unsqueeze", b.op("Add", b.cast(positions, np.int64), steps), _ints(b, 0))
        if x.type.rank == 3:  # [b, s, n, head]
            cos, sin = _angles(b, positions, 2, 2)
            split = b.op("Reshape", b.inputs[0], _ints(b, 0, 0, -1, head))
            y = b.op("Reshape", _rotate(b, split, cos, sin, head, rotary, bool(attr(node, "interleaved", 0))),
                     _ints(b, 0, 0, -1))
        else:
            cos, sin = _angles(b, positions, 2, 1)
            y = _rotate(b, b.inputs[0], cos, sin, head, rotary, bool(attr(node, "interleaved", 0)))
        return _finish(b, y)


# -- grouped-query attention -----------------------------------------------------------------


def _present(b: Body, past: str | None, new: str, past_len: str, valid_past: str, steps: str,
             length: str, heads: int, head: int) -> str:
    """The present cache [b, kv heads, length, head]: row b's first `valid_past[b]` positions of
    the past, then its `steps` new ones ([b, kv heads, s, head]), zeros after them."""
    cat = new if past is None else b.op("Concat", past, new, axis=2)
    j = b.op("Unsqueeze", b.op("Range", b.const(0, np.int64), length, b.const(1, np.int64)), _ints(b, 0))
    start = b.op("Unsqueeze", valid_past, _ints(b, 1))  # [b, 1]
    from_new = b.op("GreaterOrEqual", j, start)
    index = b.op("Where", from_new, b.op("Add", b.op("Sub", j, start), past_len), j)  # [b, length]
    last = b.op("Sub", b.op("Add", past_len, steps), b.const(1, np.int64))
    index = b.op("Min", index, last)
    shape = b.op("Concat", b.op("Slice", b.op("Shape", new), _ints(b, 0), _ints(b, 1)),
                 _ints(b, heads), b.op("Reshape", length, _ints(b, 1)), _ints(b, head), axis=0)
    index = b.op("Expand", b.op("Unsqueeze", index, _ints(b, 1, 3)), shape)
    kept = b.op("Less", j, b.op("Add", start, steps))
    return b.op("Where", b.op("Unsqueeze", kept, _ints(b, 1, 3)),
                b.op("GatherElements", cat, index, axis=2), b.const(0.0))


@register
class GroupQueryAttention(Contrib):
    """Causal attention of num_heads query heads over kv_num_heads key/value heads (each shared
    by num_heads / kv_num_heads query heads), as onnxruntime's CPU kernel computes it: query
    [b, s, d] with key and value [b, s, kv d], or query packing Q, K and V; past_key and
    past_value [b, kv heads, past, head] of which row b holds seqlens_k[b] + 1 - s positions
    (none at the first prompt: s == total_sequence_length), the new ones going after them in
    present_key and present_value ([b, kv heads, past + s, head], zeros after each row's
    length); do_rotary with cos_cache and sin_cache (rotary_interleaved), scale, softcap and
    local_window_size.

    The kv-share-buffer mode is not reproduced: given a past buffer of the maximum length,
    longer than total_sequence_length, cuvil's present holds the same values but is past + s
    long (onnxruntime's: the buffer's length), in a tensor of its own: cuvil's output shapes
    follow from the input shapes, not from an input's value."""

    op_type = "GroupQueryAttention"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        _refuse(node, ("smooth_softmax", "qk_output"))
        for i, what in ((9, "position_ids"), (10, "attention_bias"), (11, "head_sink")):
            if node.input(i) is not None:
                raise UnsupportedOpError(f"{node.describe()}: input {what} is not compiled by cuvil")
        query = required_input(node, 0)
        required_input(node, 5)
        required_input(node, 6)
        heads, kv_heads = _heads_attr(node), int(attr(node, "kv_num_heads", 0))
        if kv_heads <= 0 or heads % kv_heads:
            raise ModelError(f"{node.describe()}: kv_num_heads ({kv_heads}) must be positive and divide "
                             f"num_heads ({heads})")
        if query.type.rank != 3:
            raise ModelError(f"{node.describe()}: query must be [batch, sequence, hidden], got {query.type}")
        d = _static(node, query.type.shape[2], "the query's hidden size")
        packed = node.input(1) is None
        if packed != (node.input(2) is None):
            raise ModelError(f"{node.describe()}: key and value come together (or neither, with Q, K "
                             "and V packed in query)")
        head = d // (heads + 2 * kv_heads) if packed else d // heads
        if head * (heads + 2 * kv_heads if packed else heads) != d:
            raise ModelError(f"{node.describe()}: query hidden size {d} does not split into "
                             f"{heads} heads{f' + 2 x {kv_heads} kv heads' if packed else ''}")
        if (node.input(3) is None) != (node.input(4) is None):
            raise ModelError(f"{node.describe()}: past_key and past_value come together")
        rotary = _rotary_dim(node, 7, head) if attr(node, "do_rotary", 0) else 0
        scale = float(attr(node, "scale", 0.0)) or 1.0 / float(np.sqrt(head))
        softcap = float(attr(node, "softcap", 0.0))
        window = int(attr(node, "local_window_size", -1))

        b = Body(node)
        x = b.inputs
        if packed:
            q, k, v = b.outputs("Split", 3, x[0], _ints(b, heads * head, kv_heads * head, kv_heads * head),
                                axis=2)
        else:
            q, k, v = x[0], x[1], x[2]
        q, k, v = (b.op("Reshape", t, _ints(b, 0, 0, n, head))
                   for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))  # [b, s, n, head]
        one = b.const(1, np.int64)
        steps = b.op("Gather", b.op("Shape", x[0]), one, axis=0)
        total = b.op("Reshape", b.cast(x[6], np.int64), _ints(b))
        lengths = b.op("Add", b.cast(x[5], np.int64), one)  # [b]: each row's past + new
        first = b.op("Equal", steps, total)
        valid_past = b.op("Where", first, b.const(0, np.int64), b.op("Sub", lengths, steps))
        offsets = b.op("Range", b.const(0, np.int64), steps, one)
        positions = b.op("Add", b.op("Unsqueeze", valid_past, _ints(b, 1)), offsets)  # [b, s]
        if rotary:
            cos, sin = _angles(b, positions, 7, 2)
            interleaved = bool(attr(node, "rotary_interleaved", 0))
            q, k = (_rotate(b, t, cos, sin, head, rotary, interleaved) for t in (q, k))
        k, v = (b.op("Transpose", t, perm=[0, 2, 1, 3]) for t in (k, v))  # [b, kv heads, s, head]
        # the present's length comes from the shapes (a dim of the output): past + s, where
        # onnxruntime takes max(total, past), the same but for a past longer than the total
        if node.input(3) is not None:
            past_len = b.op("Gather", b.op("Shape", x[3]), b.const(2, np.int64), axis=0)
            pk, pv = x[3], x[4]
        else:
            past_len, pk, pv = b.const(0, np.int64), None, None
        length = b.op("Add", past_len, steps)
        present_k, present_v = (_present(b, p, t, past_len, valid_past, steps, length, kv_heads, head)
                                for p, t in ((pk, k), (pv, v)))
        # the query heads of one kv head side by side: [b, kv heads, group, s, head]
        group = heads // kv_heads
        q = b.op("Transpose", b.op("Reshape", q, _ints(b, 0, 0, kv_heads, group, head)), perm=[0, 2, 3, 1, 4])
        k_t = b.op("Transpose", b.op("Unsqueeze", present_k, _ints(b, 2)), perm=[0, 1, 2, 4, 3])
        scores = b.op("MatMul", b.op("Mul", q, b.const(scale)), k_t)  # [b, kv heads, group, s, length]
        if softcap > 0:
            scores = b.op("Mul", b.op("Tanh", b.op("Mul", scores, b.const(1.0 / softcap))), b.const(softcap))
        # key j is seen by query i of row r when j <= positions[r, i] and j < lengths[r]
        j = b.op("Range", b.const(0, np.int64), length, one)
        at = b.op("Unsqueeze", positions, _ints(b, 2))  # [b, s, 1]
        seen = b.op("And", b.op("LessOrEqual", j, at),
                    b.op("Less", j, b.op("Unsqueeze", lengths, _ints(b, 1, 2))))
        if window > 0:  # and j > positions[r, i] - window: the last `window` keys
            first_seen = b.op("Sub", at, b.const(window - 1, np.int64))
            seen = b.op("And", seen, b.op("GreaterOrEqual", j, first_seen))
        mask = b.op("Where", b.op("Unsqueeze", seen, _ints(b, 1, 2)), b.const(0.0),
                    b.const(np.finfo(np.float32).min))
        probs = b.op("Softmax", b.op("Add", scores, mask), axis=-1)
        context = b.op("MatMul", probs, b.op("Unsqueeze", present_v, _ints(b, 2)))  # [b, kv, g, s, head]
        y = b.op("Reshape", b.op("Transpose", context, perm=[0, 3, 1, 2, 4]), _ints(b, 0, 0, -1))
        return _finish(b, y, present_k, present_v)
