"""cuvil check on real artifacts: the digits wheels for three targets, Mach-O libraries linked here
with zig, and corrupted variants of each, which must fail the check that names the defect.

The wheels are built once per module with the backend hooks; the variants are repacked by this
file's own wheel writer (RECORD hashes computed here with hashlib), or relinked from the build's
object files with zig, so each one differs from a good wheel in one defect only.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Mapping, Sequence
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from wheel_files import DigitsWheels, read_entries, write_wheel

from cuvil.check import CHECK_KINDS, CheckReport, check_wheel
from cuvil.check._macho import (
    LC_CODE_SIGNATURE,
    LC_DYLD_INFO_ONLY,
    LC_DYSYMTAB,
    LC_LOAD_DYLIB,
    LC_SEGMENT_64,
    LC_SYMTAB,
    parse_macho,
)
from cuvil.check.macho import LINKER_SYMBOLS
from cuvil.cli import main as cli_main
from cuvil.runtime._loader import ABI_VERSION, abi_checksum
from cuvil.toolchains import get_target, zig

TARGETS = ("x86_64-linux", "aarch64-linux", "universal2-macos")
MACHO_LIB = "digits/_classifier.dylib"
LC_BUILD_VERSION = 0x32
EXPORTS = {"cuvil_classifier_abi_checksum", "cuvil_classifier_cpu_check",
           "cuvil_classifier_run", "cuvil_classifier_run_profiled",
           "cuvil_classifier_workspace_size", "cuvil_classifier_thread_pool",
           "cuvil_classifier_use_thread_pool", "cuvil_classifier_set_thread_limit"}


# ------------------------------------------------------------------------ wheel helpers


def repack(
    src: Path,
    out_dir: Path,
    *,
    replace: Mapping[str, bytes] | None = None,
    drop: Sequence[str] = (),
    platform: str | None = None,
    record: bool = True,
) -> Path:
    """A copy of the wheel `src` with files replaced or dropped, or another platform tag."""
    files = read_entries(src)
    for name in drop:
        del files[name]
    files.update(replace or {})
    name = src.name
    if platform is not None:
        old = name[:-4].split("-")[-1]
        name = name.replace(old, platform)
        wheel_file = next(p for p in files if p.endswith(".dist-info/WHEEL"))
        files[wheel_file] = files[wheel_file].replace(old.encode(), platform.encode())
    return write_wheel(out_dir / name, files, record=record)


def failures(report: CheckReport) -> dict[str, str]:
    return {name: message for name, ok, message in report if not ok}


def assert_fails_only(report: CheckReport, *parts: str) -> dict[str, str]:
    """Every failed check's name contains one of `parts`, and each part names a failed check."""
    failed = failures(report)
    unexpected = [n for n in failed if not any(p in n for p in parts)]
    assert not unexpected, f"unexpected failures: { {n: failed[n] for n in unexpected} }"
    for part in parts:
        assert any(part in n for n in failed), f"no failed check named *{part}*; report:\n{report.format()}"
    return failed


def manifest_of(wheel: Path) -> dict[str, Any]:
    files = read_entries(wheel)
    return json.loads(files["digits/_models.json"])


# ----------------------------------------------------------------------- built wheels


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    wheels = DigitsWheels(tmp_path_factory.mktemp("digits"))
    return SimpleNamespace(wheels=wheels, build_dir=wheels.build_dir)


def relink(
    digits: SimpleNamespace,
    out_dir: Path,
    *,
    extra_objects: Sequence[Path] = (),
    soname: str = "_classifier.so",
    extra_args: Sequence[str] = (),
    libs: Sequence[str] = ("m", "pthread"),
) -> bytes:
    """The x86_64-linux model library linked again from the build's objects, with changes."""
    target = get_target("x86_64-linux")
    digits.wheels[target.name]  # the build leaves the objects
    objects = sorted((digits.build_dir / target.name / "classifier").glob("*.o"))
    assert objects, "the build left no object files to relink"
    out = out_dir / "_classifier.so"
    zig.link_shared(
        [*objects, *extra_objects],
        out,
        target.arches[0],
        target.object_format,
        soname,
        libs=libs,
        extra_args=extra_args,
    )
    return out.read_bytes()


def flip_hex(data: bytes, at: int) -> bytes:
    """`data` with the hex digit at `at` changed to another hex digit."""
    new = b"0" if data[at : at + 1] != b"0" else b"1"
    return data[:at] + new + data[at + 1 :]


def patched(data: bytes, at: int, fmt: str, value: int) -> bytes:
    """`data` with `value` packed at `at`."""
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("target", TARGETS)
def test_good_wheels_pass_every_check(digits: SimpleNamespace, target: str) -> None:
    report = check_wheel(digits.wheels[target])
    assert report.ok, report.format()
    names = [r.name for r in report]
    assert not [r.name for r in report if r.kind not in CHECK_KINDS]  # check-warnings can name each
    for expected in ("wheel file name", "layout", "WHEEL", "METADATA", "RECORD", "manifest", "platform tag"):
        assert expected in names
    lib = "digits/_classifier.dylib" if target.endswith("macos") else "digits/_classifier.so"
    assert f"{lib}: exported symbols" in names
    assert f"{lib}: ABI checksum of classifier" in names
    if target.endswith("linux"):
        for part in ("ELF header", "SONAME", "RPATH/RUNPATH", "DT_NEEDED", "glibc versions"):
            assert f"{lib}: {part}" in names
        # auditwheel is a test dependency: its opinion must have been asked, not skipped
        assert report["auditwheel"].ok and not report["auditwheel"].skipped
    else:
        assert "auditwheel" not in names


def _file_offset(elf_bytes: bytes, symbol: str) -> int:
    """Where in the file the code of an exported function starts (pyelftools)."""
    from elftools.elf.elffile import ELFFile

    elf = ELFFile(io.BytesIO(elf_bytes))
    (sym,) = elf.get_section_by_name(".dynsym").get_symbol_by_name(symbol)
    addr = sym["st_value"]
    for seg in elf.iter_segments():
        if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= addr < seg["p_vaddr"] + seg["p_filesz"]:
            return int(addr - seg["p_vaddr"] + seg["p_offset"])
    raise AssertionError(f"{symbol} lies in no loaded segment")


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="loads an x86_64 Linux wheel")
def test_the_load_test_imports_the_package_and_catches_a_library_that_crashes(
        digits: SimpleNamespace, tmp_path: Path) -> None:
    wheel = digits.wheels["x86_64-linux"]
    report = check_wheel(wheel, auditwheel=False, load=True)
    assert report["load"].ok and not report["load"].skipped, report.format()
    assert "every model loads and runs here (classifier)" in report["load"].message
    # the entry point's first instruction made ud2, RECORD rewritten to match: no static check
    # reads code, so only loading and calling the library finds it
    files = read_entries(wheel)
    lib = files["digits/_classifier.so"]
    at = _file_offset(lib, "cuvil_classifier_run")
    broken = repack(wheel, tmp_path, replace={"digits/_classifier.so": lib[:at] + b"\x0f\x0b" + lib[at + 2:]})
    assert check_wheel(broken, auditwheel=False).ok
    report = check_wheel(broken, auditwheel=False, load=True)
    assert not report["load"].ok and "SIGILL" in report["load"].message, report.format()
    # a wheel this machine cannot run is skipped, with the reason
    report = check_wheel(digits.wheels["aarch64-linux"], auditwheel=False, load=True)
    assert report.ok and report["load"].skipped and "this machine is x86_64 linux" in report["load"].message
    # cuvil check --load says the same
    assert cli_main(["check", "--load", "--no-auditwheel", str(broken)]) == 1


def _elf_mutants(lib: bytes) -> dict[str, tuple[bytes, str]]:
    """Changes in the dynamic loader's path through the library that the section-based checks
    do not see, of the kinds that crashed or aborted the process in dlopen when bytes of a
    library were changed at random: name -> (bytes, what the ELF structure check must say)."""
    from elftools.elf.elffile import ELFFile

    elf = ELFFile(io.BytesIO(lib))

    dynamic = elf.get_section_by_name(".dynamic")["sh_offset"]
    tags = {struct.unpack_from("<q", lib, dynamic + 16 * i)[0]: dynamic + 16 * i for i in range(64)}
    last_load = max((s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"),
                    key=lambda s: s["p_vaddr"])
    phdr = elf["e_phoff"] + 56 * next(i for i, s in enumerate(elf.iter_segments())
                                      if s["p_offset"] == last_load["p_offset"] and s["p_type"] == "PT_LOAD")
    verneed = elf.get_section_by_name(".gnu.version_r")["sh_offset"]
    soname = struct.unpack_from("<Q", lib, tags[14] + 8)[0]  # DT_SONAME's string offset
    return {
        "bloom filter": (patched(lib, elf.get_section_by_name(".gnu.hash")["sh_offset"] + 8, "<I", 3),
                         "the GNU hash table's header"),
        "DT_PLTREL": (patched(lib, tags[20] + 8, "<Q", 17), "DT_PLTREL is 17"),
        "version index": (patched(lib, elf.get_section_by_name(".gnu.version")["sh_offset"] + 2, "<H", 9),
                          "version indices the library neither defines nor needs"),
        "data segment": (patched(lib, phdr + 32, "<Q", last_load["p_filesz"] + 0x100), "maps"),
        "needed version": (patched(lib, verneed + 4, "<I", soname),
                           "names a library the library does not need"),
    }


def test_the_elf_structure_check_follows_the_dynamic_loader(digits: SimpleNamespace, tmp_path: Path) -> None:
    wheel = digits.wheels["x86_64-linux"]
    report = check_wheel(wheel, auditwheel=False)
    assert report["digits/_classifier.so: ELF structure"].ok, report.format()
    lib = read_entries(wheel)["digits/_classifier.so"]
    for case, (data, words) in _elf_mutants(lib).items():
        bad = repack(wheel, tmp_path / case.replace(" ", "_"), replace={"digits/_classifier.so": data})
        found = failures(check_wheel(bad, auditwheel=False))
        assert words in found.get("digits/_classifier.so: ELF structure", ""), (case, found)


def _macho_mutants(lib: bytes) -> dict[str, tuple[bytes, str]]:
    """One rule of dyld's broken in the universal2 library at a time (the unsigned x86_64 slice,
    where no code signature catches it; LC_BUILD_VERSION is the arm64 slice's): name -> (bytes,
    what the Mach-O structure check must say, a pattern for fnmatch)."""
    _, images = parse_macho(lib)
    x86, arm = (next(im for im in images if im.arch == arch) for arch in ("x86_64", "aarch64"))
    base = x86.offset_in_file

    def command(kind: int, image: Any = x86) -> int:
        return image.offset_in_file + next(at for cmd, at, _ in image.commands if cmd == kind)

    segments = {lib[at + 8:at + 24].rstrip(b"\0").decode(): at for at in
                (base + off for cmd, off, _ in x86.commands if cmd == LC_SEGMENT_64)}
    linkedit = next(s for s in x86.segments if s.name == "__LINKEDIT")
    data_const = next(s for s in x86.segments if s.name == "__DATA_CONST")
    symoff, nsyms, _, strsize = struct.unpack_from("<IIII", lib, command(LC_SYMTAB) + 8)
    (rebase_at,) = struct.unpack_from("<I", lib, command(LC_DYLD_INFO_ONLY) + 8)
    (indirect_at,) = struct.unpack_from("<I", lib, command(LC_DYSYMTAB) + 8 + 4 * 12)
    dylib = command(LC_LOAD_DYLIB)
    return {
        "export trie past __LINKEDIT": (
            patched(lib, command(LC_DYLD_INFO_ONLY) + 40, "<I", linkedit.fileoff + linkedit.filesize),
            "the export trie (240 bytes at * runs past __LINKEDIT"),
        "overlapping segments": (patched(lib, segments["__DATA"] + 24, "<Q", data_const.vmaddr),
                                 "overlaps segment __DATA_CONST"),
        "section outside its segment": (patched(lib, segments["__TEXT"] + 72 + 32, "<Q", 0x7F000),
                                        "section __TEXT,__text"),
        "undefined symbols past the table": (
            patched(lib, command(LC_DYSYMTAB) + 8 + 20, "<I", nsyms),
            "LC_DYSYMTAB's undefined symbols"),
        "indirect symbol naming no symbol": (patched(lib, base + indirect_at, "<I", nsyms + 3),
                                             "indirect symbol table entries * name no symbol"),
        "symbol name past the string table": (patched(lib, base + symoff, "<I", strsize + 5),
                                              "lies outside its table"),
        "dylib name inside the command's fixed part": (
            patched(lib, dylib + 8, "<I", 20), "its name (at 20) does not lie within the command"),
        "rebase into __TEXT": (patched(lib, base + rebase_at + 1, "<B", 0x20),
                               "the rebase opcodes: a fixup at 0x8 of segment __TEXT"),
        "LC_BUILD_VERSION's size": (
            patched(lib, command(LC_BUILD_VERSION, arm) + 20, "<I", 2),
            "aarch64 slice: load command 12 (0x32) is 32 bytes; dyld requires 40"),
        "universal header's cpusubtype": (patched(lib, 12, ">I", 8),
                                          "lists the x86_64 slice with cpusubtype 0x8"),
    }


def assert_structure_mutants_fail(wheel: Path, library: str, check: str,
                                  mutants: dict[str, tuple[bytes, str]], tmp_path: Path) -> None:
    """The wheel passes the check `<library>: <check>`; each mutant of its library fails it
    with a message matching the mutant's words."""
    assert check_wheel(wheel)[f"{library}: {check}"].ok
    for case, (data, words) in mutants.items():
        bad = repack(wheel, tmp_path / case.replace(" ", "_"), replace={library: data})
        failed = {name: message for name, ok, message in check_wheel(bad) if not ok}
        assert fnmatch(failed.get(f"{library}: {check}", ""), f"*{words}*"), (case, failed)


def test_the_macho_structure_check_follows_dyld(digits: SimpleNamespace, tmp_path: Path) -> None:
    wheel = digits.wheels["universal2-macos"]
    assert_structure_mutants_fail(wheel, MACHO_LIB, "Mach-O structure",
                                  _macho_mutants(read_entries(wheel)[MACHO_LIB]), tmp_path)


def test_universal2_wheel_has_both_slices_and_a_valid_arm64_signature(digits: SimpleNamespace) -> None:
    report = check_wheel(digits.wheels["universal2-macos"])
    lib = "digits/_classifier.dylib"
    assert "aarch64, x86_64" in report[f"{lib}: Mach-O slices"].message
    signature = report[f"{lib}: code signature"].message
    assert "aarch64: ad-hoc" in signature and "16384 bytes" in signature
    # the checksum was found in both slices
    assert report[f"{lib}: ABI checksum of classifier"].message.count("__TEXT,__const") == 2


def test_the_report_unpacks_as_name_ok_message(digits: SimpleNamespace) -> None:
    report = check_wheel(digits.wheels["x86_64-linux"], auditwheel=False)
    assert report.results[0].name == "archive" and report.results[0].ok  # read safely first
    name, ok, message = report.results[1]
    assert (name, ok) == ("wheel file name", True) and "digits-cuvil 1.0.0" in message
    assert "OK: all" in report.format()


# ---------------------------------------------------------------- corrupted variants


def test_bad_record_hash_fails_record(digits: SimpleNamespace, tmp_path: Path) -> None:
    src = digits.wheels["x86_64-linux"]
    init = read_entries(src)["digits/__init__.py"] + b"# changed after the build\n"
    bad = repack(src, tmp_path, replace={"digits/__init__.py": init}, record=False)
    failed = assert_fails_only(check_wheel(bad, auditwheel=False), "RECORD")
    assert "digits/__init__.py" in failed["RECORD"] and "sha256 hash" in failed["RECORD"]


def test_file_missing_from_record_and_stray_files_fail(digits: SimpleNamespace, tmp_path: Path) -> None:
    src = digits.wheels["x86_64-linux"]
    files = read_entries(src)
    record_path = next(p for p in files if p.endswith("/RECORD"))
    # a file in the archive that RECORD does not list
    bad = repack(src, tmp_path / "a", replace={"digits/extra.py": b"x = 1\n"}, record=False)
    failed = assert_fails_only(check_wheel(bad, auditwheel=False), "RECORD")
    assert "not in RECORD: digits/extra.py" in failed["RECORD"]
    # a file outside the package and the .dist-info (listed in RECORD, so only the layout fails)
    bad = repack(src, tmp_path / "b", replace={"other/evil.py": b"import os\n"})
    failed = assert_fails_only(check_wheel(bad, auditwheel=False), "layout")
    assert "other/evil.py" in failed["layout"]
    # RECORD itself missing
    bad = repack(src, tmp_path / "c", drop=[record_path], record=False)
    assert "no .dist-info/RECORD" in failures(check_wheel(bad, auditwheel=False))["RECORD"]


def test_metadata_that_contradicts_the_file_name_fails(digits: SimpleNamespace, tmp_path: Path) -> None:
    src = digits.wheels["x86_64-linux"]
    files = read_entries(src)
    path = next(p for p in files if p.endswith(".dist-info/METADATA"))
    metadata = files[path].replace(b"Version: 1.0.0", b"Version: 2.0.0")
    failed = assert_fails_only(
        check_wheel(repack(src, tmp_path, replace={path: metadata}), auditwheel=False), "METADATA"
    )
    assert "2.0.0" in failed["METADATA"] and "1.0.0" in failed["METADATA"]


def test_extra_exported_symbol_fails_the_symbol_check(digits: SimpleNamespace, tmp_path: Path) -> None:
    source = tmp_path / "extra.c"
    source.write_text(
        '__attribute__((visibility("default"))) int cuvil_debug_hook(int x) { return x + 1; }\n'
        "int stays_hidden(int x) { return x * 2; }\n"
    )
    extra = zig.compile_c(source, tmp_path / "extra.o", get_target("x86_64-linux").arches[0])
    library = relink(digits, tmp_path / "lib", extra_objects=[extra])
    bad = repack(digits.wheels["x86_64-linux"], tmp_path, replace={"digits/_classifier.so": library})
    failed = assert_fails_only(check_wheel(bad, auditwheel=False), "exported symbols")
    message = failed["digits/_classifier.so: exported symbols"]
    assert "cuvil_debug_hook" in message and "stays_hidden" not in message


def test_wrong_checksum_byte_fails_the_abi_check(digits: SimpleNamespace, tmp_path: Path) -> None:
    src = digits.wheels["x86_64-linux"]
    library = read_entries(src)["digits/_classifier.so"]
    checksum = manifest_of(src)["models"][0]["checksum"]
    at = library.find(checksum.encode() + b"\0")
    assert at > 0 and library.count(checksum.encode()) == 1
    bad = repack(src, tmp_path, replace={"digits/_classifier.so": flip_hex(library, at + 5)})
    failed = assert_fails_only(check_wheel(bad, auditwheel=False), "ABI checksum")
    assert "different builds" in failed["digits/_classifier.so: ABI checksum of classifier"]


@pytest.mark.parametrize(("drop", "replace", "words"), [
    # a text file named like an extension module: Python would import it before the runtime
    ((), {"digits/_cuvil_runtime.so": b"# not a library\n"}, "digits/_cuvil_runtime.so"),
    (("digits/__init__.py",), {"digits/models.py": b"# the renamed __init__\n"},
     "digits/__init__.py is missing"),
], ids=["shadowing-module", "no-init"])
def test_member_names_that_break_the_import_are_refused(digits: SimpleNamespace, tmp_path: Path,
                                                        drop: tuple[str, ...],
                                                        replace: dict[str, bytes],
                                                        words: str) -> None:
    """Both passed every check, RECORD matching, and `import digits` then failed to give the
    model (found by tests/fuzz/test_fuzz_wheels.py's odd names)."""
    wheel = repack(digits.wheels["x86_64-linux"], tmp_path, drop=drop, replace=replace)
    failed = assert_fails_only(check_wheel(wheel, auditwheel=False), "manifest")
    assert words in failed["manifest"], failed["manifest"]


def test_manifest_signature_edited_after_the_build(digits: SimpleNamespace, tmp_path: Path) -> None:
    src = digits.wheels["x86_64-linux"]
    manifest = manifest_of(src)
    manifest["models"][0]["inputs"][0]["shape"][-1] = 9
    edited = json.dumps(manifest).encode()
    # the recorded checksum no longer fits the signature
    failed = assert_fails_only(
        check_wheel(repack(src, tmp_path / "a", replace={"digits/_models.json": edited}), auditwheel=False),
        "manifest",
        "ABI checksum",
    )
    assert "edited after the build" in failed["manifest"]
    # with the checksum field updated too, only the library's exported bytes can tell
    manifest["models"][0]["checksum"] = abi_checksum(manifest["models"][0])
    edited = json.dumps(manifest).encode()
    failed = assert_fails_only(
        check_wheel(repack(src, tmp_path / "b", replace={"digits/_models.json": edited}), auditwheel=False),
        "ABI checksum",
    )
    assert "x86_64" in failed["digits/_classifier.so: ABI checksum of classifier"]


def import_package(wheel: Path, where: Path) -> subprocess.CompletedProcess[str]:
    """`import digits` from the wheel's files, in a fresh interpreter."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(where)
    return subprocess.run([sys.executable, "-c", "import digits"], cwd=where, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(where)})


def _set(path: str, value: Any) -> Any:
    """An edit of models[0] that sets the value at `path` (keys and indices split by dots);
    value None deletes it."""
    def edit(model: dict[str, Any]) -> None:
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        for key in parents:
            model = model[key]
        if value is None:
            del model[last]  # type: ignore[arg-type]
        else:
            model[last] = value  # type: ignore[index]
    return edit


# manifests that break the schema the loader reads them by (issue: `cuvil check` passed them
# and the import then raised a raw KeyError or TypeError, or ran the expression's code)
BROKEN_MANIFESTS = {  # edit, the key the messages name, what they say of it
    "workspace missing": (_set("workspace", None), "models[0]", "lacks 'workspace'"),
    "workspace a list": (_set("workspace", [64]), "models[0].workspace",
                         "expected an integer or an expression"),
    "constraints an object": (_set("constraints", {"a": 1}), "models[0].constraints",
                              "expected a list, got an object"),
    "node_profile a string": (_set("node_profile", "x"), "models[0].node_profile",
                              "expected a list, got a string"),
    "a constraint without its message": (_set("constraints", [["batch >= 1"]]),
                                         "models[0].constraints[0]", "[condition, message]"),
    "code in the workspace": (_set("workspace", "max(__import__('os').system('touch PWNED'), 64)"),
                              "workspace", "uses a call other than max"),
    "an attribute in an output shape": (_set("outputs.0.shape_expr.0", "batch.__class__"),
                                        "outputs[0].shape_expr", "uses attribute syntax"),
    "an unknown name in the workspace": (_set("workspace", "4 * frames"), "workspace",
                                         "uses the unknown name 'frames'"),
    "a library path": (_set("library", "../_classifier.so"), "models[0].library",
                       "is not a bare file name"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_MANIFESTS))
def test_a_manifest_the_loader_cannot_use_fails_the_check_and_the_import_says_why(
        digits: SimpleNamespace, tmp_path: Path, case: str) -> None:
    src = digits.wheels["x86_64-linux"]
    edit, key, problem = BROKEN_MANIFESTS[case]
    manifest = manifest_of(src)
    edit(manifest["models"][0])
    bad = repack(src, tmp_path / "w", replace={"digits/_models.json": json.dumps(manifest).encode()})
    failed = failures(check_wheel(bad, auditwheel=False))
    assert "manifest" in failed and key in failed["manifest"] and problem in failed["manifest"], failed
    # the loader refuses the same manifest for the same reason, with an ImportError
    done = import_package(bad, tmp_path / "site")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and key.split(".")[-1] in last and problem in last, \
        done.stderr
    assert not (tmp_path / "site" / "PWNED").exists()


def test_a_manifest_nested_too_deeply_is_refused_with_a_message(digits: SimpleNamespace,
                                                                tmp_path: Path) -> None:
    src = digits.wheels["x86_64-linux"]
    nested = b"[" * 100_000 + b"]" * 100_000
    bad = repack(src, tmp_path / "w", replace={"digits/_models.json": nested})
    failed = failures(check_wheel(bad, auditwheel=False))
    assert "nests too deeply" in failed["manifest"]
    done = import_package(bad, tmp_path / "site")
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and "_models.json: not valid JSON" in last, done.stderr


def test_wrong_platform_tag_fails_tag_and_machine_checks(digits: SimpleNamespace, tmp_path: Path) -> None:
    bad = repack(digits.wheels["x86_64-linux"], tmp_path, platform="manylinux_2_17_aarch64")
    failed = assert_fails_only(check_wheel(bad), "platform tag", "ELF header", "auditwheel")
    assert "target x86_64-linux" in failed["platform tag"]
    assert "EM_X86_64" in failed["digits/_classifier.so: ELF header"]


def test_tag_older_than_the_glibc_the_library_needs(digits: SimpleNamespace, tmp_path: Path) -> None:
    # the aarch64 library needs GLIBC_2.17 (aarch64 glibc starts there): manylinux_2_12 is a lie
    bad = repack(digits.wheels["aarch64-linux"], tmp_path, platform="manylinux_2_12_aarch64")
    failed = assert_fails_only(check_wheel(bad), "platform tag", "glibc versions", "auditwheel")
    assert "GLIBC_2.17" in failed["digits/_classifier.so: glibc versions"]
    assert "manylinux_2_17" in failed["auditwheel"]


def test_rpath_fails(digits: SimpleNamespace, tmp_path: Path) -> None:
    library = relink(digits, tmp_path / "lib", extra_args=["-Wl,-rpath,$ORIGIN/../lib"])
    bad = repack(digits.wheels["x86_64-linux"], tmp_path, replace={"digits/_classifier.so": library})
    failed = assert_fails_only(check_wheel(bad, auditwheel=False), "RPATH/RUNPATH")
    assert "$ORIGIN/../lib" in failed["digits/_classifier.so: RPATH/RUNPATH"]


def test_wrong_soname_fails(digits: SimpleNamespace, tmp_path: Path) -> None:
    library = relink(digits, tmp_path / "lib", soname="libclassifier.so.1")
    bad = repack(digits.wheels["x86_64-linux"], tmp_path, replace={"digits/_classifier.so": library})
    failed = assert_fails_only(check_wheel(bad, auditwheel=False), "SONAME")
    assert "libclassifier.so.1" in failed["digits/_classifier.so: SONAME"]


def test_dependency_on_another_library_fails(digits: SimpleNamespace, tmp_path: Path) -> None:
    arch = get_target("x86_64-linux").arches[0]
    source = tmp_path / "helper.c"
    source.write_text('__attribute__((visibility("default"))) int helper(int x) { return x; }\n')
    helper_obj = zig.compile_c(source, tmp_path / "helper.o", arch)
    zig.link_shared([helper_obj], tmp_path / "dep" / "libhelper.so", arch, "elf", "libhelper.so")
    # a constructor keeps the call (and so the DT_NEEDED entry) through --gc-sections and --as-needed
    user = tmp_path / "user.c"
    user.write_text("int helper(int);\n__attribute__((constructor)) static void init(void) { helper(0); }\n")
    user_obj = zig.compile_c(user, tmp_path / "user.o", arch)
    library = relink(
        digits,
        tmp_path / "lib",
        extra_objects=[user_obj],
        libs=("m", "pthread", "helper"),
        extra_args=[f"-L{tmp_path / 'dep'}"],
    )
    bad = repack(digits.wheels["x86_64-linux"], tmp_path, replace={"digits/_classifier.so": library})
    failed = assert_fails_only(check_wheel(bad, auditwheel=False), "DT_NEEDED")
    assert "libhelper.so" in failed["digits/_classifier.so: DT_NEEDED"]


def test_universal2_checksum_changed_in_one_slice(digits: SimpleNamespace, tmp_path: Path) -> None:
    src = digits.wheels["universal2-macos"]
    library = read_entries(src)["digits/_classifier.dylib"]
    checksum = manifest_of(src)["models"][0]["checksum"].encode()
    x86 = {s.cputype: s for s in _fat_slices(library, tmp_path)}[zig.CPU_TYPE_X86_64]
    at = library.find(checksum, x86.offset, x86.offset + x86.size)
    assert at > 0
    bad = repack(src, tmp_path, replace={"digits/_classifier.dylib": flip_hex(library, at)})
    failed = assert_fails_only(check_wheel(bad), "ABI checksum")
    message = failed["digits/_classifier.dylib: ABI checksum of classifier"]
    assert message.startswith("x86_64:") and "aarch64" not in message


def test_universal2_arm64_byte_changed_breaks_the_signature(digits: SimpleNamespace, tmp_path: Path) -> None:
    src = digits.wheels["universal2-macos"]
    library = read_entries(src)["digits/_classifier.dylib"]
    checksum = manifest_of(src)["models"][0]["checksum"].encode()
    arm = {s.cputype: s for s in _fat_slices(library, tmp_path)}[zig.CPU_TYPE_ARM64]
    at = library.find(checksum, arm.offset, arm.offset + arm.size)
    assert at > 0
    bad = repack(src, tmp_path, replace={"digits/_classifier.dylib": flip_hex(library, at)})
    failed = assert_fails_only(check_wheel(bad), "ABI checksum", "code signature")
    page = (at - arm.offset) // 16384
    assert f"page {page} (bytes" in failed["digits/_classifier.dylib: code signature"]
    assert failed["digits/_classifier.dylib: ABI checksum of classifier"].startswith("aarch64:")


def _fat_slices(data: bytes, tmp_path: Path) -> list[Any]:
    path = tmp_path / "fat.dylib"
    path.write_bytes(data)
    return zig.read_universal(path)


def test_not_a_wheel(tmp_path: Path) -> None:
    path = tmp_path / "digits_cuvil-1.0.0-py3-none-manylinux_2_17_x86_64.whl"
    path.write_bytes(b"not a zip file")
    report = check_wheel(path)
    assert [(r.name, r.ok) for r in report] == [("archive", False)]
    assert "zip" in report.results[0].message
    missing = check_wheel(tmp_path / "nothing.whl")
    assert not missing.ok and "no such file" in missing.results[0].message


def test_invalid_file_name(digits: SimpleNamespace, tmp_path: Path) -> None:
    bad = tmp_path / "digits.whl"
    bad.write_bytes(digits.wheels["x86_64-linux"].read_bytes())
    failed = failures(check_wheel(bad, auditwheel=False))
    assert "not a valid wheel file name" in failed["wheel file name"]


# ------------------------------------------------------- Mach-O libraries linked here

TINY_C = """\
#include <stdint.h>
#define EXPORT __attribute__((visibility("default")))
EXPORT const char cuvil_tiny_abi_checksum[65] = "%s";
__attribute__((noinline)) int tiny_helper(int x) { return 3 * x + 1; }
EXPORT int64_t cuvil_tiny_workspace_size(const int64_t *dims) { return dims[0] * 4; }
EXPORT int32_t cuvil_tiny_run(const void *const *in, void *const *out, const int64_t *dims, void *ws) {
    const float *x = (const float *)in[0];
    float *y = (float *)out[0];
    for (int64_t i = 0; i < dims[0]; i++) y[i] = x[i] * (float)tiny_helper(1);
    return 0;
}
EXPORT int32_t cuvil_tiny_run_profiled(const void *const *in, void *const *out, const int64_t *dims,
                                       void *ws, uint64_t *timestamps_ns) {
    timestamps_ns[0] = timestamps_ns[1] = 0;
    return cuvil_tiny_run(in, out, dims, ws);
}
EXPORT void *cuvil_tiny_thread_pool(void) { return 0; }
EXPORT int32_t cuvil_tiny_use_thread_pool(void *pool) { return -1; }
EXPORT void cuvil_tiny_set_thread_limit(int32_t n) {}
EXPORT int32_t cuvil_tiny_cpu_check(char *missing, int64_t size) { return 0; }
%s
"""
TINY_SIG: dict[str, Any] = {
    "name": "tiny",
    "library": "libtiny.dylib",
    "symbols": ["n"],
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["n"]}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": ["n"], "shape_expr": ["n"]}],
    "constraints": [],
    "workspace": "4 * n",
}
TINY_SIG["checksum"] = abi_checksum(TINY_SIG)
TINY_EXPORTS = {"cuvil_tiny_abi_checksum", "cuvil_tiny_workspace_size", "cuvil_tiny_run",
                "cuvil_tiny_run_profiled", "cuvil_tiny_thread_pool", "cuvil_tiny_use_thread_pool",
                "cuvil_tiny_set_thread_limit", "cuvil_tiny_cpu_check"}
MACOS_TARGETS = ("arm64-macos", "x86_64-macos", "universal2-macos")


def link_tiny(target_name: str, out_dir: Path, extra: str = "") -> bytes:
    target = get_target(target_name)
    source = out_dir / "tiny.c"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(TINY_C % (TINY_SIG["checksum"], extra))
    objects = {a.name: [zig.compile_c(source, out_dir / f"tiny.{a.name}.o", a)] for a in target.arches}
    return zig.link_library(target, objects, out_dir / "libtiny.dylib").read_bytes()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("tiny")
    libs = {t: link_tiny(t, root / t) for t in MACOS_TARGETS}
    libs["arm64-extra"] = link_tiny(
        "arm64-macos", root / "extra", extra="EXPORT int cuvil_tiny_debug(void) { return 7; }"
    )
    return libs


def tiny_wheel(out_dir: Path, library: bytes, target_name: str) -> Path:
    target = get_target(target_name)
    manifest = {
        "abi_version": ABI_VERSION,
        "package": "tiny",
        "target": target.name,
        "cuvil_version": "test",
        "models": [TINY_SIG],
    }
    dist_info = "tiny-1.0.dist-info"
    files = {
        "tiny/__init__.py": b"",
        "tiny/_models.json": json.dumps(manifest).encode(),
        "tiny/libtiny.dylib": library,
        f"{dist_info}/METADATA": b"Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\n",
        f"{dist_info}/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
            f"Tag: py3-none-{target.platform_tag}\n"
        ).encode(),
    }
    return write_wheel(out_dir / f"tiny-1.0-py3-none-{target.platform_tag}.whl", files)


@pytest.mark.parametrize("target_name", MACOS_TARGETS)
def test_macho_reader_on_zig_libraries(tiny: dict[str, bytes], target_name: str) -> None:
    target = get_target(target_name)
    fat, images = parse_macho(tiny[target_name])
    assert fat == target.is_universal
    assert sorted(im.arch for im in images) == sorted(a.name for a in target.arches)
    for im in images:
        assert im.id_dylib == "@rpath/libtiny.dylib"
        assert im.dylibs == ["/usr/lib/libSystem.B.dylib"] and im.rpaths == []
        exported, source = im.exported_names()
        assert "export trie" in source
        assert exported - LINKER_SYMBOLS == TINY_EXPORTS
        # the symbol table, a second encoding of the same facts, agrees; the helper is hidden
        by_name = {s.name: s for s in im.symbols()}
        assert {n[1:] for n, s in by_name.items() if s.exported} - LINKER_SYMBOLS == TINY_EXPORTS
        assert "_tiny_helper" in by_name and not by_name["_tiny_helper"].exported
        raw, where = im.read_symbol("cuvil_tiny_abi_checksum", 65)
        assert raw == TINY_SIG["checksum"].encode() + b"\0", where
        signature = im.verify_code_signature()
        if im.arch == "aarch64":
            assert signature is not None and signature.ok, signature and signature.problems
            assert signature.adhoc and signature.page_size == 16384 and signature.hash_name == "sha256"
            assert signature.code_limit == im.code_signature[0]
        else:
            assert signature is None or signature.ok


def test_tiny_wheels_pass_every_check(tiny: dict[str, bytes], tmp_path: Path) -> None:
    for target_name in MACOS_TARGETS:
        report = check_wheel(tiny_wheel(tmp_path / target_name, tiny[target_name], target_name))
        assert report.ok, report.format()
        assert len(report) >= 13


def _text_offset(library: bytes) -> int:
    _, (image,) = parse_macho(library)
    text = next(s for s in image.sections if s.sectname == "__text")
    return text.offset


def test_code_signature_detects_one_changed_byte(tiny: dict[str, bytes]) -> None:
    library = tiny["arm64-macos"]
    at = _text_offset(library) + 4  # inside the first instructions
    changed = library[:at] + bytes([library[at] ^ 0x01]) + library[at + 1 :]
    _, (image,) = parse_macho(changed)
    signature = image.verify_code_signature()
    assert signature is not None and not signature.ok
    assert f"page {at // 16384} (bytes" in signature.problems[0]
    assert "modified after it was signed" in signature.problems[0]


def test_code_signature_detects_a_changed_stored_hash(tiny: dict[str, bytes]) -> None:
    library = tiny["arm64-macos"]
    _, (image,) = parse_macho(library)
    dataoff, datasize = image.code_signature
    # the last bytes of the CodeDirectory are the last page's hash; change one of them
    blob = library[dataoff : dataoff + datasize]
    count = struct.unpack(">I", blob[8:12])[0]
    index = dict(struct.unpack(">II", blob[12 + 8 * i : 20 + 8 * i]) for i in range(count))
    cd = index[0]
    cd_length = struct.unpack(">I", blob[cd + 4 : cd + 8])[0]
    at = dataoff + cd + cd_length - 1
    changed = library[:at] + bytes([library[at] ^ 0xFF]) + library[at + 1 :]
    _, (image,) = parse_macho(changed)
    signature = image.verify_code_signature()
    assert signature is not None and not signature.ok
    assert "page hash" in signature.problems[0]


def test_universal2_with_one_slice_only_fails(tiny: dict[str, bytes], tmp_path: Path) -> None:
    report = check_wheel(tiny_wheel(tmp_path, tiny["arm64-macos"], "universal2-macos"))
    failed = assert_fails_only(report, "Mach-O slices")
    assert (
        "x86_64 + aarch64" in failed["tiny/libtiny.dylib: Mach-O slices"]
        or "aarch64 + x86_64" in failed["tiny/libtiny.dylib: Mach-O slices"]
    )


def test_extra_macho_export_fails(tiny: dict[str, bytes], tmp_path: Path) -> None:
    report = check_wheel(tiny_wheel(tmp_path, tiny["arm64-extra"], "arm64-macos"))
    failed = assert_fails_only(report, "exported symbols")
    assert "cuvil_tiny_debug" in failed["tiny/libtiny.dylib: exported symbols"]


def test_unsigned_arm64_library_fails(tiny: dict[str, bytes], tmp_path: Path) -> None:
    library = tiny["arm64-macos"]
    _, (image,) = parse_macho(library)
    # turn LC_CODE_SIGNATURE into a load command the reader ignores: the file is then unsigned
    offset = next(off for cmd, off, _ in image.commands if cmd == LC_CODE_SIGNATURE)
    unsigned = library[:offset] + struct.pack("<I", 0x2B) + library[offset + 4 :]
    failed = assert_fails_only(check_wheel(tiny_wheel(tmp_path, unsigned, "arm64-macos")), "code signature")
    assert "no code signature" in failed["tiny/libtiny.dylib: code signature"]


def test_truncated_macho_is_reported_not_raised(tiny: dict[str, bytes], tmp_path: Path) -> None:
    library = tiny["universal2-macos"][:3000]
    report = check_wheel(tiny_wheel(tmp_path, library, "universal2-macos"))
    failed = failures(report)
    assert "runs past the end" in failed["tiny/libtiny.dylib: Mach-O slices"]


def test_macho_library_in_a_linux_wheel_fails_the_format_check(
    tiny: dict[str, bytes], tmp_path: Path
) -> None:
    report = check_wheel(tiny_wheel(tmp_path, tiny["x86_64-macos"], "x86_64-linux"), auditwheel=False)
    failed = assert_fails_only(report, "format")
    assert (
        "is Mach-O" in failed["tiny/libtiny.dylib: format"]
        and "need ELF" in failed["tiny/libtiny.dylib: format"]
    )
