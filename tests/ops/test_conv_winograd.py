"""Winograd convolutions (ops/_conv_winograd.py) against onnxruntime: odd image sizes (partial
tiles), pads 0 / 1 / asymmetric / auto_pad, bias or none, batch 2 and a symbolic batch,
images of one block, of a few (each step split over the threads) and of many (the blocks
spread over the threads), tile rows wider than a vector, a fused residual and Relu, 1 and 2
threads; small images' transposed products (tiles as rows) at F(4x4) and F(2x2), channel
counts off the transforms' groups of 16, and the cost rule's choices; the weights derived at
the first run (transformed-weights = "first-run": first calls from several threads at once,
in the library with CPU variants too; the library keeps the 3x3 weights, not U, and lets go of
their pages once U is derived), or stored in the library (the default, "library": U in the
blob, no kernels, nothing derived), both ways against onnxruntime; and that these
convolutions do take the Winograd path (the compiled graph and the profile say so).
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from onnx import helper
from oracle import assert_matches_ort, make_model, run_ort

import cuvil
from cuvil.compiler.driver import compile_in_process, compile_model
from cuvil.compiler.frontend import import_model
from cuvil.compiler.ops import UNCHECKED, _conv_winograd
from cuvil.compiler.ops._conv_winograd import WINOGRAD_TILE, _Plan
from cuvil.compiler.ops.conv import conv_window
from cuvil.compiler.passes import run_passes
from cuvil.compiler.passes.plan_memory import plan_memory
from cuvil.config import CompileOptions
from cuvil.errors import ConfigError
from cuvil.runtime._loader import Model

#: F(4x4, 3x3) rounds more than a direct sum (about 1e-5 of the output's range here)
TOL = {"rtol": 1e-4, "atol": 2e-4}

#: (input channels, output channels, height, width, Conv attributes, bias)
LAYERS = [
    (48, 40, 13, 11, {"pads": [1, 1, 1, 1]}, True),  # F(2x2), not transposed (42 tiles, 40 o)
    (17, 20, 19, 23, {"pads": [1, 1, 1, 1]}, True),
    (16, 16, 21, 18, {}, False),  # no padding
    (16, 24, 17, 22, {"pads": [2, 0, 1, 3]}, True),  # asymmetric
    (16, 16, 18, 15, {"auto_pad": "SAME_UPPER"}, False),
    (20, 16, 16, 17, {"auto_pad": "SAME_LOWER", "kernel_shape": [3, 3]}, True),
    (16, 16, 14, 70, {"pads": [1, 1, 1, 1]}, True),  # 18 tiles a row: more than one vector
    (64, 32, 61, 58, {"pads": [1, 1, 1, 1]}, True),  # 2 blocks, the last one short: split
    (64, 64, 120, 60, {"pads": [1, 1, 1, 1]}, True),  # 4 blocks over the threads, one short
]


#: small images, whose products run transposed: (C, M, height, width, attributes, bias,
#: tile the cost rule picks)
SMALL = [
    (64, 256, 13, 13, {"pads": [1, 1, 1, 1]}, True, 2),  # SqueezeNet's: F(4x4)'s U, 2.4 MB, streams
    (48, 56, 13, 11, {"pads": [1, 1, 1, 1]}, False, 2),  # channels off the groups of 16
    (24, 72, 12, 14, {"pads": [2, 0, 1, 1]}, True, 4),  # asymmetric, no right padding
    (256, 256, 14, 14, {"pads": [1, 1, 1, 1]}, True, 2),  # ResNet-50's at 14x14
    (96, 80, 7, 7, {"pads": [1, 1, 1, 1]}, True, 2),
    (36, 50, 9, 8, {"auto_pad": "SAME_UPPER"}, False, 2),
]


@pytest.fixture
def small_blocks(monkeypatch):
    """2 MB blocks: the images of `LAYERS` then make one, two and four of them."""
    monkeypatch.setattr(_conv_winograd, "BLOCK_BYTES", 2 << 20)


@pytest.fixture(params=["first-run", "library"], ids=["U-derived", "U-stored"])
def transformed(request) -> str:
    """Both places U can come from (the transformed-weights setting): derived at the first
    run, or computed by the compiler and stored in the library."""
    return request.param


def _weights(rng: np.random.Generator, m: int, c: int) -> np.ndarray:
    return (rng.standard_normal((m, c, 3, 3)) * np.sqrt(2 / (9 * c))).astype(np.float32)


def _layers_model(batch: int | str, layers: list | None = None):
    rng = np.random.default_rng(0)
    nodes, inputs, outputs, consts = [], {}, {}, {}
    for i, (c, m, h, w, attrs, bias, *_) in enumerate(LAYERS if layers is None else layers):
        consts[f"w{i}"] = _weights(rng, m, c)
        ins = [f"x{i}", f"w{i}"]
        if bias:
            consts[f"b{i}"] = rng.standard_normal(m).astype(np.float32)
            ins.append(f"b{i}")
        nodes.append(helper.make_node("Conv", ins, [f"y{i}"], **attrs))
        inputs[f"x{i}"] = (np.float32, [batch, c, h, w])
        outputs[f"y{i}"] = np.float32
    return make_model(nodes, inputs, outputs, consts)


def _feeds(model, batch: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in model.graph.input:
        dims = [d.dim_value or batch for d in v.type.tensor_type.shape.dim]
        feeds[v.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _planned(model, transformed: str = "library"):
    """The compiled graph's memory plan, with the transformed-weights setting `transformed`."""
    graph = import_model(model, None, "m")
    graph.transformed_weights = transformed
    return plan_memory(run_passes(graph))


def _winograd_convs(model) -> list[bool]:
    graph = run_passes(import_model(model, None, "m"))
    return [WINOGRAD_TILE in n.attrs for n in graph.nodes if n.op_type == "Conv"]


def _plans(model) -> list[_Plan]:
    graph = run_passes(import_model(model, None, "m"))
    return [_Plan(n, conv_window(n, UNCHECKED)) for n in graph.nodes if WINOGRAD_TILE in n.attrs]


def test_layers_cover_both_ways_of_threading(small_blocks) -> None:
    plans = _plans(_layers_model(1))
    assert [(p.blocks, p.split) for p in plans[-3:]] == [(1, True), (2, True), (4, False)]
    assert (plans[0].m, plans[0].transposed) == (2, False)
    assert all((p.m, p.transposed) == (4, False) for p in plans[1:])


@pytest.mark.parametrize("batch", [1, 2])
def test_layers_match_onnxruntime(batch: int, small_blocks, transformed) -> None:
    model = _layers_model(batch)
    assert _winograd_convs(model) == [True] * len(LAYERS)
    compiled = cuvil.compile(model, transformed_weights=transformed)
    assert_matches_ort(model, _feeds(model, batch), compiled=compiled, **TOL)


def test_symbolic_batch_and_threads(small_blocks, transformed) -> None:
    model = _layers_model("n")
    assert _winograd_convs(model) == [True] * len(LAYERS)
    compiled = cuvil.compile(model, transformed_weights=transformed)
    for threads, batch in ((2, 1), (1, 3), (2, 2)):
        compiled.num_threads = threads
        assert_matches_ort(model, _feeds(model, batch, seed=batch), compiled=compiled, **TOL)


def test_small_images_take_transposed_products() -> None:
    plans = _plans(_layers_model(1, SMALL))
    assert [(p.m, p.transposed, p.blocks, p.split) for p in plans] == \
        [(tile, True, 1, True) for *_, tile in SMALL]


def test_small_images_match_onnxruntime(transformed) -> None:
    model = _layers_model("n", SMALL)
    compiled = cuvil.compile(model, transformed_weights=transformed)
    for threads, batch in ((1, 1), (2, 1), (1, 2), (2, 3)):
        compiled.num_threads = threads
        assert_matches_ort(model, _feeds(model, batch, seed=batch), compiled=compiled, **TOL)


def test_small_images_with_residual_and_relu() -> None:
    """Conv -> Add(skip) -> Relu on a 14x14 image (transposed products): the residual is
    added and the activation applied when the output is copied out of its channels-last
    staging, after the transform."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = make_model(nodes, {"x": (np.float32, ["n", 72, 14, 14])}, {"y": np.float32},
                       {"w": _weights(rng, 72, 72), "b": rng.standard_normal(72).astype(np.float32)})
    (plan,) = _plans(model)
    assert plan.transposed and plan.m == 4
    compiled = cuvil.compile(model)
    for threads, batch in ((1, 1), (2, 2)):
        compiled.num_threads = threads
        assert_matches_ort(model, _feeds(model, batch), compiled=compiled, **TOL)


def _big_model():
    """Two Winograd layers of 256 channels at 14x14 (a ResNet stage's), Relu between: U takes
    long enough to derive (some 20 ms) that calls started together find it being derived."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "w1"], ["y"], pads=[1, 1, 1, 1])]
    consts = {"w0": _weights(rng, 256, 256), "b0": rng.standard_normal(256).astype(np.float32),
              "w1": _weights(rng, 256, 256)}
    return make_model(nodes, {"x": (np.float32, ["n", 256, 14, 14])}, {"y": np.float32}, consts)


@pytest.mark.parametrize("cpu", ["native", None])  # None: the baseline and its CPU variants
def test_first_calls_from_threads_at_once(cpu: str | None) -> None:
    """U is derived by the first call; calls racing it must wait for it, not read zeros."""
    model = _big_model()
    compiled = compile_in_process(model, cpu=cpu, transformed_weights="first-run")
    feeds = [_feeds(model, batch, seed=seed) for seed, batch in enumerate((1, 2, 1, 3, 1, 1))]
    start = threading.Barrier(len(feeds))
    results: dict[int, np.ndarray] = {}

    def call(i: int) -> None:
        start.wait()
        results[i] = compiled(**feeds[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, f in enumerate(feeds):
        np.testing.assert_allclose(results[i], run_ort(model, f)[0], **TOL)
    for f in feeds[:2]:  # later calls
        assert_matches_ort(model, f, compiled=compiled, **TOL)


def test_first_run_setting_keeps_the_3x3_weights(tmp_path) -> None:
    """transformed-weights = "first-run": the weights blob holds the kernels as given; U
    (16/9 of their size for F(2x2)) is not in the file."""
    model = _big_model()
    plan = _planned(model, "first-run")
    kernels = 2 * 256 * 256 * 9 * 4
    assert kernels <= len(plan.weights) < kernels + 4096
    assert plan.derived_size == 2 * 16 * 256 * 256 * 4  # F(2x2): 4x4 points
    library = compile_model(model, "big", tmp_path,
                            CompileOptions(transformed_weights="first-run")).library
    assert library.stat().st_size < kernels + plan.derived_size / 2


def test_library_stores_u_by_default(tmp_path) -> None:
    """The default ("library"): the blob holds U (F(2x2): 16/9 of the kernels), the kernels
    nothing reads are left out, and the first run derives nothing (no derived buffer)."""
    model = _big_model()
    plan = _planned(model)
    u_bytes = 2 * 16 * 256 * 256 * 4
    assert u_bytes <= len(plan.weights) < u_bytes + 4096
    assert plan.derived_size == 0 and len(plan.stored) == 2
    compiled = compile_model(model, "big", tmp_path, CompileOptions(cpu="native"))
    assert compiled.library.stat().st_size > u_bytes
    loaded = Model(compiled.library, compiled.signature)
    for seed in (1, 2):
        feeds = _feeds(model, 1, seed)
        np.testing.assert_allclose(loaded.run(feeds)["y"], run_ort(model, feeds)[0], **TOL)


def _resident_bytes(library) -> int:
    """Bytes of the library's file this process has resident (its mappings' Rss in smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                ours = len(head) >= 6 and head[-1] == str(library)
            elif ours and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the release is Linux's madvise")
def test_first_run_lets_go_of_the_3x3_weights(tmp_path) -> None:
    """The fill reads every kernel to derive U, then drops their pages: after the first run
    the library's resident file pages are its code, not the 4.7 MB of kernels; the results
    (the first and later runs) are onnxruntime's."""
    model = _big_model()
    compiled = compile_model(model, "big", tmp_path,
                             CompileOptions(cpu="native", transformed_weights="first-run"))
    loaded = Model(compiled.library, compiled.signature)
    kernels = 2 * 256 * 256 * 9 * 4
    for seed in (1, 2):
        feeds = _feeds(model, 1, seed)
        np.testing.assert_allclose(loaded.run(feeds)["y"], run_ort(model, feeds)[0], **TOL)
        assert _resident_bytes(compiled.library.resolve()) < kernels / 4


def test_profile_names_the_path() -> None:
    model = _big_model()
    compiled = cuvil.compile(model)
    profile = compiled.profile(_feeds(model, 1), runs=1)
    assert [n.op for n in profile.nodes] == ["Conv(winograd)+Relu", "Conv(winograd)"]


def test_fused_residual_and_relu() -> None:
    """Conv -> Add(skip) -> Relu, as in a ResNet block: the epilogue runs after the output
    transform (the product alone is not the conv's output)."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = make_model(nodes, {"x": (np.float32, ["n", 32, 23, 29])}, {"y": np.float32},
                       {"w": _weights(rng, 32, 32), "b": rng.standard_normal(32).astype(np.float32)})
    graph = run_passes(import_model(model, None, "m"))
    (conv,) = graph.nodes
    assert conv.attrs[WINOGRAD_TILE] == 4 and conv.attrs["cuvil.fused_activation"] == "Relu"
    assert conv.input(3) is not None  # the residual
    compiled = cuvil.compile(model)
    for batch in (1, 2):
        assert_matches_ort(model, _feeds(model, batch), compiled=compiled, **TOL)


@pytest.mark.parametrize("case", [
    {"c": 3, "attrs": {"pads": [1, 1, 1, 1]}},  # too few channels to pay
    {"c": 32, "attrs": {"pads": [1, 1, 1, 1], "strides": [2, 2]}},
    {"c": 32, "attrs": {"pads": [2, 2, 2, 2], "dilations": [2, 2]}},
    {"c": 32, "attrs": {"pads": [1, 1, 1, 1], "group": 2}},
    {"c": 32, "size": 7, "attrs": {"pads": [1, 1, 1, 1]}},  # F(4x4): 4 tiles; F(2x2): dearer
    # 512 channels at 7x7: U (16 MB for F(2x2)) would stream from memory at every call
    {"c": 512, "m": 512, "size": 7, "attrs": {"pads": [1, 1, 1, 1]}},
])
def test_other_convs_keep_im2col(case: dict) -> None:
    c, size, attrs = case["c"], case.get("size", 20), case["attrs"]
    rng = np.random.default_rng(3)
    w = _weights(rng, case.get("m", 32), c // attrs.get("group", 1))
    model = make_model([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)],
                       {"x": (np.float32, [1, c, size, size])}, {"y": np.float32}, {"w": w})
    assert _winograd_convs(model) == [False]


def test_an_unknown_transformed_weights_setting_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="transformed-weights = 'derived' is not one of"):
        compile_model(_big_model(), "big", tmp_path,
                      CompileOptions(transformed_weights="derived"))
