"""The shared GEMM kernel against numpy: every edge of the tiling, the epilogues (bias,
residual, activations), threads, and the tile shapes of each x86 instruction set the kernel
targets."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from kernel_library import FEATURES, cpu_of, host_module, link, skip_unless_host_has
from llvmlite import ir

from cuvil.compiler.codegen.module import hide_declarations
from cuvil.compiler.kernels.emitter import I32, I64, PTR, Emitter
from cuvil.compiler.kernels.gemm import Epilogue, Layout, emit_parallel_gemm, pack_a, pack_b
from cuvil.compiler.kernels.target import KernelTarget

EPILOGUES = [Epilogue(), Epilogue("row"), Epilogue("col", activation="Relu"),
             Epilogue("none", activation="Relu"), Epilogue("row", residual=True, activation="Relu"),
             Epilogue("col", residual=True, activation="Tanh"), Epilogue("none", residual=True)]
ACTIVATIONS = {None: lambda y: y, "Relu": lambda y: np.maximum(y, 0), "Tanh": np.tanh}
#: the operand layouts: row-major, A packed (conv weights), B packed (Linear weights), both
LAYOUTS = [Layout(), Layout(packed_a=True), Layout(packed_b=True), Layout(True, True)]


#: the (epilogue, layout) pairs under test: every epilogue row-major; packed operands: a few
#: epilogues suffice (bias none / row + residual / col + residual + Tanh)
KERNELS = ([(e, 0) for e in range(len(EPILOGUES))]
           + [(e, layout) for layout in range(1, len(LAYOUTS)) for e in (0, 4, 5)])


def build(tmp: Path, features: str) -> ctypes.CDLL:
    """A library exporting gemm_<i>_<l>(dims[M,N,K,acc], A, B, C, bias, residual) for each
    (epilogue i, layout l) of KERNELS (only those: LLVM's optimizer is most of the test's time)."""
    module, tm, target = host_module(features)
    for e, li in KERNELS:
        ep, layout = EPILOGUES[e], LAYOUTS[li]
        fn = ir.Function(module, ir.FunctionType(I32, [PTR] * 6), f"gemm_{e}_{li}")
        k = Emitter(module, fn, fn.args[0], [], {}, target)
        dims = [k.b.load(k.b.gep(fn.args[0], [k.i64(i)], source_etype=I64), typ=I64)
                for i in range(4)]
        m, n, kk, acc = dims
        a, b, c, bias, residual = fn.args[1:]
        for flag in (0, 1):
            with k.if_then(k.b.icmp_signed("==", acc, k.i64(flag))):
                emit_parallel_gemm(k, m, n, kk, a, kk, b, n, c, n, accumulate=bool(flag),
                                   bias=bias, residual=residual if ep.residual else None,
                                   epilogue=ep, layout=layout)
        k.b.ret(ir.Constant(I32, 0))
    return link(tmp, module, tm)


@pytest.fixture(scope="module", params=sorted(FEATURES))
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    skip_unless_host_has(request.param)
    return build(tmp_path_factory.mktemp(request.param), FEATURES[request.param])


def reference(a, b, c0, bias, residual, ep: Epilogue, accumulate: bool) -> np.ndarray:
    y = a.astype(np.float64) @ b.astype(np.float64)
    if accumulate:
        y += c0
    if ep.bias == "row":
        y += bias[: a.shape[0], None]
    elif ep.bias == "col":
        y += bias[None, : b.shape[1]]
    if ep.residual:
        y += residual
    return ACTIVATIONS[ep.activation](y)


@pytest.mark.parametrize("shape", [(1, 1, 1), (6, 16, 5), (7, 17, 3), (5, 9, 33), (13, 70, 64),
                                   (200, 3, 50), (3, 300, 17), (64, 4099, 27), (130, 130, 130),
                                   # partial panels of packed operands, parallel blocks
                                   (25, 49, 576), (64, 196, 40), (100, 1000, 9), (1000, 50, 20),
                                   # 7 panels of columns: blocks of 3 and 4 panels
                                   (160, 196, 72),
                                   # K over several blocks of KC, with and without packed panels
                                   (20, 40, 600), (13, 33, 513), (5, 20, 300), (150, 40, 300),
                                   # N past NARROW with packed B: K in one block (A's rows fit
                                   # WHOLE_K_BYTES; or not even a block of KC would), or KC
                                   (20, 300, 600), (300, 260, 520), (100, 270, 1400),
                                   # N <= 4 with packed A (`narrow_panel`): whole panels
                                   # and rows past them, K over blocks, N 5 just past it
                                   (24, 1, 600), (256, 4, 240), (37, 2, 7), (12, 3, 1),
                                   (60, 5, 33)])
@pytest.mark.parametrize(("e", "layout"), KERNELS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_matches_numpy(lib: ctypes.CDLL, shape, e: int, accumulate: bool,
                            layout: int) -> None:
    m, n, kk = shape
    rng = np.random.default_rng(m * 1000 + n + kk)
    a = rng.standard_normal((m, kk)).astype(np.float32)
    b = rng.standard_normal((kk, n)).astype(np.float32)
    c = rng.standard_normal((m, n)).astype(np.float32)
    bias = rng.standard_normal(max(m, n)).astype(np.float32)
    residual = rng.standard_normal((m, n)).astype(np.float32)
    want = reference(a, b, c, bias, residual, EPILOGUES[e], accumulate)
    dims = (ctypes.c_int64 * 4)(m, n, kk, int(accumulate))
    fn = getattr(lib, f"gemm_{e}_{layout}")
    fn.argtypes = [ctypes.c_void_p] * 6
    a_in = pack_a(a) if LAYOUTS[layout].packed_a else a
    b_in = pack_b(b) if LAYOUTS[layout].packed_b else b
    fn(dims, a_in.ctypes.data, b_in.ctypes.data, c.ctypes.data, bias.ctypes.data,
       residual.ctypes.data)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4 * np.sqrt(kk))


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_each_level_uses_its_full_vector_width(level: str) -> None:
    # LLVM tunes x86-64-v4 to prefer 256-bit vectors; the kernel's explicit 16-float vectors
    # must still become ZMM instructions there (and AVX2 code must not touch ZMM)
    import llvmlite.binding as llvm

    from cuvil.toolchains import get_target, target_machine

    arch = get_target("x86_64-linux").arches[0]
    features = next(v.features for v in arch.variants if v.cpu == cpu_of(FEATURES[level]))
    tm = target_machine(arch, cpu=cpu_of(features), features=features)
    module = ir.Module("g")
    module.triple = arch.llvm_triple
    module.data_layout = str(tm.target_data)
    fn = ir.Function(module, ir.FunctionType(I32, [PTR] * 4), "gemm")
    k = Emitter(module, fn, fn.args[0], [], {}, KernelTarget(module.triple, features))
    size = k.i64(64)
    emit_parallel_gemm(k, size, size, size, fn.args[1], size, fn.args[2], size, fn.args[3], size,
                       accumulate=False, bias=fn.args[0], epilogue=Epilogue())
    k.b.ret(ir.Constant(I32, 0))
    mod = llvm.parse_assembly(hide_declarations(str(module), "-"))
    asm = tm.emit_assembly(mod)
    fma = [line for line in asm.splitlines() if "vfmadd" in line]
    assert fma, "no fused multiply-adds in the kernel"
    assert all(("%zmm" in line) == (level == "avx512") for line in fma), fma[:3]
