"""The int8 GEMM kernel against numpy's int64 arithmetic reduced to int32 (MatMulInteger's
definition): every x86 kernel kind the host can run (VNNI, AVX-VNNI, the vpmaddwd paths), odd
sizes, K not a multiple of 4, every signedness of A and B, zero points at their extremes,
per-column b_zero; B packed at compile time or at run time; the float32 and requantizing
epilogues. The AArch64 kernels (widening NEON, SDOT/UDOT, I8MM's SMMLA/USMMLA, and the one that
picks among them at run time) are compiled, their instructions checked, and run under qemu's
CPU models with and without each extension where qemu is installed."""

from __future__ import annotations

import ctypes
import math
import subprocess
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
import pytest
from host_tools import AARCH64_LOADER, AARCH64_SYSROOT, QEMU_AARCH64, needs, tool
from kernel_library import FEATURES, host_module, link_modules
from llvmlite import ir

from cuvil.compiler.codegen.module import hide_declarations
from cuvil.compiler.driver import RUNTIME_SOURCE
from cuvil.compiler.kernels.emitter import I32, I64, PTR, Emitter
from cuvil.compiler.kernels.int8_gemm import (
    INT32,
    QEpilogue,
    QOperands,
    emit_parallel_int8_gemm,
    emit_parallel_int8_gemm_runtime_b,
    int8_isa,
    pack_b_int8,
    packed_b_size,
)
from cuvil.compiler.kernels.target import KernelTarget
from cuvil.toolchains import get_target, target_machine, zig
from cuvil.toolchains.llvm import emit_object

AVX512 = FEATURES["avx512"]
#: name -> (LLVM features, host flag needed, the kind it must select).
#: The VNNI kinds are built with their feature named (one kernel per function); "gated" is the
#: v4 copy's kernel, VNNI behind the CPUID test (the AVX-512BW one on a CPU without it).
KINDS = {
    "sse": ("", None, "madd128"),
    "avx2": (FEATURES["avx2"] + ",-avxvnni", "avx2", "madd256"),
    "avxvnni": (FEATURES["avx2"] + ",+avxvnni", "avxvnni", "avxvnni"),
    "avx512": (AVX512 + ",-avx512vnni", "avx512bw", "madd512"),
    "vnni512": (AVX512 + ",+avx512vnni", "avx512vnni", "vnni512"),
    "gated": (AVX512, "avx512bw", "vnni512"),
}
#: the epilogues, tested on vectors of 4 and 16 lanes
EPILOGUES = {"f32": QEpilogue("float32", "float32"), "u8": QEpilogue("uint8", "int32"),
             "s8": QEpilogue("int8"),
             # a fused activation (DynamicQuantizeMatMul's Gelu)
             "f32gelu": QEpilogue("float32", "float32", activation="Gelu")}
EPILOGUE_KINDS = ("sse", "vnni512")
SIGNS = [(False, False), (False, True), (True, False), (True, True)]  # (A int8, B int8)


def _host_flags() -> set[str]:
    return {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f[0] == "+"}


def _function(module: ir.Module, target: KernelTarget, name: str, body) -> None:
    """`int32 name(dims[M, N, K, a_zero, c_zero], A, B, C, scale, bias, b_zero, scratch,
    a_scale)`: body(k, m, n, kk, a_zero, c_zero, args) emits the product."""
    fn = ir.Function(module, ir.FunctionType(I32, [PTR] * 9), name)
    k = Emitter(module, fn, fn.args[0], [], {}, target)
    dims = [k.b.load(k.b.gep(fn.args[0], [k.i64(i)], source_etype=I64), typ=I64)
            for i in range(5)]
    m, n, kk, az, cz = dims
    body(k, m, n, kk, k.b.trunc(az, I32), k.b.trunc(cz, I32), fn.args[1:])
    k.b.ret(ir.Constant(I32, 0))


def _emit(module: ir.Module, target: KernelTarget, prefix: str, epilogues: bool,
          only_packed: bool = False) -> None:
    def packed(a_signed: bool, row_sums: bool, ep: QEpilogue = INT32):
        def body(k, m, n, kk, az, cz, args):
            a, b, c, scale, bias, _, _, a_scale = args
            emit_parallel_int8_gemm(k, m, n, kk, a, kk, az, b, c, n, a_signed=a_signed,
                                    row_sums=row_sums,
                                    out=QOperands(ep, scale=scale, bias=bias, c_zero=cz,
                                                  a_scale=k.b.load(a_scale, typ=ir.FloatType())))
        return body

    def runtime(a_signed: bool, b_signed: bool, per_column: bool):
        def body(k, m, n, kk, az, cz, args):
            a, b, c, _, _, b_zero, scratch, _ = args
            emit_parallel_int8_gemm_runtime_b(k, m, n, kk, a, kk, az, b, n, b_zero, scratch, c,
                                              n, a_signed=a_signed, b_signed=b_signed,
                                              b_zero_per_column=per_column)
        return body

    for a_signed in (False, True):
        for row_sums in (False, True):
            if not only_packed or a_signed == row_sums:  # (the gate: two kernels suffice)
                _function(module, target, f"{prefix}_packed_{int(a_signed)}{int(row_sums)}",
                          packed(a_signed, row_sums))
    for a_signed, b_signed in [] if only_packed else SIGNS:
        for per_column in (False, True):
            _function(module, target, f"{prefix}_runtime_{int(a_signed)}{int(b_signed)}{int(per_column)}",
                      runtime(a_signed, b_signed, per_column))
    if epilogues:
        for name, ep in EPILOGUES.items():
            _function(module, target, f"{prefix}_ep_{name}", packed(False, False, ep))


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> tuple[ctypes.CDLL, set[str]]:
    """One library holding every kind the host can run (one link for all)."""
    flags = _host_flags()
    modules, built = [], set()
    for name, (features, flag, kind) in KINDS.items():
        if flag is not None and flag not in flags:
            continue
        module, tm, target = host_module(features)
        assert int8_isa(target).kind == kind
        _emit(module, target, name, name in EPILOGUE_KINDS, only_packed=name == "gated")
        modules.append((module, tm))
        built.add(name)
    return link_modules(tmp_path_factory.mktemp("int8"), modules), built


def _call(lib, name: str, dims, a, b, c, scale=None, bias=None, b_zero=None, scratch=None,
          a_scale: float = 1.0) -> None:
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p] * 9
    keep = np.array([a_scale], np.float32)

    def ptr(x):
        return None if x is None else x.ctypes.data

    fn((ctypes.c_int64 * 5)(*dims), ptr(a), ptr(b), ptr(c), ptr(scale), ptr(bias),
       ptr(b_zero), ptr(scratch), keep.ctypes.data)


def _operands(rng, m: int, n: int, kk: int, a_signed: bool, b_signed: bool, case: int):
    """A, B, a_zero and b_zero (per column, with both extremes in it, or the symmetric
    scalar that needs no row sums) of one test case."""
    ta, tb = (np.int8 if a_signed else np.uint8), (np.int8 if b_signed else np.uint8)
    ia, ib = np.iinfo(ta), np.iinfo(tb)
    a = rng.integers(ia.min, ia.max + 1, (m, kk), dtype=np.int64).astype(ta)
    b = rng.integers(ib.min, ib.max + 1, (kk, n), dtype=np.int64).astype(tb)
    # operands at the extremes too, where a saturating instruction would go wrong
    a.flat[::7] = ia.max
    b.flat[::5] = ib.min
    a_zero = [ia.min, ia.max, 0, 7][case % 4]
    if case % 2:
        b_zero = rng.integers(ib.min, ib.max + 1, n, dtype=np.int64).astype(tb)
        b_zero[::3] = ib.max
        b_zero[1::3] = ib.min
    else:
        b_zero = np.array([0 if b_signed else 128], tb)
    return a, b, a_zero, b_zero


def _reference(a, b, a_zero: int, b_zero) -> np.ndarray:
    wide = (a.astype(np.int64) - a_zero) @ (b.astype(np.int64) - b_zero.astype(np.int64))
    return wide.astype(np.int32)  # wraps modulo 2^32, as the int32 result does


SHAPES = [(1, 1, 1), (3, 17, 5), (17, 63, 100), (100, 3, 63), (63, 100, 17), (2, 33, 3),
          (130, 70, 300), (12, 64, 576),
          # B in several blocks of columns (BLOCK_BYTES); more rows than a tile's with a K
          # whose widened rows (the vpmaddwd kinds) do not fit the buffer a tile's would take
          (2, 100, 8195), (21, 40, 6001)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_b_matches_numpy(lib, kind: str) -> None:
    library, built = lib
    if kind not in built:
        pytest.skip(f"this CPU cannot run the {kind} kernel")
    rng = np.random.default_rng(12)
    for (m, n, kk) in SHAPES:
        for case, (a_signed, b_signed) in enumerate(SIGNS * 2):
            a, b, a_zero, b_zero = _operands(rng, m, n, kk, a_signed, b_signed, case)
            packed = pack_b_int8(b, b_zero)
            assert packed.row_sums == bool(case % 2)
            name = f"{kind}_packed_{int(a_signed)}{int(packed.row_sums)}"
            if kind == "gated" and a_signed != packed.row_sums:
                continue
            c = np.full((m, n), 12345, np.int32)
            _call(library, name, (m, n, kk, a_zero, 0), a, packed.data, c)
            np.testing.assert_array_equal(c, _reference(a, b, a_zero, b_zero),
                                          err_msg=f"{m}x{n}x{kk} {a.dtype} {b.dtype} "
                                                  f"a_zero={a_zero}")


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "gated"])
def test_runtime_b_matches_numpy(lib, kind: str) -> None:
    library, built = lib
    if kind not in built:
        pytest.skip(f"this CPU cannot run the {kind} kernel")
    rng = np.random.default_rng(13)
    for (m, n, kk) in SHAPES[:-1]:
        for case, (a_signed, b_signed) in enumerate(SIGNS * 2):
            a, b, a_zero, b_zero = _operands(rng, m, n, kk, a_signed, b_signed, case + 1)
            per_column = b_zero.size > 1
            scratch = np.zeros(packed_b_size(kk, n), np.uint8)
            c = np.full((m, n), -1, np.int32)
            _call(library, f"{kind}_runtime_{int(a_signed)}{int(b_signed)}{int(per_column)}",
                  (m, n, kk, a_zero, 0), a, b, c, b_zero=b_zero, scratch=scratch)
            np.testing.assert_array_equal(c, _reference(a, b, a_zero, b_zero),
                                          err_msg=f"{m}x{n}x{kk} {a.dtype} {b.dtype}")


@pytest.mark.parametrize("kind", EPILOGUE_KINDS)
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_epilogues(lib, kind: str, epilogue: str) -> None:
    library, built = lib
    if kind not in built:
        pytest.skip(f"this CPU cannot run the {kind} kernel")
    rng = np.random.default_rng(14)
    ep = EPILOGUES[epilogue]
    for (m, n, kk) in [(3, 17, 5), (17, 63, 100), (130, 70, 300)]:
        # sums centred on 0, so that requantizing reaches both ends of the 8-bit range
        a = rng.integers(0, 256, (m, kk)).astype(np.uint8)
        b = rng.integers(-128, 128, (kk, n)).astype(np.int8)
        a_zero, b_zero = 128, np.zeros(1, np.int8)
        acc = _reference(a, b, a_zero, b_zero)
        a_scale = np.float32(0.37)
        # outputs spread over about +-150: both ends of the 8-bit range saturate
        scale = (rng.uniform(0.5, 1.5, n) * 150 / (acc.std() * a_scale)).astype(np.float32)
        multiplier = scale * a_scale  # float32, as the kernel computes it
        if ep.output == "float32":
            bias = rng.standard_normal(n).astype(np.float32)
            want = acc.astype(np.float32) * multiplier + bias
            if ep.activation == "Gelu":
                erf = np.vectorize(math.erf)(want.astype(np.float64) / math.sqrt(2))
                want = (0.5 * want * (1 + erf)).astype(np.float32)
            out = np.zeros((m, n), np.float32)
        else:
            bias = rng.integers(-5000, 5000, n).astype(np.int32) if ep.bias == "int32" else None
            lo, hi = (0, 255) if ep.output == "uint8" else (-128, 127)
            c_zero = 100 if ep.output == "uint8" else -3
            y = (acc + (bias if bias is not None else 0)).astype(np.float32) * multiplier
            want = np.clip(np.rint(y) + c_zero, lo, hi).astype(ep.output)
            out = np.zeros((m, n), ep.output)
        _call(library, f"{kind}_ep_{epilogue}",
              (m, n, kk, a_zero, 0 if ep.output == "float32" else c_zero), a,
              pack_b_int8(b, b_zero).data, out, scale=scale, bias=bias, a_scale=float(a_scale))
        if ep.output != "float32":
            assert len(np.unique(want)) > 10 and (want == lo).any() and (want == hi).any()
        if ep.activation:  # vecmath's erf: to a few ulps
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(out, want)


#: the AArch64 kinds (no such CPU here: they run under qemu when it is installed), by the
#: features their module is compiled with
ARM_KINDS = {"neon": "+neon,-dotprod,-i8mm", "dot": "+neon,+dotprod,-i8mm",
             "i8mm": "+neon,+dotprod,+i8mm",
             "gated": "+neon"}  # I8MM, else the dot product, else NEON, as the OS says
#: the kernel each selects for (uint8 A, int8 A), and whether behind a run-time test
ARM_ISAS = {"neon": (("generic", "generic"), False), "dot": (("udot", "sdot"), False),
            "i8mm": (("i8mm", "i8mm"), False), "gated": (("i8mm", "i8mm"), True)}
#: (mask, value) of the A64 encoding of each instruction (Arm ARM): SMLAL(2) Vd.4S, Vn.4H,
#: Vm.4H; SDOT and UDOT Vd.4S, Vn.16B, Vm.16B; SMMLA and USMMLA Vd.4S, Vn.16B, Vm.16B
ARM_OPCODES = {"smlal": (0xBFE0FC00, 0x0E608000), "sdot": (0xFFE0FC00, 0x4E809400),
               "udot": (0xFFE0FC00, 0x6E809400), "smmla": (0xFFE0FC00, 0x4E80A400),
               "usmmla": (0xFFE0FC00, 0x4E80AC00)}
ARM_USES = {"neon": ("smlal",), "dot": ("sdot", "udot"), "i8mm": ("smmla", "usmmla"),
            "gated": ("smlal", "sdot", "udot", "smmla", "usmmla")}
#: qemu's CPU models: max has I8MM and the dot product, neoverse-n1 (Armv8.2-A) the dot
#: product only, cortex-a72 (Armv8.0-A) neither; (HWCAP_ASIMDDP, HWCAP2_I8MM) as the OS says
ARM_CPUS = {"max": (1, 1), "neoverse-n1": (1, 0), "cortex-a72": (0, 0)}
ARM_HARNESS = Path(__file__).parents[1] / "harness" / "run_int8_gemm.c"


def _arm_names() -> list[str]:
    """The functions of one kind in the order the harness (run_int8_gemm.c) numbers them."""
    return ([f"packed_{a}{r}" for a in (0, 1) for r in (0, 1)]
            + [f"runtime_{a}{b}{z}" for a in (0, 1) for b in (0, 1) for z in (0, 1)])


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, bytes], Path]:
    """Each AArch64 kind's object code, and the harness program linked with them."""
    tmp = tmp_path_factory.mktemp("int8_arm")
    arch = get_target("aarch64-linux").arches[0]
    objects = {}
    for name, features in ARM_KINDS.items():
        tm = target_machine(arch, cpu="generic", features=features)
        module = ir.Module(name)
        module.triple = arch.llvm_triple
        module.data_layout = str(tm.target_data)
        target = KernelTarget(module.triple, features)
        kinds, gated = ARM_ISAS[name]
        for a_signed in (False, True):
            isa = int8_isa(target, a_signed)
            assert (isa.kind, isa.gate is not None) == (kinds[a_signed], gated)
        _emit(module, target, name, False, only_packed=name == "gated")
        objects[name] = emit_object(hide_declarations(str(module), "-"), tm)
        (tmp / f"{name}.o").write_bytes(objects[name])
    runtime = zig.compile_c(RUNTIME_SOURCE, tmp / "rt.o", arch)
    program = tmp / "run_int8_gemm"
    proc = subprocess.run([*zig.zig_command(), "cc", "-target", arch.zig_target, "-O2",
                           "-std=c99", "-Wall", "-Werror", str(ARM_HARNESS),
                           *(str(tmp / f"{name}.o") for name in ARM_KINDS), str(runtime),
                           "-lpthread", "-o", str(program)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return objects, program


@pytest.mark.slow  # the AArch64 kernels compiled for each extension
@pytest.mark.parametrize("kind", list(ARM_KINDS))
def test_aarch64_kernels_use_their_instructions(arm, kind: str) -> None:
    words = np.frombuffer(arm[0][kind][: len(arm[0][kind]) // 4 * 4], "<u4")
    for used in ARM_USES[kind]:
        mask, value = ARM_OPCODES[used]
        assert np.count_nonzero(words & mask == value) >= 8, f"no {used} multiply-adds in {kind}"


#: odd M, N and K: K's last 8 values whole (64), 1 to 4 of them (1, 5, 12, 100: one group of
#: 4, the I8MM step's second group absent) and 5 to 7 (13, 63, 7)
ARM_SHAPES = [(1, 1, 1), (3, 17, 5), (17, 63, 100), (100, 3, 63), (13, 70, 64), (5, 9, 12),
              (25, 40, 13), (2, 33, 7)]


@pytest.mark.slow
@needs(*QEMU_AARCH64)
@pytest.mark.parametrize("cpu", list(ARM_CPUS))
def test_aarch64_kernels_under_qemu(arm, cpu: str) -> None:
    # every kind the CPU model can run (the gated one takes I8MM on max, the dot product on
    # neoverse-n1, NEON on cortex-a72: the harness reports the OS's answers first)
    qemu = tool("qemu-aarch64-static")
    tool(str(AARCH64_LOADER))
    dotprod, i8mm = ARM_CPUS[cpu]
    kinds = ["neon", "gated", *(["dot"] if dotprod else []), *(["i8mm"] if i8mm else [])]
    rng = np.random.default_rng(15)
    names = _arm_names()
    records, wanted = [], []
    for index, kind in enumerate(ARM_KINDS):
        if kind not in kinds:
            continue
        for (m, n, kk) in ARM_SHAPES:
            for case, (a_signed, b_signed) in enumerate(SIGNS * 2):
                a, b, a_zero, b_zero = _operands(rng, m, n, kk, a_signed, b_signed, case)
                packed = pack_b_int8(b, b_zero)
                if case < 4:
                    name, operand = f"packed_{int(a_signed)}{int(packed.row_sums)}", packed.data
                else:
                    name = f"runtime_{int(a_signed)}{int(b_signed)}{int(b_zero.size > 1)}"
                    operand = b
                if kind == "gated" and name not in ("packed_00", "packed_11"):
                    continue  # (built with these only: the gates are what it tests)
                head = [index * len(names) + names.index(name), m, n, kk, a_zero, 0, a.nbytes,
                        operand.nbytes, b_zero.nbytes, 4 * m * n, packed_b_size(kk, n)]
                records.append(np.array(head, "<i8").tobytes() + a.tobytes()
                               + operand.tobytes() + b_zero.tobytes())
                wanted.append((kind, name, _reference(a, b, a_zero, b_zero)))
    proc = subprocess.run([qemu, "-L", str(AARCH64_SYSROOT), "-cpu", cpu, str(arm[1])],
                          input=b"".join(records), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert proc.stderr.decode().split() == [f"dotprod={dotprod}", f"i8mm={i8mm}"]
    at = 0
    for kind, name, want in wanted:
        got = np.frombuffer(proc.stdout[at:at + want.nbytes], "<i4").reshape(want.shape)
        at += want.nbytes
        np.testing.assert_array_equal(got, want, err_msg=f"{kind} {name} {want.shape} on {cpu}")
    assert at == len(proc.stdout)
