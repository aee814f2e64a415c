"""The matrix-vector kernel against numpy, compiled for each x86 instruction set it targets
(SSE, AVX2, AVX-512: vector widths 4, 8, 16 and accumulator budgets 8 and 16): every row count,
each layout of B, column counts around its blocks, panels and masked tails, K around its
interleaved parts, the epilogues, alpha and accumulate; columns split over the pool's threads."""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import numpy as np
import pytest
from kernel_library import FEATURES, host_module, link, skip_unless_host_has
from llvmlite import ir

from cuvil.compiler.kernels.emitter import I32, I64, PTR, Emitter
from cuvil.compiler.kernels.gemm import Epilogue, pack_b
from cuvil.compiler.kernels.gemv import LAYOUTS, emit_parallel_gemv

EPILOGUES = [Epilogue(), Epilogue("col", activation="Relu"), Epilogue("row", residual=True),
             Epilogue("none", residual=True, activation="Tanh")]
ACTIVATIONS = {None: lambda y: y, "Relu": lambda y: np.maximum(y, 0), "Tanh": np.tanh}
ALPHAS = (1.0, -0.5)


#: the (epilogue, alpha index, accumulate) cases under test, each for every layout of B
CASES = [(0, 0, False), (1, 1, False), (2, 0, True), (3, 1, True)]


def build(tmp: Path, features: str) -> ctypes.CDLL:
    """gemv_<e>_<layout>_<alpha index>(dims[M, N, K, acc], A, B, C, bias, residual) for each
    case of CASES and layout, with the case's accumulate flag (only what the tests call: LLVM's
    optimizer is most of the test's time)."""
    module, tm, target = host_module(features)
    for (e, ai, accumulate), layout in itertools.product(CASES, LAYOUTS):
        ep, alpha = EPILOGUES[e], ALPHAS[ai]
        fn = ir.Function(module, ir.FunctionType(I32, [PTR] * 6), f"gemv_{e}_{layout}_{ai}")
        k = Emitter(module, fn, fn.args[0], [], {}, target)
        m, n, kk, acc = (k.b.load(k.b.gep(fn.args[0], [k.i64(i)], source_etype=I64), typ=I64)
                         for i in range(4))
        a, b, c, bias, residual = fn.args[1:]
        ldb = kk if layout == "transposed" else n
        # the case's own accumulate flag only (dims[3] must say it; another value writes nothing)
        with k.if_then(k.b.icmp_signed("==", acc, k.i64(int(accumulate)))):
            emit_parallel_gemv(k, m, n, kk, a, kk, b, ldb, c, n, layout=layout,
                               accumulate=accumulate, bias=bias,
                               residual=residual if ep.residual else None, epilogue=ep,
                               alpha=alpha)
        k.b.ret(ir.Constant(I32, 0))
    return link(tmp, module, tm)


@pytest.fixture(scope="module", params=sorted(FEATURES))
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    skip_unless_host_has(request.param)
    return build(tmp_path_factory.mktemp(request.param), FEATURES[request.param])


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (17, 16), (31, 33), (70, 64), (130, 7),
                                   (1000, 301), (2049, 40)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("e", "alpha", "accumulate"), CASES)
def test_gemv_matches_numpy(lib: ctypes.CDLL, rows: int, shape, layout: str, e: int,
                            alpha: int, accumulate: bool) -> None:
    n, kk = shape
    rng = np.random.default_rng(rows * 7919 + n * 31 + kk)
    a = rng.standard_normal((rows, kk)).astype(np.float32)
    b = rng.standard_normal((kk, n)).astype(np.float32)
    c = rng.standard_normal((rows, n)).astype(np.float32)
    bias = rng.standard_normal(max(rows, n)).astype(np.float32)
    residual = rng.standard_normal((rows, n)).astype(np.float32)
    ep = EPILOGUES[e]
    want = ALPHAS[alpha] * (a.astype(np.float64) @ b) + (c if accumulate else 0)
    want += bias[:rows, None] if ep.bias == "row" else bias[None, :n] if ep.bias == "col" else 0
    want = ACTIVATIONS[ep.activation](want + (residual if ep.residual else 0))
    b_in = {"packed": pack_b(b), "rows": b, "transposed": np.ascontiguousarray(b.T)}[layout]
    fn = getattr(lib, f"gemv_{e}_{layout}_{alpha}")
    fn.argtypes = [ctypes.c_void_p] * 6
    dims = (ctypes.c_int64 * 4)(rows, n, kk, int(accumulate))
    fn(dims, a.ctypes.data, b_in.ctypes.data, c.ctypes.data, bias.ctypes.data,
       residual.ctypes.data)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4 * np.sqrt(kk))
