"""The run-time CPU dispatcher: its flag tests agree with the kernel's view of this CPU
(/proc/cpuinfo, an independent oracle), and the exported `run` calls the newest copy of the
model code the CPU can run. Built with zig for the host, as model libraries are."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from cuvil.compiler.codegen.dispatch import cpu_test, render_detector, render_dispatcher
from cuvil.compiler.codegen.module import variant_run_symbol
from cuvil.runtime import THREADPOOL_SOURCE
from cuvil.toolchains import AARCH64_CPU_FLAGS, X86_CPU_FLAGS, get_target, host_target_name, zig

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="compares with /proc/cpuinfo of an x86-64 Linux host")

#: /proc/cpuinfo spells some flags differently
CPUINFO_NAMES = {"sse3": "pni", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "sahf": "lahf_lm",
                 "bmi": "bmi1", "lzcnt": "abm", "avx512vbmi2": "avx512_vbmi2",
                 "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg",
                 "avx512vpopcntdq": "avx512_vpopcntdq", "avx512fp16": "avx512_fp16",
                 "avxvnni": "avx_vnni", "avx512bf16": "avx512_bf16"}


def _cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("no flags line in /proc/cpuinfo")


def _build(tmp_path: Path, source: str) -> ctypes.CDLL:
    """`source` linked with the thread pool, whose functions a dispatcher's exports call."""
    target = get_target(host_target_name())
    arch = target.arches[0]
    c = tmp_path / "probe.c"
    c.write_text(source)
    objects = [zig.compile_c(c, tmp_path / "probe.o", arch),
               zig.compile_c(THREADPOOL_SOURCE, tmp_path / "threadpool.o", arch)]
    lib = zig.link_shared(objects, tmp_path / "libprobe.so", arch, target.object_format,
                          "libprobe.so")
    return ctypes.CDLL(str(lib))


def test_each_flag_test_agrees_with_proc_cpuinfo(tmp_path):
    names = sorted(X86_CPU_FLAGS)
    source = render_detector() + "".join(
        f'\n__attribute__((visibility("default"))) int has_{i}(void) {{ return {cpu_test(n)}; }}\n'
        for i, n in enumerate(names))
    lib = _build(tmp_path, source)
    kernel = _cpuinfo_flags()
    for i, name in enumerate(names):
        got = bool(getattr(lib, f"has_{i}")())
        assert got == (CPUINFO_NAMES.get(name, name) in kernel), name


@pytest.mark.parametrize("toolchain", ["x86_64-linux", "x86_64-macos", "universal2-macos"])
def test_dispatcher_runs_the_newest_copy_this_cpu_supports(tmp_path, toolchain):
    # the variants of the shipped toolchain file, with stubs that say which one ran
    levels = [(), *(v.requires for v in get_target(toolchain).arches[0].variants)]
    stubs = "".join(
        f"int32_t {variant_run_symbol('m', i)}(const void *const *a, void *const *b, "
        f"const int64_t *c, void *d) {{ return {i}; }}\n"
        f"int32_t {variant_run_symbol('m', i, 'run_profiled')}(const void *const *a, "
        f"void *const *b, const int64_t *c, void *d, uint64_t *t) {{ return {i}; }}\n"
        for i in range(len(levels)))
    lib = _build(tmp_path, render_dispatcher("m", levels) + stubs)
    kernel = _cpuinfo_flags()
    want = max(i for i, flags in enumerate(levels)
               if all(CPUINFO_NAMES.get(f, f) in kernel for f in flags))
    assert lib.cuvil_m_run(None, None, None, None) == want
    assert lib.cuvil_m_run(None, None, None, None) == want  # the remembered choice
    assert lib.cuvil_m_run_profiled(None, None, None, None, None) == want


AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize("toolchain", ["x86_64-linux", "x86_64-macos", "universal2-macos"])
def test_x86_levels_nest_and_end_with_avx512(toolchain):
    # the dispatcher takes the first level whose flags all hold, newest first: each level must
    # need every flag of the one before, and the newest is x86-64-v4
    arch = next(a for a in get_target(toolchain).arches if a.name == "x86_64")
    levels = [set(v.requires) for v in arch.variants]
    assert all(a < b for a, b in zip(levels, levels[1:])), levels
    v4 = arch.variants[-1]
    assert v4.cpu == "x86-64-v4" and levels[-1] - levels[-2] == AVX512
    assert all(f"+{flag}" in v4.features.split(",") for flag in levels[-1])
    # ZMM registers count only when the OS saves opmask, ZMM0-15 high and ZMM16-31 (XCR0 5-7)
    assert all(X86_CPU_FLAGS[flag][4] & 0xE0 == 0xE0 for flag in AVX512)


def test_cpu_check_names_what_the_baseline_needs_and_this_cpu_lacks(tmp_path):
    # a baseline needing every flag the dispatcher knows: the check names exactly those
    # /proc/cpuinfo lacks, in the table's order, and run() refuses iff any is missing
    names = list(X86_CPU_FLAGS)
    stubs = "".join(
        f"int32_t {variant_run_symbol('m', 0, entry)}(const void *const *a, void *const *b, "
        f"const int64_t *c, void *d{', uint64_t *t' if entry == 'run_profiled' else ''}) "
        "{ return 7; }\n" for entry in ("run", "run_profiled"))
    lib = _build(tmp_path, render_dispatcher("m", [names]) + stubs)
    kernel = _cpuinfo_flags()
    lacks = [n for n in names if CPUINFO_NAMES.get(n, n) not in kernel]
    missing = ctypes.create_string_buffer(512)
    level = lib.cuvil_m_cpu_check(missing, ctypes.c_int64(len(missing)))
    assert missing.value.decode().split() == lacks
    assert level == (-1 if lacks else 0)
    assert lib.cuvil_m_run(None, None, None, None) == (-1 if lacks else 7)
    assert lib.cuvil_m_cpu_check(None, ctypes.c_int64(0)) == level  # no buffer: the level only
    if lacks:  # a short buffer holds a NUL-terminated prefix
        short = ctypes.create_string_buffer(4)
        lib.cuvil_m_cpu_check(short, ctypes.c_int64(4))
        assert short.value.decode() == " ".join(lacks)[:3]


def test_aarch64_flags_no_mac_is_asked_about_are_the_m1s():
    # the aarch64 check asks macOS's sysctl only about flags beyond the first Apple silicon
    # CPU: exactly those zig's apple-m1 model lacks
    m1 = get_target("arm64-macos").arches[0]
    assert set(zig.cpu_flags(m1)) == {f for f, (*_, sysctl, _pf) in AARCH64_CPU_FLAGS.items()
                                      if not sysctl}
