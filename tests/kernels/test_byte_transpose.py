"""The byte transpose (kernels/byte_transpose.py) against numpy: whole 16 x 16 tiles, the
partial tiles of a constant count of rows or columns left past them, the edges copied byte by
byte where the count is known only at run time, strides wider than the matrix (the bytes
between rows must stay as they were), every instruction set the host runs."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from kernel_library import FEATURES, host_module, link, skip_unless_host_has
from llvmlite import ir

from cuvil.compiler.kernels.byte_transpose import emit_byte_transpose
from cuvil.compiler.kernels.emitter import I32, I64, PTR, Emitter
from cuvil.compiler.kernels.target import KernelTarget

#: (rows, cols): tiles only, rows or columns past them, both, fewer than a tile, a conv's
#: 3 channels by 12544 positions, its 24 channels, several chunks of column tiles
SHAPES = [(16, 32), (35, 16), (16, 37), (35, 37), (3, 5), (1, 1), (3, 12544), (24, 784),
          (17, 600), (48, 3)]


def _emit(module: ir.Module, target: KernelTarget, name: str, rows: int | None,
          cols: int | None) -> None:
    """`int32 name(src, dst, dims[rows, cols, src_stride, dst_stride])`, rows and cols baked
    in as constants where given (the partial tiles), else read at run time."""
    fn = ir.Function(module, ir.FunctionType(I32, [PTR, PTR, PTR]), name)
    k = Emitter(module, fn, fn.args[2], [], {}, target)
    src, dst, dims = fn.args
    got = [k.b.load(k.b.gep(dims, [k.i64(i)], source_etype=I64), typ=I64) for i in range(4)]
    n_rows = k.i64(rows) if rows is not None else got[0]
    n_cols = k.i64(cols) if cols is not None else got[1]
    emit_byte_transpose(k, src, got[2], dst, got[3], n_rows, n_cols)
    k.b.ret(ir.Constant(I32, 0))


@pytest.fixture(scope="module", params=sorted(FEATURES))
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    skip_unless_host_has(request.param)
    module, tm, target = host_module(FEATURES[request.param])
    for i, (rows, cols) in enumerate(SHAPES):
        for kind, known in (("c", (rows, cols)), ("r", (None, None)), ("m", (rows, None))):
            _emit(module, target, f"t{i}{kind}", *known)
    return link(tmp_path_factory.mktemp(f"transpose_{request.param}"), module, tm)


@pytest.mark.parametrize("kind", ["c", "r", "m"])
def test_transposes_like_numpy(lib, kind: str) -> None:
    rng = np.random.default_rng(5)
    for i, (rows, cols) in enumerate(SHAPES):
        for pad in (0, 3):  # strides equal to the extent, and wider
            src_stride, dst_stride = cols + pad, rows + pad
            src = rng.integers(0, 256, rows * src_stride + 1).astype(np.uint8)
            dst = np.full(cols * dst_stride + 16, 0xA5, np.uint8)
            fn = getattr(lib, f"t{i}{kind}")
            fn.argtypes = [ctypes.c_void_p] * 3
            fn(src.ctypes.data, dst.ctypes.data,
               (ctypes.c_int64 * 4)(rows, cols, src_stride, dst_stride))
            want = src[:rows * src_stride].reshape(rows, src_stride)[:, :cols].T
            got = dst[:cols * dst_stride].reshape(cols, dst_stride)
            np.testing.assert_array_equal(got[:, :rows], want, err_msg=f"{rows} x {cols}")
            assert (got[:, rows:] == 0xA5).all(), f"{rows} x {cols}: wrote between rows"
            assert (dst[cols * dst_stride:] == 0xA5).all(), f"{rows} x {cols}: wrote past the end"
