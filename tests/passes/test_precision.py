"""precision = "bf16": models whose products compute in bfloat16 agree with onnxruntime (float32)
within the bound docs/precision.md documents, take the bf16 paths (and only for the products it
covers), keep a symbolic batch working, classify held-out digits as float32 does; the setting
is read from the project and checked.

Where the CPU has no bf16 instructions (a copy below AVX-512, or CUVIL_BF16=0) the products run
float32 on the bf16 weights widened: they then match onnxruntime's float32 run of the model
with those weights rounded to bf16 at float32's tolerance; the bf16 kernels (this host's, when
it has AVX-512 BF16 or AMX) round the activations too, and do not."""

from __future__ import annotations

import shutil
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
import pytest
from onnx import helper, numpy_helper
from oracle import make_model, run_ort

import cuvil
from cuvil.compiler.driver import compile_in_process, compile_model
from cuvil.compiler.frontend import import_model
from cuvil.compiler.passes import run_passes
from cuvil.compiler.passes.plan_memory import plan_memory
from cuvil.config import CompileOptions
from cuvil.errors import ConfigError
from cuvil.runtime._loader import Model

ROOT = Path(__file__).resolve().parents[2]
#: docs/precision.md: an output is within this fraction of the largest output of its tensor;
#: a probability after a softmax within this much of float32's
BOUND = 2e-2
PROBABILITY_BOUND = 5e-2


def _mixed_model():
    """A strided 3x3 conv (im2col), a 1x1 conv with a residual, a grouped conv, a Winograd
    F(4x4) conv (stays float32), a strided 3x3 conv and a 1x1 conv with a residual over a 9x9 map
    (transposed products), Gemm (transB) and MatMul with constant weights, batch symbolic."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"]),
        helper.make_node("Add", ["c2", "r1"], ["a2"]),
        helper.make_node("Conv", ["a2", "w3"], ["c3"], group=4, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c3", "w4"], ["c4"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c4", "w5", "b5"], ["c5"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c5"], ["r5"]),
        helper.make_node("Conv", ["r5", "w6"], ["c6"]),
        helper.make_node("Add", ["c6", "r5"], ["a6"]),
        helper.make_node("Relu", ["a6"], ["r6"]),
        helper.make_node("GlobalAveragePool", ["r6"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["g"], transB=1),
        helper.make_node("MatMul", ["g", "wm"], ["y"]),
    ]
    weights = {"w1": w(40, 3, 3, 3), "b1": w(40), "w2": w(40, 40, 1, 1), "w3": w(40, 10, 3, 3),
               "w4": w(64, 40, 3, 3), "w5": w(48, 64, 3, 3), "b5": w(48), "w6": w(48, 48, 1, 1),
               "wg": w(50, 48), "bg": w(50), "wm": w(50, 37)}
    return make_model(nodes, {"x": (np.float32, ["batch", 3, 33, 33])}, {"y": np.float32},
                      weights)


#: the weights of _mixed_model's products that run in bf16 (not w4's, a Winograd F(4x4) conv's)
BF16_PRODUCTS = ("w1", "w2", "w3", "w5", "w6", "wg", "wm")
#: float32 arithmetic on the same weights: the tolerance of the float32 op tests
F32_RTOL, F32_ATOL = 1e-4, 1e-5


def _host_flags() -> set[str]:
    return {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f[0] == "+"}


def _rounded_to_bf16(model, names):
    """The model with the initializers `names` rounded to bf16 (nearest, ties to even), as
    numpy computes it: the weights a bf16 library holds, in a float32 model."""
    out = type(model)()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in names:
            bits = numpy_helper.to_array(init).astype(np.float32).view(np.uint32).astype(np.uint64)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            init.CopyFrom(numpy_helper.from_array(bits.astype(np.uint32).view(np.float32),
                                                  init.name))
    return out


def _errors(compiled, model, batch: int) -> tuple[float, float]:
    """Largest error relative to the largest output: against onnxruntime's float32 run of the
    model, and of the model with its bf16 products' weights rounded to bf16."""
    x = np.random.default_rng(batch).standard_normal((batch, 3, 33, 33)).astype(np.float32)
    got = compiled(x)
    errs = []
    for oracle in (model, _rounded_to_bf16(model, BF16_PRODUCTS)):
        want = run_ort(oracle, {"x": x})[0]
        errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
    if errs[1] < F32_RTOL:  # the float32 path: elementwise, as the float32 op tests compare
        want = run_ort(_rounded_to_bf16(model, BF16_PRODUCTS), {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=F32_RTOL, atol=F32_ATOL * np.abs(want).max())
    return errs[0], errs[1]


@pytest.fixture(scope="module")
def mixed():
    model = _mixed_model()
    return model, cuvil.compile(model, precision="bf16")


def test_bf16_model_matches_onnxruntime_within_the_bound(mixed) -> None:
    model, compiled = mixed
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 33, 33)).astype(np.float32)
        want = run_ort(model, {"x": x})[0]
        got = compiled(x)
        err = np.abs(got - want).max() / np.abs(want).max()
        # within the bound, and not float32's result: the products did run in bf16
        assert 1e-5 < err < BOUND, err


@pytest.mark.slow  # a compile per CPU level
@pytest.mark.parametrize("cpu", ["x86-64-v3", "x86-64-v2"])
def test_copies_without_bf16_kernels_compute_float32(cpu: str) -> None:
    # the AVX2 and SSE copies (what Haswell and Nehalem run): float32 on the bf16 weights
    model = _mixed_model()
    compiled = compile_in_process(model, cpu=cpu, precision="bf16")
    for batch in (1, 5):
        err, err_rounded = _errors(compiled, model, batch)
        assert err_rounded < F32_RTOL and 1e-5 < err < BOUND, (batch, err, err_rounded)


@pytest.mark.slow  # a library with every CPU copy
def test_every_copy_takes_this_cpus_path(tmp_path: Path) -> None:
    # the library a wheel holds (a copy per CPU level, picked at load): bf16 here only if the
    # CPU has AVX-512 BF16 or AMX-BF16 (every AMX CPU has the former)
    model = _mixed_model()
    compiled = compile_model(model, "mixed", tmp_path, CompileOptions(precision="bf16"))
    loaded = Model(compiled.library, compiled.signature)
    err, err_rounded = _errors(loaded, model, 3)
    if {"avx512f", "avx512bf16"} <= _host_flags():
        assert err_rounded > 1e-4 and err < BOUND, (err, err_rounded)
    else:
        assert err_rounded < F32_RTOL and 1e-5 < err < BOUND, (err, err_rounded)


def test_the_avx512_copy_holds_both_paths() -> None:
    # its products ask the CPU (`bf16_hardware`), then call the bf16 kernel or the float32
    # one; the AVX2 copy and AArch64 hold no bf16 kernel (checked on the modules, on any host)
    from cuvil.compiler.codegen.module import build_module
    from cuvil.compiler.kernels.objects import KernelSet
    from cuvil.toolchains import get_target, target_machine

    graph = import_model(_mixed_model(), None, "m")
    graph.precision = "bf16"
    plan = plan_memory(run_passes(graph))
    arch = get_target("x86_64-linux").arches[0]
    arm = get_target("aarch64-linux").arches[0]
    kernels = {}
    for cpu, features, triple in [*((v.cpu, v.features, arch.llvm_triple) for v in arch.variants),
                                  (arm.cpu, arm.features, arm.llvm_triple)]:
        tm = target_machine(arm if triple == arm.llvm_triple else arch, cpu=cpu,
                            features=features)
        kernels[cpu] = KernelSet(cpu)
        build_module(graph, plan, "m", "0", triple, str(tm.target_data), features=features,
                     variant=1, kernels=kernels[cpu])
    names = {cpu: {symbol.rsplit(".", 1)[0] for symbol in ks.requests}
             for cpu, ks in kernels.items()}
    assert {"cuvil.bf16.hardware", "cuvil.bf16gemm.a.row_relu", "cuvil.bf16gemm.b.none"} <= \
        names["x86-64-v4"], names["x86-64-v4"]
    assert any(n.startswith("cuvil.gemm.") and n.endswith("_pa") for n in names["x86-64-v4"])
    for cpu in ("x86-64-v3", arm.cpu):
        assert not any("bf16" in n for n in names[cpu]), names[cpu]


@pytest.fixture(scope="module")
def avx512_copy(tmp_path_factory: pytest.TempPathFactory):
    """The AVX-512 copy (x86-64-v4), which asks the CPU at its first product."""
    if "avx512f" not in _host_flags():
        pytest.skip("this CPU has no AVX-512: the x86-64-v4 copy cannot run")
    model = _mixed_model()
    return model, compile_model(model, "mixed", tmp_path_factory.mktemp("v4"),
                                CompileOptions(cpu="x86-64-v4", precision="bf16"))


def _fresh(compiled, tmp_path: Path) -> Model:
    """The library loaded from a copy of its own (a library loaded once keeps its answers)."""
    path = tmp_path / compiled.library.name
    shutil.copy(compiled.library, path)
    return Model(path, compiled.signature)


@pytest.mark.slow  # compiles the x86-64-v4 copy on its own
def test_avx512_copy_computes_float32_when_told(avx512_copy, monkeypatch, tmp_path) -> None:
    # CUVIL_BF16=0: the path of an AVX-512 CPU without bf16 (Skylake-X, Ice Lake), here
    model, compiled = avx512_copy
    monkeypatch.setenv("CUVIL_BF16", "0")
    loaded = _fresh(compiled, tmp_path)
    for batch in (1, 5):
        err, err_rounded = _errors(loaded, model, batch)
        assert err_rounded < F32_RTOL and 1e-5 < err < BOUND, (batch, err, err_rounded)


@pytest.mark.slow  # compiles the x86-64-v4 copy on its own
def test_avx512_copy_runs_bf16_where_the_cpu_has_it(avx512_copy, tmp_path) -> None:
    model, compiled = avx512_copy
    if not _host_flags() & {"avx512bf16", "amx-bf16"}:
        pytest.skip("this CPU has neither AVX-512 BF16 nor AMX-BF16")
    loaded = _fresh(compiled, tmp_path)
    for batch in (1, 5):
        err, err_rounded = _errors(loaded, model, batch)
        # the activations are rounded too: not float32's result on the rounded weights
        assert err_rounded > 1e-4 and err < BOUND, (batch, err, err_rounded)


def test_float32_panels_are_derived_last_and_on_demand() -> None:
    # the first run populates the derived buffer up to them: a bf16 CPU never touches them
    graph = import_model(_mixed_model(), None, "m")
    graph.precision = "bf16"
    plan = plan_memory(run_passes(graph))
    bf16 = {node: at for node, at in plan.derived.items() if "cuvil.bf16_weights" in node.attrs}
    assert len(bf16) == len(BF16_PRODUCTS) and min(bf16.values()) >= plan.derived_eager_size
    assert all(at < plan.derived_eager_size for node, at in plan.derived.items()
               if node not in bf16)
    fp32 = sum(int(np.prod(w.dims)) * 4 for w in _mixed_model().graph.initializer
               if w.name in BF16_PRODUCTS)
    assert plan.derived_size - plan.derived_eager_size >= fp32


def test_bf16_paths_are_the_products_it_covers(mixed) -> None:
    _, compiled = mixed
    x = np.zeros((2, 3, 33, 33), np.float32)
    ops = [row.op for row in compiled.profile({"x": x}, runs=1).nodes]
    assert sum("Conv(bf16)" in op for op in ops) == 5, ops
    assert any(op.startswith("Conv(winograd)") for op in ops), ops
    assert any(op.startswith("Gemm(bf16)") for op in ops) and "MatMul(bf16)" in ops, ops


# -- Winograd F(2x2) convolutions in bf16 -------------------------------------------------------

#: Lavin & Gray's F(2x2, 3x3): Y = A^T [(G g G^T) * (B^T d B)] A per 4x4 input tile
_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64)
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float64)
_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bf16 (nearest, ties to even), as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _winograd_f2(x: np.ndarray, w: np.ndarray, bias: np.ndarray, round_v: bool) -> np.ndarray:
    """relu(conv(x, w, pads 1) + bias) by F(2x2, 3x3) in float64 with U rounded to bf16 (what
    a bf16 library stores), and V too where `round_v` (what the bf16 kernel rounds)."""
    n, c, h, wd = x.shape
    th, tw = -(-h // 2), -(-wd // 2)
    xp = np.zeros((n, c, 2 * th + 2, 2 * tw + 2))
    xp[:, :, 1:h + 1, 1:wd + 1] = x
    tiles = np.lib.stride_tricks.sliding_window_view(xp, (4, 4), axis=(2, 3))[:, :, ::2, ::2]
    u = _bf16(np.einsum("aj,ocjl,bl->ocab", _G, w.astype(np.float64), _G).astype(np.float32))
    v = np.einsum("ai,nctsij,bj->nctsab", _BT, tiles, _BT)
    if round_v:
        v = _bf16(v.astype(np.float32))
    m = np.einsum("ocab,nctsab->notsab", u, v)
    y = np.einsum("ia,notsab,jb->notisj", _AT, m, _AT).reshape(n, -1, 2 * th, 2 * tw)
    return np.maximum(y[:, :, :h, :wd] + bias[None, :, None, None], 0)


def _winograd_model(c: int, m: int, size: int):
    rng = np.random.default_rng(c + m + size)
    w = (rng.standard_normal((m, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    model = make_model(nodes, {"x": (np.float32, ["batch", c, size, size])}, {"y": np.float32},
                       {"w": w, "b": b})
    return model, w, b


#: (C, M, image): small images, whose products run transposed (one block of 49 tiles); odd
#: channel counts leave part of a panel and of a register tile
WINOGRAD_BF16_CONVS = [(100, 70, 14), (96, 90, 13)]


@pytest.mark.parametrize("c,m,size", WINOGRAD_BF16_CONVS)
def test_winograd_f2_convs_run_their_products_in_bf16(c: int, m: int, size: int) -> None:
    model, w, b = _winograd_model(c, m, size)
    compiled = cuvil.compile(model, precision="bf16")
    x = np.random.default_rng(size).standard_normal((2, c, size, size)).astype(np.float32)
    ops = [row.op for row in compiled.profile({"x": x}, runs=1).nodes]
    assert ops == ["Conv(winograd bf16)+Relu"], ops
    got = compiled(x)
    want = run_ort(model, {"x": x})[0]
    scale = np.abs(want).max()
    err = np.abs(got - want).max() / scale
    assert 1e-5 < err < BOUND, err
    if _host_flags() & {"avx512bf16", "amx-bf16"}:
        # both operands rounded: the reference with U and V rounded, but for V's that float32
        # and float64 round to different bf16 values (each moves one term by 2^-8 of itself)
        near = np.abs(got - _winograd_f2(x, w, b, round_v=True)).max() / scale
        assert near < err / 10, (near, err)
    else:
        np.testing.assert_allclose(got, _winograd_f2(x, w, b, round_v=False), rtol=F32_RTOL,
                                   atol=F32_ATOL * scale)


@pytest.mark.parametrize("c,m,size", WINOGRAD_BF16_CONVS)
def test_winograd_f2_convs_float32_path_uses_the_bf16_u(c: int, m: int, size: int) -> None:
    # the AVX2 copy: float32 products on U widened from bf16, at float32's tolerance
    model, w, b = _winograd_model(c, m, size)
    compiled = compile_in_process(model, cpu="x86-64-v3", precision="bf16")
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, c, size, size)).astype(np.float32)
        want = _winograd_f2(x, w, b, round_v=False)
        np.testing.assert_allclose(compiled(x), want, rtol=F32_RTOL,
                                   atol=F32_ATOL * np.abs(want).max())


def test_which_winograd_convs_run_in_bf16() -> None:
    # F(4x4) rounds too much for bf16 (docs/precision.md): the mixed model's 40 -> 64 conv at
    # 17x17 and a 96 -> 90 one at 21x21 keep it, in float32; a 32-channel one at 14x14 runs
    # im2col in bf16 instead; F(2x2) at 14x14 in bf16 (in a float32 model: F(4x4))
    from cuvil.compiler.ops._conv_winograd import WINOGRAD_TILE

    cases = {(40, 64, 17): (4, 4), (96, 90, 21): (4, 4), (32, 32, 14): (None, 4),
             (100, 70, 14): (2, 4)}
    for (c, m, size), tiles in cases.items():
        for precision, tile in zip(("bf16", "float32"), tiles):
            graph = import_model(_winograd_model(c, m, size)[0], None, "m")
            graph.precision = precision
            (conv,) = [n for n in run_passes(graph).nodes if n.op_type == "Conv"]
            assert conv.attrs.get(WINOGRAD_TILE) == tile, (c, m, size, precision, conv.attrs)
            bf16 = precision == "bf16" and tile != 4
            assert ("cuvil.bf16_weights" in conv.attrs) == bf16, conv.attrs


def test_digits_cnn_classifies_held_out_digits_as_float32_does() -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    _, x_test, _, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                                            stratify=digits.target)
    path = ROOT / "examples" / "digits" / "models" / "classifier.onnx"
    f32 = cuvil.compile(path)(x_test)
    bf16 = cuvil.compile(path, precision="bf16")(x_test)
    agree = np.mean(f32.argmax(1) == bf16.argmax(1))
    accuracy = {name: float(np.mean(p.argmax(1) == y_test)) for name, p in
                (("float32", f32), ("bf16", bf16))}
    assert agree >= 0.99 and abs(accuracy["bf16"] - accuracy["float32"]) <= 0.005, \
        (agree, accuracy)
    assert np.abs(bf16 - f32).max() < PROBABILITY_BOUND


def test_precision_is_checked() -> None:
    with pytest.raises(ConfigError, match="precision = 'fp8' is not one of 'float32', 'bf16'"):
        cuvil.compile(_mixed_model(), precision="fp8")


def test_precision_from_the_project(tmp_path: Path) -> None:
    from cuvil.config import load_project

    (tmp_path / "m.onnx").write_bytes(b"")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "1"\n[tool.cuvil.models.m]\nsource = "m.onnx"\n'
        'precision = "bf16"\n')
    assert load_project(tmp_path).models[0].precision == "bf16"
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "1"\n[tool.cuvil.models.m]\nsource = "m.onnx"\n'
        'precision = "half"\n')
    with pytest.raises(ConfigError, match=r'precision.*one of "float32", "bf16"'):
        load_project(tmp_path)
