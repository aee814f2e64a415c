"""ai.onnx.ml tree ensembles: TreeEnsembleClassifier, TreeEnsembleRegressor (opsets 1-3) and
TreeEnsemble (opset 5), compiled to native code.

At compile time every ensemble becomes one packed forest (`_Forest`): a table of node
records stored as a constant in the library (`_Layout`: per node a head word of its feature,
comparison and missing-value track, its threshold and two children, a child < 0 naming leaf
~child) and the leaves' weights in CSR form (the weights of leaf l are entries start[l] to
start[l + 1] of target/weight). The native op (`cuvil.TreeEnsembleScores`) walks it in tasks
of a block of `_BLOCK` rows and a group of trees (`tree_groups`) spread over the thread pool;
within a task, runs of `_LANES` trees at a time (they stay in cache while the block's rows
descend them), each row descends the run's trees side by side, a level of each per iteration
of one loop (a load, one comparison and a select each, branch-free), until all reached their
leaves, whose weights it adds to its group's scores in tree order (or takes the min/max of).
A second pass combines the groups in group order, so the sums do not depend on the thread
count. The comparison is emitted once when the forest uses one mode (scikit-learn's
BRANCH_LEQ), else selected by the mode bits of the node's head word.

What follows the sums (base values, post_transform, the labels and onnxruntime's two-class
conventions) is a graph of standard ops (`_ml_graph`), so its arithmetic is shared with every
other model. Which classes have scores is decided at compile time from the leaves (onnxruntime
decides per row; the two agree unless a class gets weights on some paths only and loses the
arg max to classes without scores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import sympy
from llvmlite import ir
from onnx import helper, numpy_helper

from cuvil.compiler.ir import Dim, Node, TensorType, simplify_dim
from cuvil.compiler.kernels.emitter import I32, I64, Emitter, llvm_type
from cuvil.compiler.ops import InferContext, Op, attr, register
from cuvil.compiler.ops._ml_graph import Body, Expanded, ints, no_string_labels, post_transform, text
from cuvil.errors import ModelError, UnsupportedOpError

#: node comparisons, numbered as opset 5 numbers them
MODES = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ")
_PREDICATES = ("<=", "<", ">=", ">", "==", "!=")
_EQ, _MEMBER = MODES.index("BRANCH_EQ"), 6  # opset 5's mode numbers
#: rows that descend a tree together
_BLOCK = 32
#: trees per group at least, and groups at most (`tree_groups`)
_GROUP_TREES = 64
_MAX_GROUPS = 8


def tree_groups(n_trees: int) -> int:
    """Groups the trees of a forest are split into, each a task of its own for every block of
    rows: one row still makes several tasks. Fixed at compile time, not by the thread count,
    so that the order of the sums is too."""
    return max(1, min(_MAX_GROUPS, n_trees // _GROUP_TREES))


def _padded_targets(targets: int, dtype: np.dtype) -> int:
    """A group's scores of a row fill whole cache lines: groups on other threads must not
    write into one line (each leaf is a write)."""
    per_line = 64 // dtype.itemsize
    return -(-targets // per_line) * per_line


@dataclass
class _Forest:
    feature: list[int]
    split: np.ndarray
    mode: list[int]
    missing_true: list[int]
    true_child: list[int]  # >= 0: a node; < 0: leaf ~child
    false_child: list[int]
    roots: list[int]
    leaf_start: list[int]  # one more than the leaves
    leaf_target: list[int]
    leaf_weight: np.ndarray
    targets: int


def _values(node: Node, name: str) -> np.ndarray | None:
    """A float list attribute or its `_as_tensor` twin (doubles), as an array; None if absent."""
    tensor = node.attrs.get(f"{name}_as_tensor")
    if tensor is not None:
        return np.asarray(tensor).ravel()
    if name in node.attrs:
        return np.asarray(node.attrs[name], dtype=np.float32)
    return None


def _forest_v3(node: Node, leaf_prefix: str, targets: int) -> _Forest:
    """Pack the opset 1-3 attributes (nodes_* per node; class_* or target_* per leaf weight)."""
    where = node.describe()
    tree_ids, node_ids = ints(node, "nodes_treeids"), ints(node, "nodes_nodeids")
    n = len(node_ids)
    features = ints(node, "nodes_featureids")
    modes = [m.decode() if isinstance(m, bytes) else str(m) for m in attr(node, "nodes_modes", [])]
    splits = _values(node, "nodes_values")
    trues, falses = ints(node, "nodes_truenodeids"), ints(node, "nodes_falsenodeids")
    missing = ints(node, "nodes_missing_value_tracks_true") or [0] * n
    if not n or any(len(a) != n for a in (tree_ids, features, modes, trues, falses, missing)) \
            or splits is None or len(splits) != n:
        raise ModelError(f"{where}: the nodes_* attributes must all have one entry per node "
                         f"({n} nodes_nodeids)")
    unknown = sorted(set(modes) - {*MODES, "LEAF"})
    if unknown:
        raise UnsupportedOpError(f"{where}: node modes {unknown} are not among "
                                 f"{', '.join(MODES)}, LEAF")
    at = {(t, i): j for j, (t, i) in enumerate(zip(tree_ids, node_ids))}
    # leaves (nodes of mode LEAF) are numbered in node order
    leaf_of = {j: i for i, j in enumerate(j for j in range(n) if modes[j] == "LEAF")}
    inner = [j for j in range(n) if modes[j] != "LEAF"]
    index = {j: i for i, j in enumerate(inner)}

    def ref(tree: int, nid: int) -> int:
        j = at.get((tree, nid))
        if j is None:
            raise ModelError(f"{where}: tree {tree} refers to node {nid}, which it does not have")
        return ~leaf_of[j] if j in leaf_of else index[j]

    weights: dict[int, list[tuple[int, float]]] = {}
    w_trees, w_nodes = ints(node, f"{leaf_prefix}_treeids"), ints(node, f"{leaf_prefix}_nodeids")
    w_ids, w_values = ints(node, f"{leaf_prefix}_ids"), _values(node, f"{leaf_prefix}_weights")
    if w_values is None or not len(w_trees) == len(w_nodes) == len(w_ids) == len(w_values):
        raise ModelError(f"{where}: the {leaf_prefix}_* attributes must have one entry per weight")
    for t, i, target, w in zip(w_trees, w_nodes, w_ids, w_values):
        j = at.get((t, i))
        if j is None or j not in leaf_of:
            raise ModelError(f"{where}: a weight names node {i} of tree {t}, which is not a leaf")
        if not 0 <= target < targets:
            raise ModelError(f"{where}: a weight of tree {t} is for target/class {target}, outside "
                             f"0..{targets - 1}")
        weights.setdefault(leaf_of[j], []).append((target, float(w)))
    # a tree's root is its (first) node that no node of the tree names as a child
    children = {(tree_ids[j], c) for j in inner for c in (trues[j], falses[j])}
    roots: dict[int, int] = {}
    for j, t in enumerate(tree_ids):
        if (t, node_ids[j]) not in children:
            roots.setdefault(t, j)
    if set(roots) != set(tree_ids):
        raise ModelError(f"{where}: trees {sorted(set(tree_ids) - set(roots))} have no root")
    return _pack(
        [features[j] for j in inner], splits[inner], [MODES.index(modes[j]) for j in inner],
        [missing[j] for j in inner], [ref(tree_ids[j], trues[j]) for j in inner],
        [ref(tree_ids[j], falses[j]) for j in inner],
        [~leaf_of[j] if j in leaf_of else index[j] for _, j in sorted(roots.items())],
        [weights.get(leaf, []) for leaf in range(len(leaf_of))], targets, splits.dtype)


def _forest_v5(node: Node) -> _Forest:
    where = node.describe()
    features = ints(node, "nodes_featureids")
    n = len(features)
    splits = np.asarray(attr(node, "nodes_splits")).ravel()
    modes = [int(m) for m in np.asarray(attr(node, "nodes_modes")).ravel()]
    trues, falses = ints(node, "nodes_truenodeids"), ints(node, "nodes_falsenodeids")
    true_leaf, false_leaf = ints(node, "nodes_trueleafs"), ints(node, "nodes_falseleafs")
    missing = ints(node, "nodes_missing_value_tracks_true") or [0] * n
    if any(len(a) != n for a in (splits, modes, trues, falses, true_leaf, false_leaf, missing)):
        raise ModelError(f"{where}: the nodes_* attributes must all have one entry per node")
    if any(not 0 <= m <= _MEMBER for m in modes):
        raise ModelError(f"{where}: nodes_modes must be 0..{_MEMBER} (BRANCH_LEQ..BRANCH_MEMBER)")
    targets_of, weights = ints(node, "leaf_targetids"), np.asarray(attr(node, "leaf_weights")).ravel()
    targets = int(attr(node, "n_targets", 1) or 1)
    if len(targets_of) != len(weights):
        raise ModelError(f"{where}: leaf_targetids and leaf_weights differ in length")
    true = [~c if leaf else c for c, leaf in zip(trues, true_leaf)]
    false = [~c if leaf else c for c, leaf in zip(falses, false_leaf)]
    split_list = list(splits)
    _membership_chains(node, features, split_list, modes, missing, true, false)
    return _pack(features, split_list, modes, missing, true, false, ints(node, "tree_roots"),
                 [[(t, float(w))] for t, w in zip(targets_of, weights)], targets,
                 np.asarray(attr(node, "nodes_splits")).dtype)


def _membership_chains(node: Node, feature: list[int], split: list[Any], mode: list[int],
                       missing: list[int], true: list[int], false: list[int]) -> None:
    """Rewrite each BRANCH_MEMBER node (x in a set) as a chain of BRANCH_EQ nodes, one per
    member, appended to the lists: a member goes to the node's true child, the last miss to its
    false child. The sets are `membership_values`, in node order, separated by NaN."""
    members = [j for j, m in enumerate(mode) if m == _MEMBER]
    if not members:
        return
    given = attr(node, "membership_values", None)
    values = np.asarray([] if given is None else given, dtype=np.float64).ravel()
    sets: list[list[float]] = []
    current: list[float] = []
    for v in values.tolist():
        if np.isnan(v):
            sets.append(current)
            current = []
        else:
            current.append(v)
    if current or len(sets) < len(members):
        sets.append(current)
    if len(sets) != len(members):
        raise ModelError(f"{node.describe()}: membership_values holds {len(sets)} sets "
                         f"(separated by NaN) for {len(members)} BRANCH_MEMBER nodes")
    for j, members_of_j in zip(members, sets):
        chain: list[float] = members_of_j or [float("nan")]  # an empty set: x == NaN never holds
        mode[j], split[j] = _EQ, chain[0]
        last = j
        for member in chain[1:]:
            feature.append(feature[j])
            split.append(member)
            mode.append(_EQ)
            missing.append(missing[j])
            true.append(true[j])
            false.append(false[last])
            false[last] = len(feature) - 1
            last = len(feature) - 1


def _pack(feature: list[int], split: Any, mode: list[int], missing: list[int], true: list[int],
          false: list[int], roots: list[int], leaves: list[list[tuple[int, float]]],
          targets: int, dtype: np.dtype) -> _Forest:
    start = [0]
    for ws in leaves:
        start.append(start[-1] + len(ws))
    wdtype = np.float64 if dtype == np.float64 else np.float32
    return _Forest(feature, np.asarray(split, dtype=wdtype), mode, missing, true, false, roots,
                   start, [t for ws in leaves for t, _ in ws],
                   np.asarray([w for ws in leaves for _, w in ws], dtype=wdtype), targets)


def _tensor_attr(b: Body, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(arr), b.name())


def _scores(b: Body, forest: _Forest, aggregate: str, out_dtype: Any) -> str:
    """The native op: per row and target, the SUM/AVERAGE/MIN/MAX of the leaves' weights."""
    f = forest
    if max(f.feature, default=0) > _FEATURE_MASK:
        raise UnsupportedOpError(f"{b.node.describe()}: the trees read feature "
                                 f"{max(f.feature)}; cuvil compiles tree ensembles of up to "
                                 f"{_FEATURE_MASK + 1} features (a node's feature shares a word "
                                 "with its mode)")
    return b.op("TreeEnsembleScores", b.inputs[0], domain="cuvil",
                # a forest of single leaves has no nodes: one unused node keeps the tables
                feature=f.feature or [0],
                split=_tensor_attr(b, f.split if len(f.split) else np.zeros(1, f.split.dtype)),
                mode=f.mode or [0], missing_true=f.missing_true or [0],
                true_child=f.true_child or [0], false_child=f.false_child or [0],
                roots=f.roots, leaf_start=f.leaf_start, leaf_target=f.leaf_target or [0],
                leaf_weight=_tensor_attr(b, f.leaf_weight if len(f.leaf_weight)
                                         else np.zeros(1, f.leaf_weight.dtype)),
                targets=f.targets, aggregate=aggregate,
                out_dtype=helper.np_dtype_to_tensor_dtype(np.dtype(out_dtype)))


def _check_input(node: Node) -> None:
    x = node.inputs[0]
    if x is None:
        raise ModelError(f"{node.describe()}: input X is required")
    if x.type.rank not in (1, 2):
        raise ModelError(f"{node.describe()}: X must be [N, C] or [C], got {x.type}")
    if x.type.dtype.name not in ("float32", "float64", "int64", "int32"):
        raise UnsupportedOpError(f"{node.describe()}: X has dtype {x.type.dtype}; tree ensembles "
                                 "take float32, float64, int64 or int32 features")


def _regression_output(b: Body, node: Node, raw: str, targets: int, base: list[float],
                       how: str) -> str:
    """onnxruntime's finish of a regression: base values added, then post_transform, which it
    applies only with several targets."""
    if how == "PROBIT":
        raise UnsupportedOpError(f"{node.describe()}: post_transform PROBIT is not compiled by cuvil")
    if targets == 1:
        if len(base) == 1:
            raw = b.op("Add", raw, b.const([base[0]]))
        return raw
    if len(base) == targets:
        raw = b.op("Add", raw, b.const(base))
    return post_transform(b, raw, how)


@register
class TreeEnsembleRegressor(Expanded):
    op_type = "TreeEnsembleRegressor"

    def expand(self, node: Node) -> onnx.FunctionProto:
        _check_input(node)
        targets = int(node.attrs.get("n_targets", 1))
        forest = _forest_v3(node, "target", targets)
        aggregate = text(node, "aggregate_function", "SUM")
        b = Body(node)
        raw = _scores(b, forest, aggregate, np.float32)
        given = _values(node, "base_values")
        base = [float(v) for v in given] if given is not None else []
        return b.finish(_regression_output(b, node, raw, targets, base,
                                           text(node, "post_transform", "NONE")),
                        domains={"cuvil": 1})


@register
class TreeEnsemble(Expanded):
    op_type = "TreeEnsemble"
    since = 5

    def expand(self, node: Node) -> onnx.FunctionProto:
        _check_input(node)
        x = node.inputs[0]
        assert x is not None
        forest = _forest_v5(node)
        aggregate = ("AVERAGE", "SUM", "MIN", "MAX")[int(attr(node, "aggregate_function", 1))]
        how = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")[
            int(attr(node, "post_transform", 0))]
        out = x.type.dtype if x.type.dtype.kind == "f" else np.dtype(np.float32)
        b = Body(node)
        raw = _scores(b, forest, aggregate, out)
        return b.finish(_regression_output(b, node, raw, forest.targets, [], how),
                        domains={"cuvil": 1})


@register
class TreeEnsembleClassifier(Expanded):
    """Labels and scores as onnxruntime computes them, its two-class conventions included:
    with weights for one class only the score s becomes [1 - s, s] (all weights positive, a
    label for s > 0.5) or, under LOGISTIC, [logistic(-s), logistic(s)] (a label for s > 0)."""

    op_type = "TreeEnsembleClassifier"

    def expand(self, node: Node) -> onnx.FunctionProto:
        _check_input(node)
        no_string_labels(node)
        labels = ints(node, "classlabels_int64s")
        classes = len(labels)
        if classes < 2:
            raise ModelError(f"{node.describe()}: classlabels_int64s must name at least 2 classes")
        forest = _forest_v3(node, "class", classes)
        base_arr = _values(node, "base_values")
        base = [float(v) for v in base_arr] if base_arr is not None else []
        how = text(node, "post_transform", "NONE")
        if how == "PROBIT":
            raise UnsupportedOpError(f"{node.describe()}: post_transform PROBIT is not compiled "
                                     "by cuvil")
        scored = sorted(set(forest.leaf_target))
        b = Body(node)
        raw = _scores(b, forest, "SUM", np.float32)
        if classes > 2:
            if base:
                if len(base) != classes:
                    raise ModelError(f"{node.describe()}: {len(base)} base_values for {classes} "
                                     "classes")
                raw = b.op("Add", raw, b.const(base))
                scored = list(range(classes))
            mask = np.full(classes, -np.inf, np.float32)
            mask[scored] = 0
            best = b.op("ArgMax", b.op("Add", raw, b.const(mask)), axis=1, keepdims=0)
            label = b.op("Gather", b.const(labels, np.int64), best, axis=0)
            return b.finish(label, post_transform(b, raw, how), domains={"cuvil": 1})
        return self._binary(b, node, raw, labels, base, how, forest, scored)

    @staticmethod
    def _binary(b: Body, node: Node, raw: str, labels: list[int], base: list[float], how: str,
                forest: _Forest, scored: list[int]) -> onnx.FunctionProto:
        def column(i: int) -> str:
            return b.op("Slice", raw, b.const([i], np.int64), b.const([i + 1], np.int64),
                        b.const([1], np.int64))

        s0, s1 = column(0), column(1)
        has0, has1 = 0 in scored, 1 in scored
        if len(base) == 2:
            if has1:  # onnxruntime: score1 = base[1] + score0, score0 = -score1
                s1 = b.op("Add", s0, b.const([base[1]]))
                s0 = b.op("Neg", s1)
            else:
                s0, s1 = b.op("Add", s0, b.const([base[0]])), b.op("Add", s1, b.const([base[1]]))
        elif len(base) == 1:
            s0 = b.op("Add", s0, b.const([base[0]]))
        elif base:
            raise ModelError(f"{node.describe()}: {len(base)} base_values for 2 classes")
        two = has1  # onnxruntime keeps the second score only when class 1 has weights
        positive = s1 if two else (s0 if has0 else b.const([0.0]))
        positive = b.op("Squeeze", positive, b.const([1], np.int64))
        one_class = len(scored) == 1
        all_positive = bool((forest.leaf_weight >= 0).all())
        threshold = 0.5 if one_class and all_positive else 0.0
        pos, neg = (labels[1], labels[0]) if one_class else (1, 0)
        label = b.op("Where", b.op("Greater", positive, b.const(threshold)),
                     b.const(pos, np.int64), b.const(neg, np.int64))
        if two:
            scores = post_transform(b, b.op("Concat", s0, s1, axis=1), how)
        elif one_class and all_positive:
            scores = b.op("Concat", b.op("Sub", b.const(1.0), s0), s0, axis=1)
        elif one_class and how == "LOGISTIC":
            scores = b.op("Sigmoid", b.op("Concat", b.op("Neg", s0), s0, axis=1))
        elif one_class:
            scores = b.op("Concat", b.op("Neg", s0), s0, axis=1)
        else:
            raise UnsupportedOpError(f"{node.describe()}: this two-class layout of weights is not "
                                     "compiled by cuvil")
        return b.finish(label, scores, domains={"cuvil": 1})


# -- the native traversal ----------------------------------------------------------------------


#: trees a row descends side by side: each descent is a chain of dependent loads (a level's
#: node names the next), which the CPU overlaps only across independent descents
_LANES = 8
#: a node record's head word: its feature in the low bits, its comparison (mode) above them
#: and its missing-value track in the sign bit, so that a level reads no other table
_FEATURE_BITS = 24
_FEATURE_MASK = (1 << _FEATURE_BITS) - 1


@dataclass(frozen=True)
class _Layout:
    """The node records of a forest compared in `dtype`, as int32 words: float32 thresholds
    [head, threshold, true child, false child] (16 bytes); float64 ones [head, true child,
    false child, unused, threshold] (24 bytes, the threshold 8-aligned). A level of the
    descent reads one record, on one cache line."""

    dtype: np.dtype

    @property
    def words(self) -> int:
        return 4 if self.dtype == np.float32 else 6

    @property
    def true_word(self) -> int:  # the false child follows it
        return 2 if self.dtype == np.float32 else 1

    def records(self, node: Node) -> np.ndarray:
        a = node.attrs
        feature = np.asarray(a["feature"], np.int64)
        head = (feature | np.asarray(a["mode"], np.int64) << _FEATURE_BITS
                | (np.asarray(a["missing_true"], np.int64) != 0) << 31)
        record = np.zeros((len(feature), self.words), np.int32)
        record[:, 0] = head.astype(np.uint32).view(np.int32)
        split = np.asarray(a["split"])
        if self.dtype == np.float32:
            record[:, 1] = split.astype(np.float32).view(np.int32)
        else:
            record[:, 4:6] = split.astype("<f8").view(np.int32).reshape(-1, 2)
        record[:, self.true_word] = a["true_child"]
        record[:, self.true_word + 1] = a["false_child"]
        return record.reshape(-1)

    def threshold(self, k: Emitter, nodes: ir.GlobalVariable, at_node: ir.Value) -> ir.Value:
        if self.dtype == np.float32:
            return k.b.bitcast(_load(k, nodes, k.b.add(at_node, k.i64(1))), llvm_type(self.dtype))
        ptr = k.b.gep(nodes, [k.b.add(at_node, k.i64(4))], inbounds=True, source_etype=I32)
        return k.b.load(ptr, typ=llvm_type(self.dtype))


#: numpy dtypes of the table element types
_NUMPY = {"i8": np.int8, "i32": np.int32, "float": np.float32, "double": np.float64}


def _table(k: Emitter, values: Any, ty: ir.Type, name: str) -> ir.GlobalVariable:
    """A constant table in the library, written as raw bytes (every target is little-endian):
    LLVM reads a string of bytes much faster than a list of a million numbers."""
    arr = np.ascontiguousarray(np.asarray(values, dtype=_NUMPY[str(ty)]).reshape(-1) if
                               len(values) else np.zeros(1, _NUMPY[str(ty)])).astype("<" + np.dtype(
                                   _NUMPY[str(ty)]).str[1:])
    raw = bytearray(arr.tobytes())
    arr_ty = ir.ArrayType(ir.IntType(8), len(raw))
    g = ir.GlobalVariable(k.module, arr_ty, k.module.get_unique_name(f"{k.function.name}.{name}"))
    g.linkage = "private"
    g.global_constant = True
    g.unnamed_addr = True
    g.align = 8
    g.initializer = ir.Constant(arr_ty, raw)
    g.element = ty
    return g


def _load(k: Emitter, table: ir.GlobalVariable, i: ir.Value) -> ir.Value:
    ty = table.element
    return k.b.load(k.b.gep(table, [i], inbounds=True, source_etype=ty), typ=ty)


@register
class TreeEnsembleScores(Op):
    """cuvil's own: a packed forest's aggregated leaf weights, [N, targets] (see the module)."""

    op_type = "TreeEnsembleScores"
    domain = "cuvil"
    dtypes = ("float32", "float64", "int64", "int32")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        assert x is not None
        rows = x.type.shape[:1] if x.type.rank == 2 else (1,)
        features = x.type.shape[-1]
        used = max(node.attrs["feature"], default=-1)
        if isinstance(features, int) and used >= features:
            raise ModelError(f"{node.describe()}: the trees read feature {used}, but X has "
                             f"{features} features")
        out = np.dtype(helper.tensor_dtype_to_np_dtype(int(node.attrs["out_dtype"])))
        return [TensorType(out, (*rows, int(node.attrs["targets"])))]

    def scratch_bytes(self, node: Node) -> Dim:
        """The groups' scores (`tree_groups`): [rows, groups, padded targets]."""
        groups = tree_groups(len(node.attrs["roots"]))
        y = node.outputs[0]
        assert y is not None
        if groups == 1:
            return 0
        padded = _padded_targets(int(node.attrs["targets"]), y.type.dtype)
        return simplify_dim(y.type.shape[0] * groups * padded * y.type.dtype.itemsize)

    def lower(self, node: Node, k: Emitter) -> None:  # noqa: C901  (older than the rule: to split)
        a = node.attrs
        x_val, y_val = node.inputs[0], node.outputs[0]
        assert x_val is not None
        split = np.asarray(a["split"])
        cmp_dtype = np.dtype(np.float64) if np.float64 in (split.dtype, x_val.type.dtype) \
            else np.dtype(np.float32)
        out_dtype = y_val.type.dtype
        oty = llvm_type(out_dtype)
        rows = x_val.type.shape[0] if x_val.type.rank == 2 else 1
        features = x_val.type.shape[-1]
        targets = int(a["targets"])
        aggregate = str(a["aggregate"])
        layout = _Layout(cmp_dtype)
        nodes = _table(k, layout.records(node), I32, "nodes")
        roots = _table(k, a["roots"], I32, "roots")
        leaf_start = np.asarray(a["leaf_start"])
        one_weight_per_leaf = bool(np.array_equal(leaf_start, np.arange(len(leaf_start))))
        start = _table(k, leaf_start, I32, "leaf_start")
        target = _table(k, a["leaf_target"], I32, "leaf_target")
        weight = _table(k, np.asarray(a["leaf_weight"]).astype(out_dtype), oty, "leaf_weight")
        modes = sorted(set(a["mode"]))
        tracks = any(a["missing_true"])
        n_trees = len(a["roots"])
        init = {"MIN": np.inf, "MAX": -np.inf}.get(aggregate, 0.0)
        blocks = simplify_dim(sympy.floor((rows + _BLOCK - 1) / _BLOCK))
        depth = 1 + max(1, len(a["feature"]) // max(n_trees, 1)).bit_length()
        groups = tree_groups(n_trees)
        # the trees of a group come in runs of _LANES, which descend side by side; only the
        # forest's last n_trees % _LANES trees descend one by one
        runs = -(-n_trees // _LANES)
        full = n_trees // _LANES * _LANES
        # a task's work: the rows of its block (fewer than _BLOCK in a small batch, which
        # should not wake a thread for a few trees) times its trees' levels
        per_row = (n_trees // groups) * depth * 2
        block_rows_v = k.dim(simplify_dim(sympy.Min(rows, _BLOCK)))
        cost = k.b.mul(block_rows_v, k.i64(per_row))
        padded = _padded_targets(targets, out_dtype)

        def block_rows(blk: ir.Value, x: Any) -> tuple[ir.Value, ir.Value]:
            r0 = k.b.mul(blk, k.i64(_BLOCK))
            end = k.b.add(r0, k.i64(_BLOCK))
            return r0, k.b.select(k.b.icmp_signed("<", end, x.dims[0]), end, x.dims[0])

        def finish(v: ir.Value) -> ir.Value:
            if aggregate == "AVERAGE":
                return k.b.fdiv(v, ir.Constant(oty, float(n_trees)))
            if aggregate in ("MIN", "MAX"):  # no leaf gave the target a weight: 0, as onnxruntime
                return k.b.select(k.b.fcmp_ordered("==", v, ir.Constant(oty, init)),
                                  ir.Constant(oty, 0.0), v)
            return v

        def combine(old: ir.Value, w: ir.Value) -> ir.Value:
            if aggregate == "MIN":
                return k.fmin(old, w)
            if aggregate == "MAX":
                return k.fmax(old, w)
            return k.b.fadd(old, w)

        def smaller(p: ir.Value, q: ir.Value) -> ir.Value:
            return k.b.select(k.b.icmp_signed("<", p, q), p, q)

        with k.parallel_loop(simplify_dim(blocks * groups), cost=cost, name="task",
                             carry=[k.scratch] if groups > 1 else []) as task:
            b = k.b
            x = k.contiguous(k.buffers[x_val], x_val.type.dtype, (rows, features))
            if groups > 1:  # the group's scores: [row, group, target] in the scratch
                g = b.urem(task, k.i64(groups))
                blk = b.udiv(task, k.i64(groups))
                y = k.contiguous(k.carried[0], out_dtype, (rows, groups, padded))

                def run_edge(h: ir.Value) -> ir.Value:
                    first_run = b.udiv(b.mul(h, k.i64(runs)), k.i64(groups))
                    return smaller(b.mul(first_run, k.i64(_LANES)), k.i64(n_trees))
                first_tree, last_tree = run_edge(g), run_edge(b.add(g, k.i64(1)))

                def at_score(r: ir.Value, t: ir.Value) -> list[ir.Value]:
                    return [r, g, t]
            else:
                blk = task
                y = k.contiguous(k.buffers[y_val], out_dtype, (rows, targets))
                first_tree, last_tree = k.i64(0), k.i64(n_trees)

                def at_score(r: ir.Value, t: ir.Value) -> list[ir.Value]:
                    return [r, t]
            r0, r1 = block_rows(blk, x)
            with k.loop(r1, start=r0, name="r") as r, k.loop(targets, name="t") as t:
                k.store(y, at_score(r, t), ir.Constant(oty, init))

            def add_weights(r: ir.Value, leaf: ir.Value) -> None:
                def add(e: ir.Value) -> None:
                    tt = k.i64(0) if targets == 1 else b.zext(_load(k, target, e), I64)
                    score = at_score(r, tt)
                    k.store(y, score, combine(k.load(y, score), _load(k, weight, e)))

                if one_weight_per_leaf:  # regressors, binary classifiers: no CSR walk
                    add(leaf)
                else:
                    first = b.zext(_load(k, start, leaf), I64)
                    last = b.zext(_load(k, start, b.add(leaf, k.i64(1))), I64)
                    with k.loop(last, start=first, name="w") as e:
                        add(e)

            def trees(begin: ir.Value, end: ir.Value, lanes: int) -> None:
                """Trees begin..end-1, `lanes` at a time, each row of the block down them; the
                leaves' weights added in tree order."""
                with k.loop(end, start=begin, step=lanes, name=f"trees{lanes}") as t0:
                    tops = [_load(k, roots, b.add(t0, k.i64(j))) for j in range(lanes)]
                    with k.loop(r1, start=r0, name="r") as r:
                        for leaf in self._descend(k, layout, nodes, x, x_val.type.dtype, r,
                                                  tops, modes, tracks):
                            add_weights(r, leaf)

            side_by_side_end = smaller(last_tree, k.i64(full))
            trees(first_tree, side_by_side_end, _LANES)
            trees(side_by_side_end, last_tree, 1)
            if groups == 1 and aggregate in ("AVERAGE", "MIN", "MAX"):
                with k.loop(r1, start=r0, name="r") as r, k.loop(targets, name="t") as t:
                    k.store(y, [r, t], finish(k.load(y, [r, t])))
        if groups == 1:
            return
        # the groups' scores combined in group order: the same sums on any number of threads
        with k.parallel_loop(blocks, cost=_BLOCK * targets * groups, name="combine",
                             carry=[k.scratch]) as blk:
            x = k.contiguous(k.buffers[x_val], x_val.type.dtype, (rows, features))
            y = k.contiguous(k.buffers[y_val], out_dtype, (rows, targets))
            parts = k.contiguous(k.carried[0], out_dtype, (rows, groups, padded))
            r0, r1 = block_rows(blk, x)
            with k.loop(r1, start=r0, name="r") as r, k.loop(targets, name="t") as t:
                v = k.load(parts, [r, k.i64(0), t])
                for g in range(1, groups):
                    v = combine(v, k.load(parts, [r, k.i64(g), t]))
                k.store(y, [r, t], finish(v))

    def _descend(self, k: Emitter, layout: _Layout, nodes: ir.GlobalVariable, x: Any,
                 x_dtype: np.dtype, r: ir.Value, tops: list[ir.Value], modes: list[int],
                 tracks: bool) -> list[ir.Value]:
        """Row r down the trees whose roots are `tops`, side by side: one loop, a level of
        every tree per iteration, until all reached their leaves; returns the leaves (i64).
        A tree at its leaf reads node 0 and stays where it is."""
        b = k.b
        many = len(tops) > 1
        before = b.block
        head = k.function.append_basic_block("descend.head")
        step = k.function.append_basic_block("descend.step")
        done = k.function.append_basic_block("descend.done")
        b.branch(head)
        b.position_at_end(head)
        at = []
        for top in tops:
            phi = b.phi(I32, name="node")
            phi.add_incoming(top, before)
            at.append(phi)
        zero = ir.Constant(I32, 0)
        leaves = [b.icmp_signed("<", here, zero) for here in at]
        all_leaves = leaves[0]
        for leaf in leaves[1:]:
            all_leaves = b.and_(all_leaves, leaf)
        b.cbranch(all_leaves, done, step)
        b.position_at_end(step)
        following = []
        for here, leaf in zip(at, leaves):
            i = b.zext(b.select(leaf, zero, here) if many else here, I64)
            at_node = b.mul(i, k.i64(layout.words))

            def word(j: int, at_node: ir.Value = at_node) -> ir.Value:
                return _load(k, nodes, b.add(at_node, k.i64(j)))

            head_word = word(0)
            f = b.zext(b.and_(head_word, ir.Constant(I32, _FEATURE_MASK)), I64)
            v = k.convert(k.load(x, [r, f]), x_dtype, layout.dtype)
            go = self._compare(k, v, layout.threshold(k, nodes, at_node), modes, head_word)
            if tracks:  # the missing-value track is the head word's sign bit
                nan = b.fcmp_unordered("uno", v, v)
                go = b.or_(go, b.and_(nan, b.icmp_signed("<", head_word, zero)))
            # cmovs, not branches (LLVM branches around loads it can sink, and here a branch
            # on the comparison, a NaN or whether the tree is done mispredicts often)
            unpredictable = k.module.add_metadata([])
            nxt = b.select(go, word(layout.true_word), word(layout.true_word + 1))
            nxt.set_metadata("unpredictable", unpredictable)
            if many:
                nxt = b.select(leaf, here, nxt)
                nxt.set_metadata("unpredictable", unpredictable)
            following.append(nxt)
        for phi, nxt in zip(at, following):
            phi.add_incoming(nxt, b.block)
        b.branch(head)
        b.position_at_end(done)
        return [b.zext(b.xor(here, ir.Constant(I32, -1)), I64) for here in at]

    @staticmethod
    def _compare(k: Emitter, v: ir.Value, threshold: ir.Value, modes: list[int],
                 head_word: ir.Value) -> ir.Value:
        """x <op> threshold; NEQ holds for NaN (as C's != does), the others do not. One mode
        is one comparison; several are selected by the mode bits of the node's head word."""
        b = k.b

        def one(m: int) -> ir.Value:
            pred = _PREDICATES[m]
            return (b.fcmp_unordered(pred, v, threshold) if pred == "!="
                    else b.fcmp_ordered(pred, v, threshold))

        result = one(modes[0])
        if len(modes) == 1:
            return result
        mode = b.and_(b.lshr(head_word, ir.Constant(I32, _FEATURE_BITS)), ir.Constant(I32, 7))
        for m in modes[1:]:
            result = b.select(b.icmp_unsigned("==", mode, ir.Constant(I32, m)), one(m), result)
        return result
