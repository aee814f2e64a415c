"""Wheel-side fuzzing: the digits example's wheel with bytes changed where the dynamic loader
and the checks read its library (ELF header, program headers, the dynamic, symbol, string,
hash, version and relocation tables), or with its manifest edited, RECORD rewritten to match
each time (as a damaged download or a careless repack leaves it); the zip's own records with a
field changed; members renamed, given twice or added under odd names. Each mutant is either
refused by `cuvil check --load` (exit status 1, a FAIL line, no traceback) or imports in a
fresh interpreter and gives the original's outputs.

Left out: relocation addends, the code and the data, whose bytes no check can tell from the
real ones (a changed addend that still points inside the image may run and answer wrongly).

The macOS and Windows wheels are fuzzed the same way in their libraries' headers and loader
tables. No Mac runs here, so a universal2 dylib's mutant must be refused, and its bytes are
changed only in fields dyld acts on whose every other value is a defect (`macho_fields`). A
DLL's mutant that `cuvil check` passes must load and answer as built under wine (skipped
without wine64); wine maps a DLL at its preferred base, so it does not apply the relocations.
"""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import budget
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from wheel_files import DigitsWheels, read_entries, write_wheel

from cuvil.check._macho import parse_macho
from cuvil.cli import main as cli_main
from cuvil.toolchains import get_target, zig

LIBRARY = "digits/_classifier.so"
MANIFEST = "digits/_models.json"
#: the sections the loader's path reads (their bytes, relocation addends excepted)
LOADER_SECTIONS = (".dynamic", ".dynsym", ".dynstr", ".gnu.hash", ".hash", ".gnu.version",
                   ".gnu.version_r", ".rela.dyn", ".rela.plt")

# imports the package from a folder and writes its outputs for a fixed input
PROBE = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import digits
x = np.random.default_rng(0).standard_normal((3, 1, 8, 8)).astype(np.float32)
np.save(sys.argv[2], digits.classifier(x))
"""

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                                 reason="runs the x86_64 Linux wheel it mutates")]


class Original:
    """The built wheel's files, the regions of its library a mutant may change, and the
    outputs of its package."""

    def __init__(self, wheels: DigitsWheels, root: Path) -> None:
        from elftools.elf.elffile import ELFFile

        wheel = wheels["x86_64-linux"]
        self.name, self.files = wheel.name, read_entries(wheel)
        lib = self.files[LIBRARY]
        elf = ELFFile(io.BytesIO(lib))
        self.regions = [(0, 64), (elf["e_phoff"], elf["e_phoff"] + elf["e_phnum"] * 56)]
        for section in elf.iter_sections():
            start, size = section["sh_offset"], section["sh_size"]
            if section.name.startswith(".rela"):  # offset and info of each entry, not its addend
                self.regions += [(at, at + 16) for at in range(start, start + size, 24)]
            elif section.name in LOADER_SECTIONS:
                self.regions.append((start, start + size))
        self.outputs = run_package(self.files, root / "original")
        assert self.outputs is not None


def run_package(files: dict[str, bytes], folder: Path) -> np.ndarray | None:
    """The package's outputs for the probe's input, run in a fresh interpreter (None if it
    did not run)."""
    for name, data in files.items():
        if name.startswith("digits/"):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(folder / "y.npy")],
                          env=env, capture_output=True, timeout=120)
    return np.load(folder / "y.npy") if done.returncode == 0 else None


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> DigitsWheels:
    return DigitsWheels(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def original(wheels: DigitsWheels, tmp_path_factory: pytest.TempPathFactory) -> Original:
    return Original(wheels, tmp_path_factory.mktemp("wheel"))


def checked(name: str, files: dict[str, bytes], folder: Path, capsys: pytest.CaptureFixture[str],
            *options: str) -> bool:
    """Whether `cuvil check` passes the wheel of `files` (`passes_check`)."""
    return passes_check(write_wheel(folder / name, files), capsys, *options)


def passes_check(wheel: Path, capsys: pytest.CaptureFixture[str], *options: str) -> bool:
    """Whether `cuvil check` passes `wheel`; a refusal must be exit status 1 with a FAIL line,
    and never a traceback."""
    status = cli_main(["check", *options, "--no-auditwheel", str(wheel)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    if status == 1:
        assert "FAIL " in out, out
        return False
    assert status == 0, (status, out, err)
    return True


def check_mutant(original: Original, files: dict[str, bytes], folder: Path,
                 capsys: pytest.CaptureFixture[str]) -> str:
    """Refused by cuvil check --load, or runs as the original: which of the two."""
    if not checked(original.name, files, folder, capsys, "--load"):
        return "refused"
    got = run_package(files, folder / "run")
    assert got is not None, "passed cuvil check --load but does not run"
    assert np.array_equal(got, original.outputs), "passed cuvil check but answers differently"
    return "ran"


counter = iter(range(10**9))


def test_the_unchanged_wheel_passes_and_runs(original: Original, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """What every mutant is held to: the wheel as built passes and runs."""
    assert check_mutant(original, dict(original.files), tmp_path, capsys) == "ran"


@settings(max_examples=budget(25), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_library_is_refused_or_runs_as_built(original: Original, data: st.DataObject,
                                                        tmp_path_factory: pytest.TempPathFactory,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    lib = bytearray(original.files[LIBRARY])
    for _ in range(data.draw(st.integers(1, 3))):
        start, end = data.draw(st.sampled_from(original.regions))
        lib[data.draw(st.integers(start, end - 1))] = data.draw(st.integers(0, 255))
    folder = tmp_path_factory.mktemp(f"lib{next(counter)}")
    check_mutant(original, {**original.files, LIBRARY: bytes(lib)}, folder, capsys)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a JSON value."""
    found = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            found += _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _paths(v, (*path, i))
    return found


REPLACEMENTS = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), st.text(max_size=20),
                         st.just("batch + 1"), st.just("__import__('os')"), st.just([]), st.just({}),
                         st.just([[[[[[[[1]]]]]]]]))


@settings(max_examples=budget(25), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_edited_manifest_is_refused_or_runs_as_built(original: Original, data: st.DataObject,
                                                        tmp_path_factory: pytest.TempPathFactory,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads(original.files[MANIFEST])
    for _ in range(data.draw(st.integers(1, 2))):
        path = data.draw(st.sampled_from(_paths(manifest)[1:]))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(REPLACEMENTS)
    folder = tmp_path_factory.mktemp(f"manifest{next(counter)}")
    check_mutant(original, {**original.files, MANIFEST: json.dumps(manifest).encode()}, folder, capsys)


# ------------------------------------------------- the zip archive and the names in it

#: the fields of a zip's records a reader acts on: (signature, {field: (offset, size)})
ZIP_FIELDS = {
    b"PK\x03\x04": {"flags": (6, 2), "method": (8, 2), "crc": (14, 4), "compressed": (18, 4),
                      "size": (22, 4), "name length": (26, 2), "extra length": (28, 2)},
    b"PK\x01\x02": {"flags": (8, 2), "method": (10, 2), "crc": (16, 4), "compressed": (20, 4),
                      "size": (24, 4), "name length": (28, 2), "extra length": (30, 2),
                      "comment length": (32, 2), "disk": (34, 2), "attributes": (38, 4),
                      "header offset": (42, 4)},
    b"PK\x05\x06": {"disk": (4, 2), "entries here": (8, 2), "entries": (10, 2),
                      "directory size": (12, 4), "directory offset": (16, 4),
                      "comment length": (20, 2)},
}


def zip_fields(archive: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every field of ZIP_FIELDS in the archive's records."""
    found = []
    for signature, fields in ZIP_FIELDS.items():
        at = archive.find(signature)
        while at >= 0:
            found += [(at + offset, size) for offset, size in fields.values()]
            at = archive.find(signature, at + 4)
    return found


def installs_as_built(original: Original, wheel: Path, folder: Path) -> None:
    """A wheel `cuvil check --load` passed: pip's reader (zipfile) unpacks it, and the package
    gives the original's outputs."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        files = {info.filename: archive.read(info) for info in archive.infolist()
                 if not info.is_dir()}
    got = run_package(files, folder / "run")
    assert got is not None, "passed cuvil check --load but does not run once unpacked"
    assert np.array_equal(got, original.outputs), "passed cuvil check but answers differently"


@settings(max_examples=budget(20), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_zip_whose_records_lie_is_refused_or_installs_as_built(
        original: Original, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A field of a local header, a central directory entry or the end record changed, as a
    damaged download or a hand-made zip leaves it (RECORD left as it was)."""
    folder = tmp_path_factory.mktemp(f"zip{next(counter)}")
    archive = bytearray(write_wheel(folder / "clean.whl", original.files).read_bytes())
    fields = zip_fields(bytes(archive))
    for _ in range(data.draw(st.integers(1, 2))):
        at, size = data.draw(st.sampled_from(fields))
        old = int.from_bytes(archive[at:at + size], "little")
        top = (1 << (8 * size)) - 1
        value = data.draw(st.one_of(st.sampled_from([0, 1, top, (old + 1) & top, (old - 1) & top]),
                                    st.integers(0, top)))
        archive[at:at + size] = value.to_bytes(size, "little")
    wheel = folder / original.name
    wheel.write_bytes(bytes(archive))
    if passes_check(wheel, capsys, "--load"):
        installs_as_built(original, wheel, folder)


NAME_EDITS = ("rename", "duplicate", "add")
ODD_NAMES = ("../digits/x.py", "/digits/x.py", "digits\\x.py", "digits//x.py", "digits/./x.py",
             "DIGITS/_classifier.so", "digits/_classifier.so/", "digits/x\x00.py",
             "digits/_cuvil_runtime.so", "digits/\u00e9.py", "digits_cuvil-1.0.0.dist-info/x")


@settings(max_examples=budget(20), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_odd_member_names_are_refused_or_install_as_built(
        original: Original, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A member renamed, given twice or added under an odd name, RECORD rewritten to match."""
    import zipfile

    names = sorted(original.files)
    edit = data.draw(st.sampled_from(NAME_EDITS))
    name = data.draw(st.sampled_from(names))
    odd = data.draw(st.one_of(st.sampled_from(ODD_NAMES), st.sampled_from(names),
                              st.text(min_size=1, max_size=30)))
    # a new name (zipfile cannot write an empty one); over an existing member's name, "add" or
    # "rename" would only change a file's contents, which RECORD then vouches for
    assume(odd and (edit == "duplicate" or odd not in original.files))
    folder = tmp_path_factory.mktemp(f"names{next(counter)}")
    files = dict(original.files)
    if edit == "rename":
        files[odd] = files.pop(name)
    elif edit == "add":
        files[odd] = b"# added\n"
    wheel = write_wheel(folder / original.name, files)
    if edit == "duplicate":  # a second member of the same name, after RECORD
        with zipfile.ZipFile(wheel, "a") as archive, pytest.warns(UserWarning, match="Duplicate"):
            archive.writestr(name, b"# a second copy\n")
    if passes_check(wheel, capsys, "--load"):
        installs_as_built(original, wheel, folder)


# ------------------------------------------------- macOS and Windows libraries

DYLIB = "digits/_classifier.dylib"
DLL = "digits/_classifier.dll"
WINE = Path("/usr/lib/wine/wine64")
HARNESS = Path(__file__).resolve().parents[1] / "harness" / "run_model.c"
# the sections dyld gives a meaning by their type: initializers, bound pointers, zero-fill
TYPED_SECTIONS = {"__mod_init_func", "__got", "__la_symbol_ptr", "__stubs", "__bss"}
# the load commands whose kind (the low byte of cmd) dyld acts on
ACTED_ON = {0x19, 0x2, 0xB, 0x22, 0xD, 0xC, 0x1B, 0x24, 0x32, 0x1D}


def macho_fields(lib: bytes) -> list[tuple[int, int]]:
    """The fields of the universal library's headers and load commands that dyld acts on and
    the structure check pins, so that any other value is a defect it must refuse. Left out: what
    dyld reads as a hint or not at all (header flags, section alignments, names and reserved
    fields, versions, timestamps, UUID bytes, maxprot), what may grow or shrink within a page or
    its padding (vmsize, __DATA's filesize, opcode stream and string table sizes), and the
    opcodes, trie and symbols themselves, whose changed values no check can tell from the real
    ones (as relocation addends in the ELF fuzz)."""
    _, images = parse_macho(lib)
    fields = [(0, 8)] + [(8 + 20 * i, 24 + 20 * i) for i in range(len(images))]  # not align
    for im in images:
        base = im.offset_in_file
        fields.append((base, base + 24))  # magic, cputype, cpusubtype, filetype, ncmds, sizeofcmds
        at = 0
        for segment in im.segments:
            command = next(off for cmd, off, _ in im.commands if cmd == 0x19
                           and im.data[off + 8:off + 24].rstrip(b"\0").decode() == segment.name)
            seg = base + command
            fields += [(seg + 8, seg + 32), (seg + 40, seg + 48), (seg + 60, seg + 68)]  # name,
            # vmaddr, fileoff, initprot, nsects; filesize where the segment has no zero-fill
            if segment.filesize == segment.vmsize or segment.name == "__LINKEDIT":
                fields.append((seg + 48, seg + 56))
            for j, section in enumerate(im.sections[at:at + segment.nsects]):
                sect = seg + 72 + 80 * j
                fields.append((sect + 16, sect + 32))  # segname
                if not section.zerofill:
                    fields += [(sect + 32, sect + 40), (sect + 48, sect + 52)]  # addr, offset
                if section.sectname in TYPED_SECTIONS:
                    fields.append((sect + 64, sect + 65))  # the type byte of flags
                if section.sectname == "__mod_init_func":
                    fields.append((sect + 40, sect + 48))  # size: how many initializers dyld calls
            at += segment.nsects
        for cmd, off, _ in im.commands:
            command = base + off
            fields.append((command + 4, command + 8))  # cmdsize
            if cmd & 0xFF in ACTED_ON:
                fields.append((command, command + 1))
            words = {0x2: (0, 1, 2), 0xB: (0, 1, 2, 3, 4, 5, 12, 13), 0x1D: (0, 1)}.get(cmd, ())
            if cmd == 0x80000022:  # the offset of each blob that is not empty
                info = struct.unpack_from("<10I", im.data, off + 8)
                words = tuple(2 * i for i in range(5) if info[2 * i + 1])
            fields += [(command + 8 + 4 * w, command + 12 + 4 * w) for w in words]
            if cmd in (0xC, 0xD):  # the name's offset, and the name through its NUL
                (name,) = struct.unpack_from("<I", im.data, off + 8)
                end = lib.index(b"\0", command + name) + 1
                fields += [(command + 8, command + 12), (command + name, end)]
    return fields


def pe_fields(lib: bytes) -> list[tuple[int, int]]:
    """The DLL's headers and the loader's tables. Left out: the entry point, exported functions'
    addresses, TLS addresses and the names of imported functions, whose changed values no check
    can tell from the real ones."""
    import pefile

    pe = pefile.PE(data=lib)
    nt = pe.DOS_HEADER.e_lfanew
    entry = nt + 24 + 16
    fields = [(0x3C, 0x40), (nt, entry), (entry + 4, pe.sections[-1].get_file_offset() + 40)]
    offset = pe.get_offset_from_rva
    export = pe.DIRECTORY_ENTRY_EXPORT.struct
    fields.append((export.get_file_offset(), export.get_file_offset() + 40))
    names, ordinals = offset(export.AddressOfNames), offset(export.AddressOfNameOrdinals)
    fields += [(names, names + 4 * export.NumberOfNames), (ordinals, ordinals + 2 * export.NumberOfNames)]
    fields += [(symbol.name_offset, symbol.name_offset + len(symbol.name) + 1)
               for symbol in pe.DIRECTORY_ENTRY_EXPORT.symbols]
    for descriptor in pe.DIRECTORY_ENTRY_IMPORT:
        imported = descriptor.struct
        name = offset(imported.Name)
        fields += [(imported.get_file_offset(), imported.get_file_offset() + 20),
                   (name, name + len(descriptor.dll) + 1)]
        for table in (imported.OriginalFirstThunk, imported.FirstThunk):
            fields.append((offset(table), offset(table) + 8 * (len(descriptor.imports) + 1)))
    for block in pe.DIRECTORY_ENTRY_BASERELOC:
        at = block.struct.get_file_offset()
        fields.append((at, at + block.struct.SizeOfBlock))
    for directory in (pe.OPTIONAL_HEADER.DATA_DIRECTORY[3], pe.OPTIONAL_HEADER.DATA_DIRECTORY[6]):
        if directory.Size:  # the exception and debug tables
            at = offset(directory.VirtualAddress)
            fields.append((at, at + directory.Size))
    return fields


class Native:
    """The digits example's wheel for macOS or Windows, and the fields of its library that a
    mutant may change."""

    def __init__(self, wheels: DigitsWheels, root: Path, target: str, library: str,
                 fields: Callable[[bytes], list[tuple[int, int]]]) -> None:
        self.root = root
        wheel = wheels[target]
        self.name, self.files = wheel.name, read_entries(wheel)
        self.library = library
        self.fields = fields(self.files[library])

    def mutant(self, data: st.DataObject, changes: int) -> dict[str, bytes]:
        lib = bytearray(self.files[self.library])
        for _ in range(changes):
            start, end = data.draw(st.sampled_from(self.fields))
            at = data.draw(st.integers(start, end - 1))
            lib[at] = data.draw(st.integers(0, 255).filter(lambda b, old=lib[at]: b != old))
        return {**self.files, self.library: bytes(lib)}


@pytest.fixture(scope="module")
def macos(wheels: DigitsWheels, tmp_path_factory: pytest.TempPathFactory) -> Native:
    return Native(wheels, tmp_path_factory.mktemp("macos"), "universal2-macos", DYLIB, macho_fields)


class Wine:
    """The Windows DLL's run under wine by the C harness (tests/harness/run_model.c), for a
    fixed input: what a mutant that passes the check must still answer."""

    def __init__(self, windows: Native) -> None:
        self.folder = windows.root / "wine"
        self.folder.mkdir()
        header = self.folder / "classifier.h"
        header.write_bytes(windows.files["digits/classifier.h"])
        self.harness = self.folder / "run.exe"
        arch = get_target("x86_64-windows").arches[0]
        mcpu = zig.zig_mcpu(arch)  # the DLL's CPU model: zig's MinGW runtime is built for it
        subprocess.run([*zig.zig_command(), "cc", "-target", arch.zig_target,
                        *([f"-mcpu={mcpu}"] if mcpu else []), "-O2", "-DCUVIL_MODEL=classifier",
                        "-DCUVIL_MODEL_UPPER=CLASSIFIER", '-DCUVIL_HEADER="classifier.h"',
                        "-DCUVIL_DIMS=3", f"-I{self.folder}", str(HARNESS), "-o", str(self.harness)],
                       check=True, capture_output=True)
        x = np.random.default_rng(0).standard_normal((3, 1, 8, 8)).astype(np.float32).tobytes()
        self.inputs = self.folder / "inputs.bin"
        self.inputs.write_bytes(struct.pack("<Q", len(x)) + x)
        self.env = {**os.environ, "WINEPREFIX": str(self.folder / "prefix"), "WINEDEBUG": "-all",
                    "WINEDLLOVERRIDES": "mscoree,mshtml="}
        self.outputs = self.run(windows.files[DLL])
        assert self.outputs is not None, "the DLL as built does not run under wine"

    def run(self, dll: bytes) -> str | None:
        """The harness's output (None if it failed); a hung loader is killed after 30 s."""
        path = self.folder / "_classifier.dll"
        path.write_bytes(dll)
        proc = subprocess.Popen([str(WINE), str(self.harness), str(path), str(self.inputs), "30"],
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return None
        return out if proc.returncode == 0 else None

    def close(self) -> None:
        subprocess.run([str(WINE.with_name("wineserver")), "-k"], env=self.env, check=False)


@pytest.fixture(scope="module")
def windows(wheels: DigitsWheels,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Native, Wine | None]]:
    native = Native(wheels, tmp_path_factory.mktemp("windows"), "x86_64-windows", DLL, pe_fields)
    wine = Wine(native) if WINE.is_file() else None
    yield native, wine
    if wine is not None:
        wine.close()


@settings(max_examples=budget(20), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_macho_library_is_refused(macos: Native, data: st.DataObject,
                                            tmp_path_factory: pytest.TempPathFactory,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """No Mac runs here: a mutant of a field dyld acts on must be refused."""
    files = macos.mutant(data, 1)
    folder = tmp_path_factory.mktemp(f"macho{next(counter)}")
    assert not checked(macos.name, files, folder, capsys), "cuvil check passed a damaged dylib"


@settings(max_examples=budget(20), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_dll_is_refused_or_runs_as_built(windows: tuple[Native, Wine | None],
                                                   data: st.DataObject,
                                                   tmp_path_factory: pytest.TempPathFactory,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    native, wine = windows
    files = native.mutant(data, data.draw(st.integers(1, 3)))
    folder = tmp_path_factory.mktemp(f"pe{next(counter)}")
    if not checked(native.name, files, folder, capsys):
        return
    if wine is None:
        pytest.skip("wine64 is not installed: a DLL cuvil check passes cannot be run here")
    assert wine.run(files[DLL]) == wine.outputs, "passed cuvil check but does not run as built"
