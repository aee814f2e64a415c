"""fuse_attention: which MatMul -> (scale) -> (mask) -> Softmax -> MatMul chains become one
cuvil Attention node, and the compiled model against onnxruntime running the graph as written,
at several sequence lengths of symbolic dims (one query row, fewer rows than a task's block,
several blocks), heads that broadcast, masks of every broadcast form; and against the same
model compiled without the pass."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from oracle import assert_matches_ort, make_model
from pipeline import compile_without, op_labels

import cuvil
import cuvil.compiler.passes as passes
from cuvil.compiler.ops.attention import ROWS

rng = np.random.default_rng(11)
F32 = np.float32


def attention(scale: tuple[str, float, bool] | None, mask: bool, mask_first: bool = False,
              q_shape=("b", 3, "s", 24), kt_shape=("b", 3, 24, "t"), v_shape=("b", 3, "t", 16),
              mask_shape=("b", 1, 1, "t")):
    """softmax(q @ kt (scale) (+ mask)) @ v; scale = (Mul or Div, constant, constant first)."""
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["scores"])]
    last = "scores"
    if scale is not None:
        op, _, first = scale
        nodes.append(helper.make_node(op, ["c", last] if first else [last, "c"], ["scaled"]))
        last = "scaled"
    inputs = {"q": (F32, list(q_shape)), "kt": (F32, list(kt_shape)), "v": (F32, list(v_shape))}
    if mask:
        nodes.append(helper.make_node("Add", ["m", last] if mask_first else [last, "m"],
                                      ["masked"]))
        inputs["m"] = (F32, list(mask_shape))
        last = "masked"
    nodes += [helper.make_node("Softmax", [last], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["y"])]
    consts = {"c": np.array(scale[1], F32)} if scale is not None else {}
    return make_model(nodes, inputs, {"y": F32}, consts)


def feeds_for(model, **dims: int) -> dict[str, np.ndarray]:
    out = {}
    for i in model.graph.input:
        shape = [d.dim_value or dims[d.dim_param] for d in i.type.tensor_type.shape.dim]
        scale = 4.0 if i.name == "m" else 1.0  # masks that move the softmax a lot
        out[i.name] = (rng.standard_normal(shape) * scale).astype(F32)
    return out


def check(model, sizes: list[dict[str, int]]) -> None:
    compiled, plain = cuvil.compile(model), compile_without(model, passes.fuse_attention)
    for dims in sizes:
        feeds = feeds_for(model, **dims)
        assert_matches_ort(model, feeds, compiled=compiled)
        # the same steps; a product of a few rows may take the matrix-vector kernel unfused
        # (another order of the sums' terms), so not bit for bit
        np.testing.assert_allclose(compiled.run(feeds)["y"], plain.run(feeds)["y"], rtol=1e-6,
                                   atol=1e-6, err_msg=str(dims))


SIZES = [{"b": 2, "s": 37, "t": 37}, {"b": 1, "s": 1, "t": 5},
         {"b": 1, "s": ROWS + 3, "t": 200}]


@pytest.mark.parametrize("scale", [None, ("Div", 4.89898, False), ("Mul", 0.2, True)])
@pytest.mark.parametrize("mask,mask_first", [(False, False), (True, False),
                                             pytest.param(True, True, marks=pytest.mark.slow)])
def test_scaled_masked_attention(scale, mask: bool, mask_first: bool) -> None:
    model = attention(scale, mask, mask_first)
    assert op_labels(model) == ["Attention"]
    check(model, SIZES)


@pytest.mark.parametrize("mask_shape,mask_first", [(("s", "t"), False), (("b", 3, "s", "t"), True),
                                                   ((1, 1, 1, "t"), False)])
def test_mask_forms(mask_shape, mask_first: bool) -> None:
    # a causal-style [s, t] mask, one per head and query (the scores' shape: Add's first
    # operand is the mask), one for every batch entry alike
    model = attention(("Mul", 0.25, False), True, mask_first, mask_shape=mask_shape)
    assert op_labels(model) == ["Attention"]
    check(model, [{"b": 2, "s": 9, "t": 9}, {"b": 1, "s": 40, "t": 40}])


def test_broadcast_heads_and_cross_attention() -> None:
    # one K and V for every query head ([b, 1, ...]: multi-query), queries of another length
    # than the keys, V's width not Q's; rank-3 q against rank-4 keys
    model = attention(None, False, q_shape=(3, "s", 8), kt_shape=("b", 1, 8, "t"),
                      v_shape=("b", 1, "t", 20))
    assert op_labels(model) == ["Attention"]
    check(model, [{"b": 2, "s": 5, "t": 70}, {"b": 1, "s": 1, "t": 1}])
    # one key and value matrix for every batch entry and head, a mask of one row
    model = attention(("Mul", 0.5, False), True, q_shape=(2, 3, "s", 8), kt_shape=(8, "t"),
                      v_shape=("t", 5), mask_shape=("t",))
    assert op_labels(model) == ["Attention"]
    check(model, [{"s": 7, "t": 9}, {"s": 130, "t": 3}])


def test_one_head() -> None:
    # one matrix each (rank 2): the queries split into blocks for the threads
    model = attention(("Div", 3.0, False), True, q_shape=("s", 8), kt_shape=(8, "t"),
                      v_shape=("t", 6), mask_shape=("s", "t"))
    assert op_labels(model) == ["Attention"]
    check(model, [{"s": 100, "t": 33}, {"s": 1, "t": 2}, {"s": 17, "t": 300}])


@pytest.mark.parametrize("keys_first", [True, False])
def test_head_transposes_fold_into_the_node(keys_first: bool) -> None:
    # torch's head split [b, s, 24] -> [b, s, 3, 8] -> [b, 3, s, 8] for q and v, and the merge
    # after; the keys' transpose to [b, 3, 8, t] moves the last axis and stays a node, unless
    # they come as [b, 8, 3, t] (keys_first False), whose transpose keeps it last
    nodes = [helper.make_node("Reshape", ["xq", "split"], ["q4"]),
             helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["xv", "split"], ["v4"]),
             helper.make_node("Transpose", ["v4"], ["v"], perm=[0, 2, 1, 3])]
    inputs = {"xq": (F32, ["b", "s", 24]), "xv": (F32, ["b", "t", 24])}
    if keys_first:
        nodes += [helper.make_node("Reshape", ["xk", "split"], ["k4"]),
                  helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1])]
        inputs["xk"] = (F32, ["b", "t", 24])
    else:
        nodes.append(helper.make_node("Transpose", ["xkt"], ["kt"], perm=[0, 2, 1, 3]))
        inputs["xkt"] = (F32, ["b", 8, 3, "t"])
    nodes += [helper.make_node("MatMul", ["q", "kt"], ["scores"]),
              helper.make_node("Div", ["scores", "c"], ["scaled"]),
              helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
              helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx_t", "merge"], ["y"])]
    model = make_model(nodes, inputs, {"y": F32},
                       {"split": np.array([0, 0, 3, 8]), "merge": np.array([0, 0, 24]),
                        "c": np.array(2.828, F32)})
    labels = op_labels(model)
    assert labels.count("Attention") == 1 and labels.count("Transpose") == int(keys_first), labels
    check(model, SIZES)


def test_what_stays_unfused() -> None:
    # the probabilities are also a graph output; a softmax over another axis; scores
    # multiplied by a tensor, not a constant
    base = [helper.make_node("MatMul", ["q", "kt"], ["scores"])]
    inputs = {"q": (F32, [2, 5, 8]), "kt": (F32, [2, 8, 5]), "v": (F32, [2, 5, 4])}
    probs_out = make_model([*base, helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
                            helper.make_node("MatMul", ["probs", "v"], ["y"])],
                           inputs, {"y": F32, "probs": F32})
    assert "Attention" not in op_labels(probs_out)
    other_axis = make_model([*base, helper.make_node("Softmax", ["scores"], ["probs"], axis=1),
                             helper.make_node("MatMul", ["probs", "v"], ["y"])],
                            inputs, {"y": F32})
    assert "Attention" not in op_labels(other_axis)
    tensor_scale = make_model([*base, helper.make_node("Mul", ["scores", "w"], ["scaled"]),
                               helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
                               helper.make_node("MatMul", ["probs", "v"], ["y"])],
                              {**inputs, "w": (F32, [2, 5, 5])}, {"y": F32})
    assert "Attention" not in op_labels(tensor_scale)
    for model in (probs_out, other_axis, tensor_scale):
        assert_matches_ort(model, feeds_for(model))
