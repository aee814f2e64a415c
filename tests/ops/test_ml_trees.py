"""Tree ensembles written with onnx.helper, for what scikit-learn's converters never write:
every node mode, missing-value tracks, the MIN/MAX/AVERAGE aggregates, several targets and
opset 5's TreeEnsemble. Compared with onnxruntime on inputs with NaNs and values equal to
the thresholds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import cuvil
from tests.oracle import run_ort

pytest.importorskip("onnxruntime")

MODES = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ"]
FEATURES = 4


def _random_trees(rng: np.random.Generator, trees: int, depth: int, targets: int):
    """Full binary trees: per node (tree, id, feature, threshold, mode, missing-true, true id,
    false id), ids in breadth-first order; per leaf its weights [(target, weight)]."""
    nodes, leaves = [], []
    thresholds = np.round(rng.normal(size=64), 1).astype(np.float32)
    for t in range(trees):
        inner = 2 ** depth - 1
        for i in range(inner):
            nodes.append((t, i, int(rng.integers(FEATURES)), float(rng.choice(thresholds)),
                          MODES[int(rng.integers(len(MODES)))], int(rng.integers(2)),
                          2 * i + 1, 2 * i + 2))
        for i in range(inner, 2 * inner + 1):
            # a weight for every target, in order, as converters write them (onnxruntime and
            # onnx's reference disagree about targets a leaf leaves out)
            weights = [(k, float(rng.normal())) for k in range(targets)]
            leaves.append((t, i, weights))
    return nodes, leaves, thresholds


def _inputs(rng: np.random.Generator, thresholds: np.ndarray) -> np.ndarray:
    x = rng.choice(thresholds, size=(64, FEATURES)).astype(np.float32)  # ties with thresholds
    x[::3] += rng.normal(size=(len(x[::3]), FEATURES)).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = np.nan
    return x


def _v3_regressor(nodes, leaves, targets: int, aggregate: str, base: list[float]) -> onnx.ModelProto:
    # each tree's nodes together, in id order, as converters write them
    rows = sorted([(n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7]) for n in nodes]
                  + [(le[0], le[1], 0, 0.0, "LEAF", 0, 0, 0) for le in leaves])
    weights = [(le[0], le[1], k, w) for le in leaves for k, w in le[2]]
    attrs = {
        "nodes_treeids": [r[0] for r in rows], "nodes_nodeids": [r[1] for r in rows],
        "nodes_featureids": [r[2] for r in rows], "nodes_values": [r[3] for r in rows],
        "nodes_modes": [r[4] for r in rows], "nodes_missing_value_tracks_true": [r[5] for r in rows],
        "nodes_truenodeids": [r[6] for r in rows], "nodes_falsenodeids": [r[7] for r in rows],
        "target_treeids": [w[0] for w in weights], "target_nodeids": [w[1] for w in weights],
        "target_ids": [w[2] for w in weights], "target_weights": [w[3] for w in weights],
        "n_targets": targets, "aggregate_function": aggregate}
    if base:
        attrs["base_values"] = base
    node = helper.make_node("TreeEnsembleRegressor", ["X"], ["Y"], domain="ai.onnx.ml", **attrs)
    return _model(node, targets, 3, 17)


def _v5(nodes, leaves, targets: int, aggregate: int, transform: int) -> onnx.ModelProto:
    # per tree, nodes come in order; node index = position in `nodes`; leaves likewise
    first_node = {t: min(i for i, n in enumerate(nodes) if n[0] == t) for t in {n[0] for n in nodes}}
    inner = {t: sum(1 for n in nodes if n[0] == t) for t in first_node}
    first_leaf: dict[int, int] = {}
    leaf_targets, leaf_weights = [], []
    for i, le in enumerate(leaves):
        first_leaf.setdefault(le[0], i)
        k, w = le[2][0]  # opset 5: one weight per leaf
        leaf_targets.append(k)
        leaf_weights.append(w)

    def child(t: int, nid: int) -> tuple[int, int]:
        if nid < inner[t]:
            return first_node[t] + nid, 0
        return first_leaf[t] + nid - inner[t], 1

    trues = [child(n[0], n[6]) for n in nodes]
    falses = [child(n[0], n[7]) for n in nodes]
    node = helper.make_node(
        "TreeEnsemble", ["X"], ["Y"], domain="ai.onnx.ml",
        nodes_featureids=[n[2] for n in nodes],
        nodes_splits=numpy_helper.from_array(np.array([n[3] for n in nodes], np.float32)),
        nodes_modes=numpy_helper.from_array(np.array([MODES.index(n[4]) for n in nodes], np.uint8)),
        nodes_missing_value_tracks_true=[n[5] for n in nodes],
        nodes_truenodeids=[c for c, _ in trues], nodes_trueleafs=[lf for _, lf in trues],
        nodes_falsenodeids=[c for c, _ in falses], nodes_falseleafs=[lf for _, lf in falses],
        tree_roots=sorted(first_node.values()), leaf_targetids=leaf_targets,
        leaf_weights=numpy_helper.from_array(np.array(leaf_weights, np.float32)),
        n_targets=targets, aggregate_function=aggregate, post_transform=transform)
    return _model(node, targets, 5, 21)


def _model(node: onnx.NodeProto, targets: int, ml_opset: int, opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node], "trees", [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["N", targets])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                     helper.make_opsetid("ai.onnx.ml", ml_opset)])
    model.ir_version = 10 if ml_opset >= 5 else 8
    onnx.checker.check_model(model)
    return model


def _compare(model: onnx.ModelProto, x: np.ndarray) -> None:
    (want,) = run_ort(model, {"X": x})
    got = cuvil.compile(model).run({"X": x})["Y"]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("aggregate", "base"), [("SUM", [0.5, -1.0, 2.0]), ("AVERAGE", []),
                                                 ("MIN", [0.25, 0.0, 0.0]), ("MAX", [])])
def test_regressor_every_mode_and_missing_track(aggregate, base):
    rng = np.random.default_rng(len(aggregate) + len(base))
    nodes, leaves, thresholds = _random_trees(rng, trees=6, depth=3, targets=3)
    _compare(_v3_regressor(nodes, leaves, 3, aggregate, base), _inputs(rng, thresholds))


@pytest.mark.slow  # a compile of 300 trees per case
@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_large_forests(aggregate, rows):
    """300 trees, every aggregate, at one block of rows or several, on one thread or two: the
    trees score in groups, one task each, combined in group order."""
    from cuvil.compiler.ops.ml_trees import tree_groups

    assert tree_groups(300) > 1 and tree_groups(40) == 1
    rng = np.random.default_rng(rows)
    nodes, leaves, thresholds = _random_trees(rng, trees=300, depth=4, targets=3)
    model = _v3_regressor(nodes, leaves, 3, aggregate, [])
    x = _inputs(rng, thresholds)
    x = np.resize(x, (rows, x.shape[1]))
    (want,) = run_ort(model, {"X": x})
    compiled = cuvil.compile(model)
    got = {}
    for threads in (1, 2):
        compiled.num_threads = threads
        got[threads] = compiled.run({"X": x})["Y"]
        np.testing.assert_allclose(got[threads], want, rtol=1e-5, atol=1e-5)
    # the groups are summed in group order whatever the thread count: the same bits
    assert np.array_equal(got[1], got[2])


def test_single_target_regressor_with_one_base_value():
    rng = np.random.default_rng(7)
    nodes, leaves, thresholds = _random_trees(rng, trees=5, depth=4, targets=1)
    _compare(_v3_regressor(nodes, leaves, 1, "SUM", [3.5]), _inputs(rng, thresholds))


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
def test_opset5_tree_ensemble(aggregate):
    rng = np.random.default_rng(aggregate)
    nodes, leaves, thresholds = _random_trees(rng, trees=6, depth=3, targets=3)
    _compare(_v5(nodes, leaves, 3, aggregate, 0), _inputs(rng, thresholds))


@pytest.mark.parametrize("transform", [1, 2])
def test_opset5_post_transform_follows_the_spec(transform):
    """The spec numbers SOFTMAX 1 and LOGISTIC 2; onnxruntime 1.32 swaps them (and onnx's
    reference evaluator ignores the attribute), so the oracle is onnxruntime's untransformed
    scores with the transform the spec names applied in numpy."""
    rng = np.random.default_rng(10 + transform)
    nodes, leaves, thresholds = _random_trees(rng, trees=6, depth=3, targets=3)
    x = _inputs(rng, thresholds)
    (raw,) = run_ort(_v5(nodes, leaves, 3, 1, 0), {"X": x})
    if transform == 1:
        e = np.exp(raw - raw.max(axis=1, keepdims=True))
        want = e / e.sum(axis=1, keepdims=True)
    else:
        want = 1 / (1 + np.exp(-raw))
    got = cuvil.compile(_v5(nodes, leaves, 3, 1, transform)).run({"X": x})["Y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_opset5_set_membership_nodes():
    # BRANCH_MEMBER (x in a set): sets of several members and of one (onnxruntime refuses
    # empty ones), NaN features tracking true or false, features that take the members' values
    rng = np.random.default_rng(21)
    nodes, leaves, _ = _random_trees(rng, trees=4, depth=3, targets=2)
    model = _v5(nodes, leaves, 2, 0, 0)
    attrs = {a.name: a for a in model.graph.node[0].attribute}
    modes = numpy_helper.to_array(attrs["nodes_modes"].t).copy()
    sets = []
    for j in range(0, len(modes), 2):
        modes[j] = 6
        sets.append([[1.0, 3.0, 4.0], [2.0], [0.0, 5.0]][len(sets) % 3])
    attrs["nodes_modes"].t.CopyFrom(numpy_helper.from_array(modes, "nodes_modes"))
    flat = [v for s in sets for v in [*s, np.nan]][:-1]
    model.graph.node[0].attribute.append(helper.make_attribute(
        "membership_values", numpy_helper.from_array(np.array(flat, np.float32))))
    onnx.checker.check_model(model)
    x = rng.integers(0, 6, (64, FEATURES)).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = np.nan
    _compare(model, x)


@pytest.mark.parametrize("trees", [13, 70])
def test_float64_thresholds_and_features(trees):
    """Double thresholds (nodes_values_as_tensor) and features compare in float64, from node
    records of their own layout; 13 and 70 trees: runs of 8 trees side by side and the rest
    one by one, in one group of trees or two."""
    rng = np.random.default_rng(trees)
    nodes, leaves, thresholds = _random_trees(rng, trees=trees, depth=4, targets=2)
    model = _v3_regressor(nodes, leaves, 2, "SUM", [])
    node = model.graph.node[0]
    values = next(a for a in node.attribute if a.name == "nodes_values")
    node.attribute.remove(values)
    # thresholds a float32 cannot hold: inputs within a float32 step of them must still split
    precise = np.asarray(values.floats, np.float64) + 1e-9
    node.attribute.append(helper.make_attribute(
        "nodes_values_as_tensor", numpy_helper.from_array(precise, "nodes_values_as_tensor")))
    model.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    onnx.checker.check_model(model)
    x = _inputs(rng, thresholds).astype(np.float64)
    x[1::4] += 1e-9  # equal to the thresholds in float64
    _compare(model, x)


def test_feature_index_beyond_the_node_records():
    """A node's feature shares its record's head word with the mode and the missing track:
    features from 2**24 on are refused with a message, not misread."""
    from cuvil.errors import UnsupportedOpError

    rng = np.random.default_rng(3)
    nodes, leaves, _ = _random_trees(rng, trees=1, depth=1, targets=1)
    nodes = [(*n[:2], 2 ** 24, *n[3:]) for n in nodes]
    model = _v3_regressor(nodes, leaves, 1, "SUM", [])
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 2 ** 24 + 1
    with pytest.raises(UnsupportedOpError, match="features"):
        cuvil.compile(model)
