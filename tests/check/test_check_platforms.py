"""cuvil check on the musllinux and Windows wheels of the digits example: the good ones pass,
and one defect at a time (a DLL of another machine, an extra export, an import beyond KERNEL32
and the C runtime, a glibc library under a musllinux tag and the reverse) fails the check that
names it. The DLLs are relinked with zig from the build's own object files. The PE structure
check is shown one broken loader table at a time in the DLL as built."""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_check import assert_fails_only, assert_structure_mutants_fail, patched, repack
from wheel_files import DigitsWheels, read_entries

from cuvil.check import check_wheel
from cuvil.check._pe import read_pe
from cuvil.runtime import _loader
from cuvil.toolchains import get_target, zig

pytestmark = pytest.mark.slow

DLL = "digits/_classifier.dll"
SO = "digits/_classifier.so"
NEW_TARGETS = ("x86_64-linux-musl", "aarch64-linux-musl", "x86_64-windows", "aarch64-windows")


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    wheels = DigitsWheels(tmp_path_factory.mktemp("digits"))
    return SimpleNamespace(wheels=wheels, build_dir=wheels.build_dir)


def relink_dll(digits: SimpleNamespace, out_dir: Path, extra_c: str = "",
               libs: tuple[str, ...] = ("m", "pthread")) -> bytes:
    """The x86_64-windows model DLL linked again from the build's objects, plus `extra_c`."""
    target = get_target("x86_64-windows")
    digits.wheels[target.name]  # the build leaves the objects
    objects = sorted((digits.build_dir / target.name / "classifier").glob("*.o"))
    assert objects, "the build left no object files to relink"
    if extra_c:
        source = out_dir / "extra.c"
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(extra_c)
        objects.append(zig.compile_c(source, out_dir / "extra.o", target.arches[0]))
    out = out_dir / "_classifier.dll"
    zig.link_shared(objects, out, target.arches[0], target.object_format, out.name, libs=libs)
    return out.read_bytes()


@pytest.mark.parametrize("target", NEW_TARGETS)
def test_good_wheels_of_the_new_targets_pass_every_check(digits: SimpleNamespace, target: str) -> None:
    wheel = digits.wheels[target]
    assert wheel.name.endswith(f"-py3-none-{get_target(target).platform_tag}.whl")
    report = check_wheel(wheel)
    assert report.ok, report.format()
    results = {r.name: r.message for r in report}
    if target.endswith("windows"):
        arch = "x86_64 (Machine 0x8664)" if target.startswith("x86_64") else "aarch64 (Machine 0xaa64)"
        assert results[f"{DLL}: PE header"] == f"PE32+ DLL for {arch}"
        assert results[f"{DLL}: DLL name"] == "_classifier.dll"
        imported = results[f"{DLL}: imports"].split(", ")
        assert "KERNEL32.dll" in imported
        assert all(d == "KERNEL32.dll" or d.startswith("api-ms-win-crt-") for d in imported), imported
        assert results[f"{DLL}: exported symbols"].startswith("exactly cuvil_classifier_abi_checksum")
        assert "matches" in results[f"{DLL}: ABI checksum of classifier"]
    else:
        assert results[f"{SO}: libc"] == "musl (DT_NEEDED libc.so)"
        assert results[f"{SO}: DT_NEEDED"] == "libc.so"


def test_dll_of_another_machine_fails_the_header_check(digits: SimpleNamespace, tmp_path: Path) -> None:
    arm = read_entries(digits.wheels["aarch64-windows"])[DLL]
    bad = repack(digits.wheels["x86_64-windows"], tmp_path, replace={DLL: arm})
    failed = assert_fails_only(check_wheel(bad), "PE header")
    message = failed[f"{DLL}: PE header"]
    assert "Machine 0xaa64 (aarch64) does not match platform tag win_amd64 (x86_64)" in message


def test_extra_dll_export_fails_the_symbol_check(digits: SimpleNamespace, tmp_path: Path) -> None:
    library = relink_dll(digits, tmp_path / "lib", extra_c=(
        "__declspec(dllexport) int cuvil_debug_hook(int x) { return x + 1; }\n"
        "int stays_hidden(int x) { return x * 2; }\n"))
    assert "cuvil_debug_hook" in read_pe(library).exported
    bad = repack(digits.wheels["x86_64-windows"], tmp_path, replace={DLL: library})
    failed = assert_fails_only(check_wheel(bad), "exported symbols")
    message = failed[f"{DLL}: exported symbols"]
    assert "exports cuvil_debug_hook besides the C ABI of model(s) classifier" in message
    assert "stays_hidden" not in message


def test_import_beyond_kernel32_and_the_crt_fails(digits: SimpleNamespace, tmp_path: Path) -> None:
    # a constructor keeps the call, and so USER32's import, through --gc-sections
    library = relink_dll(digits, tmp_path / "lib", libs=("m", "pthread", "user32"), extra_c=(
        "#include <windows.h>\n"
        "__attribute__((constructor)) static void beep(void) { MessageBeep(0); }\n"))
    assert "USER32.dll" in read_pe(library).imports
    bad = repack(digits.wheels["x86_64-windows"], tmp_path, replace={DLL: library})
    failed = assert_fails_only(check_wheel(bad), "imports")
    message = failed[f"{DLL}: imports"]
    assert message.startswith("imports from USER32.dll; a cuvil DLL may import only KERNEL32.dll")


def _pe_mutants(lib: bytes) -> dict[str, tuple[bytes, str]]:
    """One rule of the Windows loader's broken at a time in the x86_64 DLL: name -> (bytes,
    what the PE structure check must say)."""
    import pefile

    pe = pefile.PE(data=lib)
    exports = pe.DIRECTORY_ENTRY_EXPORT.struct
    names_at = pe.get_offset_from_rva(exports.AddressOfNames)
    ordinals_at = pe.get_offset_from_rva(exports.AddressOfNameOrdinals)
    first, second = struct.unpack_from("<II", lib, names_at)
    directories = pe.OPTIONAL_HEADER.DATA_DIRECTORY
    relocations = pe.get_offset_from_rva(directories[5].VirtualAddress)
    imports = pe.get_offset_from_rva(directories[1].VirtualAddress)
    debug_entry = directories[6].get_file_offset()
    section = pe.sections[2].get_file_offset()
    swapped = patched(patched(lib, names_at, "<I", second), names_at + 4, "<I", first)
    return {
        "export names out of order": (swapped, "the export name table is not sorted"),
        "export ordinal past the functions": (
            patched(lib, ordinals_at, "<H", exports.NumberOfFunctions), "export ordinal 0"),
        "base relocation block of a bad size": (
            patched(lib, relocations + 4, "<I", 10), "has size 10: not a multiple of 4"),
        "base relocation of an unknown type": (
            patched(lib, relocations + 8, "<H", 0x5000 | struct.unpack_from("<H", lib, relocations + 8)[0]
                     & 0xFFF), "an entry of type 5"),
        "data directory outside every section": (
            patched(lib, debug_entry, "<I", pe.OPTIONAL_HEADER.SizeOfImage + 0x1000),
            "the debug directory (28 bytes at * lies outside the bytes of every section"),
        "sections out of order": (patched(lib, section + 12, "<I", pe.sections[2].VirtualAddress
                                           + 0x1000), "not where the one before ends"),
        "import DLL name outside the image": (patched(lib, imports + 12, "<I", 0x7FFFFF00),
                                              "import descriptor 0's DLL name"),
        "e_lfanew past the file": (patched(lib, 0x3C, "<I", len(lib)), "e_lfanew"),
    }


def test_the_pe_structure_check_follows_the_windows_loader(digits: SimpleNamespace,
                                                           tmp_path: Path) -> None:
    wheel = digits.wheels["x86_64-windows"]
    assert_structure_mutants_fail(wheel, DLL, "PE structure", _pe_mutants(read_entries(wheel)[DLL]),
                                  tmp_path)


def test_dll_in_a_linux_wheel_fails_the_format_check(digits: SimpleNamespace, tmp_path: Path) -> None:
    dll = read_entries(digits.wheels["x86_64-windows"])[DLL]
    bad = repack(digits.wheels["x86_64-linux"], tmp_path, replace={SO: dll})
    failed = {name: message for name, ok, message in check_wheel(bad, auditwheel=False) if not ok}
    assert failed[f"{SO}: format"] == ("the library is PE/COFF, but platform tag(s) "
                                       "manylinux_2_17_x86_64 need ELF")


def test_glibc_library_under_a_musllinux_tag_fails_the_libc_check(digits: SimpleNamespace,
                                                                   tmp_path: Path) -> None:
    bad = repack(digits.wheels["x86_64-linux"], tmp_path, platform="musllinux_1_2_x86_64")
    failed = assert_fails_only(check_wheel(bad), "platform tag", "libc")
    message = failed[f"{SO}: libc"]
    assert "linked against glibc (DT_NEEDED libc.so.6" in message
    assert "tag musllinux_1_2_x86_64 is for musl systems" in message
    assert "x86_64-linux-musl" in message


def test_musl_library_under_a_manylinux_tag_fails_the_libc_check(digits: SimpleNamespace,
                                                                 tmp_path: Path) -> None:
    bad = repack(digits.wheels["aarch64-linux-musl"], tmp_path, platform="manylinux_2_17_aarch64")
    failed = assert_fails_only(check_wheel(bad, auditwheel=False), "platform tag", "libc")
    message = failed[f"{SO}: libc"]
    assert "linked against musl (DT_NEEDED libc.so)" in message
    assert "tag manylinux_2_17_aarch64 is for glibc systems" in message


def test_windows_loader_limits_the_dll_search(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # what the generated package asks LoadLibraryEx for on Windows (not run here: no Windows
    # Python under wine): an absolute path, the DLL's folder and System32 only
    calls = []
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(ctypes, "CDLL", lambda path, **kw: calls.append((path, kw)))
    monkeypatch.chdir(tmp_path)
    _loader._open_library("digits/_classifier.dll")
    (path, kwargs), = calls
    assert path == os.path.join(str(tmp_path), "digits", "_classifier.dll")
    assert kwargs == {"winmode": 0x100 | 0x800}  # LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR | _SYSTEM32


def _doctor_failure(wheel: Path) -> tuple[str, str]:
    from cuvil.check.doctor import diagnose

    diagnosis = diagnose(str(wheel))
    assert not diagnosis.ok, diagnosis.text()
    return next((what, fix) for ok, what, fix in diagnosis.findings if not ok)


@pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION"), reason="needs a glibc host")
def test_doctor_refuses_a_musl_wheel_on_a_glibc_system(digits: SimpleNamespace) -> None:
    what, fix = _doctor_failure(digits.wheels["x86_64-linux-musl"])
    assert "built for x86_64-linux-musl (musllinux_1_2_x86_64), whose libraries need musl" in what
    assert "this system's C library is glibc" in what and "-C target=x86_64-linux" in fix


@pytest.mark.skipif(sys.platform == "win32", reason="diagnoses a Windows wheel elsewhere")
def test_doctor_reads_a_dll_and_names_the_other_os(digits: SimpleNamespace) -> None:
    what, _ = _doctor_failure(digits.wheels["x86_64-windows"])
    assert "built for x86_64-windows (win_amd64)" in what, what
