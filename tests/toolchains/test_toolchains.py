"""Toolchains: toolchain files, host detection, LLVM machines, the zig driver, CMake files."""

from __future__ import annotations

import ctypes
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cuvil.compiler.kernels.target import KernelTarget
from cuvil.errors import ToolchainError
from cuvil.toolchains import (
    ENV_VAR,
    Arch,
    bundled_toolchain_dir,
    get_target,
    host_cpu,
    host_target_name,
    list_targets,
    load_toolchain_file,
    target_machine,
    zig,
)
from cuvil.toolchains.cmake import write_cmake_toolchain

BUNDLED = ["aarch64-linux", "aarch64-linux-musl", "aarch64-windows", "arm64-macos", "universal2-macos",
           "x86_64-linux", "x86_64-linux-musl", "x86_64-macos", "x86_64-windows"]
#: what each object format's targets are called, link and run on
FORMATS = {"elf": (".so", "linux"), "macho": (".dylib", "macos"), "coff": (".dll", "windows")}

GOOD_TOML = """\
name = "{name}"
object-format = "elf"
platform-tag = "manylinux_2_17_x86_64"
library-suffix = ".so"

[[arch]]
name = "x86_64"
llvm-triple = "x86_64-unknown-linux-gnu"
zig-target = "x86_64-linux-gnu.2.17"
cpu = "x86-64-v2"
features = ""
"""


def write_toml(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------ toolchain files


def test_bundled_toolchain_files_load_with_valid_wheel_tags():
    from packaging.tags import parse_tag

    targets = {t.name: t for t in list_targets()}
    assert sorted(targets) == BUNDLED
    for t in targets.values():
        assert t.source.parent == bundled_toolchain_dir()
        (tag,) = parse_tag(f"py3-none-{t.platform_tag}")
        assert tag.platform == t.platform_tag
        suffix, os_name = FORMATS[t.object_format]
        assert t.library_suffix == suffix
        assert 1 <= len(t.arches) <= 2
        for a in t.arches:
            assert a.name in ("x86_64", "aarch64")
            assert a.os == os_name
            # the tag's C library is the one the code links: musllinux <-> musl triples
            assert (a.libc == "musl") == t.platform_tag.startswith("musllinux_"), t.name
    u = targets["universal2-macos"]
    assert [a.name for a in u.arches] == ["x86_64", "aarch64"]
    assert u.platform_tag == "macosx_10_13_universal2"


def test_musl_and_windows_tags_are_the_ones_pip_accepts_there(monkeypatch):
    from packaging import _musllinux, tags

    # on a musl 1.2 system (what packaging reads from the loader, faked here) ...
    monkeypatch.setattr(_musllinux, "_get_musl_version", lambda _exe: _musllinux._MuslVersion(1, 2))
    for arch in ("x86_64", "aarch64"):
        assert get_target(f"{arch}-linux-musl").platform_tag in _musllinux.platform_tags([arch])
    # ... and on Windows, whose platform sysconfig names win-amd64 / win-arm64
    for arch, spelled in (("x86_64", "win-amd64"), ("aarch64", "win-arm64")):
        monkeypatch.setattr(tags.sysconfig, "get_platform", lambda s=spelled: s)
        assert [get_target(f"{arch}-windows").platform_tag] == list(tags._generic_platforms())


def test_universal2_tag_installs_on_intel_and_apple_silicon():
    from packaging.tags import mac_platforms

    tag = get_target("universal2-macos").platform_tag
    assert tag in mac_platforms((10, 13), "x86_64")
    assert tag in mac_platforms((11, 0), "arm64")
    assert get_target("arm64-macos").platform_tag in mac_platforms((11, 0), "arm64")
    assert get_target("x86_64-macos").platform_tag in mac_platforms((10, 13), "x86_64")


@pytest.mark.parametrize(
    ("old", "new", "key", "words"),
    [
        ('platform-tag = "manylinux_2_17_x86_64"\n', "", "platform-tag", "missing"),
        ('library-suffix = ".so"', "library-suffix = 3", "library-suffix", "expected a string"),
        ('object-format = "elf"', 'object-format = "wasm"', "object-format", "'wasm'"),
        ('object-format = "elf"', 'object-format = "coff"', "arch[0].llvm-triple",
         "does not produce PE/COFF"),
        ('cpu = "x86-64-v2"\n', "", "arch[0].cpu", "missing"),
        ('features = ""', "features = ['+avx']", "arch[0].features", "expected a string"),
        ('features = ""', 'features = "avx2"', "arch[0].features", "'avx2'"),
        ('cpu = "x86-64-v2"', 'cpu = "x86-64-v2"\ncpus = "x"', "arch[0].cpus", "did you mean 'cpu'"),
        (
            'llvm-triple = "x86_64-unknown-linux-gnu"',
            'llvm-triple = "x86_64-apple-macosx10.13.0"',
            "arch[0].llvm-triple",
            "does not produce ELF",
        ),
        ('platform-tag = "manylinux_2_17_x86_64"', 'platform-tag = "Linux x86"', "platform-tag", "wheel"),
        ("[[arch]]", "[arch]", "arch", "[[arch]] tables"),
    ],
)
def test_bad_toolchain_file_names_file_and_key(tmp_path, old, new, key, words):
    text = GOOD_TOML.format(name="mine")
    assert old in text
    path = write_toml(tmp_path, "mine", text.replace(old, new))
    with pytest.raises(ToolchainError) as info:
        load_toolchain_file(path)
    message = str(info.value)
    assert str(path) in message
    assert f"'{key}'" in message or "TOML" in message
    assert words in message


def test_toolchain_file_name_must_match_file(tmp_path):
    path = write_toml(tmp_path, "mine", GOOD_TOML.format(name="other"))
    with pytest.raises(ToolchainError, match=r"'name'.*mine\.toml"):
        load_toolchain_file(path)


def test_invalid_toml_is_a_toolchain_error(tmp_path):
    path = write_toml(tmp_path, "mine", "name = \n")
    with pytest.raises(ToolchainError, match="not valid TOML"):
        load_toolchain_file(path)


def test_user_toolchain_dirs_from_argument_and_environment(tmp_path, monkeypatch):
    arg_dir, env_dir = tmp_path / "arg", tmp_path / "env"
    arg_dir.mkdir()
    env_dir.mkdir()
    write_toml(arg_dir, "from-arg", GOOD_TOML.format(name="from-arg"))
    write_toml(env_dir, "from-env", GOOD_TOML.format(name="from-env"))
    # a user's file replaces a bundled target of the same name
    write_toml(env_dir, "x86_64-linux", GOOD_TOML.format(name="x86_64-linux").replace("x86-64-v2", "haswell"))
    monkeypatch.setenv(ENV_VAR, os.pathsep.join([str(env_dir), str(tmp_path / "missing")]))
    assert get_target("from-arg", [arg_dir]).source == arg_dir / "from-arg.toml"
    assert get_target("from-env").source == env_dir / "from-env.toml"
    assert get_target("x86_64-linux").arches[0].cpu == "haswell"
    names = [t.name for t in list_targets([arg_dir])]
    assert names == sorted([*BUNDLED, "from-arg", "from-env"])
    with pytest.raises(ToolchainError, match="from-arg"):
        get_target("from-arg")  # not on the path without the argument


def test_unknown_target_suggests_a_name():
    with pytest.raises(ToolchainError) as info:
        get_target("x86_64-linx")
    message = str(info.value)
    assert "Did you mean 'x86_64-linux'?" in message
    for name in BUNDLED:
        assert name in message
    assert ENV_VAR in message


# -------------------------------------------------------------------------- host


@pytest.mark.parametrize(("machine", "interpreter", "want"), [
    ("ARM64", "win-amd64", "x86_64-windows"),  # an x64 Python emulated on Windows on Arm
    ("AMD64", "win-arm64", "aarch64-windows"),
    ("AMD64", "win-amd64", "x86_64-windows"),
])
def test_windows_host_target_follows_the_interpreter(monkeypatch, machine, interpreter, want):
    # the library must load into this Python: its arch, not the machine's, picks the target
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(sysconfig, "get_platform", lambda: interpreter)
    assert host_target_name() == want


def test_host_target_matches_this_machine():
    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    name = host_target_name()
    if platform.system() == "Linux":
        assert name == f"{arch}-linux"
    elif platform.system() == "Darwin":
        assert name == ("arm64-macos" if arch == "aarch64" else "x86_64-macos")
    host = get_target(None)
    assert host.name == name
    assert host.is_host()
    assert get_target("host") == host
    others = [t.name for t in list_targets() if t.is_host()]
    if platform.system() == "Linux":
        assert others == [name]
    cpu, features = host_cpu()
    assert cpu and isinstance(features, str)


def test_target_machines_for_every_bundled_arch():
    for t in list_targets():
        for a in t.arches:
            tm = target_machine(a)
            assert tm.triple == a.llvm_triple
            layout = str(tm.target_data)
            assert layout.startswith("e-")  # all bundled targets are little-endian
            # symbol mangling: Mach-O (_name), ELF, Windows COFF (x86-64 "m:w", arm64 "m:e")
            mangling = {"macho": ("m:o",), "elf": ("m:e",), "coff": ("m:w", "m:e")}
            assert any(m in layout for m in mangling[t.object_format]), (t.name, layout)
    host = get_target(None)
    tm = target_machine(host.arches[0], cpu="native", opt_level=2)
    assert tm.triple == host.arches[0].llvm_triple
    foreign = get_target("aarch64-linux" if host.arches[0].name == "x86_64" else "x86_64-linux")
    with pytest.raises(ToolchainError, match="native"):
        target_machine(foreign.arches[0], cpu="native")


def test_zig_mcpu_names():
    x86 = get_target("x86_64-linux").arches[0]
    assert zig.zig_mcpu(x86) == "x86_64_v2"
    assert zig.zig_mcpu(get_target("aarch64-linux").arches[0]) == "generic+neon"
    assert zig.zig_mcpu(get_target("arm64-macos").arches[0]) == "apple_m1"
    odd = Arch("x86_64", x86.llvm_triple, x86.zig_target, "not-a-cpu", "")
    assert zig.zig_mcpu(odd) is None
    unknown_feature = Arch("x86_64", x86.llvm_triple, x86.zig_target, "x86-64-v3", "+avx2,+no-such-feature")
    assert zig.zig_mcpu(unknown_feature) == "x86_64_v3+avx2"


# ------------------------------------------------------------------------- zig driver

TEST_C = r"""
#include <stddef.h>
#include <stdint.h>

extern const unsigned char cuvil_test_blob[] __attribute__((visibility("hidden")));
extern const unsigned char cuvil_test_empty[] __attribute__((visibility("hidden")));

int cuvil_test_hidden_helper(size_t i) { return cuvil_test_blob[i]; }

__attribute__((visibility("default"))) int cuvil_test_byte(size_t i) {
    return cuvil_test_hidden_helper(i);
}

__attribute__((visibility("default"))) int cuvil_test_alignments(void) {
    return (int)((uintptr_t)cuvil_test_blob % 64) + (int)((uintptr_t)cuvil_test_empty % 64);
}
"""
EXPORTED = {"cuvil_test_byte", "cuvil_test_alignments"}
BLOB_SIZE = 3 * 1024 * 1024 + 17


def _build_objects(root: Path, target, src: Path, blob: Path, empty: Path) -> dict[str, list[Path]]:
    objects = {}
    for arch in target.arches:
        d = root / target.name / arch.name
        objects[arch.name] = [
            zig.compile_c(src, d / "test.o", arch),
            zig.embed_blob(blob, "cuvil_test_blob", d / "blob.o", arch, target.object_format),
            zig.embed_blob(empty, "cuvil_test_empty", d / "empty.o", arch, target.object_format),
        ]
    return objects


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Libraries for x86_64-linux, aarch64-linux and universal2-macos (linked in parallel)."""
    import numpy as np

    root = tmp_path_factory.mktemp("toolchains")
    src = root / "test.c"
    src.write_text(TEST_C)
    blob_bytes = np.random.default_rng(7).integers(0, 256, size=BLOB_SIZE, dtype=np.uint8).tobytes()
    blob = root / "blob.bin"
    blob.write_bytes(blob_bytes)
    empty = root / "empty.bin"
    empty.write_bytes(b"")
    timings: dict[str, float] = {}
    logs: list[str] = []

    def build(name: str):
        t = get_target(name)
        objects = _build_objects(root, t, src, blob, empty)
        lib = root / t.name / f"libcuvil_test{t.library_suffix}"
        start = time.perf_counter()
        slices = []
        if t.is_universal:
            for arch in t.arches:
                thin = root / t.name / arch.name / lib.name
                zig.link_shared(objects[arch.name], thin, arch, t.object_format, lib.name, log=logs.append)
                slices.append(thin)
            zig.fuse_universal(slices, lib)
        else:
            zig.link_library(t, objects, lib, log=logs.append)
        timings[f"{name} first"] = time.perf_counter() - start
        # a second link of the same target: zig's cache is warm now
        again = root / t.name / f"again{t.library_suffix}"
        start = time.perf_counter()
        zig.link_library(t, objects, again, soname=lib.name)
        timings[f"{name} again"] = time.perf_counter() - start
        return t, lib, slices, again

    names = ["x86_64-linux", "aarch64-linux", "universal2-macos"]
    with ThreadPoolExecutor(len(names)) as pool:
        results = dict(zip(names, pool.map(build, names)))
    print("link timings (s):", {k: round(v, 2) for k, v in timings.items()})
    return {"root": root, "blob": blob_bytes, "results": results, "logs": logs, "timings": timings}


def _elf_exports(path: Path):
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        machine = elf["e_machine"]
        dynamic = next(s for s in elf.iter_sections() if isinstance(s, DynamicSection))
        tags = {t.entry.d_tag: t for t in dynamic.iter_tags()}
        soname = tags["DT_SONAME"].soname if "DT_SONAME" in tags else None
        needed = [t.needed for t in dynamic.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        dynsym = elf.get_section_by_name(".dynsym")
        exported = {
            s.name
            for s in dynsym.iter_symbols()
            if s.name
            and s["st_shndx"] != "SHN_UNDEF"
            and s["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK")
            and s["st_other"]["visibility"] in ("STV_DEFAULT", "STV_PROTECTED")
        }
        all_dynamic = {s.name for s in dynsym.iter_symbols() if s.name}
    return machine, soname, set(tags), needed, exported, all_dynamic


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "machine"), [("x86_64-linux", "EM_X86_64"), ("aarch64-linux", "EM_AARCH64")]
)
def test_linked_elf_library(built, name, machine):
    _t, lib, _, again = built["results"][name]
    for path in (lib, again):
        e_machine, soname, tags, needed, exported, all_dynamic = _elf_exports(path)
        assert e_machine == machine
        assert soname == lib.name
        assert "DT_RPATH" not in tags and "DT_RUNPATH" not in tags
        assert exported == EXPORTED
        assert "cuvil_test_blob" not in all_dynamic
        assert "cuvil_test_hidden_helper" not in all_dynamic
        assert set(needed) <= {"libc.so.6", "libm.so.6"}
    assert not [p for p in lib.parent.iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.slow
def test_linked_host_library_reads_blob(built):
    t, lib, _, _ = built["results"]["x86_64-linux"]
    if not t.is_host():
        pytest.skip("x86_64-linux libraries cannot be loaded on this machine")
    dll = ctypes.CDLL(str(lib))
    dll.cuvil_test_byte.argtypes = [ctypes.c_size_t]
    dll.cuvil_test_byte.restype = ctypes.c_int
    blob = built["blob"]
    for offset in (0, 1, 4096, 123457, BLOB_SIZE - 1):
        assert dll.cuvil_test_byte(offset) == blob[offset]
    assert dll.cuvil_test_alignments() == 0
    with pytest.raises(AttributeError):
        dll.cuvil_test_hidden_helper  # noqa: B018 - hidden symbols are not exported
    with pytest.raises(AttributeError):
        dll.cuvil_test_blob  # noqa: B018


LC_SYMTAB, LC_ID_DYLIB, LC_CODE_SIGNATURE = 0x2, 0xD, 0x1D
LC_VERSION_MIN_MACOSX, LC_BUILD_VERSION = 0x24, 0x32


def _macho_info(data: bytes):
    magic, cputype, _sub, filetype, ncmds, _size, _flags = struct.unpack_from("<IiiIIII", data, 0)
    assert magic == 0xFEEDFACF
    info = {"cputype": cputype & 0xFFFFFFFF, "filetype": filetype, "cmds": set()}
    offset = 32
    for _ in range(ncmds):
        cmd, cmdsize = struct.unpack_from("<II", data, offset)
        info["cmds"].add(cmd)
        if cmd == LC_ID_DYLIB:
            (name_off,) = struct.unpack_from("<I", data, offset + 8)
            raw = data[offset + name_off : offset + cmdsize]
            info["install_name"] = raw.split(b"\0", 1)[0].decode()
        elif cmd == LC_BUILD_VERSION:
            info["minos"] = struct.unpack_from("<I", data, offset + 12)[0]
        elif cmd == LC_VERSION_MIN_MACOSX:
            info["minos"] = struct.unpack_from("<I", data, offset + 8)[0]
        elif cmd == LC_SYMTAB:
            symoff, nsyms, stroff, _strsize = struct.unpack_from("<IIII", data, offset + 8)
            exported, names = set(), set()
            for i in range(nsyms):
                strx, ntype, _sect, _desc, _value = struct.unpack_from("<IBBHQ", data, symoff + 16 * i)
                name = data[stroff + strx :].split(b"\0", 1)[0].decode()
                names.add(name)
                if ntype & 0x01 and not ntype & 0x10 and (ntype & 0x0E) == 0x0E:
                    exported.add(name)
            info["exported"], info["symbols"] = exported, names
        offset += cmdsize
    return info


@pytest.mark.slow
def test_linked_universal2_library(built):
    _t, lib, slices, again = built["results"]["universal2-macos"]
    data = lib.read_bytes()
    entries = zig.read_universal(lib)
    assert [e.cputype for e in entries] == [zig.CPU_TYPE_X86_64, zig.CPU_TYPE_ARM64]
    assert [e.align for e in entries] == [12, 14]
    minos = {zig.CPU_TYPE_X86_64: (10 << 16) | (13 << 8), zig.CPU_TYPE_ARM64: 11 << 16}
    for entry, thin in zip(entries, slices):
        body = data[entry.offset : entry.offset + entry.size]
        assert body == thin.read_bytes()  # slices come back identical
        info = _macho_info(body)
        assert info["cputype"] == entry.cputype
        assert info["filetype"] == 6  # MH_DYLIB
        assert info["install_name"] == f"@rpath/{lib.name}"
        assert info["minos"] == minos[entry.cputype]
        # zig's Mach-O linker also leaves its synthesized header symbols external
        linker_made = {"__mh_dylib_header", "___dso_handle"}
        assert info["exported"] - linker_made == {f"_{n}" for n in EXPORTED}
        assert "_cuvil_test_blob" in info["symbols"]  # present, but not exported
        if entry.cputype == zig.CPU_TYPE_ARM64:
            assert LC_CODE_SIGNATURE in info["cmds"]  # zig signs arm64 ad hoc
    # link_library does slices + fuse in one call
    again_entries = zig.read_universal(again)
    assert [e.cputype for e in again_entries] == [e.cputype for e in entries]
    lipo = shutil.which("llvm-lipo") or shutil.which("lipo")
    if lipo:
        out = subprocess.run([lipo, "-info", str(lib)], capture_output=True, text=True, check=True).stdout
        assert "x86_64" in out and "arm64" in out


@pytest.mark.slow
def test_link_logs_progress_and_timings(built):
    logs = built["logs"]
    assert any("linking" in line and "x86_64-linux-gnu.2.17" in line for line in logs)
    assert any(line.startswith("cuvil: linked") for line in logs)
    for name in ("x86_64-linux", "aarch64-linux"):
        assert built["timings"][f"{name} again"] < 15  # warm cache: well under a second usually


def _fake_macho(cputype: int, cpusubtype: int, payload: bytes) -> bytes:
    return struct.pack("<IIIIIII", 0xFEEDFACF, cputype, cpusubtype, 6, 0, 0, 0) + b"\0" * 4 + payload


def test_fuse_universal_round_trip(tmp_path):
    x86 = tmp_path / "x86.dylib"
    arm = tmp_path / "arm.dylib"
    x86.write_bytes(_fake_macho(zig.CPU_TYPE_X86_64, 3, b"intel" * 1000))
    arm.write_bytes(_fake_macho(zig.CPU_TYPE_ARM64, 0, b"apple" * 5000))
    out = zig.fuse_universal([x86, arm], tmp_path / "fat.dylib")
    data = out.read_bytes()
    assert struct.unpack_from(">II", data) == (0xCAFEBABE, 2)
    entries = zig.read_universal(out)
    assert [(e.cputype, e.cpusubtype, e.align) for e in entries] == [
        (zig.CPU_TYPE_X86_64, 3, 12),
        (zig.CPU_TYPE_ARM64, 0, 14),
    ]
    for e, thin in zip(entries, (x86, arm)):
        assert e.offset % (1 << e.align) == 0
        assert data[e.offset : e.offset + e.size] == thin.read_bytes()
    assert len(data) == entries[-1].offset + entries[-1].size
    with pytest.raises(ToolchainError, match="same cpu type"):
        zig.fuse_universal([x86, x86], tmp_path / "bad.dylib")
    with pytest.raises(ToolchainError, match="already a universal"):
        zig.fuse_universal([out], tmp_path / "bad.dylib")
    with pytest.raises(ToolchainError, match="not a universal"):
        zig.read_universal(x86)
    assert not (tmp_path / "bad.dylib").exists()


def test_embed_blob_object_is_hidden_and_aligned(tmp_path):
    from elftools.elf.elffile import ELFFile

    arch = get_target("x86_64-linux").arches[0]
    data = tmp_path / "weights.bin"
    data.write_bytes(bytes(range(256)) * 10)
    obj = zig.embed_blob(data, "cuvil_w", tmp_path / "w.o", arch, "elf")
    with open(obj, "rb") as f:
        elf = ELFFile(f)
        sym = elf.get_section_by_name(".symtab").get_symbol_by_name("cuvil_w")[0]
        assert sym["st_other"]["visibility"] == "STV_HIDDEN"
        assert sym["st_size"] == 2560
        section = elf.get_section(sym["st_shndx"])
        assert section.name.startswith(".rodata")
        assert not section["sh_flags"] & 0x1  # not writable
        assert section["sh_addralign"] == 64
        assert section.data()[sym["st_value"] : sym["st_value"] + 2560] == data.read_bytes()
    with pytest.raises(ToolchainError, match="C identifier"):
        zig.embed_blob(data, "bad-name", tmp_path / "x.o", arch, "elf")
    with pytest.raises(ToolchainError, match="object format"):
        zig.embed_blob(data, "ok", tmp_path / "x.o", arch, "wasm")


def test_zig_failure_reports_command_and_stderr(tmp_path):
    arch = get_target("x86_64-linux").arches[0]
    src = tmp_path / "broken.c"
    src.write_text("int f(void) { return missing_name; }\n")
    out = tmp_path / "broken.o"
    with pytest.raises(ToolchainError) as info:
        zig.compile_c(src, out, arch)
    message = str(info.value)
    assert "zig cc -target x86_64-linux-gnu.2.17" in message
    assert "missing_name" in message
    assert list(tmp_path.iterdir()) == [src]  # no half-written or temp output


# ----------------------------------------------------------------------------- CMake


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cmake_toolchain_builds_shared_library(tmp_path, built):
    t = get_target("x86_64-linux")
    toolchain = write_cmake_toolchain(t, t.arches[0], tmp_path / "toolchain" / "x86_64-linux.cmake")
    text = toolchain.read_text()
    assert "set(CMAKE_SYSTEM_NAME Linux)" in text
    for tool in ("cc", "c++", "ar", "ranlib"):
        wrapper = toolchain.with_name(f"x86_64-linux-{tool}")
        assert os.access(wrapper, os.X_OK)
        assert shlex.quote(zig.zig_command()[0]) in wrapper.read_text()
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.15)\nproject(tiny C)\nadd_library(tiny SHARED tiny.c)\n"
    )
    (src / "tiny.c").write_text(
        '__attribute__((visibility("default"))) int tiny_add(int a, int b) { return a + b; }\n'
        "int tiny_hidden(void) { return 3; }\n"
    )
    build = tmp_path / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "cmake",
        "-S",
        str(src),
        "-B",
        str(build),
        *generator,
        f"-DCMAKE_TOOLCHAIN_FILE={toolchain}",
        "-DCMAKE_BUILD_TYPE=Release",
    ]
    for cmd in (configure, ["cmake", "--build", str(build)]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    lib = build / "libtiny.so"
    e_machine, soname, _, _, exported, _ = _elf_exports(lib)
    assert e_machine == "EM_X86_64"
    assert soname == "libtiny.so"
    assert exported == {"tiny_add"}
    if t.is_host():
        assert ctypes.CDLL(str(lib)).tiny_add(2, 3) == 5


@pytest.mark.parametrize(("target", "cpu", "float_lanes", "int8_kind"), [
    ("x86_64-linux", None, 4, ("madd128", False, None, None)),
    # AVX-VNNI behind a run-time test
    ("x86_64-linux", "x86-64-v3", 8, ("avxvnni", True, "madd256", False)),
    # every Apple silicon CPU has the dot product, the M2 on I8MM: I8MM behind a run-time test,
    # over UDOT/SDOT
    ("arm64-macos", None, 4, ("i8mm", True, "udot", False)),
    # Armv8.0-A: I8MM, then the dot product, behind run-time tests
    ("aarch64-linux", None, 4, ("i8mm", True, "udot", True)),
    ("aarch64-linux", "neoverse-v1", 4, ("i8mm", False, None, None)),
])
def test_baseline_kernels_get_what_the_cpu_implies(target, cpu, float_lanes, int8_kind):
    # a pinned or implied cpu's extensions (zig's cpu model) reach the kernels' tile choice
    from cuvil.compiler.driver import baseline_features
    from cuvil.compiler.kernels.int8_gemm import int8_isa

    arch = get_target(target).arches[0]
    kernel_target = KernelTarget(arch.llvm_triple, baseline_features(arch, cpu)[0])
    assert kernel_target.isa.vector == float_lanes
    isa = int8_isa(kernel_target)
    below = isa.fallback
    assert (isa.kind, isa.gate is not None, below and below.kind,
            below and below.gate is not None) == int8_kind
