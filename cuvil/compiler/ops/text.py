"""Text features: TfIdfVectorizer (opset 9) over integer token ids.

The n-gram pool is known at compile time. It becomes a trie stored as constant tables in the
library: a node per n-gram prefix, with its children's tokens sorted so that a step down is a
binary search (unrolled: the search length is known at compile time), and the output column of
the n-gram the node completes. The first step, from the root, is usually a direct table
indexed by token id (vocabularies are mostly dense ids); every walk starts there.

At run time each row is scanned as onnxruntime scans it: for each skip distance d (1 to
max_skip_count + 1) and start position s, the tokens at s, s + d, s + 2d... walk down the
trie; every n-gram of a length in [min_gram_length, max_gram_length] met on the way counts
once (1-grams only at d = 1, since skipping does not change them). As in onnxruntime, each
occurrence updates its n-gram's output column right away: TF adds 1, TFIDF adds the n-gram's
weight, IDF sets the column to it (the weights belong to the pool's n-grams, in pool order,
as the ONNX spec says; onnx's reference evaluator reads them per output column instead, which
only agrees when ngram_indexes is 0, 1, 2...). Rows run on the thread pool.

String tokens (pool_strings, string X) are not compiled: cuvil has no string tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir

from cuvil.compiler.ir import Node, TensorType, simplify_dim
from cuvil.compiler.kernels.emitter import I64, Emitter, View
from cuvil.compiler.ops import InferContext, Op, attr, register
from cuvil.compiler.ops._window import entry_alloca
from cuvil.errors import ModelError, UnsupportedOpError

F32 = ir.FloatType()


@dataclass(frozen=True)
class _Trie:
    """Flat tables: node i's children are child_key/child_node[first[i] : first[i] + count[i]]
    (keys ascending); column[i] is the output column of the n-gram ending at node i, or -1."""

    first: list[int]
    count: list[int]
    column: list[int]
    weight: list[float]  # the weight of the n-gram ending at node i (1 without weights)
    child_key: list[int]
    child_node: list[int]
    depth: int  # the longest n-gram


@dataclass(frozen=True)
class _Spec:
    mode: str
    min_gram: int
    max_gram: int
    max_skip: int
    columns: int  # output size: max(ngram_indexes) + 1
    trie: _Trie


def _ints(node: Node, name: str) -> list[int]:
    return [int(v) for v in node.attrs.get(name, [])]


def _spec(node: Node) -> _Spec:
    where = node.describe()
    mode = attr(node, "mode")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in ("TF", "IDF", "TFIDF"):
        raise ModelError(f"{where}: mode {mode!r} is not one of 'TF', 'IDF', 'TFIDF'")
    for name in ("min_gram_length", "max_gram_length", "max_skip_count", "ngram_counts",
                 "ngram_indexes"):
        if name not in node.attrs:
            raise ModelError(f"{where}: the attribute {name} is required")
    min_gram, max_gram = int(node.attrs["min_gram_length"]), int(node.attrs["max_gram_length"])
    max_skip = int(node.attrs["max_skip_count"])
    if min_gram < 1 or max_gram < min_gram or max_skip < 0:
        raise ModelError(f"{where}: need 1 <= min_gram_length <= max_gram_length and "
                         f"max_skip_count >= 0; got {min_gram}, {max_gram} and {max_skip}")
    if attr(node, "pool_strings"):
        raise UnsupportedOpError(f"{where}: the n-gram pool is given as strings (pool_strings); "
                                 "cuvil compiles TfIdfVectorizer over integer tokens only "
                                 "(pool_int64s with int32/int64 input). Map the tokens to integer "
                                 "ids before this node and give pool_int64s instead")
    pool = _ints(node, "pool_int64s")
    counts = _ints(node, "ngram_counts")
    indexes = _ints(node, "ngram_indexes")
    if not counts or not indexes:
        raise ModelError(f"{where}: ngram_counts and ngram_indexes must not be empty")
    if min(indexes) < 0:
        raise ModelError(f"{where}: ngram_indexes {indexes} must be >= 0 (output columns)")
    columns = max(indexes) + 1
    weights = [float(w) for w in node.attrs.get("weights", [])]
    if weights and len(weights) != len(indexes):
        raise ModelError(f"{where}: weights has {len(weights)} entries; it needs one per n-gram "
                         f"of the pool, as ngram_indexes ({len(indexes)})")

    # the n-grams of the loaded lengths, numbered across all lengths as the pool lists them
    grams: dict[tuple[int, ...], tuple[int, float]] = {}  # n-gram -> (column, weight)
    ngram_id = 0
    for i, start in enumerate(counts):
        size = i + 1
        end = counts[i + 1] if i + 1 < len(counts) else len(pool)
        if not 0 <= start <= end <= len(pool):
            raise ModelError(f"{where}: ngram_counts {counts} must be non-decreasing start "
                             f"positions within pool_int64s ({len(pool)} items)")
        if (end - start) % size:
            raise ModelError(f"{where}: the {end - start} pool items of the {size}-grams "
                             f"(ngram_counts[{i}]) do not make whole {size}-grams")
        number = (end - start) // size
        if min_gram <= size <= max_gram:
            for j in range(number):
                gram = tuple(pool[start + j * size: start + (j + 1) * size])
                if gram in grams:
                    raise ModelError(f"{where}: the {size}-gram {list(gram)} appears twice in "
                                     "pool_int64s")
                if ngram_id + j >= len(indexes):
                    raise ModelError(f"{where}: ngram_indexes has {len(indexes)} entries, fewer "
                                     f"than the n-grams in the pool")
                grams[gram] = (indexes[ngram_id + j], weights[ngram_id + j] if weights else 1.0)
        ngram_id += number
    return _Spec(mode, min_gram, max_gram, max_skip, columns, _build_trie(grams))


def _build_trie(grams: dict[tuple[int, ...], tuple[int, float]]) -> _Trie:
    children: list[dict[int, int]] = [{}]
    column, weight = [-1], [0.0]
    for gram, (col, w) in grams.items():
        at = 0
        for token in gram:
            nxt = children[at].get(token)
            if nxt is None:
                nxt = len(children)
                children[at][token] = nxt
                children.append({})
                column.append(-1)
                weight.append(0.0)
            at = nxt
        column[at], weight[at] = col, w
    first: list[int] = []
    count: list[int] = []
    keys: list[int] = []
    nodes: list[int] = []
    for kids in children:
        first.append(len(keys))
        count.append(len(kids))
        for token in sorted(kids):
            keys.append(token)
            nodes.append(kids[token])
    depth = max((len(g) for g in grams), default=0)
    return _Trie(first, count, column, weight, keys, nodes, depth)


def _table(k: Emitter, values: list[int] | list[float], ty: ir.Type, name: str) -> ir.GlobalVariable:
    arr_ty = ir.ArrayType(ty, len(values))
    g = ir.GlobalVariable(k.module, arr_ty, k.module.get_unique_name(f"{k.function.name}.{name}"))
    g.linkage = "private"
    g.global_constant = True
    g.unnamed_addr = True
    g.initializer = ir.Constant(arr_ty, list(values))
    return g


#: the root's children get a direct table (indexed by token - smallest token) when the tokens
#: span at most this many times their number (token ids are mostly a dense vocabulary)
_DIRECT_SPREAD = 8


def _root_table(k: Emitter, trie: _Trie) -> tuple[ir.GlobalVariable, int, int] | None:
    """(table, smallest token, span) mapping a first token to its trie node (-1: none)."""
    lo, hi = trie.first[0], trie.first[0] + trie.count[0]
    tokens, children = trie.child_key[lo:hi], trie.child_node[lo:hi]
    if not tokens:
        return None
    span = tokens[-1] - tokens[0] + 1
    if span > max(_DIRECT_SPREAD * len(tokens), 1024):
        return None
    table = [-1] * span
    for token, child in zip(tokens, children):
        table[token - tokens[0]] = child
    return _table(k, table, ir.IntType(32), "root"), tokens[0], span


def _load(k: Emitter, table: ir.GlobalVariable, i: ir.Value) -> ir.Value:
    ptr = k.b.gep(table, [k.i64(0), i], inbounds=True, source_etype=table.value_type)
    return k.b.load(ptr, typ=table.value_type.element)


@register
class TfIdfVectorizer(Op):
    op_type = "TfIdfVectorizer"
    since = 9
    dtypes = ("int32", "int64")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        if x is None:
            raise ModelError(f"{node.describe()}: input X is required")
        if x.type.dtype.name not in self.dtypes:
            if x.type.dtype.kind in "OSU":
                raise UnsupportedOpError(
                    f"{node.describe()}: X holds strings; cuvil has no string tensors and "
                    "compiles TfIdfVectorizer over int32/int64 token ids only. Map the tokens to "
                    "integer ids before the model (or before this node) and use pool_int64s")
            raise ModelError(f"{node.describe()}: X has dtype {x.type.dtype.name}; "
                             "TfIdfVectorizer takes int32, int64 (or string) tokens")
        if x.type.rank not in (1, 2):
            raise ModelError(f"{node.describe()}: X {x.type} must be [C] or [N, C]")
        spec = _spec(node)
        rows = x.type.shape[:-1]
        return [TensorType(np.dtype(np.float32), (*rows, spec.columns))]

    def lower(self, node: Node, k: Emitter) -> None:
        spec = _spec(node)
        trie = spec.trie
        x_val, y_val = node.inputs[0], node.outputs[0]
        assert x_val is not None
        shape = x_val.type.shape
        rows = shape[0] if len(shape) == 2 else 1
        length = shape[-1]
        dtype = x_val.type.dtype
        first = _table(k, trie.first, I64, "first")
        count = _table(k, trie.count, I64, "count")
        column = _table(k, trie.column, I64, "column")
        # one entry past the end, so a search over no children still reads inside the table
        keys = _table(k, [*trie.child_key, 0], I64, "keys")
        nodes = _table(k, [*trie.child_node, 0], I64, "nodes")
        weight = _table(k, trie.weight, F32, "weight") if spec.mode != "TF" else None
        root = _root_table(k, trie)
        # halvings for the children of the nodes searched by _find (the root is not, when it
        # has a direct table)
        searched = trie.count[1:] if root is not None else trie.count
        steps = max(max(searched, default=0) - 1, 0).bit_length()
        depth = min(spec.max_gram, trie.depth)
        # distances after the first count n-grams of 2 tokens or more
        lo_skipped = max(spec.min_gram, 2)
        distances = 1 + (spec.max_skip if lo_skipped <= spec.max_gram else 0)
        cost = simplify_dim(length * distances * max(depth, 1) * (8 + 4 * steps)
                            + spec.columns * 2)
        with k.parallel_loop(rows, cost=cost, name="row") as r:
            b = k.b
            x = k.contiguous(k.buffers[x_val], dtype, (rows, length))
            y = k.contiguous(k.buffers[y_val], np.dtype(np.float32), (rows, spec.columns))
            at = entry_alloca(k, I64, "node")
            pos = entry_alloca(k, I64, "pos")
            n_items = x.dims[1]
            zero = k.i64(0)

            def visit(child: ir.Value, n: ir.Value, lo: ir.Value) -> None:
                """Count the n-gram ending at trie node `child` (-1: none), of length n."""
                col = _load(k, column, b.select(b.icmp_signed(">=", child, zero), child, zero))
                hit = b.and_(b.and_(b.icmp_signed(">=", child, zero), b.icmp_signed(">=", col, zero)),
                             b.icmp_signed(">=", n, lo))
                with k.if_then(hit):
                    # per occurrence, as onnxruntime: TF counts, TFIDF sums the n-gram's
                    # weight, IDF sets it
                    if weight is None:
                        v = b.fadd(k.load(y, [r, col]), ir.Constant(F32, 1.0))
                    elif spec.mode == "TFIDF":
                        v = b.fadd(k.load(y, [r, col]), _load(k, weight, child))
                    else:
                        v = _load(k, weight, child)
                    k.store(y, [r, col], v)

            def find(node: ir.Value | None, token: ir.Value) -> ir.Value:
                if node is None and root is not None:
                    table, low, span = root
                    i = b.sub(token, k.i64(low))
                    inside = b.icmp_unsigned("<", i, k.i64(span))
                    child = b.sext(_load(k, table, b.select(inside, i, zero)), I64)
                    return b.select(inside, child, k.i64(-1))
                return self._find(k, steps, node or zero, token, first, count, keys, nodes)

            with k.loop(spec.columns, name="c0") as c:
                k.store(y, [r, c], ir.Constant(F32, 0.0))
            with k.loop(distances + 1, start=1, name="d") as d:
                lo = b.select(b.icmp_signed("==", d, k.i64(1)), k.i64(spec.min_gram),
                              k.i64(lo_skipped))
                with k.loop(n_items, name="s") as s:
                    child = find(None, k.convert(k.load(x, [r, s]), dtype, np.dtype(np.int64)))
                    visit(child, k.i64(1), lo)
                    if depth >= 2:
                        self._walk(k, child, s, d, lo, depth, x, r, at, pos, find, visit)

    @staticmethod
    def _walk(k: Emitter, child: ir.Value, s: ir.Value, d: ir.Value, lo: ir.Value, depth: int,
              x: View, r: ir.Value, at: ir.Value, pos: ir.Value, find: Any, visit: Any) -> None:
        """From the first token's node down: tokens s + d, s + 2d... while the trie has them."""
        b = k.b
        zero = k.i64(0)
        with k.if_then(b.icmp_signed(">=", child, zero)):
            b.store(child, at)
            b.store(b.add(s, d), pos)
            with k.loop(depth + 1, start=2, name="len") as n:
                p, here = b.load(pos), b.load(at)
                alive = b.and_(b.icmp_signed(">=", here, zero), b.icmp_signed("<", p, x.dims[1]))
                with k.if_then(alive):
                    nxt = find(here, k.convert(k.load(x, [r, p]), x.dtype, np.dtype(np.int64)))
                    b.store(nxt, at)
                    b.store(b.add(p, d), pos)
                    visit(nxt, n, lo)

    @staticmethod
    def _find(k: Emitter, steps: int, node: ir.Value, token: ir.Value, first: ir.Value,
              count: ir.Value, keys: ir.Value, nodes: ir.Value) -> ir.Value:
        """The child of `node` reached by `token`, or -1: the last key <= token among the
        node's (ascending) children, found by halving the range `steps` times."""
        b = k.b
        base, size = _load(k, first, node), _load(k, count, node)
        for _ in range(steps):
            half = b.lshr(size, k.i64(1))
            mid = b.add(base, half)
            go = b.icmp_signed("<=", _load(k, keys, mid), token)
            base = b.select(go, mid, base)
            size = b.sub(size, half)
        found = b.and_(b.icmp_signed(">", size, k.i64(0)),
                       b.icmp_signed("==", _load(k, keys, base), token))
        return b.select(found, _load(k, nodes, base), k.i64(-1))
