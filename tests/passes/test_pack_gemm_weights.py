"""pack_gemm_weights alone: a Gemm with constant transposed weights reads them transposed
once at compile time (transB=0); constant weights of products on the GEMM kernel are stored
in its panel layouts. The compiled models against onnxruntime, on this CPU's tiles and on
the AVX2 and baseline ones."""

from __future__ import annotations

import numpy as np
import pytest
from irbuild import build, structure
from onnx import helper
from oracle import assert_matches_ort, make_model

from cuvil.compiler.kernels.gemm import PACK_COLS, PACK_ROWS
from cuvil.compiler.ops.gemm import PACKED_WEIGHTS
from cuvil.compiler.passes.pack_gemm_weights import pack_gemm_weights

rng = np.random.default_rng(3)
W = rng.standard_normal((6, 11)).astype(np.float32)  # [N, K]
B = rng.standard_normal(6).astype(np.float32)


def test_constant_transposed_weights_are_packed() -> None:
    g = build("""
        x: float32[batch, 11]
        y = Gemm(x, w, b, transB=1, alpha=0.5)
        return y
    """, w=W, b=B)
    w = g.nodes[0].inputs[1]
    pack_gemm_weights(g)
    g.verify()
    assert structure(g) == ["%0 = Gemm(x, const[11, 6], const[6]) {'alpha': 0.5, 'transB': 0}",
                            "return %0"]
    packed = g.nodes[0].inputs[1]
    assert packed is not None and packed.const is not None
    np.testing.assert_array_equal(packed.const, W.T)
    assert packed.const.flags.c_contiguous
    assert w is not None and w.users == [] and packed.users == [g.nodes[0]]


def test_shared_weights_are_packed_for_each_reader() -> None:
    g = build("""
        x: float32[2, 11]
        y = Gemm(x, w, transB=1)
        z = Gemm(x, w, transB=1)
        s = Add(y, z)
        return s
    """, w=W)
    pack_gemm_weights(g)
    g.verify()
    assert [n.attrs for n in g.nodes[:2]] == [{"transB": 0, PACKED_WEIGHTS: 1}] * 2
    assert all(n.inputs[1].const.shape == (11, 6) for n in g.nodes[:2])  # type: ignore[union-attr]
    assert g.nodes[0].inputs[1] is not g.nodes[1].inputs[1]


def b_panels(b: np.ndarray) -> np.ndarray:
    """The kernel's packed B, element by element: column panels of PACK_COLS (the last one
    narrower), each row by row."""
    kk, n = b.shape
    out = np.empty(b.size, b.dtype)
    for k, j in np.ndindex(kk, n):
        base = j // PACK_COLS * PACK_COLS
        out[base * kk + k * min(PACK_COLS, n - base) + j - base] = b[k, j]
    return out


def a_panels(a: np.ndarray) -> np.ndarray:
    """The kernel's packed A: row panels of PACK_ROWS (the last one shorter), each k-major."""
    m, kk = a.shape
    out = np.empty(a.size, a.dtype)
    for i, k in np.ndindex(m, kk):
        base = i // PACK_ROWS * PACK_ROWS
        out[base * kk + k * min(PACK_ROWS, m - base) + i - base] = a[i, k]
    return out


def test_matmul_and_gemm_weights_are_stored_in_column_panels() -> None:
    w = rng.standard_normal((5, 70)).astype(np.float32)
    g = build("""
        x: float32[batch, 3, 5]
        y = MatMul(x, w)
        x2: float32[batch, 5]
        z = Gemm(x2, w, b)
        return y, z
    """, w=w, b=rng.standard_normal(70).astype(np.float32))
    pack_gemm_weights(g)
    g.verify()
    for node in g.nodes:
        packed = node.inputs[1]
        assert node.attrs[PACKED_WEIGHTS] == 1 and packed is not None and packed.const is not None
        assert packed.const.shape == (5, 70)
        np.testing.assert_array_equal(packed.const.ravel(), b_panels(w))


def test_conv_weights_are_stored_in_row_panels_per_group() -> None:
    w = rng.standard_normal((30, 2, 3, 3)).astype(np.float32)  # 2 groups of 15 channels
    g = build("""
        x: float32[1, 4, 8, 8]
        y = Conv(x, w, group=2)
        return y
    """, w=w)
    pack_gemm_weights(g)
    g.verify()
    packed = g.nodes[0].inputs[1]
    assert g.nodes[0].attrs[PACKED_WEIGHTS] == 1 and packed is not None and packed.const is not None
    want = np.concatenate([a_panels(m) for m in w.reshape(2, 15, 18)])
    np.testing.assert_array_equal(packed.const.ravel(), want)


@pytest.mark.parametrize("case", ["runtime-weights", "alpha", "batched-matmul", "float64"])
def test_other_products_are_left_alone(case) -> None:
    text = {
        "runtime-weights": "x: float32[2, 11]\nw: float32[6, 11]\ny = Gemm(x, w, transB=1)",
        "alpha": "x: float32[2, 11]\ny = Gemm(x, w, alpha=0.5)",
        "batched-matmul": "x: float32[2, 3, 11]\ny = MatMul(x, w)",
        "float64": "x: float64[2, 11]\ny = MatMul(x, w)",
    }[case] + "\nreturn y"
    weights = {"batched-matmul": np.stack([W.T, W.T]), "float64": W.T.astype(np.float64)}
    g = build(text, w=weights.get(case, W.T if case != "runtime-weights" else W))
    before = structure(g)
    pack_gemm_weights(g)
    g.verify()
    assert structure(g) == before


def test_packed_model_matches_onnxruntime() -> None:
    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1, alpha=0.7,
                                         beta=0.3)],
                       {"x": (np.float32, ["batch", 11])}, {"y": np.float32}, {"w": W, "b": B})
    compiled = assert_matches_ort(model, {"x": rng.standard_normal((5, 11)).astype(np.float32)})
    assert_matches_ort(model, {"x": rng.standard_normal((1, 11)).astype(np.float32)},
                       compiled=compiled)


#: CPU levels the packed layouts are checked on: this machine's, and the AVX2 and baseline
#: x86 tiles (which read the same panels with smaller tiles)
LEVELS = ["host", "x86-64-v3", "x86-64-v2"]


# the fast test run (-m "not slow") builds for this machine only: each x86 level compiles its kernels
@pytest.fixture(params=[level if level == "host" else pytest.param(level, marks=pytest.mark.slow)
                        for level in LEVELS])
def level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Makes cuvil.compile's "native" build one for the given x86 level (its features size the
    kernel's tiles); the x86 levels run only on an x86 host that has them."""
    import platform

    import llvmlite.binding as llvm

    import cuvil.toolchains
    import cuvil.toolchains._targets as targets

    if request.param == "host":
        return "host"
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 levels need an x86 host")
    arch = cuvil.toolchains.get_target("x86_64-linux").arches[0]
    features = arch.features if request.param == "x86-64-v2" else next(
        v.features for v in arch.variants if v.cpu == request.param)
    host = set(llvm.get_host_cpu_features().flatten().split(","))
    if not {f for f in features.split(",") if f.startswith("+")} <= host:
        pytest.skip(f"this CPU cannot run {request.param}")
    monkeypatch.setattr(targets, "host_cpu", lambda: (request.param, features))
    monkeypatch.setattr(cuvil.toolchains, "host_cpu", lambda: (request.param, features))
    return str(request.param)


def _conv_model(cin: int, cout: int, kernel: int, size: int, group: int = 1, stride: int = 1,
                residual: bool = False):  # type: ignore[no-untyped-def]
    pad = kernel // 2
    out = (size + 2 * pad - kernel) // stride + 1
    w = (rng.standard_normal((cout, cin // group, kernel, kernel)) * 0.2).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[pad] * 4, group=group,
                              strides=[stride] * 2)]
    inputs: dict = {"x": (np.float32, ["batch", cin, size, size])}
    last = "c"
    if residual:
        inputs["r"] = (np.float32, ["batch", cout, out, out])
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        last = "s"
    nodes.append(helper.make_node("Relu", [last], ["y"]))
    return make_model(nodes, inputs, {"y": np.float32},
                      {"w": w, "b": rng.standard_normal(cout).astype(np.float32)}), out


# output channels around the 12-row panels (and the AVX2/baseline tiles), groups, positions
# around the 32-column panels, pointwise, chunked and whole unfolds, K over several blocks
# (the fast test run keeps the first three)
CONVS = [(3, 5, 3, 9, 1, 1, False), (16, 64, 1, 14, 1, 1, True), (8, 30, 3, 10, 2, 1, False),
         (40, 25, 3, 7, 1, 1, True), (300, 13, 1, 7, 1, 1, False), (6, 44, 3, 33, 1, 2, True),
         (64, 100, 3, 16, 1, 1, False)]


@pytest.mark.parametrize("conv", [pytest.param(c, id=str(c), marks=() if i < 3 else pytest.mark.slow)
                                  for i, c in enumerate(CONVS)])
def test_packed_conv_matches_onnxruntime(level: str, conv) -> None:
    cin, cout, kernel, size, group, stride, residual = conv
    model, out = _conv_model(cin, cout, kernel, size, group, stride, residual)
    compiled = None
    for batch in (1, 2):
        feeds = {"x": rng.standard_normal((batch, cin, size, size)).astype(np.float32)}
        if residual:
            feeds["r"] = rng.standard_normal((batch, cout, out, out)).astype(np.float32)
        compiled = assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4, compiled=compiled)


@pytest.mark.parametrize("shape", [(3, 33, 70), (25, 9, 100),
                                   *(pytest.param(s, id=str(s), marks=pytest.mark.slow)
                                     for s in [(7, 300, 32), (130, 64, 33)])], ids=str)
def test_packed_linear_layers_match_onnxruntime(level: str, shape) -> None:
    rows, kk, n = shape
    w = rng.standard_normal((kk, n)).astype(np.float32)
    wt = np.ascontiguousarray(w.T)
    bias = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"]),
             helper.make_node("Gemm", ["x2", "wt", "bias"], ["z"], transB=1)]
    model = make_model(nodes, {"x": (np.float32, ["batch", rows, kk]),
                               "x2": (np.float32, ["batch", kk])},
                       {"y": np.float32, "z": np.float32}, {"w": w, "wt": wt, "bias": bias})
    compiled = None
    for batch in (1, 3):
        feeds = {"x": rng.standard_normal((batch, rows, kk)).astype(np.float32),
                 "x2": rng.standard_normal((batch, kk)).astype(np.float32)}
        compiled = assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4, compiled=compiled)
