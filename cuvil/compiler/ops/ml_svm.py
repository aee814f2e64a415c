"""ai.onnx.ml support vector machines: SVMClassifier and SVMRegressor, as libsvm-based
converters (skl2onnx) write them and onnxruntime runs them.

Both compile as graphs of standard ops (`_ml_graph`): the kernel values of a batch against
all support vectors are one GEMM (RBF as |x|^2 - 2 x.sv + |sv|^2 after centring both on the
support vectors' mean), computed in float64 up to the decision values because float32 sums
over hundreds of support vectors lose ~1e-5 (onnxruntime's own error is of that size), and
what libsvm does per pair of classes is folded at compile time into constant matrices: the
pairwise decision values are one more GEMM, the votes a third. Probability estimates follow onnxruntime:
Platt's sigmoid per pair, clipped to [1e-7, 1 - 1e-7], then libsvm's pairwise coupling, an
iterative solve of at most 100 sweeps that stops per row once its error is below
0.005 / classes, compiled as a Loop whose rows freeze when they converge.

onnxruntime's conventions that the spec leaves open, followed here: the label of an SVC is
the class with most votes (first on ties), with or without probabilities; a binary SVC
without probabilities returns [-s, s] (post_transform NONE); without `vectors_per_class`
the model is linear (coefficients [classes, features], rho[0] added to every class).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from cuvil.compiler.ir import Node
from cuvil.compiler.ops import register
from cuvil.compiler.ops._ml_graph import (
    Body,
    Expanded,
    floats,
    ints,
    matrix_input,
    no_string_labels,
    post_transform,
    rows_2d,
    text,
)
from cuvil.errors import ModelError, UnsupportedOpError

KERNELS = ("LINEAR", "POLY", "RBF", "SIGMOID")
#: libsvm's coupling: sweeps at most, and the error (times classes) at which a row stops
COUPLING_SWEEPS = 100
COUPLING_EPS = 0.005


def _kernel_params(node: Node) -> tuple[str, float, float, float]:
    kernel = text(node, "kernel_type", "LINEAR")
    if kernel not in KERNELS:
        raise ModelError(f"{node.describe()}: kernel_type {kernel!r} is not one of "
                         f"{', '.join(KERNELS)}")
    params = floats(node, "kernel_params")
    if params and len(params) != 3:
        raise ModelError(f"{node.describe()}: kernel_params must be [gamma, coef0, degree], got "
                         f"{len(params)} values")
    gamma, coef0, degree = params or [0.0, 0.0, 0.0]
    return kernel, gamma, coef0, degree


def _support_vectors(node: Node, features: int, count: int) -> np.ndarray:
    sv = np.asarray(floats(node, "support_vectors"), np.float32)
    if sv.size != count * features:
        raise ModelError(f"{node.describe()}: {sv.size} support_vectors values are not {count} "
                         f"vectors of {features} features")
    return sv.reshape(count, features)


def _kernel(b: Body, x: str, sv: np.ndarray, kernel: str, gamma: float, coef0: float,
            degree: float) -> str:
    """[N, vectors] float64: the kernel of each row of x (float64) with each support vector."""
    f64 = np.float64
    sv = sv.astype(f64)
    if kernel == "RBF":
        centre = sv.mean(axis=0)
        svc = sv - centre
        xc = b.op("Sub", x, b.const(centre, f64))
        x2 = b.op("ReduceSum", b.op("Mul", xc, xc), b.const([1], np.int64), keepdims=1)
        cross = b.op("Gemm", xc, b.const(svc, f64), b.const((svc ** 2).sum(axis=1), f64),
                     alpha=-2.0, transB=1)
        dist = b.op("Max", b.op("Add", cross, x2), b.const(0.0, f64))
        return b.op("Exp", b.op("Mul", dist, b.const(-gamma, f64)))
    if kernel == "LINEAR":
        return b.op("Gemm", x, b.const(sv, f64), transB=1)
    dot = b.op("Gemm", x, b.const(sv, f64), b.const(coef0, f64), alpha=gamma, transB=1)
    if kernel == "SIGMOID":
        return b.op("Tanh", dot)
    if degree == int(degree) and 1 <= degree <= 4:
        out = dot
        for _ in range(int(degree) - 1):
            out = b.op("Mul", out, dot)
        return out
    return b.op("Pow", dot, b.const(degree, f64))


def _pairs(classes: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(classes) for j in range(i + 1, classes)]


def _coupling(b: Body, pair_probs: str, classes: int) -> str:
    """libsvm's multiclass_probability as onnxruntime runs it, for every row at once:
    pair_probs [N, pairs] (P(class i | i or j) for i < j) -> probabilities [N, classes]."""
    pairs = _pairs(classes)
    k = classes
    # r[n, i, j] = P(i | i or j), r[n, j, i] = 1 - that, r[n, i, i] = 0; as matrices of 0/1
    to_upper = np.zeros((len(pairs), k * k), np.float32)
    to_lower = np.zeros((len(pairs), k * k), np.float32)
    for p, (i, j) in enumerate(pairs):
        to_upper[p, i * k + j] = 1.0
        to_lower[p, j * k + i] = 1.0
    rest = b.op("Sub", b.const(1.0), pair_probs)
    r_flat = b.op("Add", b.op("MatMul", pair_probs, b.const(to_upper)),
                  b.op("MatMul", rest, b.const(to_lower)))
    r = b.op("Reshape", r_flat, b.const([-1, k, k], np.int64))
    rt = b.op("Transpose", r, perm=[0, 2, 1])
    # Q[i, j] = -r[j, i] r[i, j] off the diagonal, Q[i, i] = sum_j r[j, i]^2
    diag = b.op("ReduceSum", b.op("Mul", r, r), b.const([1], np.int64), keepdims=0)
    eye = np.eye(k, dtype=np.float32)
    q = b.op("Sub", b.op("Mul", b.op("Unsqueeze", diag, b.const([1], np.int64)), b.const(eye)),
             b.op("Mul", rt, r))
    rows = b.op("Shape", diag, start=0, end=1)
    p0 = b.op("Expand", b.const(np.full((1, k), 1.0 / k, np.float32)),
              b.op("Concat", rows, b.const([k], np.int64), axis=0))
    active0 = b.op("Expand", b.const([[True]], np.bool_),
                   b.op("Concat", rows, b.const([1], np.int64), axis=0))
    loop = b.outputs("Loop", 2, b.const(COUPLING_SWEEPS, np.int64), b.const(True, np.bool_), p0,
                     active0, body=_sweep(b.node, k, q, diag))
    return loop[0]


def _sweep(node: Node, k: int, q: str, diag: str) -> onnx.GraphProto:
    """The Loop body: one Gauss-Seidel sweep of libsvm's coupling over the rows still active;
    a row whose error is below eps stops (and stays stopped) as in libsvm's `break`."""
    s = Body(node, prefix="sweep")
    op, const = s.op, s.const

    def column(t: str, i: int) -> str:
        return op("Gather", t, const([i], np.int64), axis=1)

    p_in, active_in = "sweep_p", "sweep_active"
    qp = op("Squeeze", op("MatMul", q, op("Unsqueeze", p_in, const([2], np.int64))),
            const([2], np.int64))
    pqp = op("ReduceSum", op("Mul", p_in, qp), const([1], np.int64), keepdims=1)
    error = op("ReduceMax", op("Abs", op("Sub", qp, pqp)), axes=[1], keepdims=1)
    active = op("And", active_in, op("Not", op("Less", error, const(COUPLING_EPS / k))))
    p = p_in
    for i in range(k):
        qii, qp_i = column(diag, i), column(qp, i)
        delta = op("Div", op("Sub", pqp, qp_i), qii)
        one_hot = const(np.eye(k, dtype=np.float32)[i:i + 1])
        p = op("Add", p, op("Mul", delta, one_hot))
        grow = op("Add", const(1.0), delta)
        pqp = op("Div", op("Div", op("Add", pqp, op("Mul", delta, op(
            "Add", op("Mul", delta, qii), op("Mul", const(2.0), qp_i)))), grow), grow)
        q_row = op("Squeeze", op("Gather", q, const([i], np.int64), axis=1), const([1], np.int64))
        qp = op("Div", op("Add", qp, op("Mul", delta, q_row)), grow)
        p = op("Div", p, grow)
    p_out = op("Where", active, p, p_in)
    go_on = op("Cast", op("ReduceMax", op("Cast", active, to=onnx.TensorProto.INT32),
                          keepdims=0), to=onnx.TensorProto.BOOL)
    outs = [op("Identity", go_on), op("Identity", p_out), op("Identity", active)]
    f32, b8 = onnx.TensorProto.FLOAT, onnx.TensorProto.BOOL
    return helper.make_graph(
        s.nodes, "svm_coupling_sweep",
        [helper.make_tensor_value_info("sweep_i", onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info("sweep_cond", b8, []),
         helper.make_tensor_value_info(p_in, f32, None),
         helper.make_tensor_value_info(active_in, b8, None)],
        [helper.make_tensor_value_info(outs[0], b8, []),
         helper.make_tensor_value_info(outs[1], f32, None),
         helper.make_tensor_value_info(outs[2], b8, None)])


@register
class SVMClassifier(Expanded):
    op_type = "SVMClassifier"

    def expand(self, node: Node) -> onnx.FunctionProto:
        no_string_labels(node)
        features, _ = matrix_input(node)
        labels = ints(node, "classlabels_ints")
        classes = len(labels)
        if classes < 2:
            raise ModelError(f"{node.describe()}: classlabels_ints names {classes} classes; an "
                             "SVMClassifier needs at least two")
        kernel, gamma, coef0, degree = _kernel_params(node)
        how = text(node, "post_transform", "NONE")
        if how == "PROBIT":
            raise UnsupportedOpError(f"{node.describe()}: post_transform 'PROBIT' is not "
                                     "compiled by cuvil")
        coef = np.asarray(floats(node, "coefficients"), np.float32)
        rho = np.asarray(floats(node, "rho"), np.float32)
        prob_a, prob_b = floats(node, "prob_a"), floats(node, "prob_b")
        if len(prob_a) != len(prob_b):
            raise ModelError(f"{node.describe()}: {len(prob_a)} prob_a but {len(prob_b)} prob_b")
        per_class = ints(node, "vectors_per_class")
        b = Body(node)
        x = rows_2d(b, b.as_float(0), node)
        label_table = b.const(labels, np.int64)
        if not per_class:
            return self._linear(node, b, x, coef, rho, features, labels, how, bool(prob_a))
        if len(per_class) != classes:
            raise ModelError(f"{node.describe()}: vectors_per_class has {len(per_class)} entries "
                             f"for {classes} classes")
        vectors = sum(per_class)
        pairs = _pairs(classes)
        if coef.size != (classes - 1) * vectors or rho.size != len(pairs) or (
                prob_a and len(prob_a) != len(pairs)):
            raise ModelError(f"{node.describe()}: expected {(classes - 1) * vectors} coefficients "
                             f"and {len(pairs)} rho (and prob_a/prob_b, if given), one per pair "
                             f"of classes; got {coef.size} and {rho.size}")
        coef = coef.reshape(classes - 1, vectors)
        start = np.concatenate([[0], np.cumsum(per_class)])
        # decision value of pair (i, j): class i's vectors weighted by coefficient row j - 1,
        # class j's by row i (libsvm's layout), plus rho
        pair_weights = np.zeros((vectors, len(pairs)), np.float32)
        for p, (i, j) in enumerate(pairs):
            pair_weights[start[i]:start[i + 1], p] = coef[j - 1, start[i]:start[i + 1]]
            pair_weights[start[j]:start[j + 1], p] = coef[i, start[j]:start[j + 1]]
        k = _kernel(b, b.cast(x, np.float64), _support_vectors(node, features, vectors), kernel,
                    gamma, coef0, degree)
        decision = b.cast(b.op("Gemm", k, b.const(pair_weights, np.float64),
                               b.const(rho, np.float64)), np.float32)
        # a vote for i where the value is > 0, for j otherwise: votes = wins @ (I - J) + J's sums
        for_i = np.zeros((len(pairs), classes), np.float32)
        for_j = np.zeros((len(pairs), classes), np.float32)
        for p, (i, j) in enumerate(pairs):
            for_i[p, i], for_j[p, j] = 1.0, 1.0
        wins = b.cast(b.op("Greater", decision, b.const(0.0)), np.float32)
        votes = b.op("Gemm", wins, b.const(for_i - for_j), b.const(for_j.sum(axis=0)))
        label = b.op("Gather", label_table, b.op("ArgMax", votes, axis=1, keepdims=0), axis=0)
        if prob_a:
            val = b.op("Add", b.op("Mul", decision, b.const(prob_a)), b.const(prob_b))
            pair_probs = b.op("Clip", b.op("Sigmoid", b.op("Neg", val)), b.const(1e-7),
                              b.const(1 - 1e-7))
            return b.finish(label, post_transform(b, _coupling(b, pair_probs, classes), how))
        if classes == 2:  # onnxruntime adds the other class: [-s, s], or [1 - s, s] otherwise
            other = b.op("Neg", decision) if how == "NONE" else b.op("Sub", b.const(1.0), decision)
            return b.finish(label, b.op("Concat", other, decision, axis=1))
        return b.finish(label, post_transform(b, decision, how))

    @staticmethod
    def _linear(node: Node, b: Body, x: str, coef: np.ndarray, rho: np.ndarray, features: int,
                labels: list[int], how: str, have_proba: bool) -> onnx.FunctionProto:
        """No support vectors (liblinear's layout): scores = x @ coef.T + rho[0]."""
        classes = len(labels)
        if coef.size != classes * features or rho.size < 1:
            raise ModelError(f"{node.describe()}: a linear SVMClassifier needs {classes} x "
                             f"{features} coefficients and a rho; got {coef.size} and {rho.size}")
        scores = b.op("Gemm", x, b.const(coef.reshape(classes, features)), b.const(rho[0]),
                      transB=1)
        best = b.op("ArgMax", scores, axis=1, keepdims=0)
        label = b.op("Gather", b.const(labels, np.int64), best, axis=0)
        if classes == 2 and not have_proba:
            # onnxruntime: the second label when the top score is >= 0.5 (all coefficients
            # >= 0) or > 0 (some negative), else the arg max
            top = b.op("ReduceMax", scores, axes=[1], keepdims=0)
            cut = b.const(0.5 if bool((coef >= 0).all()) else 0.0)
            above = b.op("GreaterOrEqual" if bool((coef >= 0).all()) else "Greater", top, cut)
            label = b.op("Where", above, b.const(labels[1], np.int64), label)
        return b.finish(label, post_transform(b, scores, how))


@register
class SVMRegressor(Expanded):
    """One output column: sum of coefficient x kernel over the support vectors plus rho[0]
    (or x @ coefficients + rho[0] with n_supports 0); a one-class SVM gives 1 / -1 by sign."""

    op_type = "SVMRegressor"

    def expand(self, node: Node) -> onnx.FunctionProto:
        features, _ = matrix_input(node)
        kernel, gamma, coef0, degree = _kernel_params(node)
        vectors = int(node.attrs.get("n_supports", 0))
        coef = np.asarray(floats(node, "coefficients"), np.float32)
        rho = floats(node, "rho")
        if not rho:
            raise ModelError(f"{node.describe()}: rho is required")
        b = Body(node)
        x = rows_2d(b, b.as_float(0), node)
        if vectors > 0:
            if coef.size != vectors:
                raise ModelError(f"{node.describe()}: {coef.size} coefficients for n_supports "
                                 f"{vectors}")
            k = _kernel(b, b.cast(x, np.float64), _support_vectors(node, features, vectors),
                        kernel, gamma, coef0, degree)
            y = b.cast(b.op("Gemm", k, b.const(coef.reshape(vectors, 1), np.float64),
                            b.const(rho[:1], np.float64)), np.float32)
        else:
            if coef.size != features:
                raise ModelError(f"{node.describe()}: a linear SVMRegressor needs {features} "
                                 f"coefficients, got {coef.size}")
            y = b.op("Gemm", x, b.const(coef.reshape(features, 1)), b.const(rho[:1]))
        if int(node.attrs.get("one_class", 0)):
            y = b.op("Where", b.op("Greater", y, b.const(0.0)), b.const(1.0), b.const(-1.0))
        return b.finish(y)

