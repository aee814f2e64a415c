"""Conv and ConvTranspose against onnxruntime: seeded random shapes and attributes (odd sizes,
asymmetric pads, every auto_pad, strides larger than the kernel, dilations, groups including
depthwise, 1-D to 3-D, bias present or not, kernel_shape given or not), symbolic batch and
spatial dims checked at several sizes, float16 and float64, run-time weights, the errors a
model can cause, and onnx's backend node tests.

Cases are batched (one compile per test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from kernel_library import skip_unless_host_has
from onnx import helper
from oracle import assert_matches_ort, make_model

import cuvil
from cuvil.errors import ModelError, UnsupportedOpError

F16 = {"rtol": 3e-3, "atol": 3e-3}
F64 = {"rtol": 1e-10, "atol": 1e-10}
#: symbolic dims ("_s<axis>" are private to each case) and the sizes each test runs them at
SIZES = ({"n": 1, "_s0": 7, "_s1": 6, "_s2": 5}, {"n": 3, "_s0": 10, "_s1": 13, "_s2": 8},
         {"n": 2, "_s0": 5, "_s1": 9, "_s2": 11})


def _channels(rng: np.random.Generator) -> tuple[int, int, int]:
    """(group, input channels per group, output channels per group); a fifth are depthwise."""
    if rng.random() < 0.2:
        return int(rng.integers(2, 5)), 1, int(rng.integers(1, 3))
    return int(rng.choice([1, 1, 2, 3])), int(rng.integers(1, 4)), int(rng.integers(1, 4))


def conv_case(rng: np.random.Generator, r: int, dtype: str = "float32",
              symbolic: bool = False) -> Case:
    group, cg, mg = _channels(rng)
    kernel = [int(rng.integers(1, 4)) for _ in range(r)]
    attrs: dict = {}
    strides = [int(rng.integers(1, 4)) for _ in range(r)] if rng.random() < 0.6 else [1] * r
    dilations = [int(rng.integers(1, 3)) for _ in range(r)] if rng.random() < 0.5 else [1] * r
    if strides != [1] * r or rng.random() < 0.2:
        attrs["strides"] = strides
    if dilations != [1] * r or rng.random() < 0.2:
        attrs["dilations"] = dilations
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    mode = str(rng.choice(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    if mode != "NOTSET":
        attrs["auto_pad"] = mode
    elif rng.random() < 0.7:
        attrs["pads"] = [int(rng.integers(0, 3)) for _ in range(2 * r)]  # asymmetric
    if rng.random() < 0.5:
        attrs["kernel_shape"] = kernel
    if group != 1 or rng.random() < 0.3:
        attrs["group"] = group
    spatial: list = [e + int(rng.integers(0, 6)) for e in extent]
    if symbolic:
        spatial = [f"_s{a}" if rng.random() < 0.7 else d for a, d in enumerate(spatial)]
    case = Case("Conv", ["x", "w", "b"] if rng.random() < 0.6 else ["x", "w"], attrs,
                feeds={"x": (dtype, ["n" if symbolic else int(rng.integers(1, 3)), cg * group,
                                     *spatial])},
                consts={"w": rng.standard_normal([mg * group, cg, *kernel]).astype(dtype)})
    if "b" in case.inputs:
        case.consts["b"] = rng.standard_normal([mg * group]).astype(dtype)
    if mode.startswith("SAME") and max(dilations) > 1:
        # onnxruntime refuses dilations with SAME padding: check against the reference
        case.oracle = "reference"
    return case


def conv_transpose_case(rng: np.random.Generator, r: int, dtype: str = "float32",
                        symbolic: bool = False) -> Case:
    group, cg, mg = _channels(rng)
    kernel = [int(rng.integers(1, 4)) for _ in range(r)]
    attrs: dict = {}
    strides = [int(rng.integers(1, 4)) for _ in range(r)] if rng.random() < 0.6 else [1] * r
    dilations = [int(rng.integers(1, 3)) for _ in range(r)] if rng.random() < 0.4 else [1] * r
    if strides != [1] * r:
        attrs["strides"] = strides
    if dilations != [1] * r:
        attrs["dilations"] = dilations
    out_pad = [int(rng.integers(0, s)) for s in strides] if rng.random() < 0.4 else [0] * r
    if out_pad != [0] * r:
        attrs["output_padding"] = out_pad
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    spatial = [int(rng.integers(1, 6)) for _ in range(r)]
    full = [s * (n - 1) + p + e for s, n, p, e in zip(strides, spatial, out_pad, extent)]
    mode = str(rng.choice(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID", "shape"]))
    if mode.startswith("SAME") and any(p + e < s for p, e, s in zip(out_pad, extent, strides)):
        mode = "VALID"  # cuvil rejects that (see test_conv_transpose_errors)
    if mode == "NOTSET" and rng.random() < 0.7:
        begin = [int(rng.integers(0, min(3, f))) for f in full]
        attrs["pads"] = begin + [int(rng.integers(0, min(3, f - b))) for f, b in zip(full, begin)]
    elif mode == "shape" and not symbolic:
        # smaller than the full output (cropped) or larger (zeros appended)
        # (onnxruntime allows excess + output_padding < stride only)
        attrs["output_shape"] = [max(1, f + int(rng.integers(-2, s - p))) for f, s, p in
                                 zip(full, strides, out_pad)]
        if rng.random() < 0.4:
            attrs["auto_pad"] = str(rng.choice(["SAME_UPPER", "SAME_LOWER"]))
    elif mode in ("SAME_UPPER", "SAME_LOWER", "VALID"):
        attrs["auto_pad"] = mode
    if rng.random() < 0.5:
        attrs["kernel_shape"] = kernel
    if group != 1 or rng.random() < 0.3:
        attrs["group"] = group
    dims: list = spatial
    if symbolic:
        # pads must leave an output at the smallest size: symbolic dims only without pads
        dims = [f"_s{a}" if "pads" not in attrs and rng.random() < 0.7 else d
                for a, d in enumerate(spatial)]
    case = Case("ConvTranspose", ["x", "w", "b"] if rng.random() < 0.6 else ["x", "w"], attrs,
                feeds={"x": (dtype, ["n" if symbolic else int(rng.integers(1, 3)), cg * group,
                                     *dims])},
                consts={"w": rng.standard_normal([cg * group, mg, *kernel]).astype(dtype)})
    if "b" in case.inputs:
        case.consts["b"] = rng.standard_normal([mg * group]).astype(dtype)
    return case


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_conv_random(rank):
    rng = np.random.default_rng(100 + rank)
    check_cases([conv_case(rng, rank) for _ in range(10)], seed=rank)


def test_large_outputs_unfold_by_chunks_of_rows():
    # outputs of many rows take the chunked path (X' unfolded and multiplied per chunk of
    # output rows on the thread pool), with a partial last chunk; a small size at run time
    # takes the whole-X' path of the same compiled code
    rng = np.random.default_rng(11)
    cases = [
        Case("Conv", ["x", "w", "b"], {"strides": [2], "dilations": [2], "pads": [3, 1]},
             feeds={"x": ("float32", [2, 3, 1500])},
             consts={"w": rng.standard_normal((4, 3, 5)).astype(np.float32),
                     "b": rng.standard_normal(4).astype(np.float32)}),
        Case("Conv", ["x", "w"], {"group": 2, "pads": [1, 0, 2, 1], "strides": [1, 2]},
             feeds={"x": ("float32", [1, 4, "h", "w"])},
             consts={"w": rng.standard_normal((6, 2, 3, 3)).astype(np.float32)}),
        Case("Conv", ["x", "w", "b"], {"pads": [1, 1, 1, 1, 1, 1]},
             feeds={"x": ("float32", [1, 2, 20, 12, 11])},
             consts={"w": rng.standard_normal((3, 2, 3, 3, 3)).astype(np.float32),
                     "b": rng.standard_normal(3).astype(np.float32)}),
    ]
    check_cases(cases, sizes=({"h": 45, "w": 37}, {"h": 5, "w": 4}))


def test_gemm_path_unfolding_and_panels():
    # strided unfolding in vectors (strides 2 to 4: rows with and without room for a last
    # vector) and element by element (5); enough output channels that the kernel copies B into
    # panels: N = 49 and 196 positions (row tiles outside, a partial panel), over 256 (panels
    # outside), pointwise (B is X, rows H*W apart), grouped pointwise (a group's columns are
    # part of X's rows), and K over several blocks; a symbolic batch run at two sizes
    rng = np.random.default_rng(12)

    def case(x: list, w: tuple, **attrs) -> Case:
        return Case("Conv", ["x", "w", "b"], attrs, feeds={"x": ("float32", ["n", *x])},
                    consts={"w": rng.standard_normal(w).astype(np.float32) * 0.3,
                            "b": rng.standard_normal(w[0]).astype(np.float32)})

    cases = [
        case([5, 37, 41], (16, 5, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]),
        case([3, 50, 70], (13, 3, 5, 5), strides=[3, 3], pads=[2, 1, 0, 2]),
        case([2, 60, 90], (12, 2, 3, 3), strides=[4, 4], dilations=[2, 2]),
        case([3, 40, 40], (8, 3, 5, 5), strides=[5, 5], pads=[1, 2, 1, 2]),
        case([3, 224], (14, 3, 7), strides=[2], pads=[3, 3]),
        case([40, 7, 7], (50, 40, 1, 1)),
        case([24, 14, 14], (30, 24, 1, 1)),
        case([20, 23, 19], (26, 20, 1, 1)),
        case([8, 30, 30], (28, 4, 1, 1), group=2),
        case([16, 14, 14], (24, 16, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]),
        case([300, 7, 7], (20, 300, 1, 1)),
        # rows shorter than a vector, copied with masked loads and stores on AVX-512: stride
        # 3 (15 of 16 lanes), stride 2 onto 7 wide rows with pads, stride 1 rows of 7 and 9
        case([4, 17, 47], (20, 4, 3, 3), strides=[3, 3], pads=[1, 1, 1, 1]),
        case([6, 13, 13], (14, 6, 3, 3), strides=[2, 2], pads=[1, 0, 1, 2]),
        case([5, 9, 9], (18, 5, 3, 3), pads=[1, 1, 1, 1]),
        case([5, 7, 7], (16, 5, 3, 3), pads=[0, 2, 1, 0]),
    ]
    check_cases(cases, sizes=({"n": 1}, {"n": 2}), atol=1e-4)


def test_small_maps_run_transposed():
    """Convs whose maps have few positions (7x7, 5x5: vectors of positions would be mostly
    masked) run the product transposed, channels along the vectors: 1x1 and 3x3 at 7x7, a
    strided 3x3 down to 7x7, output channels that are not a multiple of the lanes, a fused
    residual and Relu, a symbolic batch at two sizes."""
    rng = np.random.default_rng(13)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["s2"]),
        helper.make_node("Relu", ["s2"], ["y1"]),
        helper.make_node("Conv", ["r1", "w3"], ["y2"], pads=[0, 1, 2, 1]),
        helper.make_node("Conv", ["big", "w4", "b4"], ["y3"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["small", "w5", "b5"], ["y4"], pads=[1, 1, 1, 1]),
    ]
    consts = {"w1": w(36, 20, 1, 1), "b1": w(36), "w2": w(36, 36, 3, 3), "b2": w(36),
              "w3": w(19, 36, 3, 3), "w4": w(48, 12, 3, 3), "b4": w(48),
              "w5": w(32, 24, 3, 3), "b5": w(32)}
    model = make_model(nodes, {"x": ("float32", ["n", 20, 7, 7]),
                               "big": ("float32", ["n", 12, 13, 13]),
                               "small": ("float32", ["n", 24, 5, 5])},
                       dict.fromkeys(("y1", "y2", "y3", "y4"), "float32"), consts)
    compiled = cuvil.compile(model)
    for n in (1, 3):
        feeds = {name: rng.standard_normal((n, c, s, s)).astype(np.float32)
                 for name, c, s in (("x", 20, 7), ("big", 12, 13), ("small", 24, 5))}
        assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4, compiled=compiled)
    paths = [node.op for node in compiled.profile(feeds, runs=1).nodes]
    assert sum("Conv(transposed)" in op for op in paths) == 5, paths


def test_maps_of_a_few_positions_known_at_run_time():
    """Convs over a symbolic length that is 1 to 3 positions at run time (a speech model fed
    a few frames) multiply each panel of weights by a column at a time (gemm_kernel's
    `narrow_panel`): 256 output channels (21 whole panels and 4 rows), a bias, a fused residual
    Add and Relu, strides and padding, and one length past the narrow path."""
    rng = np.random.default_rng(17)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1], strides=[2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["s2"]),
        helper.make_node("Relu", ["s2"], ["y"]),
    ]
    model = make_model(nodes, {"x": ("float32", ["n", 80, "t"])}, {"y": "float32"},
                       {"w1": w(256, 80, 3), "b1": w(256), "w2": w(256, 256, 3), "b2": w(256)})
    compiled = cuvil.compile(model)
    for n, t in ((1, 1), (3, 2), (2, 5), (4, 7), (2, 12)):
        feeds = {"x": rng.standard_normal((n, 80, t)).astype(np.float32)}
        assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4, compiled=compiled)


def test_conv_symbolic_batch_and_spatial_dims():
    rng = np.random.default_rng(7)
    cases = [conv_case(rng, r, symbolic=True) for r in (1, 1, 2, 2, 2, 3)]
    check_cases(cases, sizes=SIZES)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_conv_transpose_random(rank):
    rng = np.random.default_rng(200 + rank)
    check_cases([conv_transpose_case(rng, rank) for _ in range(10)], seed=rank)


@pytest.mark.parametrize("cpu", ["native", "x86-64-v3"])
def test_conv_transpose_large_maps_by_tasks_and_chunks(cpu):
    # the GEMM + scatter path (ops/_conv_transpose.py) at sizes the random cases never reach:
    # several tasks of output channels per group (a short last one), several chunks of input
    # rows (a partial last one), scatters in vectors at strides 1, 2 and 4 (rows with and
    # without room for a last vector) and element by element at 3 and 8, images of a
    # symbolic batch, groups, dilations, output_padding, 1-D to 3-D; the largest tasks at one
    # thread, smaller ones on the pool. The weights are copied per task where a chunk's
    # columns make more than one of the kernel's panels: 24 columns are one panel of the
    # AVX-512 kernel (read in place) and two of the AVX2 one (copied); 64 channels x 16 taps
    # put W^T's columns 4 KB apart
    if cpu != "native":
        skip_unless_host_has("avx2")
    rng = np.random.default_rng(12)

    def case(inputs, attrs, x_shape, w_shape):
        c = Case("ConvTranspose", inputs, attrs, feeds={"x": ("float32", x_shape)},
                 consts={"w": rng.standard_normal(w_shape).astype(np.float32)})
        if "b" in inputs:
            c.consts["b"] = rng.standard_normal(w_shape[1] * attrs.get("group", 1)).astype(
                np.float32)
        return c

    cases = [
        case(["x", "w", "b"], {"strides": [2, 2], "pads": [1, 1, 1, 1]}, ["n", 24, 20, 30],
             (24, 43, 4, 4)),
        case(["x", "w", "b"], {"strides": [8], "pads": [4, 4]}, ["n", 16, 300], (16, 24, 16)),
        case(["x", "w"], {"strides": [3, 3], "dilations": [2, 1], "output_padding": [1, 2],
                          "group": 2, "pads": [2, 0, 1, 3]}, [1, 10, 13, 19], (10, 9, 5, 5)),
        case(["x", "w", "b"], {"pads": [1, 1, 1, 1], "group": 3}, ["n", 12, "h", 41],
             (12, 11, 3, 3)),
        case(["x", "w", "b"], {"strides": [4, 4], "pads": [2, 2, 2, 2]}, [1, 8, 9, 17],
             (8, 16, 8, 8)),
        case(["x", "w", "b"], {"strides": [2, 2, 2]}, [2, 6, 5, 7, 9], (6, 20, 2, 2, 2)),
        case(["x", "w", "b"], {"strides": [8], "pads": [4, 4]}, ["n", 32, 24], (32, 20, 16)),
        case(["x", "w", "b"], {"strides": [2, 2], "pads": [1, 1, 1, 1]}, [1, 48, 16, 16],
             (48, 64, 4, 4)),
    ]
    check_cases(cases, sizes=({"n": 1, "h": 37}, {"n": 3, "h": 6}), threads=(1, None), cpu=cpu)


def test_conv_transpose_symbolic_batch_and_spatial_dims():
    rng = np.random.default_rng(8)
    cases = [conv_transpose_case(rng, r, symbolic=True) for r in (1, 1, 2, 2, 2, 3)]
    check_cases(cases, sizes=SIZES)


def test_float16_against_onnxruntime():
    rng = np.random.default_rng(9)
    cases = [conv_case(rng, r, "float16") for r in (1, 2, 2, 3)]
    cases += [conv_transpose_case(rng, r, "float16") for r in (1, 2, 2, 3)]
    check_cases([c for c in cases if c.oracle == "ort"], **F16)


def test_float64_against_reference():
    # onnxruntime has no float64 Conv or ConvTranspose on CPU
    rng = np.random.default_rng(10)
    cases = [conv_case(rng, r, "float64") for r in (1, 2, 2, 3)]
    for r in (1, 2, 2, 3):
        c = conv_transpose_case(rng, r, "float64")
        while c.attrs.get("group", 1) != 1 or "output_shape" in c.attrs:
            # the reference mishandles groups and explicit output_shape
            c = conv_transpose_case(rng, r, "float64")
        cases.append(c)
    for c in cases:
        c.oracle = "reference"
    check_cases(cases, **F64)


def test_run_time_weights_and_bias():
    rng = np.random.default_rng(11)
    cases = []
    for op in ("Conv", "ConvTranspose"):
        for r in (1, 2):
            c = (conv_case if op == "Conv" else conv_transpose_case)(rng, r)
            c.inputs = ["x", "w", "b"]
            w = c.consts.pop("w")
            c.consts.pop("b", None)
            c.feeds["w"] = ("float32", list(w.shape))
            m = w.shape[0] if op == "Conv" else w.shape[1] * c.attrs.get("group", 1)
            c.feeds["b"] = ("float32", [m])
            cases.append(c)
    check_cases(cases)


def test_backend_node_tests():
    tests = backend_cases("conv", ["Conv"]) + backend_cases("convtranspose", ["ConvTranspose"])
    assert len(tests) >= 17
    check_backend_cases(tests)


# -- errors a model can cause -----------------------------------------------------------------


def _model(op, x_shape, w_shape, **attrs):
    return make_model([helper.make_node(op, ["x", "w"], ["y"], **attrs)],
                      {"x": ("float32", x_shape)}, {"y": "float32"},
                      initializers={"w": np.ones(w_shape, np.float32)})


def test_conv_errors():
    with pytest.raises(ModelError, match="kernel_shape"):
        cuvil.compile(_model("Conv", [1, 2, 5, 5], [3, 2, 3, 3], kernel_shape=[2, 2]))
    with pytest.raises(ModelError, match="groups"):
        cuvil.compile(_model("Conv", [1, 4, 5, 5], [3, 2, 3, 3], group=2))
    with pytest.raises(ModelError, match="input channels"):
        cuvil.compile(_model("Conv", [1, 3, 5, 5], [4, 2, 3, 3], group=2))
    with pytest.raises(ModelError, match="smaller than the window"):
        cuvil.compile(_model("Conv", [1, 2, 2, 5], [3, 2, 3, 3]))


def test_conv_transpose_errors():
    # SAME padding with a stride beyond the kernel: onnxruntime and the reference disagree
    with pytest.raises(UnsupportedOpError, match="SAME_UPPER"):
        cuvil.compile(_model("ConvTranspose", [1, 1, 4], [1, 1, 2], strides=[3],
                             auto_pad="SAME_UPPER"))
    with pytest.raises(ModelError, match="output_padding"):
        cuvil.compile(_model("ConvTranspose", [1, 1, 4], [1, 1, 2], strides=[2],
                             output_padding=[2]))
    with pytest.raises(ModelError, match="exceeds the unpadded output"):
        cuvil.compile(_model("ConvTranspose", [1, 1, 4], [1, 1, 2], strides=[2],
                             output_shape=[11]))
    with pytest.raises(ModelError, match="pads remove"):
        cuvil.compile(_model("ConvTranspose", [1, 1, 2], [1, 1, 2], pads=[2, 2]))


def test_empty_auto_pad_means_notset():
    # some exporters write auto_pad="" (onnxruntime reads it as NOTSET)
    rng = np.random.default_rng(12)
    check_cases([Case("Conv", ["x", "w"], {"auto_pad": "", "pads": [1, 0, 2, 1]},
                      feeds={"x": ("float32", [1, 2, 5, 6])},
                      consts={"w": rng.standard_normal([3, 2, 3, 3]).astype(np.float32)},
                      oracle_attrs={"pads": [1, 0, 2, 1]})])


# -- Col2Im ------------------------------------------------------------------------------------


def col2im_case(rng: np.random.Generator, r: int, dtype: str = "float32", oracle: str = "ort",
                symbolic_batch: bool = False) -> Case:
    block = [int(rng.integers(1, 4)) for _ in range(r)]
    attrs: dict = {}
    if rng.random() < 0.8:
        attrs["strides"] = [int(rng.integers(1, 4)) for _ in range(r)]
    if rng.random() < 0.7:
        attrs["pads"] = [int(rng.integers(0, 3)) for _ in range(2 * r)]
    if rng.random() < 0.5:
        attrs["dilations"] = [int(rng.integers(1, 3)) for _ in range(r)]
    s = attrs.get("strides", [1] * r)
    p = attrs.get("pads", [0] * 2 * r)
    d = attrs.get("dilations", [1] * r)
    image = [int(rng.integers(1, 8)) + d[a] * (block[a] - 1) for a in range(r)]
    blocks = [(image[a] + p[a] + p[r + a] - d[a] * (block[a] - 1) - 1) // s[a] + 1 for a in range(r)]
    c = int(rng.integers(1, 4))
    shape = ["n" if symbolic_batch else 2, c * int(np.prod(block)), int(np.prod(blocks))]
    return Case("Col2Im", ["x", "image", "block"], attrs, feeds={"x": (dtype, shape)},
                consts={"image": np.array(image, np.int64), "block": np.array(block, np.int64)},
                oracle=oracle)


@pytest.mark.parametrize("rank", [2, 3])
def test_col2im_random(rank):
    rng = np.random.default_rng(100 + rank)
    # onnxruntime 1.32 misplaces padded 3-D blocks (checked against a direct loop); onnx's
    # reference evaluator is the oracle there
    oracle = "ort" if rank == 2 else "reference"
    cases = [col2im_case(rng, rank, oracle=oracle, symbolic_batch=i % 2 == 0) for i in range(12)]
    check_cases(cases, opset=18, sizes=({"n": 1}, {"n": 3}))


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # int8 sums wrap, in both
def test_col2im_other_dtypes_against_reference():
    rng = np.random.default_rng(7)
    cases = [col2im_case(rng, 2, dtype, oracle="reference")
             for dtype in ("float64", "int32", "int64", "int8", "uint8") for _ in range(2)]
    check_cases(cases, opset=18)
    check_cases([col2im_case(rng, 2, "float16", oracle="reference") for _ in range(3)], opset=18,
                **F16)


def test_col2im_image_shape_from_the_input_dims():
    # image_shape = Shape(ref)[2:]: symbolic spatial dims; L (the block count) is checked at
    # call time against them
    from onnx import numpy_helper

    nodes = [helper.make_node("Shape", ["ref"], ["ref_shape"], start=2),
             helper.make_node("Col2Im", ["x", "ref_shape", "block"], ["y"], strides=[2, 1],
                              pads=[1, 0, 0, 1])]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", 1, ["n", 12, "l"]),
         helper.make_tensor_value_info("ref", 1, [1, 1, "h", "w"])],
        [helper.make_tensor_value_info("y", 1, ["n", 2, "h", "w"])],
        [numpy_helper.from_array(np.array([2, 3], np.int64), "block")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    compiled = cuvil.compile(model)
    from oracle import assert_matches_ort

    rng = np.random.default_rng(5)
    for n, h, w in [(1, 4, 5), (2, 7, 3)]:
        blocks = ((h + 1 - 2) // 2 + 1) * ((w + 1 - 3) + 1)
        feeds = {"x": rng.standard_normal((n, 12, blocks)).astype(np.float32),
                 "ref": np.zeros((1, 1, h, w), np.float32)}
        assert_matches_ort(model, feeds, compiled=compiled)
    with pytest.raises(ValueError, match="number of block positions"):
        compiled.run({"x": np.zeros((1, 12, 5), np.float32), "ref": np.zeros((1, 1, 4, 5), np.float32)})


@pytest.mark.parametrize("image,block,attrs,x_shape,message", [
    ([4, 4], [2, 2], {}, [1, 8, 10], "must equal the number of block positions"),
    ([4, 4], [2, 2], {}, [1, 6, 9], "not a multiple of the block size"),
    ([4, 4], [2], {}, [1, 8, 9], "same number"),
    ([4, 4], [2, 2], {"strides": [1]}, [1, 8, 9], "strides \\[1\\] must hold 2 values"),
    ([2, 4], [3, 2], {}, [1, 12, 3], "does not fit in the padded image"),
    ([4, 4], [2, 2], {"pads": [0, 0, -1, 0]}, [1, 8, 9], "pads"),
])
def test_col2im_errors(image, block, attrs, x_shape, message):
    from onnx import numpy_helper

    g = helper.make_graph(
        [helper.make_node("Col2Im", ["x", "image", "block"], ["y"], name="fold", **attrs)], "g",
        [helper.make_tensor_value_info("x", 1, x_shape)],
        [helper.make_tensor_value_info("y", 1, ["a", "b", "c", "d"])],
        [numpy_helper.from_array(np.array(image, np.int64), "image"),
         numpy_helper.from_array(np.array(block, np.int64), "block")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    with pytest.raises(ModelError, match=message) as info:
        cuvil.compile(model)
    assert "'fold'" in str(info.value)
