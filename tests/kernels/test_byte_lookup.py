"""The byte lookup kernel (kernels/byte_lookup.py) for each way a library can hold it: byte at
a time (the SSE baseline), 16-entry shuffles (AVX2, AVX-512 without VBMI), VBMI named in the
features, VBMI behind the CPUID test, and AArch64's tbl/tbx under qemu; against numpy's
indexing, for lengths around the vectors and both index types."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
import pytest
from host_tools import AARCH64_LOADER, AARCH64_SYSROOT, tool
from kernel_library import FEATURES, host_module, link_modules
from llvmlite import ir

from cuvil.compiler.codegen.module import hide_declarations
from cuvil.compiler.kernels.byte_lookup import LOOKUP_TYPE, byte_lookup_function
from cuvil.compiler.kernels.target import KernelTarget
from cuvil.toolchains import get_target, target_machine, zig
from cuvil.toolchains.llvm import emit_object

AVX512 = FEATURES["avx512"]
#: name -> (features, host flag needed to run it)
KINDS = {"sse": ("", None), "avx2": (FEATURES["avx2"], "avx2"),
         "avx512": (AVX512 + ",-avx512vbmi", "avx512bw"),
         "vbmi": (AVX512 + ",+avx512vbmi", "avx512vbmi"), "gated": (AVX512, "avx512bw")}


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> tuple[ctypes.CDLL, list[str]]:
    flags = {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f[0] == "+"}
    modules, built = [], []
    for name, (features, needs) in KINDS.items():
        if needs is not None and needs not in flags:
            continue
        module, tm, target = host_module(features)
        fn = ir.Function(module, LOOKUP_TYPE, f"lookup_{name}")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        b.call(byte_lookup_function(module, target), fn.args)
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
        for n in (0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 200, 4099):
            src = rng.integers(0, 256, n + 3).astype(np.uint8)
            if n >= 256:
                src[:256] = np.arange(256)  # every byte once
            dst = np.full(n + 3, 7, np.uint8)  # the 3 bytes past n must stay as they are
            fn(table.ctypes.data, src.ctypes.data, dst.ctypes.data, n, 0x80 if signed else 0)
            want = table[src[:n] ^ (0x80 if signed else 0)]
            np.testing.assert_array_equal(dst[:n], want, err_msg=f"{name} n={n}")
            assert (dst[n:] == 7).all(), f"{name} n={n} wrote past the end"


ARM_HARNESS = Path(__file__).parents[1] / "harness" / "run_byte_lookup.c"
#: A64 encodings (Arm ARM): TBL and TBX Vd.16B, {4 registers}, Vm.16B
TBL4, TBX4 = 0x4E006000, 0x4E007000


def test_aarch64_tbl_kernel_under_qemu(tmp_path: Path) -> None:
    arch = get_target("aarch64-linux").arches[0]
    tm = target_machine(arch, cpu="generic", features="+neon")
    module = ir.Module("lookup")
    module.triple = arch.llvm_triple
    module.data_layout = str(tm.target_data)
    fn = ir.Function(module, LOOKUP_TYPE, "lookup")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    b.call(byte_lookup_function(module, KernelTarget(module.triple, "+neon")), fn.args)
    b.ret_void()
    code = emit_object(hide_declarations(str(module), "-"), tm)
    words = np.frombuffer(code[: len(code) // 4 * 4], "<u4")
    for name, value in (("tbl", TBL4), ("tbx", TBX4)):
        assert np.count_nonzero(words & 0xFFE0FC00 == value), f"no four-register {name}"
    qemu = tool("qemu-aarch64-static")
    tool(str(AARCH64_LOADER))
    (tmp_path / "lookup.o").write_bytes(code)
    program = tmp_path / "run_byte_lookup"
    proc = subprocess.run([*zig.zig_command(), "cc", "-target", arch.zig_target, "-O2",
                           "-std=c99", "-Wall", "-Werror", str(ARM_HARNESS),
                           str(tmp_path / "lookup.o"), "-o", str(program)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rng = np.random.default_rng(3)
    records, wanted = [], []
    for signed in (False, True):
        table = rng.integers(0, 256, 256).astype(np.uint8)
        for n in (0, 1, 15, 16, 17, 33, 255, 300):
            src = rng.integers(0, 256, n).astype(np.uint8)
            if n >= 256:
                src[:256] = np.arange(256)  # every byte once
            flip = 0x80 if signed else 0
            records.append(np.array([n, flip], "<i8").tobytes() + table.tobytes() + src.tobytes())
            wanted.append((n, signed, table[src ^ flip]))
    proc = subprocess.run([qemu, "-L", str(AARCH64_SYSROOT), "-cpu", "cortex-a72", str(program)],
                          input=b"".join(records), capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    at = 0
    for n, signed, want in wanted:
        got = np.frombuffer(proc.stdout[at:at + n + 16], np.uint8)
        at += n + 16
        np.testing.assert_array_equal(got[:n], want, err_msg=f"n={n} signed={signed}")
        assert (got[n:] == 0xA5).all(), f"n={n} wrote past the end"
    assert at == len(proc.stdout)
