"""onnxruntime's contrib operators (domain com.microsoft) that its transformer optimizer
(`onnxruntime.transformers.optimizer`) writes into models: Attention, MultiHeadAttention,
EmbedLayerNormalization, SkipLayerNormalization, SkipSimplifiedLayerNormalization, Gelu,
BiasGelu, FastGelu, QuickGelu, FusedMatMul, BiasSoftmax and BiasAdd, with the semantics of
onnxruntime's operator documentation (docs/ContribOperators.md) and its CPU kernels.

Each compiles as a graph of standard ops (`Op.expand`, as most of ai.onnx.ml does), so these
models run cuvil's own GEMM, Softmax and LayerNormalization kernels, and the graph passes fuse
what follows a product into its epilogue as for any exported model: an Attention's Q, K and V
projections become three MatMuls with their bias (the 1/sqrt(head size) scale folded into
the constant Q weights), a SkipLayerNormalization's bias and residual join the MatMul before
it, a BiasGelu's bias and Gelu too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import sympy

from cuvil.compiler.ir import Dim, Node, TensorType
from cuvil.compiler.ops import InferContext, Op, attr, register, required_input
from cuvil.compiler.ops._ml_graph import Body
from cuvil.errors import ModelError, UnsupportedOpError

MS = "com.microsoft"
#: the default-domain opset the bodies are written for (Gelu is an operator from 20 on)
OPSET = 20
#: onnxruntime's defaults (contrib_defs.cc)
LAYER_NORM_EPSILON = 1e-12
MASK_FILTER_VALUE = -10000.0


class Contrib(Op):
    """A com.microsoft op compiled as standard ops; it has no lowering of its own."""

    domain = MS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        raise AssertionError("expanded by the importer")


def _finish(b: Body, *outputs: str) -> onnx.FunctionProto:
    return b.finish(*outputs, opset=OPSET)


def _refuse(node: Node, names: Sequence[str]) -> None:
    """Attributes cuvil does not compile, when the node sets them to anything but 0."""
    for name in names:
        if attr(node, name, 0):
            raise UnsupportedOpError(f"{node.describe()}: attribute {name}={attr(node, name)!r} is "
                                     f"not compiled by cuvil (it compiles {node.op_type} with "
                                     f"{name}=0); re-export or optimize the model without it")


def _static(node: Node, d: Dim, what: str) -> int:
    if not isinstance(d, int):
        raise UnsupportedOpError(f"{node.describe()}: {what} ({d}) must be known at compile time; "
                                 "pin it with `inputs = {...}` in [tool.cuvil.models.<name>]")
    return d


def _same(a: Dim, b: Dim) -> bool:
    return bool(sympy.simplify(sympy.sympify(a) - b) == 0)


def _ints(b: Body, *values: int) -> str:
    return b.const(list(values), np.int64)


# -- activations ---------------------------------------------------------------------------


@register
class Gelu(Contrib):
    op_type = "Gelu"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        b = Body(node)
        return _finish(b, b.op("Gelu", b.inputs[0]))


@register
class BiasGelu(Contrib):
    """Gelu(A + B), B a vector over the last axis."""

    op_type = "BiasGelu"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        b = Body(node)
        required_input(node, 1)
        return _finish(b, b.op("Gelu", b.op("Add", b.inputs[0], b.inputs[1])))


@register
class FastGelu(Contrib):
    """The tanh approximation of Gelu, of X + bias when the bias is given."""

    op_type = "FastGelu"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        b = Body(node)
        x = b.inputs[0] if node.input(1) is None else b.op("Add", b.inputs[0], b.inputs[1])
        return _finish(b, b.op("Gelu", x, approximate="tanh"))


@register
class QuickGelu(Contrib):
    """X * Sigmoid(alpha * X) (alpha 1.702 by default)."""

    op_type = "QuickGelu"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        b = Body(node)
        x = b.inputs[0]
        alpha = float(attr(node, "alpha", 1.702))
        scaled = x if alpha == 1.0 else b.op("Mul", x, b.const(alpha))
        return _finish(b, b.op("Mul", x, b.op("Sigmoid", scaled)))


@register
class BiasAdd(Contrib):
    """X + bias + skip."""

    op_type = "BiasAdd"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        for i in (1, 2):
            required_input(node, i)
        b = Body(node)
        return _finish(b, b.op("Add", b.op("Add", b.inputs[0], b.inputs[1]), b.inputs[2]))


# -- products and softmax --------------------------------------------------------------------


def _matrix_perm(node: Node, rank: int, trans: bool, trans_batch: bool, what: str) -> list[int] | None:
    """onnxruntime's FusedMatMul operand permutation: transBatch moves the first dim to just
    before the last (the batch dims move up one), trans then swaps the last two."""
    if not (trans or trans_batch):
        return None
    if rank < 2:
        raise UnsupportedOpError(f"{node.describe()}: {what} is 1-D; it cannot be transposed "
                                 "(set transA/transB/transBatch* to 0 for vectors)")
    perm = list(range(rank))
    if trans_batch:
        perm = [*range(1, rank - 1), 0, rank - 1]
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return None if perm == list(range(rank)) else perm


@register
class FusedMatMul(Contrib):
    """alpha * MatMul(A', B'), A' and B' optionally transposed (transA, transB) and with the
    first dim moved behind the batch dims (transBatchA, transBatchB)."""

    op_type = "FusedMatMul"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        b = Body(node)
        operands = []
        for i, name in ((0, "A"), (1, "B")):
            v = required_input(node, i)
            perm = _matrix_perm(node, v.type.rank, bool(attr(node, f"trans{name}", 0)),
                                bool(attr(node, f"transBatch{name}", 0)), name)
            operands.append(b.inputs[i] if perm is None else b.op("Transpose", b.inputs[i], perm=perm))
        y = b.op("MatMul", *operands)
        alpha = float(attr(node, "alpha", 1.0))
        return _finish(b, y if alpha == 1.0 else b.op("Mul", y, b.const(alpha)))


@register
class BiasSoftmax(Contrib):
    """Softmax(data + bias) over the dims from `axis` on (as Softmax before opset 13). The bias
    broadcasts over the leading dims (is_inner_broadcast=0) or over the dims just before
    `axis` (is_inner_broadcast=1: the bias holds the leading and the softmax dims)."""

    op_type = "BiasSoftmax"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        x, bias = required_input(node, 0), required_input(node, 1)
        rank = x.type.rank
        axis = int(attr(node, "axis", 1))
        axis = axis + rank if axis < 0 else axis
        if not 0 <= axis < rank:
            raise ModelError(f"{node.describe()}: axis {attr(node, 'axis', 1)} is out of range for "
                             f"rank {rank}")
        b = Body(node)
        bias_name = b.inputs[1]
        missing = rank - bias.type.rank
        if attr(node, "is_inner_broadcast", 0) and missing > 0:
            if missing > axis:
                raise ModelError(f"{node.describe()}: bias {bias.type} does not hold the dims from "
                                 f"axis {axis} on of {x.type}")
            bias_name = b.op("Unsqueeze", bias_name, _ints(b, *range(axis - missing, axis)))
        s = b.op("Add", b.inputs[0], bias_name)
        if axis == rank - 1:
            return _finish(b, b.op("Softmax", s, axis=-1))
        flat = b.op("Softmax", b.op("Flatten", s, axis=axis), axis=-1)
        return _finish(b, b.op("Reshape", flat, b.op("Shape", b.inputs[0])))


# -- normalizations --------------------------------------------------------------------------


def _skip_sum(b: Body, node: Node, bias_slot: int) -> str:
    """input + bias + skip, the bias first so a MatMul before takes both into its epilogue."""
    for i in (0, 1, 2):
        required_input(node, i)
    s = b.inputs[0]
    if node.input(bias_slot) is not None:
        s = b.op("Add", s, b.inputs[bias_slot])
    return b.op("Add", s, b.inputs[1])


@register
class SkipLayerNormalization(Contrib):
    """LayerNormalization(input + skip + bias) over the last axis; outputs the normalized
    tensor, its mean and inverse standard deviation, and the sum itself."""

    op_type = "SkipLayerNormalization"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        b = Body(node)
        s = _skip_sum(b, node, 4)
        params = [b.inputs[2]] + ([b.inputs[3]] if node.input(3) is not None else [])
        y, mean, inv = b.outputs("LayerNormalization", 3, s, *params, axis=-1,
                                 epsilon=float(attr(node, "epsilon", LAYER_NORM_EPSILON)))
        return _finish(b, y, mean, inv, s)


@register
class SkipSimplifiedLayerNormalization(Contrib):
    """RMS normalization of input + skip + bias over the last axis, times gamma; outputs as
    SkipLayerNormalization's (onnxruntime computes no mean for it: the second output is the
    mean of squares here)."""

    op_type = "SkipSimplifiedLayerNormalization"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        b = Body(node)
        s = _skip_sum(b, node, 3)
        square_mean = b.op("ReduceMean", b.op("Mul", s, s), _ints(b, -1), keepdims=1)
        eps = float(attr(node, "epsilon", LAYER_NORM_EPSILON))
        inv = b.op("Reciprocal", b.op("Sqrt", b.op("Add", square_mean, b.const(eps))))
        y = b.op("Mul", b.op("Mul", s, inv), b.inputs[2])
        return _finish(b, y, b.op("Identity", square_mean), inv, s)


@register
class EmbedLayerNormalization(Contrib):
    """BERT's embedding layer: word + position (+ segment) embeddings, LayerNormalization; the
    mask_index output counts each row's 1s in the mask (zeros without a mask), the third
    output is the sum before the normalization."""

    op_type = "EmbedLayerNormalization"
    dtypes = ("int32",)  # of the word ids

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        ids = required_input(node, 0)
        for i in (2, 3, 5, 6):
            required_input(node, i)
        if ids.type.rank != 2:
            raise ModelError(f"{node.describe()}: input_ids must be [batch, sequence], got {ids.type}")
        if (node.input(1) is None) != (node.input(4) is None):
            raise ModelError(f"{node.describe()}: segment_ids and segment_embedding come together; "
                             "the node gives only one of them")
        b = Body(node)
        x = b.inputs
        s = b.op("Gather", x[2], x[0], axis=0)
        if node.input(8) is not None:
            pos = b.op("Gather", x[3], x[8], axis=0)
        else:  # positions 0 .. sequence - 1: the first rows of the table
            seq = b.op("Slice", b.op("Shape", x[0]), _ints(b, 1), _ints(b, 2))
            pos = b.op("Slice", x[3], _ints(b, 0), seq, _ints(b, 0))
        s = b.op("Add", s, pos)
        if node.input(1) is not None:
            s = b.op("Add", s, b.op("Gather", x[4], x[1], axis=0))
        y = b.op("LayerNormalization", s, x[5], x[6], axis=-1,
                 epsilon=float(attr(node, "epsilon", LAYER_NORM_EPSILON)))
        mask = node.input(7)
        if mask is not None:
            ones = b.cast(b.op("Equal", x[7], b.const(1, mask.type.dtype)), np.int32)
            mask_index = b.op("ReduceSum", ones, _ints(b, 1), keepdims=0)
        else:
            batch = b.op("Slice", b.op("Shape", x[0]), _ints(b, 0), _ints(b, 1))
            zero = onnx.numpy_helper.from_array(np.zeros(1, np.int32))
            mask_index = b.op("ConstantOfShape", batch, value=zero)
        return _finish(b, y, mask_index, s)


# -- attention ----------------------------------------------------------------------------


class _Heads:
    """Q, K and V of one attention node, split into heads: q [b, n, s, h] (already scaled
    when `scaled`), k_t [b, n, h, t] for the scores, k and v [b, n, t, h] (the present)."""

    def __init__(self, q: str, k_t: str, k: str, v: str, scaled: bool) -> None:
        self.q, self.k_t, self.k, self.v, self.scaled = q, k_t, k, v, scaled


def _split_heads(b: Body, x: str, heads: int, size: int) -> str:
    """[b, s, n * h] -> [b, s, n, h] (a view)."""
    return b.op("Reshape", x, _ints(b, 0, 0, heads, size // heads))


def _with_past(b: Body, k: str, v: str, past_k: str | None, past_v: str | None,
               scaled: bool, q: str) -> _Heads:
    """Heads from K and V as [b, s, n, h], after the past ones (each [b, n, p, h]) when given."""
    if past_k is None or past_v is None:
        k_t = b.op("Transpose", k, perm=[0, 2, 3, 1])
        return _Heads(q, k_t, b.op("Transpose", k, perm=[0, 2, 1, 3]),
                      b.op("Transpose", v, perm=[0, 2, 1, 3]), scaled)
    k_full = b.op("Concat", past_k, b.op("Transpose", k, perm=[0, 2, 1, 3]), axis=2)
    v_full = b.op("Concat", past_v, b.op("Transpose", v, perm=[0, 2, 1, 3]), axis=2)
    return _Heads(q, b.op("Transpose", k_full, perm=[0, 1, 3, 2]), k_full, v_full, scaled)


def _dim(b: Body, x: str, axis: int) -> str:
    """x.shape[axis] as an int64 scalar."""
    return b.op("Gather", b.op("Shape", x), b.const(axis, np.int64), axis=0)


def _mask_bias(b: Body, node: Node, slot: int, batch: Dim, heads: _Heads, filter_value: float,
               unidirectional: bool) -> str | None:
    """The additive mask over the scores ([b, 1, s or 1, t]): `filter_value` where the mask
    hides a key (raw masks: value <= 0; key lengths: from the end on; end and start positions:
    outside [start, end)); when unidirectional, the keys after each query's position are
    removed outright (the float's lowest value), as onnxruntime's CPU kernels do."""
    total = _dim(b, heads.k, 2)
    keys = b.op("Range", b.const(0, np.int64), total, b.const(1, np.int64))  # [t]
    bias = None
    m = node.input(slot)
    if m is not None:
        x = b.inputs[slot]
        shape = m.type.shape
        if m.type.rank == 1:
            if _same(shape[0], batch):
                end = b.op("Unsqueeze", b.cast(x, np.int64), _ints(b, 1))  # [b, 1]
                keep = b.op("Less", keys, end)
            elif _same(shape[0], 2 * batch):
                end, start = b.outputs("Split", 2, b.cast(x, np.int64), axis=0)
                end, start = (b.op("Unsqueeze", e, _ints(b, 1)) for e in (end, start))
                keep = b.op("And", b.op("Less", keys, end),
                            b.op("GreaterOrEqual", keys, start))
            else:
                raise UnsupportedOpError(
                    f"{node.describe()}: a 1-D mask of {shape[0]} values for a batch of {batch}: "
                    "cuvil compiles key lengths (batch) and end/start positions (2 * batch); the "
                    "3 * batch + 2 form (packed sequences) is not compiled")
            keep = b.op("Unsqueeze", keep, _ints(b, 1, 2))  # [b, 1, 1, t]
        elif m.type.rank in (2, 3):
            keep = b.op("Greater", x, b.const(0, m.type.dtype))
            keep = b.op("Unsqueeze", keep, _ints(b, 1) if m.type.rank == 3 else _ints(b, 1, 2))
        elif m.type.rank == 4:
            raise UnsupportedOpError(f"{node.describe()}: a 4-D mask ({m.type}, Megatron's form) is not "
                                     "compiled by cuvil, nor run by onnxruntime's CPU kernel; give "
                                     "a [batch, total] or [batch, sequence, total] mask")
        else:
            raise ModelError(f"{node.describe()}: the mask is {m.type}; onnxruntime takes 1-D to 3-D "
                             "masks")
        bias = b.op("Where", keep, b.const(0.0), b.const(filter_value))
    if unidirectional:  # key j > query i + past length, i.e. j - i > t - s
        rows = _dim(b, heads.q, 2)
        queries = b.op("Unsqueeze", b.op("Range", b.const(0, np.int64), rows, b.const(1, np.int64)),
                       _ints(b, 1))
        above = b.op("Greater", b.op("Sub", keys, queries), b.op("Sub", total, rows))
        causal = b.op("Where", above, b.const(np.finfo(np.float32).min), b.const(0.0))
        bias = causal if bias is None else b.op("Add", bias, causal)
    return bias


def _attend(b: Body, heads: _Heads, scale: float, mask: str | None,
            attention_bias: str | None) -> str:
    """Softmax(q k^T * scale + mask + attention_bias) v, heads merged: [b, s, n * hv]."""
    q = heads.q if heads.scaled else b.op("Mul", heads.q, b.const(scale))
    scores = b.op("MatMul", q, heads.k_t)
    for extra in (mask, attention_bias):
        if extra is not None:
            scores = b.op("Add", scores, extra)
    context = b.op("MatMul", b.op("Softmax", scores, axis=-1), heads.v)
    return b.op("Reshape", b.op("Transpose", context, perm=[0, 2, 1, 3]), _ints(b, 0, 0, -1))


def _scale(node: Node, head_size: int) -> float:
    scale = float(attr(node, "scale", 0.0))
    return scale if scale != 0.0 else 1.0 / float(np.sqrt(head_size))


def _heads_attr(node: Node) -> int:
    heads = int(attr(node, "num_heads", 0))
    if heads <= 0:
        raise ModelError(f"{node.describe()}: the num_heads attribute is required (a positive "
                         "number of heads)")
    return heads


def _divisible(node: Node, size: int, heads: int, what: str) -> None:
    if size % heads:
        raise ModelError(f"{node.describe()}: {what} {size} is not a multiple of num_heads {heads}")


@register
class Attention(Contrib):
    """Self-attention with the Q, K, V projections merged into one weight [in, q + k + v]:
    optional bias, mask_index (raw 2-D or 3-D masks, key lengths, end/start positions),
    past state ([2, b, n, p, h]) with the present as second output, attention_bias, scale,
    unidirectional (causal) and mask_filter_value."""

    op_type = "Attention"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        _refuse(node, ("do_rotary", "past_present_share_buffer"))
        if node.input(6) is not None:
            raise UnsupportedOpError(f"{node.describe()}: input past_sequence_length (a shared "
                                     "past/present buffer) is not compiled by cuvil")
        x, w = required_input(node, 0), required_input(node, 1)
        if x.type.rank != 3 or w.type.rank != 2:
            raise ModelError(f"{node.describe()}: input must be [batch, sequence, hidden] and weights "
                             f"[hidden, q + k + v]; got {x.type} and {w.type}")
        heads = _heads_attr(node)
        total = _static(node, w.type.shape[1], "the weights' second dim")
        sizes = [int(s) for s in attr(node, "qkv_hidden_sizes", None) or [total // 3] * 3]
        if len(sizes) != 3 or sum(sizes) != total or sizes[0] != sizes[1]:
            raise ModelError(f"{node.describe()}: qkv_hidden_sizes {sizes} must be three sizes, Q's "
                             f"equal to K's, summing to the weights' {total} columns")
        for size, what in zip(sizes, ("Q hidden size", "K hidden size", "V hidden size")):
            _divisible(node, size, heads, what)
        scale = _scale(node, sizes[0] // heads)
        b = Body(node)
        parts = []
        offset = 0
        for i, size in enumerate(sizes):
            # the weights are constant in practice: these Slices fold, and Q's scale with them
            cols = (_ints(b, offset), _ints(b, offset + size))
            wi = b.op("Slice", b.inputs[1], *cols, _ints(b, 1))
            bi = b.op("Slice", b.inputs[2], *cols, _ints(b, 0)) if node.input(2) is not None else None
            if i == 0:
                wi = b.op("Mul", wi, b.const(scale))
                bi = b.op("Mul", bi, b.const(scale)) if bi is not None else None
            y = b.op("MatMul", b.inputs[0], wi)
            y = b.op("Add", y, bi) if bi is not None else y
            parts.append(_split_heads(b, y, heads, size))
            offset += size
        q = b.op("Transpose", parts[0], perm=[0, 2, 1, 3])
        past_k = past_v = None
        if node.input(4) is not None:
            if len(set(sizes)) != 1:
                raise ModelError(f"{node.describe()}: with a past state Q, K and V must have one "
                                 f"hidden size; qkv_hidden_sizes is {sizes}")
            past_k, past_v = (b.op("Squeeze", p, _ints(b, 0))
                              for p in b.outputs("Split", 2, b.inputs[4], axis=0))
        h = _with_past(b, parts[1], parts[2], past_k, past_v, True, q)
        mask = _mask_bias(b, node, 3, x.type.shape[0], h,
                          float(attr(node, "mask_filter_value", MASK_FILTER_VALUE)),
                          bool(attr(node, "unidirectional", 0)))
        out = _attend(b, h, scale, mask, b.inputs[5] if node.input(5) is not None else None)
        if len(set(sizes)) != 1:  # no present: K and V heads of two sizes do not stack
            return _finish(b, out)
        present = b.op("Concat", *(b.op("Unsqueeze", t, _ints(b, 0)) for t in (h.k, h.v)), axis=0)
        return _finish(b, out, present)


@register
class MultiHeadAttention(Contrib):
    """Attention over projected query [b, s, d], key [b, t, d] and value [b, t, dv] (or key
    and value already split into heads, [b, n, t, h]), with the projections' bias
    [d + d + dv], key_padding_mask (as Attention's mask_index), attention_bias, past_key and
    past_value ([b, n, p, h]: present_key and present_value are outputs 2 and 3), scale,
    unidirectional and mask_filter_value."""

    op_type = "MultiHeadAttention"

    def expand(self, node: Node) -> onnx.FunctionProto:
        self.check_dtypes(node)
        for i, what in ((8, "past_sequence_length"), (9, "cache_indirection")):
            if node.input(i) is not None:
                raise UnsupportedOpError(f"{node.describe()}: input {what} (shared buffers, beam "
                                         "search) is not compiled by cuvil")
        query = required_input(node, 0)
        key, value = node.input(1), node.input(2)
        if query.type.rank != 3 or key is None or value is None:
            raise UnsupportedOpError(
                f"{node.describe()}: cuvil compiles MultiHeadAttention with separate query [b, s, d], "
                "key and value inputs; packed QKV or KV inputs are not compiled")
        if key.type.rank not in (3, 4) or value.type.rank != key.type.rank:
            raise ModelError(f"{node.describe()}: key and value must be both [b, t, d] or both "
                             f"[b, n, t, h]; got {key.type} and {value.type}")
        heads = _heads_attr(node)
        d = _static(node, query.type.shape[2], "the query's hidden size")
        _divisible(node, d, heads, "query hidden size")
        split_kv = key.type.rank == 4
        dv = (_static(node, value.type.shape[1], "value heads")
              * _static(node, value.type.shape[3], "value head size")) if split_kv \
            else _static(node, value.type.shape[2], "the value's hidden size")
        _divisible(node, dv, heads, "value hidden size")
        scale = _scale(node, d // heads)
        b = Body(node)
        x = b.inputs
        with_bias = node.input(3) is not None

        def biased(i: int, start: int, size: int) -> str:
            if not with_bias:
                return x[i]
            return b.op("Add", x[i], b.op("Slice", x[3], _ints(b, start), _ints(b, start + size),
                                          _ints(b, 0)))

        q = b.op("Transpose", _split_heads(b, biased(0, 0, d), heads, d), perm=[0, 2, 1, 3])
        if split_kv:  # [b, n, t, h] already: no bias applies to them
            if with_bias:
                raise UnsupportedOpError(f"{node.describe()}: a bias with key and value given as "
                                         "[b, n, t, h] is not compiled by cuvil")
            k_heads, v_heads = x[1], x[2]
            if node.input(6) is not None and node.input(7) is not None:
                k_heads = b.op("Concat", x[6], k_heads, axis=2)
                v_heads = b.op("Concat", x[7], v_heads, axis=2)
            h = _Heads(q, b.op("Transpose", k_heads, perm=[0, 1, 3, 2]), k_heads, v_heads, False)
        else:
            k = _split_heads(b, biased(1, d, d), heads, d)
            v = _split_heads(b, biased(2, 2 * d, dv), heads, dv)
            past = [x[i] if node.input(i) is not None else None for i in (6, 7)]
            h = _with_past(b, k, v, past[0], past[1], False, q)
        mask = _mask_bias(b, node, 4, query.type.shape[0], h,
                          float(attr(node, "mask_filter_value", MASK_FILTER_VALUE)),
                          bool(attr(node, "unidirectional", 0)))
        out = _attend(b, h, scale, mask, x[5] if node.input(5) is not None else None)
        return _finish(b, out, h.k, h.v)
