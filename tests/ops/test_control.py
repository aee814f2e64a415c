"""If, Loop and Scan against onnxruntime, and the ONNX backend node cases that use them.

Models are built with onnx.helper. Each test compiles its model once and runs it on several
inputs (both values of a run-time condition, several sizes of a symbolic dim, several trip
counts), comparing every output with onnxruntime.
"""

from __future__ import annotations

import importlib
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper
from oracle import assert_matches_ort

import cuvil
from cuvil.compiler.frontend import import_model
from cuvil.errors import ModelError, UnsupportedOpError

vi = helper.make_tensor_value_info
rng = np.random.default_rng(7)


def _elem(dtype: Any) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def model(nodes: Sequence[onnx.NodeProto], inputs: Mapping[str, tuple[Any, list[Any]]],
          outputs: Mapping[str, tuple[Any, list[Any]]], inits: Mapping[str, Any] | None = None,
          opset: int = 17, strict: bool = True) -> onnx.ModelProto:
    """A checked model with typed outputs (onnx's inference leaves loop outputs shapeless)."""
    g = helper.make_graph(
        list(nodes), "control",
        [vi(n, _elem(t), s) for n, (t, s) in inputs.items()],
        [vi(n, _elem(t), s) for n, (t, s) in outputs.items()],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=strict)
    return m


def body(name: str, nodes: Sequence[onnx.NodeProto], inputs: Sequence[tuple[str, Any, Any]],
         outputs: Sequence[tuple[str, Any, Any]]) -> onnx.GraphProto:
    return helper.make_graph(list(nodes), name, [vi(n, _elem(t), s) for n, t, s in inputs],
                             [vi(n, _elem(t), s) for n, t, s in outputs])


def floats(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def op_types(m: onnx.ModelProto, inputs: Mapping[str, Any] | None = None) -> list[str]:
    return [n.op_type for n in import_model(m, inputs).nodes]


# -- If ---------------------------------------------------------------------------------------

ADD_XY = body("add", [helper.make_node("Add", ["x", "y"], ["t"])], [], [("t", np.float32, ["n", 3])])
MUL_XW = body("mul", [helper.make_node("Mul", ["x", "w"], ["t"])], [], [("t", np.float32, ["n", 3])])


def test_if_on_a_constant_condition_is_replaced_by_its_branch() -> None:
    m = model([helper.make_node("If", ["yes"], ["a"], then_branch=ADD_XY, else_branch=MUL_XW),
               helper.make_node("If", ["no"], ["b"], then_branch=ADD_XY, else_branch=MUL_XW)],
              {"x": (np.float32, ["n", 3]), "y": (np.float32, ["n", 3])},
              {"a": (np.float32, ["n", 3]), "b": (np.float32, ["n", 3])},
              {"yes": np.array(True), "no": np.array(False), "w": floats(3)})
    assert "If" not in op_types(m)
    compiled = None
    for n in (1, 5):
        compiled = assert_matches_ort(m, {"x": floats(n, 3), "y": floats(n, 3)}, compiled=compiled)


def test_if_on_a_condition_decided_by_shapes_is_inlined() -> None:
    """Exporters test shapes: Shape(x)[1] == 4 is known although x's first dim is symbolic.
    The branch not taken has another output shape, which a run-time If could not compile."""
    keep = body("keep", [helper.make_node("Relu", ["x"], ["r"])], [], [("r", np.float32, ["n", 4])])
    flip = body("flip", [helper.make_node("Transpose", ["x"], ["r"], perm=[1, 0])], [],
                [("r", np.float32, [4, "n"])])
    m = model([helper.make_node("Shape", ["x"], ["s"]),
               helper.make_node("Gather", ["s", "one"], ["d"], axis=0),
               helper.make_node("Equal", ["d", "four"], ["c"]),
               helper.make_node("If", ["c"], ["y"], then_branch=keep, else_branch=flip)],
              {"x": (np.float32, ["n", 4])}, {"y": (np.float32, ["d0", "d1"])},
              {"one": np.array(1, dtype=np.int64), "four": np.array(4, dtype=np.int64)})
    assert "If" not in op_types(m)
    compiled = None
    for n in (2, 6):
        compiled = assert_matches_ort(m, {"x": floats(n, 4)}, compiled=compiled)


def test_if_on_a_run_time_condition_runs_the_branch_it_picks() -> None:
    """Two outputs; the branches read graph inputs, an initializer and a value computed before
    the If; one returns an outer value through Identity."""
    then = body("then", [helper.make_node("Add", ["x", "y"], ["s"]),
                         helper.make_node("Relu", ["s"], ["t0"]),
                         helper.make_node("Identity", ["z"], ["t1"])],
                [], [("t0", np.float32, ["n", 3]), ("t1", np.float32, ["n", 3])])
    other = body("else", [helper.make_node("Mul", ["x", "w"], ["e0"]),
                          helper.make_node("Sub", ["z", "y"], ["e1"])],
                 [], [("e0", np.float32, ["n", 3]), ("e1", np.float32, ["n", 3])])
    m = model([helper.make_node("Tanh", ["x"], ["z"]),
               helper.make_node("If", ["c"], ["a", "b"], then_branch=then, else_branch=other)],
              {"c": (np.bool_, []), "x": (np.float32, ["n", 3]), "y": (np.float32, ["n", 3])},
              {"a": (np.float32, ["n", 3]), "b": (np.float32, ["n", 3])}, {"w": floats(3)})
    compiled = None
    for n, c in [(4, True), (4, False), (1, False), (9, True)]:
        compiled = assert_matches_ort(m, {"c": np.array(c), "x": floats(n, 3), "y": floats(n, 3)},
                                      compiled=compiled)


def test_nested_ifs() -> None:
    """A run-time If inside a run-time branch, reading values of both enclosing scopes; a
    constant-condition If inside the other branch (inlined into the branch)."""
    inner_then = body("it", [helper.make_node("Add", ["h", "x"], ["u"])], [],
                      [("u", np.float32, [2, 3])])
    inner_else = body("ie", [helper.make_node("Mul", ["h", "h"], ["u"])], [],
                      [("u", np.float32, [2, 3])])
    then = body("then", [helper.make_node("Exp", ["x"], ["h"]),
                         helper.make_node("If", ["c2"], ["v"], then_branch=inner_then,
                                          else_branch=inner_else),
                         helper.make_node("Neg", ["v"], ["t"])],
                [], [("t", np.float32, [2, 3])])
    fixed_then = body("ft", [helper.make_node("Sigmoid", ["x"], ["f"])], [], [("f", np.float32, [2, 3])])
    fixed_else = body("fe", [helper.make_node("Abs", ["x"], ["f"])], [], [("f", np.float32, [2, 3])])
    other = body("else", [helper.make_node("If", ["k"], ["g"], then_branch=fixed_then,
                                           else_branch=fixed_else),
                          helper.make_node("Add", ["g", "x"], ["e"])],
                 [], [("e", np.float32, [2, 3])])
    m = model([helper.make_node("If", ["c1"], ["y"], then_branch=then, else_branch=other)],
              {"c1": (np.bool_, []), "c2": (np.bool_, [1]), "x": (np.float32, [2, 3])},
              {"y": (np.float32, [2, 3])}, {"k": np.array(False)})
    compiled = None
    for c1 in (True, False):
        for c2 in (True, False):
            compiled = assert_matches_ort(m, {"c1": np.array(c1), "c2": np.array([c2]),
                                              "x": floats(2, 3)}, compiled=compiled)


def test_branch_names_are_renamed_away_from_outer_names() -> None:
    """Both branches define `t`, and so does the graph after the If (its output)."""
    then = body("then", [helper.make_node("Add", ["x", "x"], ["t"])], [], [("t", np.float32, [3])])
    other = body("else", [helper.make_node("Neg", ["x"], ["t"])], [], [("t", np.float32, [3])])
    for cond in (np.array(True), None):
        inits = {} if cond is None else {"c": cond}
        inputs: dict[str, Any] = {"x": (np.float32, [3])}
        if cond is None:
            inputs["c"] = (np.bool_, [])
        m = model([helper.make_node("If", ["c"], ["r"], then_branch=then, else_branch=other),
                   helper.make_node("Mul", ["r", "x"], ["t"])],
                  inputs, {"t": (np.float32, [3]), "r": (np.float32, [3])}, inits)
        compiled = cuvil.compile(m)
        assert [o.name for o in compiled.outputs] == ["t", "r"]
        feeds = {"x": floats(3)} if cond is not None else {"x": floats(3), "c": np.array(False)}
        assert_matches_ort(m, feeds, compiled=compiled)


def test_run_time_if_with_branches_of_different_shapes_is_unsupported() -> None:
    keep = body("keep", [helper.make_node("Relu", ["x"], ["r"])], [], [("r", np.float32, ["n", 4])])
    flip = body("flip", [helper.make_node("Transpose", ["x"], ["r"], perm=[1, 0])], [],
                [("r", np.float32, [4, "n"])])
    m = model([helper.make_node("If", ["c"], ["y"], then_branch=keep, else_branch=flip, name="pick")],
              {"c": (np.bool_, []), "x": (np.float32, ["n", 4])}, {"y": (np.float32, ["d0", "d1"])})
    with pytest.raises(UnsupportedOpError, match=r"'pick' \(If\).*float32\[n, 4\].*float32\[4, n\]"):
        cuvil.compile(m)


def test_unsupported_op_inside_a_branch_is_reported_with_the_others(monkeypatch) -> None:
    from cuvil.compiler.frontend import importer

    real_lookup = importer.lookup  # Det and Unique stand for ops cuvil has no kernel for
    monkeypatch.setattr(importer, "lookup", lambda d, op, v: None if op in ("Det", "Unique")
                        else real_lookup(d, op, v))
    then = body("then", [helper.make_node("Det", ["x"], ["t"])], [], [("t", np.float32, [])])
    other = body("else", [helper.make_node("ReduceSum", ["x"], ["t"], keepdims=0)], [],
                 [("t", np.float32, [])])
    m = model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
               helper.make_node("Unique", ["x"], ["u"])],
              {"c": (np.bool_, []), "x": (np.float32, [3, 3])},
              {"y": (np.float32, []), "u": (np.float32, ["k"])}, opset=17)
    with pytest.raises(UnsupportedOpError, match=r"(?s)Det.*Unique"):
        cuvil.compile(m)


# -- Loop -------------------------------------------------------------------------------------

ITER, COND = ("i", np.int64, []), ("cond_in", np.bool_, [])


def test_loop_with_constant_trip_count_scan_outputs_and_an_outer_value() -> None:
    """acc <- acc @ w + i for 5 iterations; each iteration's relu(acc) stacked; w is read from
    the enclosing graph."""
    loop_body = body("body", [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                              helper.make_node("MatMul", ["acc", "w"], ["mm"]),
                              helper.make_node("Cast", ["i"], ["fi"], to=TP.FLOAT),
                              helper.make_node("Add", ["mm", "fi"], ["acc_out"]),
                              helper.make_node("Relu", ["acc_out"], ["row"])],
                     [ITER, COND, ("acc", np.float32, ["n", 4])],
                     [("cond_out", np.bool_, []), ("acc_out", np.float32, ["n", 4]),
                      ("row", np.float32, ["n", 4])])
    m = model([helper.make_node("Loop", ["M", "", "x"], ["final", "rows"], body=loop_body)],
              {"x": (np.float32, ["n", 4])},
              {"final": (np.float32, ["n", 4]), "rows": (np.float32, [5, "n", 4])},
              {"M": np.array(5, dtype=np.int64), "w": floats(4, 4) * 0.5})
    assert "Loop" in op_types(m)  # a run-time loop, not unrolled
    compiled = None
    for n in (3, 7):
        compiled = assert_matches_ort(m, {"x": floats(n, 4)}, compiled=compiled)


def test_loop_until_a_run_time_condition() -> None:
    """Doubling v while sum(v) < limit, at most M times: cond, M and limit are inputs."""
    loop_body = body("body", [helper.make_node("Add", ["v", "v"], ["v2"]),
                              helper.make_node("ReduceSum", ["v2"], ["s"], keepdims=0),
                              helper.make_node("Less", ["s", "limit"], ["cond_out"])],
                     [ITER, COND, ("v", np.float32, [3])],
                     [("cond_out", np.bool_, []), ("v2", np.float32, [3])])
    m = model([helper.make_node("Loop", ["M", "c", "x"], ["y"], body=loop_body)],
              {"x": (np.float32, [3]), "M": (np.int64, []), "c": (np.bool_, []),
               "limit": (np.float32, [])}, {"y": (np.float32, [3])})
    compiled = None
    x = np.array([1, 2, 3], dtype=np.float32)
    for trips, c, limit in [(10, True, 100.0), (3, True, 1e9), (10, False, 100.0), (0, True, 5.0),
                            (-2, True, 5.0), (50, True, 7.0)]:
        compiled = assert_matches_ort(m, {"x": x, "M": np.array(trips), "c": np.array(c),
                                          "limit": np.array(limit, dtype=np.float32)},
                                      compiled=compiled)


def test_loop_with_run_time_trip_count_and_no_condition() -> None:
    """Two carried values (a float tensor and an int counter); the body uses an outer value
    and the iteration number."""
    loop_body = body("body", [helper.make_node("Cast", ["i"], ["fi"], to=TP.FLOAT),
                              helper.make_node("Mul", ["w", "fi"], ["step"]),
                              helper.make_node("Add", ["v", "step"], ["v_out"]),
                              helper.make_node("Add", ["k", "i"], ["k_out"]),
                              helper.make_node("Identity", ["cond_in"], ["cond_out"])],
                     [ITER, COND, ("v", np.float32, ["n"]), ("k", np.int64, [])],
                     [("cond_out", np.bool_, []), ("v_out", np.float32, ["n"]), ("k_out", np.int64, [])])
    m = model([helper.make_node("Sin", ["x"], ["w"]),
               helper.make_node("Loop", ["M", "", "x", "zero"], ["y", "k"], body=loop_body)],
              {"x": (np.float32, ["n"]), "M": (np.int64, [])},
              {"y": (np.float32, ["n"]), "k": (np.int64, [])}, {"zero": np.array(0, dtype=np.int64)})
    compiled = None
    for trips, n in [(0, 4), (1, 4), (6, 9)]:
        compiled = assert_matches_ort(m, {"x": floats(n), "M": np.array(trips)}, compiled=compiled)


def test_loop_over_the_rows_of_a_symbolic_dim() -> None:
    """M = Shape(x)[0]: the trip count (and the scan output's length) is the symbolic dim n;
    the body gathers row i at run time and keeps a running sum."""
    loop_body = body("body", [helper.make_node("Gather", ["x", "i"], ["r"], axis=0),
                              helper.make_node("Add", ["acc", "r"], ["acc_out"]),
                              helper.make_node("Mul", ["acc_out", "r"], ["prod"]),
                              helper.make_node("Identity", ["cond_in"], ["cond_out"])],
                     [ITER, COND, ("acc", np.float32, [3])],
                     [("cond_out", np.bool_, []), ("acc_out", np.float32, [3]),
                      ("prod", np.float32, [3])])
    m = model([helper.make_node("Shape", ["x"], ["s"]),
               helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
               helper.make_node("Loop", ["n", "yes", "init"], ["sum", "prods"], body=loop_body)],
              {"x": (np.float32, ["rows", 3])},
              {"sum": (np.float32, [3]), "prods": (np.float32, ["rows", 3])},
              {"zero": np.array(0, dtype=np.int64), "yes": np.array(True), "init": floats(3)})
    compiled = None
    for rows in (1, 4, 11):
        compiled = assert_matches_ort(m, {"x": floats(rows, 3)}, compiled=compiled)
    assert compiled.outputs[1].shape == ("rows", 3)


def test_run_time_if_inside_a_loop_body() -> None:
    """Even iterations add x, odd ones multiply by 0.5: the If's condition comes from the
    iteration number; the branches read the body's carried value and the graph's input."""
    even = body("even", [helper.make_node("Add", ["v", "x"], ["e"])], [], [("e", np.float32, [2, 2])])
    odd = body("odd", [helper.make_node("Mul", ["v", "half"], ["o"])], [], [("o", np.float32, [2, 2])])
    loop_body = body("body", [helper.make_node("Mod", ["i", "two"], ["r"]),
                              helper.make_node("Equal", ["r", "zero"], ["is_even"]),
                              helper.make_node("If", ["is_even"], ["v_out"], then_branch=even,
                                               else_branch=odd),
                              helper.make_node("Identity", ["cond_in"], ["cond_out"])],
                     [ITER, COND, ("v", np.float32, [2, 2])],
                     [("cond_out", np.bool_, []), ("v_out", np.float32, [2, 2])])
    m = model([helper.make_node("Loop", ["M", "", "x"], ["y"], body=loop_body)],
              {"x": (np.float32, [2, 2]), "M": (np.int64, [])}, {"y": (np.float32, [2, 2])},
              {"two": np.array(2, dtype=np.int64), "zero": np.array(0, dtype=np.int64),
               "half": np.array(0.5, dtype=np.float32)})
    compiled = None
    for trips in (0, 1, 2, 7):
        compiled = assert_matches_ort(m, {"x": floats(2, 2), "M": np.array(trips)}, compiled=compiled)


def test_loops_running_zero_or_more_times_with_a_passed_through_value() -> None:
    """The body returns one carried value unchanged (its input name as output); M = 0 gives
    the initial values and empty scan outputs."""
    through = body("body", [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                            helper.make_node("Neg", ["v"], ["v_out"]),
                            helper.make_node("Identity", ["v"], ["row"])],
                   [ITER, COND, ("v", np.float32, [2]), ("p", np.float32, [3])],
                   [("cond_out", np.bool_, []), ("v_out", np.float32, [2]), ("p", np.float32, [3]),
                    ("row", np.float32, [2])])
    m = model([helper.make_node("Loop", ["zero", "", "x", "q"], ["y0", "p0", "rows0"], body=through),
               helper.make_node("Loop", ["three", "", "x", "q"], ["y3", "p3", "rows3"], body=through)],
              {"x": (np.float32, [2]), "q": (np.float32, [3])},
              {"y0": (np.float32, [2]), "p0": (np.float32, [3]), "rows0": (np.float32, [0, 2]),
               "y3": (np.float32, [2]), "p3": (np.float32, [3]), "rows3": (np.float32, [3, 2])},
              {"zero": np.array(0, dtype=np.int64), "three": np.array(3, dtype=np.int64)})
    assert_matches_ort(m, {"x": floats(2), "q": floats(3)})


def test_loop_inside_a_run_time_branch() -> None:
    """The then-branch runs a loop (its scratch nested in the If's); the else-branch is one op."""
    loop_body = body("body", [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                              helper.make_node("MatMul", ["v", "w"], ["mm"]),
                              helper.make_node("Tanh", ["mm"], ["v_out"]),
                              helper.make_node("ReduceMax", ["v_out"], ["row"], axes=[1], keepdims=0)],
                     [ITER, COND, ("v", np.float32, ["n", 3])],
                     [("cond_out", np.bool_, []), ("v_out", np.float32, ["n", 3]),
                      ("row", np.float32, ["n"])])
    then = body("then", [helper.make_node("Loop", ["four", "", "x"], ["t", "rows"], body=loop_body),
                         helper.make_node("ReduceMax", ["rows"], ["r"], axes=[0], keepdims=0)],
                [], [("t", np.float32, ["n", 3]), ("r", np.float32, ["n"])])
    other = body("else", [helper.make_node("Neg", ["x"], ["t"]),
                          helper.make_node("ReduceMin", ["x"], ["r"], axes=[1], keepdims=0)],
                 [], [("t", np.float32, ["n", 3]), ("r", np.float32, ["n"])])
    m = model([helper.make_node("If", ["c"], ["a", "b"], then_branch=then, else_branch=other)],
              {"c": (np.bool_, []), "x": (np.float32, ["n", 3])},
              {"a": (np.float32, ["n", 3]), "b": (np.float32, ["n"])},
              {"four": np.array(4, dtype=np.int64), "w": floats(3, 3)})
    compiled = None
    for n, c in [(2, True), (2, False), (6, True)]:
        compiled = assert_matches_ort(m, {"c": np.array(c), "x": floats(n, 3)}, compiled=compiled)


SLICE_BODY = body("body", [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                           helper.make_node("Add", ["i", "one"], ["end"]),
                           helper.make_node("Unsqueeze", ["i", "axes"], ["start1"]),
                           helper.make_node("Unsqueeze", ["end", "axes"], ["end1"]),
                           helper.make_node("Slice", ["table", "start1", "end1"], ["item"]),
                           helper.make_node("Add", ["y", "item"], ["y_out"]),
                           helper.make_node("Identity", ["y_out"], ["row"])],
                  [ITER, COND, ("y", np.float32, [1])],
                  [("cond_out", np.bool_, []), ("y_out", np.float32, [1]), ("row", np.float32, [1])])


def test_loop_whose_body_needs_constant_iteration_numbers_is_unrolled() -> None:
    """Slice by the iteration number needs it at compile time (the shape of a Slice follows
    from its starts): with a known trip count the loop is unrolled, as test_loop11 needs."""
    m = model([helper.make_node("Loop", ["M", "c", "y"], ["y_final", "rows"], body=SLICE_BODY)],
              {"y": (np.float32, [1])}, {"y_final": (np.float32, [1]), "rows": (np.float32, [4, 1])},
              {"M": np.array(4, dtype=np.int64), "c": np.array(True),
               "table": floats(6), "one": np.array(1, dtype=np.int64),
               "axes": np.array([0], dtype=np.int64)})
    assert "Loop" not in op_types(m)
    compiled = None
    for _ in range(2):
        compiled = assert_matches_ort(m, {"y": floats(1)}, compiled=compiled)


def test_loop_that_cannot_be_compiled_nor_unrolled_says_why() -> None:
    m = model([helper.make_node("Loop", ["M", "c", "y"], ["y_final", "rows"], body=SLICE_BODY,
                                name="walk")],
              {"y": (np.float32, [1]), "M": (np.int64, [])},
              {"y_final": (np.float32, [1]), "rows": (np.float32, ["k", 1])},
              {"c": np.array(True), "table": floats(6), "one": np.array(1, dtype=np.int64),
               "axes": np.array([0], dtype=np.int64)})
    with pytest.raises(UnsupportedOpError, match=r"Slice.*known at compile time"):
        cuvil.compile(m)


def _growing(trips: Any) -> onnx.ModelProto:
    grow = body("body", [helper.make_node("Concat", ["v", "x"], ["v_out"], axis=0),
                         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
                [ITER, COND, ("v", np.float32, ["k"])],
                [("cond_out", np.bool_, []), ("v_out", np.float32, ["k"])])
    inputs: dict[str, Any] = {"x": (np.float32, [2])}
    inits: dict[str, Any] = {}
    if trips is None:
        inputs["M"] = (np.int64, [])
    else:
        inits["M"] = np.array(trips, dtype=np.int64)
    return model([helper.make_node("Loop", ["M", "", "x"], ["y"], body=grow, name="grow")],
                 inputs, {"y": (np.float32, ["k"])}, inits)


def test_loop_carried_value_that_grows() -> None:
    """Concat onto a carried value changes its shape every iteration: unrolled with a known
    trip count, unsupported (with the reason) otherwise."""
    assert_matches_ort(_growing(3), {"x": floats(2)})
    with pytest.raises(UnsupportedOpError, match=r"'grow' \(Loop\).*carried value 0 .*float32\[2\].*"
                                                 r"float32\[4\]"):
        cuvil.compile(_growing(None))


def test_scan_outputs_of_a_run_time_trip_count_are_unsupported() -> None:
    loop_body = body("body", [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                              helper.make_node("Neg", ["v"], ["v_out"]),
                              helper.make_node("Identity", ["v"], ["row"])],
                     [ITER, COND, ("v", np.float32, [2])],
                     [("cond_out", np.bool_, []), ("v_out", np.float32, [2]), ("row", np.float32, [2])])
    m = model([helper.make_node("Loop", ["M", "", "x"], ["y", "rows"], body=loop_body, name="lp")],
              {"x": (np.float32, [2]), "M": (np.int64, [])},
              {"y": (np.float32, [2]), "rows": (np.float32, ["k", 2])})
    with pytest.raises(UnsupportedOpError, match=r"'lp' \(Loop\).*scan outputs.*trip count M"):
        cuvil.compile(m)


def test_scan_outputs_of_a_data_dependent_loop_are_unsupported() -> None:
    loop_body = body("body", [helper.make_node("ReduceSum", ["v"], ["s"], keepdims=0),
                              helper.make_node("Less", ["s", "limit"], ["cond_out"]),
                              helper.make_node("Add", ["v", "v"], ["v_out"]),
                              helper.make_node("Identity", ["v"], ["row"])],
                     [ITER, COND, ("v", np.float32, [2])],
                     [("cond_out", np.bool_, []), ("v_out", np.float32, [2]), ("row", np.float32, [2])])
    m = model([helper.make_node("Loop", ["M", "", "x"], ["y", "rows"], body=loop_body, name="lp")],
              {"x": (np.float32, [2])}, {"y": (np.float32, [2]), "rows": (np.float32, ["k", 2])},
              {"M": np.array(100, dtype=np.int64), "limit": np.array(1e3, dtype=np.float32)})
    with pytest.raises(UnsupportedOpError, match=r"'lp' \(Loop\).*condition.*computed at run time"):
        cuvil.compile(m)


# -- Scan -------------------------------------------------------------------------------------


def test_scan_axes_and_directions() -> None:
    """Two scan inputs (axis 0 forward, axis 1 backward), a state, and two scan outputs
    (axis 0 backward, axis 1 forward), over a symbolic length."""
    scan_body = body("body", [helper.make_node("Add", ["s", "a"], ["t"]),
                              helper.make_node("Mul", ["t", "b"], ["s_out"]),
                              helper.make_node("Tanh", ["s_out"], ["o1"]),
                              helper.make_node("Sub", ["a", "b"], ["o2"])],
                     [("s", np.float32, [3]), ("a", np.float32, [3]), ("b", np.float32, [3])],
                     [("s_out", np.float32, [3]), ("o1", np.float32, [3]), ("o2", np.float32, [3])])
    m = model([helper.make_node("Scan", ["s0", "xa", "xb"], ["s_final", "y1", "y2"], body=scan_body,
                                num_scan_inputs=2, scan_input_axes=[0, 1],
                                scan_input_directions=[0, 1], scan_output_axes=[0, -1],
                                scan_output_directions=[1, 0])],
              {"s0": (np.float32, [3]), "xa": (np.float32, ["L", 3]), "xb": (np.float32, [3, "L"])},
              {"s_final": (np.float32, [3]), "y1": (np.float32, ["L", 3]), "y2": (np.float32, [3, "L"])})
    compiled = None
    for length in (1, 5):
        compiled = assert_matches_ort(m, {"s0": floats(3), "xa": floats(length, 3),
                                          "xb": floats(3, length)}, compiled=compiled)


def test_scan8_with_a_batch_axis() -> None:
    scan_body = body("body", [helper.make_node("Add", ["s", "a"], ["s_out"]),
                              helper.make_node("Mul", ["s_out", "a"], ["o"])],
                     [("s", np.float32, [2]), ("a", np.float32, [2])],
                     [("s_out", np.float32, [2]), ("o", np.float32, [2])])
    m = model([helper.make_node("Scan", ["", "s0", "x"], ["s_final", "y"], body=scan_body,
                                num_scan_inputs=1, directions=[1])],
              {"s0": (np.float32, ["B", 2]), "x": (np.float32, ["B", 4, 2])},
              {"s_final": (np.float32, ["B", 2]), "y": (np.float32, ["B", 4, 2])}, opset=8)
    compiled = None
    for batch in (1, 3):
        compiled = assert_matches_ort(m, {"s0": floats(batch, 2), "x": floats(batch, 4, 2)},
                                      compiled=compiled)


def test_scan_state_that_changes_shape_is_unsupported() -> None:
    scan_body = body("body", [helper.make_node("Concat", ["s", "a"], ["s_out"], axis=0),
                              helper.make_node("Identity", ["a"], ["o"])],
                     [("s", np.float32, ["k"]), ("a", np.float32, [2])],
                     [("s_out", np.float32, ["k2"]), ("o", np.float32, [2])])
    m = model([helper.make_node("Scan", ["s0", "x"], ["s_final", "y"], body=scan_body,
                                num_scan_inputs=1, name="sc")],
              {"s0": (np.float32, [2]), "x": (np.float32, [3, 2])},
              {"s_final": (np.float32, ["k"]), "y": (np.float32, [3, 2])}, strict=False)
    with pytest.raises(ModelError, match=r"'sc' \(Scan\).*state 0"):
        cuvil.compile(m)


# -- the ONNX backend node tests --------------------------------------------------------------

#: onnx's node test modules whose cases use If, Loop or Scan (directly or in _expanded form)
MODULES = ("if_", "loop", "scan", "rangeop", "affinegrid")
#: graph inputs bound to their test value, as an exporter writes constants (the conformance
#: suite's rule: inputs that decide output shapes): Range's and AffineGrid's (for their
#: _expanded forms, which compute the shape inside a Loop or from the size), Loop's M and cond
BIND = {"range": ("start", "limit", "delta"), "affine_grid": ("size",)}


def _backend_cases() -> list[Any]:
    """The cases of `MODULES` (and LinearAttention's) using If, Loop or Scan, without
    importing every other op's generators (importing a module registers its cases)."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in (*MODULES, "linear_attention"):
            importlib.import_module(f"onnx.backend.test.case.node.{module}")
    return [c for c in node._NodeTestCases
            if any(n.op_type in ("If", "Loop", "Scan") for n in c.model.graph.node)]


def _in_scope(case: Any) -> bool:
    """Sequence, optional and bfloat16 cases are outside what a cuvil library exchanges."""
    from conformance import scope

    return scope.classify(case.model, case.name) is None


def _check(case: Any) -> None:
    from cuvil.onnx_backend import CuvilBackend

    g = case.model.graph
    inits = {i.name for i in g.initializer}
    names = [v.name for v in g.input if v.name not in inits]
    bind_names = {n for key, ns in BIND.items() if key in case.name for n in ns}
    for n in g.node:
        if n.op_type == "Loop":
            bind_names.update(n.input[:2])
    for ins, outs in case.data_sets:
        feeds = dict(zip(names, ins))
        bind = {n: feeds.pop(n) for n in list(feeds) if n in bind_names}
        rep = CuvilBackend.prepare(case.model, "CPU", bind=bind or None)
        for got, want in zip(rep.run(feeds), outs):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol)


ALL_CASES = [c for c in _backend_cases() if _in_scope(c)]
BACKEND = [c for c in ALL_CASES if not c.name.startswith("test_linear_attention")]
LINEAR_ATTENTION = [c for c in ALL_CASES if c.name.startswith("test_linear_attention")]


def test_backend_cases_found() -> None:
    names = {c.name for c in BACKEND}
    assert {"test_if", "test_loop11", "test_scan_sum", "test_scan9_sum",
            "test_range_float_type_positive_delta_expanded"} <= names
    assert not any(re.search(r"seq|opt", n) for n in names)
    assert len(LINEAR_ATTENTION) >= 13


@pytest.mark.parametrize("case", BACKEND, ids=lambda c: c.name)
def test_backend_node_case(case: Any) -> None:
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", LINEAR_ATTENTION, ids=lambda c: c.name)
def test_backend_linear_attention_expanded(case: Any) -> None:
    """LinearAttention's expanded form: a Scan over the sequence with matrix states."""
    _check(case)
