"""The bf16 GEMM kernel against numpy: A and B rounded to bf16 (to nearest, ties to even) and
multiplied in float64, the kernel's float32 sums within their rounding of that. Every kernel
kind the host can run (AMX, AVX-512 BF16; and AMX's with its tile operations emulated in C,
tests/harness/amx_emulation.c, wherever AVX-512 BF16 runs), every side (weights on the right: Gemm/MatMul,
and the transposed convolutions, whose activations are read by columns; on the left:
convolutions), odd sizes, K over several blocks, the epilogues,
threads. Copies without bf16 instructions hold no bf16 kernel: there the float32 kernel
multiplies float32 panels derived from the bf16 weights, checked the same way (only B or W
rounded)."""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
import pytest
from kernel_library import FEATURES, host_module, link_modules
from llvmlite import ir

from cuvil.compiler.kernels.bf16_gemm import (
    SIDES,
    bf16_hardware,
    bf16_isa,
    bf16_isas,
    emit_float32_panels,
    emit_parallel_bf16_gemm,
    from_bf16,
    pack_l,
    pack_r,
    to_bf16,
)
from cuvil.compiler.kernels.emitter import I8, I32, I64, PTR, Emitter
from cuvil.compiler.kernels.gemm import Epilogue, Layout, emit_parallel_gemm
from cuvil.compiler.kernels.target import KernelTarget

AVX512 = FEATURES["avx512"]
#: name -> (LLVM features, host flags needed, the kind it must select first)
KINDS = {
    "dpbf16": (AVX512 + ",-amx-bf16,+avx512bf16", ("avx512bf16",), "dpbf16"),
    # the v4 copy: AMX, else AVX512-BF16, tested at run time (every AMX CPU has AVX512-BF16)
    "gated": (AVX512, ("avx512bf16",), "amx"),
    # the AMX kernel alone (no other in the chain, so no run-time test), its tile operations
    # emulated (EMULATED_KINDS): its loops, addresses and layouts run on CPUs without AMX
    "amx_emulated": (AVX512 + ",-avx512bf16", ("avx512bf16",), "amx"),
}
EMULATED_KINDS = ("amx_emulated",)
AMX_EMULATION = Path(__file__).parents[1] / "harness" / "amx_emulation.c"
EPILOGUES = [Epilogue(), Epilogue("row", residual=True, activation="Relu"),
             Epilogue("col", activation="Tanh")]
ACTIVATIONS = {None: lambda y: y, "Relu": lambda y: np.maximum(y, 0), "Tanh": np.tanh}


def _host_flags() -> set[str]:
    return {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f[0] == "+"}


#: the kinds whose every epilogue is tested (the others: the plain one; compile time)
EPILOGUE_KINDS = ("gated", "amx_emulated")


def _emit(module: ir.Module, target: KernelTarget, prefix: str,
          epilogues: int = len(EPILOGUES)) -> None:
    """`int32 <prefix>_<side>_<e>(dims[M, N, K, acc], L, R, C, bias, residual)` per side and
    epilogue (the first `epilogues`)."""
    for side in SIDES:
        for e, ep in enumerate(EPILOGUES[:epilogues]):
            fn = ir.Function(module, ir.FunctionType(I32, [PTR] * 6), f"{prefix}_{side}_{e}")
            k = Emitter(module, fn, fn.args[0], [], {}, target)
            m, n, kk, acc = (k.b.load(k.b.gep(fn.args[0], [k.i64(i)], source_etype=I64), typ=I64)
                             for i in range(4))
            left, right, c, bias, residual = fn.args[1:]
            for flag in (0, 1):
                with k.if_then(k.b.icmp_signed("==", acc, k.i64(flag))):
                    # side "bt": L by columns, [K, M]
                    ldl = m if side == "bt" else kk
                    emit_parallel_bf16_gemm(k, m, n, kk, left, ldl, right, n, c, n, side=side,
                                            accumulate=bool(flag), bias=bias,
                                            residual=residual if ep.residual else None,
                                            epilogue=ep)
            k.b.ret(ir.Constant(I32, 0))


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> tuple[ctypes.CDLL, dict[str, str]]:
    """One library holding every kind the host can run (one link for all); the kind each runs."""
    flags = _host_flags()
    modules, built = [], {}
    for name, (features, needs, first) in KINDS.items():
        if not set(needs) <= flags:
            continue
        module, tm, target = host_module(features)
        if name in EMULATED_KINDS:
            target = dataclasses.replace(target, emulate_amx=True)
        assert bf16_isa(target).kind == first
        _emit(module, target, name, len(EPILOGUES) if name in EPILOGUE_KINDS else 1)
        modules.append((module, tm))
        # what the gated copy runs here: the first kind whose test this host passes
        runs = first if name != "gated" else next(
            isa.kind for isa in bf16_isas(target)
            if {"amx": {"amx-bf16", "amx-tile"}, "dpbf16": {"avx512bf16"}}[isa.kind] <= flags)
        built[name] = runs
    if not modules:
        pytest.skip("this CPU has no bf16 instructions")
    return link_modules(tmp_path_factory.mktemp("bf16"), modules, (AMX_EMULATION,)), built


def _rounded(x: np.ndarray) -> np.ndarray:
    return from_bf16(to_bf16(x)).astype(np.float64)


def _run(lib, name: str, side: str, e: int, shape, accumulate: bool = False, seed: int = 0):
    m, n, kk = shape
    rng = np.random.default_rng(seed + m * 7919 + n * 31 + kk)
    a = rng.standard_normal((m, kk)).astype(np.float32)
    b = rng.standard_normal((kk, n)).astype(np.float32)
    c = rng.standard_normal((m, n)).astype(np.float32)
    bias = rng.standard_normal(max(m, n)).astype(np.float32)
    residual = rng.standard_normal((m, n)).astype(np.float32)
    ep = EPILOGUES[e]
    ra, rb = _rounded(a), _rounded(b)
    want = ra @ rb + (c if accumulate else 0)
    want += bias[:m, None] if ep.bias == "row" else bias[None, :n] if ep.bias == "col" else 0
    want += residual if ep.residual else 0
    want = ACTIVATIONS[ep.activation](want)
    # float32 sums of rounded products: a few ulps of the sum of |products| per output
    bound = 4e-6 * (np.abs(ra) @ np.abs(rb) + np.abs(c) + 1) + 1e-6
    left, right = ((pack_l(a), b) if side == "a" else
                   (np.ascontiguousarray(a.T) if side == "bt" else a, pack_r(b)))
    fn = getattr(lib, f"{name}_{side}_{e}")
    fn.argtypes = [ctypes.c_void_p] * 6
    fn((ctypes.c_int64 * 4)(m, n, kk, int(accumulate)), left.ctypes.data, right.ctypes.data,
       c.ctypes.data, bias.ctypes.data, residual.ctypes.data)
    return c, want, bound


#: odd sizes; K over several blocks; K = 512 and 2048, whose packed L rows get a cache line
#: more (`l_columns`); N = 130: four whole panels packed together, then a group of one column
SHAPES = [(1, 1, 1), (3, 5, 2), (12, 32, 32), (13, 33, 31), (17, 40, 70), (33, 70, 100),
          (64, 49, 576), (100, 7, 33), (5, 300, 1100), (13, 130, 512), (17, 33, 2048)]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("side", SIDES)
def test_matches_rounded_numpy(lib, kind: str, side: str) -> None:
    library, built = lib
    if kind not in built:
        pytest.skip(f"this CPU cannot run the {kind} kernel")
    for shape in SHAPES:
        got, want, bound = _run(library, kind, side, 0, shape)
        err = np.abs(got - want)
        assert np.all(err <= bound), (kind, built[kind], side, shape, float(np.max(err / bound)))


@pytest.mark.parametrize("kind", EPILOGUE_KINDS)
@pytest.mark.parametrize("e", range(len(EPILOGUES)))
@pytest.mark.parametrize("accumulate", [False, True])
def test_epilogues(lib, kind: str, e: int, accumulate: bool) -> None:
    library, built = lib
    if kind not in built:
        pytest.skip(f"this CPU cannot run the {kind} kernel")
    for side, shape in (("a", (45, 37, 600)), ("b", (37, 45, 70)), ("bt", (49, 45, 300))):
        got, want, bound = _run(library, kind, side, e, shape, accumulate)
        assert np.all(np.abs(got - want) <= bound), (kind, side, shape)


def test_differs_from_float32_by_bf16_rounding(lib) -> None:
    # the rounding is there (results are not float32 products) and of the size bf16 gives
    library, built = lib
    if "gated" not in built:
        pytest.skip("this CPU has no bf16 instructions")
    kind = "gated"
    got, _, _ = _run(library, kind, "b", 0, (20, 30, 256), seed=5)
    rng = np.random.default_rng(5 + 20 * 7919 + 30 * 31 + 256)
    a = rng.standard_normal((20, 256))
    b = rng.standard_normal((256, 30))
    exact = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64)
    rel = np.abs(got - exact) / (np.abs(a) @ np.abs(b))
    assert 1e-5 < rel.max() < 2 ** -8


def test_to_bf16_rounds_to_nearest_even() -> None:
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -2.5, np.inf,
                  np.float32(3.4e38), np.nan], np.float32)
    got = from_bf16(to_bf16(x))
    assert got[:5].tolist() == [1.0, 1.0, 1 + 4 * 2 ** -8, 1 + 2 * 2 ** -8, -2.5]
    assert got[5] == np.inf and got[6] == np.inf and np.isnan(got[7])


def test_copies_without_bf16_instructions_hold_no_bf16_kernel() -> None:
    from cuvil.toolchains import get_target, target_machine

    arch = get_target("aarch64-linux").arches[0]
    tm = target_machine(arch, cpu=arch.cpu)
    arm = ir.Module("g")
    arm.triple = arch.llvm_triple
    arm.data_layout = str(tm.target_data)
    hosts = [host_module(f) for f in ("", FEATURES["avx2"], AVX512 + ",-amx-bf16,-avx512bf16")]
    for module, target in [(arm, KernelTarget(arm.triple, arch.features)),
                           *((module, target) for module, _, target in hosts)]:
        fn = ir.Function(module, ir.FunctionType(I32, []), "f")
        assert bf16_isas(target) == []
        assert bf16_hardware(Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)) is None


#: copies with no bf16 kernel: their float32 GEMM kernel on the derived panels
PANEL_KINDS = {"sse": "", "avx512": AVX512 + ",-amx-bf16,-avx512bf16"}
#: (side, M, N, K, groups): side "a" W[M, K] per group @ X[K, N]; "b" A[M, K] @ B[K, N]
#: (K = 512: packed L rows of a cache line more, `l_columns`)
PANEL_SHAPES = [("a", 13, 9, 70, 2), ("a", 30, 5, 33, 1), ("a", 1, 1, 1, 1), ("a", 14, 6, 512, 2),
                ("b", 3, 45, 70, 1), ("b", 20, 70, 100, 1), ("b", 1, 1, 1, 1)]


@pytest.fixture(scope="module")
def panels_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """`int32 <kind>_<i>(L, R, C, panels)` for PANEL_SHAPES[i]: the float32 panels of the bf16
    operand into `panels`, then C = L @ R on the float32 kernel over them."""
    modules = []
    for kind, features in PANEL_KINDS.items():
        if kind == "avx512" and "avx512f" not in _host_flags():
            continue
        module, tm, target = host_module(features)
        for i, (side, m, n, kk, groups) in enumerate(PANEL_SHAPES):
            fn = ir.Function(module, ir.FunctionType(I32, [PTR] * 4), f"{kind}_{i}")
            k = Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)
            left, right, c, panels = fn.args
            b = k.b
            rows, cols = (m, kk) if side == "a" else (kk, n)
            emit_float32_panels(k, side, left if side == "a" else right, panels, rows, cols,
                                groups)
            for g in range(groups):
                at = [b.gep(p, [k.i64(g * size * 4)], source_etype=I8)
                      for p, size in ((panels, m * kk), (right, kk * n), (c, m * n))]
                if side == "a":
                    emit_parallel_gemm(k, k.i64(m), k.i64(n), k.i64(kk), at[0], k.i64(kk),
                                       at[1], k.i64(n), at[2], k.i64(n),
                                       layout=Layout(packed_a=True))
                else:
                    emit_parallel_gemm(k, k.i64(m), k.i64(n), k.i64(kk), left, k.i64(kk), panels,
                                       k.i64(n), c, k.i64(n), layout=Layout(packed_b=True))
            k.b.ret(ir.Constant(I32, 0))
        modules.append((module, tm))
    return link_modules(tmp_path_factory.mktemp("panels"), modules)


@pytest.mark.parametrize("kind", list(PANEL_KINDS))
def test_float32_panels_of_bf16_weights(panels_lib, kind: str) -> None:
    if kind == "avx512" and "avx512f" not in _host_flags():
        pytest.skip("this CPU has no AVX-512")
    for i, (side, m, n, kk, groups) in enumerate(PANEL_SHAPES):
        rng = np.random.default_rng(i)
        w = rng.standard_normal((groups, m, kk) if side == "a" else (kk, n)).astype(np.float32)
        x = rng.standard_normal((groups, kk, n) if side == "a" else (m, kk)).astype(np.float32)
        rw = _rounded(w)
        if side == "a":
            left, right = np.stack([pack_l(g) for g in w]), x
            want = rw @ x.astype(np.float64)
            bound = 4e-6 * (np.abs(rw) @ np.abs(x)) + 1e-6
        else:
            left, right = x, pack_r(w)
            want = x.astype(np.float64) @ rw
            bound = 4e-6 * (np.abs(x) @ np.abs(rw)) + 1e-6
        c = np.zeros(want.shape, np.float32)
        panels = np.zeros(w.size, np.float32)
        fn = getattr(panels_lib, f"{kind}_{i}")
        fn.argtypes = [ctypes.c_void_p] * 4
        fn(left.ctypes.data, right.ctypes.data, c.ctypes.data, panels.ctypes.data)
        assert np.all(np.abs(c - want) <= bound), (kind, side, m, n, kk, groups)
