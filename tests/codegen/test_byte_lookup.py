"""The byte lookup kernel (codegen/byte_lookup.py) for each way a library can hold it: byte at
a time (SSE, and AVX-512 without VBMI), VBMI named in the features, and VBMI behind the CPUID
test; against numpy's indexing, for lengths around the 64-byte vectors and both index types."""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import numpy as np
import pytest
from kernel_library import FEATURES, host_module, link_modules
from llvmlite import ir

from cuvil.compiler.codegen.byte_lookup import LOOKUP_TYPE, byte_lookup_function

AVX512 = FEATURES["avx512"]
#: name -> (features, host flag needed to run it)
KINDS = {"sse": ("", None), "avx512": (AVX512 + ",-avx512vbmi", "avx512bw"),
         "vbmi": (AVX512 + ",+avx512vbmi", "avx512vbmi"), "gated": (AVX512, "avx512bw")}


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> tuple[ctypes.CDLL, list[str]]:
    flags = {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f[0] == "+"}
    modules, built = [], []
    for name, (features, needs) in KINDS.items():
        if needs is not None and needs not in flags:
            continue
        module, tm = host_module(features)
        fn = ir.Function(module, LOOKUP_TYPE, f"lookup_{name}")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        b.call(byte_lookup_function(module), fn.args)
        b.ret_void()
        modules.append((module, tm))
        built.append(name)
    return link_modules(tmp_path_factory.mktemp("lookup"), modules), built


@pytest.mark.parametrize("signed", [False, True])
def test_every_kind_looks_up_every_byte(lib, signed: bool) -> None:
    library, built = lib
    assert "sse" in built
    rng = np.random.default_rng(int(signed))
    table = rng.integers(0, 256, 256).astype(np.uint8)
    for name in built:
        fn = getattr(library, f"lookup_{name}")
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_uint8]
        for n in (0, 1, 63, 64, 65, 200, 4099):
            src = rng.integers(0, 256, n + 3).astype(np.uint8)
            if n >= 256:
                src[:256] = np.arange(256)  # every byte once
            dst = np.full(n + 3, 7, np.uint8)  # the 3 bytes past n must stay as they are
            fn(table.ctypes.data, src.ctypes.data, dst.ctypes.data, n, 0x80 if signed else 0)
            want = table[src[:n] ^ (0x80 if signed else 0)]
            np.testing.assert_array_equal(dst[:n], want, err_msg=f"{name} n={n}")
            assert (dst[n:] == 7).all(), f"{name} n={n} wrote past the end"
