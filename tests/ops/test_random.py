"""RandomNormal, RandomUniform, their *Like forms, Bernoulli and Multinomial.

Random draws have no oracle value by value: shapes and dtypes are checked against onnxruntime
(onnx's type inference where onnxruntime has no kernel: float16 draws, float64 Multinomial);
values by their distribution (mean, standard deviation and a Kolmogorov-Smirnov test against
the exact distribution; Bernoulli rates; Multinomial frequencies against the softmax of the
input), with bounds that a correct generator fails with a probability below 1e-6 and that a
wrong mean, scale, range or distribution fails for sure at these sample sizes. Noise scaled
by 0 (a constant, or an input fed 0, as text-to-speech models scale their noise) matches
onnxruntime exactly. A seeded node repeats its values at every call and on any number of
threads (onnx's reference evaluator's semantics); unseeded nodes draw anew at every call, also
from several Python threads at once, and identical unseeded nodes are neither folded nor merged.
onnx's Bernoulli node cases hold numpy's draws: they are checked by shape and dtype.
"""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from batch_oracle import backend_cases, check_backend_cases
from onnx import TensorProto, helper
from oracle import make_model, run_ort
from scipy import stats

import cuvil
from cuvil.compiler.frontend import import_model
from cuvil.compiler.passes import run_passes
from cuvil.errors import ModelError, UnsupportedOpError

#: p-values below this fail a Kolmogorov-Smirnov test; `_SIGMAS` standard errors a moment
_P_MIN = 1e-6
_SIGMAS = 6.0
RANDOM_OPS = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
              "Bernoulli", "Multinomial"}

N, M = 4, 25000  # x: [n, 1000] fed as N x 1000; Bernoulli's p: [5, m] fed as 5 x M
PROBS = np.array([0.0, 0.1, 0.5, 0.97, 1.0])
LOGITS = np.array([[0, 1, 2, 3, -2, 0.5], [-40, 0, 0, -40, 0, 2], [0, 0, 0, 0, 0, 0]],
                  np.float32)
SEEDED = ("normal_seeded", "uniform_seeded", "uniform_like_seeded", "bernoulli_seeded",
          "multinomial_seeded")
UNSEEDED = ("normal", "uniform", "normal_like", "bernoulli", "multinomial", "twin_a", "twin_b",
            "like_const")


def _node(op, inputs, output, **attrs):
    return helper.make_node(op, inputs, [output], name=output, **attrs)


def ort_model() -> onnx.ModelProto:
    """Every op, in dtypes onnxruntime has kernels for."""
    f, d = TensorProto.FLOAT, TensorProto.DOUBLE
    nodes = [
        _node("RandomNormal", [], "normal", shape=[200, 500], mean=2.0, scale=3.0),
        _node("RandomNormal", [], "normal_seeded", shape=[100000], dtype=d, mean=-1.0,
              scale=0.5, seed=7.0),
        _node("RandomUniform", [], "uniform", shape=[100000], low=-2.0, high=3.0),
        _node("RandomUniform", [], "uniform_seeded", shape=[50, 2000], dtype=d, low=10.0,
              high=10.5, seed=1.5),
        _node("RandomNormalLike", ["x"], "normal_like", mean=0.5, scale=2.0),
        _node("RandomUniformLike", ["ids"], "uniform_like_seeded", dtype=d, seed=3.0),
        _node("Bernoulli", ["p"], "bernoulli"),
        _node("Bernoulli", ["p"], "bernoulli_seeded", dtype=TensorProto.BOOL, seed=2.0),
        _node("Multinomial", ["logits"], "multinomial", sample_size=40000, dtype=TensorProto.INT64),
        _node("Multinomial", ["logits"], "multinomial_seeded", sample_size=1000, seed=4.0),
        # two identical unseeded nodes, and one output read twice
        _node("RandomNormal", [], "twin_a", shape=[1000], dtype=f),
        _node("RandomNormal", [], "twin_b", shape=[1000], dtype=f),
        _node("Neg", ["twin_a"], "twin_a_neg"),
        # an input known at compile time: still drawn at run time
        _node("RandomNormalLike", ["const"], "like_const"),
        # noise scaled by 0: a constant, and an input fed 0 (as VITS voices scale theirs)
        _node("RandomNormalLike", ["x"], "noise", seed=11.0),
        _node("Mul", ["zero", "noise"], "silenced"),
        _node("Add", ["x", "silenced"], "quiet"),
        _node("RandomNormalLike", ["x"], "noise2"),
        _node("Mul", ["noise_scale", "noise2"], "scaled_noise"),
        _node("Add", ["x", "scaled_noise"], "scaled"),
    ]
    outputs = {"normal": "float32", "normal_seeded": "float64", "uniform": "float32",
               "uniform_seeded": "float64", "normal_like": "float32",
               "uniform_like_seeded": "float64", "bernoulli": "float32",
               "bernoulli_seeded": "bool", "multinomial": "int64", "multinomial_seeded": "int32",
               "twin_a": "float32", "twin_b": "float32", "twin_a_neg": "float32",
               "like_const": "float32", "quiet": "float32", "scaled": "float32"}
    return make_model(nodes, {"x": ("float32", ["n", 1000]), "ids": ("int64", [4, 25000]),
                              "p": ("float32", [5, "m"]), "logits": ("float32", [3, 6]),
                              "noise_scale": ("float32", [])},
                      outputs, {"zero": np.float32(0), "const": np.ones(1000, np.float32)})


def half_model() -> onnx.ModelProto:
    """The dtypes onnxruntime has no random kernels for."""
    nodes = [
        _node("RandomNormal", [], "normal16", shape=[100000], dtype=TensorProto.FLOAT16,
              mean=1.0, scale=2.0),
        _node("RandomUniformLike", ["x16"], "uniform16", low=-1.0, high=1.0, seed=5.0),
        _node("Bernoulli", ["p16"], "bernoulli16"),
        _node("Multinomial", ["logits64"], "multinomial64", sample_size=40000,
              dtype=TensorProto.INT64),
    ]
    return make_model(nodes, {"x16": ("float16", [100000]), "p16": ("float16", [5, "m"]),
                              "logits64": ("float64", [3, 6])},
                      {"normal16": "float16", "uniform16": "float16", "bernoulli16": "float16",
                       "multinomial64": "int64"})


def feeds(noise_scale: float = 0.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((N, 1000)).astype(np.float32),
            "ids": np.zeros((4, 25000), np.int64),
            "p": np.repeat(PROBS[:, None], M, axis=1).astype(np.float32),
            "logits": LOGITS, "noise_scale": np.array(noise_scale, np.float32)}


def half_feeds() -> dict[str, np.ndarray]:
    return {"x16": np.zeros(100000, np.float16),
            "p16": np.repeat(PROBS[:, None], M, axis=1).astype(np.float16),
            "logits64": LOGITS.astype(np.float64)}


@pytest.fixture(scope="module")
def compiled():
    model = ort_model()
    return model, cuvil.compile(model)


@pytest.fixture(scope="module")
def compiled_half():
    model = half_model()
    return model, cuvil.compile(model)


# -- distributions ---------------------------------------------------------------------------


def assert_normal(a: np.ndarray, mean: float, std: float) -> None:
    x = a.astype(np.float64).ravel()
    assert np.isfinite(x).all()
    assert abs(x.mean() - mean) < _SIGMAS * std / np.sqrt(x.size), x.mean()
    assert abs(x.std() - std) < _SIGMAS * std / np.sqrt(2 * x.size), x.std()
    # a wrong shape of distribution with the right moments (a uniform, say) fails here
    assert stats.kstest((x - mean) / std, "norm").pvalue > _P_MIN


def assert_uniform(a: np.ndarray, low: float, high: float) -> None:
    x = a.astype(np.float64).ravel()
    assert x.min() >= low and x.max() < high, (x.min(), x.max())
    std = (high - low) / np.sqrt(12)
    assert abs(x.mean() - (low + high) / 2) < _SIGMAS * std / np.sqrt(x.size), x.mean()
    assert stats.kstest(x, "uniform", args=(low, high - low)).pvalue > _P_MIN


def assert_bernoulli(a: np.ndarray) -> None:
    """`a` drawn with the rows' probabilities PROBS."""
    assert set(np.unique(a.astype(np.float64))) <= {0.0, 1.0}
    for p, row in zip(PROBS, a.astype(np.float64)):
        rate = row.mean()
        if p in (0.0, 1.0):
            assert rate == p
        else:
            assert abs(rate - p) < _SIGMAS * np.sqrt(p * (1 - p) / row.size), (p, rate)


def assert_multinomial(a: np.ndarray) -> None:
    """Each row of `a` drawn with the probabilities softmax(LOGITS[row])."""
    assert a.min() >= 0 and a.max() < LOGITS.shape[1]
    for logits, row in zip(LOGITS.astype(np.float64), a):
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        freq = np.bincount(row, minlength=len(probs)) / row.size
        bound = _SIGMAS * np.sqrt(probs * (1 - probs) / row.size)
        assert (np.abs(freq - probs) <= bound).all(), (probs, freq)
        assert (freq[probs < 1e-12] == 0).all()


# -- the tests -------------------------------------------------------------------------------


def test_outputs_have_onnxruntimes_shapes_and_dtypes(compiled):
    model, m = compiled
    got = m.run(feeds())
    want = dict(zip([o.name for o in model.graph.output], run_ort(model, feeds())))
    for name, w in want.items():
        assert (got[name].shape, got[name].dtype) == (w.shape, w.dtype), name


def test_float16_and_float64_outputs_have_onnxs_inferred_types(compiled_half):
    model, m = compiled_half
    got = m.run(half_feeds())
    inferred = onnx.shape_inference.infer_shapes(model).graph.output
    for out in inferred:
        t = out.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        have = got[out.name]
        assert have.dtype == helper.tensor_dtype_to_np_dtype(t.elem_type), out.name
        assert len(have.shape) == len(dims), out.name
        assert all(w is None or w == h for h, w in zip(have.shape, dims)), out.name
    assert got["bernoulli16"].shape == (5, M) and got["multinomial64"].shape == (3, 40000)


def test_distributions(compiled):
    _, m = compiled
    got = m.run(feeds())
    assert_normal(got["normal"], 2.0, 3.0)
    assert_normal(got["normal_seeded"], -1.0, 0.5)
    assert_normal(got["normal_like"], 0.5, 2.0)
    assert_normal(np.concatenate([got["twin_a"], got["twin_b"], got["like_const"]]), 0.0, 1.0)
    assert_uniform(got["uniform"], -2.0, 3.0)
    assert_uniform(got["uniform_seeded"], 10.0, 10.5)
    assert_uniform(got["uniform_like_seeded"], 0.0, 1.0)
    assert_bernoulli(got["bernoulli"])
    assert_bernoulli(got["bernoulli_seeded"])
    assert_multinomial(got["multinomial"])


def test_float16_draws_and_float64_logits(compiled_half):
    _, m = compiled_half
    got = m.run(half_feeds())
    assert_normal(got["normal16"], 1.0, 2.0)
    assert_uniform(got["uniform16"], -1.0, 1.0)
    assert_bernoulli(got["bernoulli16"])
    assert_multinomial(got["multinomial64"])


def test_noise_scaled_by_zero_matches_onnxruntime_exactly(compiled):
    model, m = compiled
    names = [o.name for o in model.graph.output]
    for scale in (0.0, 1.0):
        got = m.run(feeds(scale))
        want = dict(zip(names, run_ort(model, feeds(scale))))
        np.testing.assert_array_equal(got["quiet"], want["quiet"])
        np.testing.assert_array_equal(got["quiet"], feeds()["x"])
        if scale == 0.0:
            np.testing.assert_array_equal(got["scaled"], want["scaled"])
        else:  # the noise is really there
            assert_normal(got["scaled"] - feeds()["x"], 0.0, 1.0)


def test_seeded_nodes_repeat_and_unseeded_ones_draw_anew(compiled):
    _, m = compiled
    first = m.run(feeds())
    m.num_threads = 1
    try:
        again = m.run(feeds())
    finally:
        m.num_threads = None
    for name in SEEDED:  # the same on one thread as on the pool's two
        np.testing.assert_array_equal(first[name], again[name], err_msg=name)
    for name in UNSEEDED:
        assert not np.array_equal(first[name], again[name]), name
    # identical nodes are not merged; an output read twice is one draw
    assert not np.array_equal(first["twin_a"], first["twin_b"])
    np.testing.assert_array_equal(first["twin_a_neg"], -first["twin_a"])


def test_random_nodes_are_neither_folded_nor_merged(compiled):
    model, _ = compiled
    graph = run_passes(import_model(model))
    kept = sorted(n.name for n in graph.nodes if n.op_type in RANDOM_OPS)
    assert kept == sorted(n.name for n in model.graph.node if n.op_type in RANDOM_OPS)


def test_calls_from_several_threads_draw_distinct_valid_streams(compiled):
    _, m = compiled
    results: list[dict[str, np.ndarray]] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(3):
            out = m.run(feeds())
            with lock:
                results.append(out)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12
    normals = {r["normal"].tobytes() for r in results}
    assert len(normals) == len(results)
    for r in results:
        assert_normal(r["normal"], 2.0, 3.0)
        for name in SEEDED:
            np.testing.assert_array_equal(r[name], results[0][name], err_msg=name)


def test_onnx_backend_cases_compile_with_their_shapes_and_dtypes():
    """onnx's own Bernoulli cases: their expected values are numpy's draws, which no other
    generator reproduces (the cases say so), so shapes and dtypes only."""
    cases = backend_cases("bernoulli", ["Bernoulli"])
    assert len(cases) == 3
    check_backend_cases(cases, values=False)


@pytest.mark.parametrize("node, inputs, error, match", [
    (_node("RandomNormal", [], "y", shape=[2], dtype=TensorProto.INT32), {}, UnsupportedOpError,
     "node 'y'.*dtype int32"),
    (_node("RandomUniform", [], "y", shape=[2, -1]), {}, ModelError, "node 'y'.*shape"),
    (_node("RandomNormalLike", ["x"], "y"), {"x": ("int64", [2])}, ModelError,
     "node 'y'.*dtype attribute"),
    (_node("RandomUniform", [], "y", shape=[2], seed=float("nan")), {}, ModelError,
     "node 'y'.*seed"),
    (_node("Multinomial", ["x"], "y"), {"x": ("float32", [2, 3, 4])}, ModelError,
     "node 'y'.*2-D"),
    (_node("Multinomial", ["x"], "y", dtype=TensorProto.FLOAT), {"x": ("float32", [2, 3])},
     UnsupportedOpError, "node 'y'.*cuvil compiles Multinomial to int32, int64"),
])
def test_errors_name_the_node(node, inputs, error, match):
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(
            np.dtype(t)), s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    graph.output[0].type.tensor_type.shape.SetInParent()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.raises(error, match=match):
        import_model(model)
