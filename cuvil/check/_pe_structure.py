"""A PE32+ DLL as the Windows loader reads it, checked for consistency.

pefile, which the other PE checks read through, accepts many damaged files: it clips what runs
past the end and skips what it cannot parse. The Windows loader maps the file by its section
table (sections in order, contiguous, aligned: ReactOS's PeFmtCreateSection states the rules the
kernel keeps), then follows the data directories: it applies the base relocations, binds the
imports, runs the TLS callbacks and the entry point, and `GetProcAddress` binary-searches the
export names. `structure_problems` walks that path with plain `struct` reads and reports what
would send the loader outside the file or the image, or that it would refuse
(STATUS_INVALID_IMAGE_FORMAT). Layouts follow Microsoft's PE format specification.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import NoReturn

from cuvil.check._structure import Problems, walk_problems

__all__ = ["structure_problems"]

_FILE_HEADER = struct.Struct("<HHIIIHH")
_OPTIONAL64 = struct.Struct("<HBBIIIIIQIIHHHHHHIIIIHHQQQQII")
_SECTION = struct.Struct("<8sIIIIIIHHI")
_EXPORTS = struct.Struct("<IIHHIIIIIII")
_IMPORT = struct.Struct("<IIIII")
_TLS64 = struct.Struct("<QQQQII")
_DEBUG = struct.Struct("<IIHHIIII")

PE32_PLUS = 0x20B
IMAGE_FILE_EXECUTABLE_IMAGE = 0x2
IMAGE_SCN_MEM_EXECUTE, IMAGE_SCN_MEM_WRITE = 0x20000000, 0x80000000
MACHINE_AMD64, MACHINE_ARM64 = 0x8664, 0xAA64
IMAGE_REL_BASED_ABSOLUTE, IMAGE_REL_BASED_DIR64 = 0, 10
_DIRECTORIES = ("export", "import", "resource", "exception", "certificate", "base relocation",
                "debug", "architecture", "global pointer", "TLS", "load config", "bound import",
                "IAT", "delay import", "CLR runtime", "reserved")
EXPORT, IMPORT, EXCEPTION, CERTIFICATE, BASERELOC, DEBUG, TLS, LOAD_CONFIG, BOUND_IMPORT, IAT = \
    0, 1, 3, 4, 5, 6, 9, 10, 11, 12
#: directories the specification says must be zero
_MUST_BE_ZERO = (7, 8, 15)
#: "DLL.name" or "DLL.#ordinal", as an export forwarder names another DLL's export
_FORWARDER = re.compile(rb"[^.\0\s]+(\.[^.\0\s]+)*\.(#\d+|[^.\0\s#][^\0\s]*)")


def structure_problems(data: bytes) -> list[str]:
    """What in the Windows loader's path through `data` (a PE32+ image) is inconsistent;
    empty when nothing is."""
    return walk_problems(lambda problems: _Image(data, problems).walk())


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class _Image:
    """One walk through the image; `sections` are (name, address, memory size, raw size,
    raw offset, characteristics) once the headers are read."""

    def __init__(self, data: bytes, problems: Problems) -> None:
        self.data = data
        self.problems = problems
        self.fail = problems.fail
        self.sections: list[tuple[str, int, int, int, int, int]] = []
        self.size_of_image = 0
        self.image_base = 0
        self.machine = 0
        self.directories: list[tuple[int, int]] = []

    def stop(self, text: str) -> NoReturn:
        self.problems.stop(text)

    def walk(self) -> None:
        directories = self.directories = self._headers()
        for index, (rva, size) in enumerate(directories):
            name = f"the {_DIRECTORIES[index]} directory"
            if index in _MUST_BE_ZERO and (rva or size):
                self.fail(f"{name} ({size} bytes at {rva:#x}) is reserved and must be zero")
            elif index == CERTIFICATE and size and rva + size > len(self.data):
                self.fail(f"{name} ({size} bytes at file offset {rva:#x}) runs past the file")
            elif index == BOUND_IMPORT and size and rva + size > self.sections[0][1]:
                self.fail(f"{name} ({size} bytes at {rva:#x}) lies outside the headers")
            elif index not in (CERTIFICATE, BOUND_IMPORT) and size:
                self.offset(rva, size, name)
            elif rva and not size and index not in _MUST_BE_ZERO:
                self.fail(f"{name} has an address ({rva:#x}) but no size")
        tables: dict[int, Callable[[int, int], None]] = {
            EXPORT: self._exports, IMPORT: self._imports, BASERELOC: self._relocations,
            EXCEPTION: self._exceptions, TLS: self._tls, LOAD_CONFIG: self._load_config,
            DEBUG: self._debug}
        for index, check in tables.items():
            rva, size = directories[index]
            if size:
                check(rva, size)

    # -------------------------------------------------------------------------- headers
    def _headers(self) -> list[tuple[int, int]]:
        data, fail, stop = self.data, self.fail, self.stop
        if len(data) < 64 or data[:2] != b"MZ":
            stop("no DOS header (MZ)")
        (lfanew,) = struct.unpack_from("<I", data, 0x3C)
        if lfanew < 4 or lfanew + 24 > len(data):
            stop(f"the DOS header's e_lfanew ({lfanew:#x}) points outside the file")
        if data[lfanew:lfanew + 4] != b"PE\0\0":
            stop(f"no PE signature at e_lfanew ({lfanew:#x})")
        (self.machine, nsections, _, _, _, optional_size,
         characteristics) = _FILE_HEADER.unpack_from(data, lfanew + 4)
        if self.machine not in (MACHINE_AMD64, MACHINE_ARM64):
            stop(f"the file header's Machine {self.machine:#06x} is neither x86-64 nor Arm64")
        if not characteristics & IMAGE_FILE_EXECUTABLE_IMAGE:
            fail("the file header lacks IMAGE_FILE_EXECUTABLE_IMAGE: the loader refuses the image")
        optional_at = lfanew + 24
        if optional_size < _OPTIONAL64.size or optional_at + optional_size > len(data):
            stop(f"the optional header ({optional_size} bytes at {optional_at:#x}) is shorter "
                 f"than PE32+'s {_OPTIONAL64.size} bytes or runs past the file")
        (magic, _, _, _, _, _, entry, _, self.image_base, section_alignment, file_alignment,
         *_, self.size_of_image, size_of_headers, _, _, _, _, _, _, _, _,
         ndirs) = _OPTIONAL64.unpack_from(data, optional_at)
        if magic != PE32_PLUS:
            stop(f"the optional header's magic is {magic:#x}, not PE32+ ({PE32_PLUS:#x})")
        if ndirs > 16 or _OPTIONAL64.size + 8 * ndirs > optional_size:
            stop(f"{ndirs} data directories do not fit the optional header ({optional_size} bytes)")
        # the specification's rules (the kernel refuses an image that breaks them)
        if not (512 <= file_alignment <= 0x10000 and not file_alignment & (file_alignment - 1)
                and section_alignment >= file_alignment
                and not section_alignment & (section_alignment - 1)):
            stop(f"SectionAlignment {section_alignment:#x} and FileAlignment {file_alignment:#x} "
                 "are not powers of two with 512 <= FileAlignment <= SectionAlignment")
        if self.image_base % 0x10000:
            fail(f"ImageBase {self.image_base:#x} is not a multiple of 64 KiB")
        if size_of_headers % file_alignment or size_of_headers > len(data):
            fail(f"SizeOfHeaders {size_of_headers:#x} is not a multiple of FileAlignment "
                 f"{file_alignment:#x} or runs past the file")
        table_at = optional_at + optional_size
        if not 0 < nsections <= 96 or table_at + nsections * _SECTION.size > size_of_headers:
            stop(f"the section table ({nsections} sections at {table_at:#x}) is empty, too long "
                 f"or not within SizeOfHeaders ({size_of_headers:#x})")
        end = _align(size_of_headers, section_alignment)
        for i in range(nsections):
            (raw_name, vsize, va, raw_size, raw_at, _, _, _, _,
             flags) = _SECTION.unpack_from(data, table_at + i * _SECTION.size)
            name = raw_name.rstrip(b"\0").decode("ascii", "replace")
            # the kernel maps sections in order, each where the one before ends
            if va != end:
                stop(f"section {i} ({name}) starts at {va:#x}, not where the one before ends "
                     f"({end:#x}): sections must be in order, contiguous and aligned")
            if raw_size and (raw_at % file_alignment or raw_at < size_of_headers
                             or raw_at + raw_size > len(data)):
                stop(f"section {i} ({name}): its {raw_size:#x} bytes at file offset {raw_at:#x} "
                     "are not aligned to FileAlignment, overlap the headers or run past the file")
            length = raw_size if vsize < raw_size or not vsize else vsize
            end = va + _align(length, section_alignment)
            self.sections.append((name, va, length, raw_size, raw_at, flags))
        if self.size_of_image != end:
            stop(f"SizeOfImage {self.size_of_image:#x} is not the end of the last section ({end:#x})")
        raws = sorted((s[4], s[4] + s[3]) for s in self.sections if s[3])
        if any(a_end > b_start for (_, a_end), (b_start, _) in zip(raws, raws[1:])):
            fail("two sections share bytes of the file")
        if entry and not any(va <= entry < va + size and flags & IMAGE_SCN_MEM_EXECUTE
                             for _, va, size, _, _, flags in self.sections):
            fail(f"the entry point {entry:#x} lies in no executable section")
        dirs_at = optional_at + _OPTIONAL64.size
        return [struct.unpack_from("<II", data, dirs_at + 8 * i) for i in range(ndirs)] + \
            [(0, 0)] * (16 - ndirs)

    # ------------------------------------------------------------------- address helpers
    def section_of(self, rva: int, size: int = 1) -> tuple[str, int, int, int, int, int] | None:
        for section in self.sections:
            if section[1] <= rva and rva + size <= section[1] + section[2]:
                return section
        return None

    def offset(self, rva: int, size: int, what: str) -> int:
        """The file offset of [rva, rva + size), which must lie in one section's bytes."""
        section = self.section_of(rva, size)
        if section is None or rva + size > section[1] + section[3]:
            self.stop(f"{what} ({size} bytes at {rva:#x}) lies outside the bytes of every section")
        return section[4] + rva - section[1]

    def string(self, rva: int, what: str, limit: int | None = None) -> bytes:
        """The NUL-terminated string at `rva`, within its section (or before `limit`)."""
        at = self.offset(rva, 1, what)
        section = self.section_of(rva)
        assert section is not None
        end = section[4] + min(section[2], section[3]) if limit is None else limit
        stop = self.data.find(b"\0", at, end)
        if stop < 0:
            self.stop(f"{what} at {rva:#x} is not NUL-terminated within its table")
        return self.data[at:stop]

    def table(self, kind: str, rva: int, count: int, what: str) -> tuple[int, ...]:
        """`count` numbers of struct type `kind` at `rva` (none: the address is not read)."""
        if not count:
            return ()
        at = self.offset(rva, count * struct.calcsize(kind), what)
        return struct.unpack_from(f"<{count}{kind}", self.data, at)

    def in_image(self, rva: int, size: int, what: str, executable: bool = False) -> None:
        section = self.section_of(rva, size)
        if section is None or (executable and not section[5] & IMAGE_SCN_MEM_EXECUTE):
            kind = "an executable section" if executable else "a section"
            self.fail(f"{what} ({rva:#x}) lies outside {kind}")

    # --------------------------------------------------------------------------- tables
    def _exports(self, rva: int, size: int) -> None:
        at = self.offset(rva, _EXPORTS.size, "the export directory")
        (_, _, _, _, name, _, nfunctions, nnames, functions_at, names_at,
         ordinals_at) = _EXPORTS.unpack_from(self.data, at)
        self.string(name, "the export directory's DLL name")
        if nnames > nfunctions:
            self.stop(f"the export directory names {nnames} exports of {nfunctions} functions")
        functions = self.table("I", functions_at, nfunctions, "the export address table")
        names = self.table("I", names_at, nnames, "the export name table")
        ordinals = self.table("H", ordinals_at, nnames, "the export ordinal table")
        strings = [self.string(n, f"export name {i}") for i, n in enumerate(names)]
        # GetProcAddress binary-searches the names: out of order, a name is not found
        for i, (a, b) in enumerate(zip(strings, strings[1:])):
            if a >= b:
                self.fail(f"the export name table is not sorted: {a!r} before {b!r} (entry {i})")
        for i, ordinal in enumerate(ordinals):
            if ordinal >= nfunctions:
                self.fail(f"export ordinal {i} ({ordinal}) is past the {nfunctions} functions")
        for i, function in enumerate(functions):
            if rva <= function < rva + size:  # a forwarder: "DLL.name" within the directory
                text = self.string(function, f"forwarder {i}", self.offset(rva, size, "") + size)
                if not _FORWARDER.fullmatch(text):
                    self.fail(f"export {i} forwards to {text!r}, which is not DLL.name")
            elif function:
                self.in_image(function, 1, f"export {i}'s address")

    def _imports(self, rva: int, size: int) -> None:
        iat = self.directories[IAT]
        named: set[str] = set()
        for i in range(size // _IMPORT.size):
            at = self.offset(rva + i * _IMPORT.size, _IMPORT.size, f"import descriptor {i}")
            lookup, stamp, _, name, first = _IMPORT.unpack_from(self.data, at)
            if not (lookup or name or first):
                return
            raw = self.string(name, f"import descriptor {i}'s DLL name")
            dll = raw.decode("ascii", "replace")
            if not raw or not raw.isascii() or not dll.isprintable():  # pefile skips such names
                self.fail(f"import descriptor {i} names the DLL {dll!r}, which LoadLibrary cannot find")
            if dll.lower() in named:  # the linkers give each DLL one descriptor
                self.fail(f"import descriptor {i} names {dll}, which an earlier one names")
            named.add(dll.lower())
            thunks = self._thunks(lookup or first, f"{dll}'s import lookup table")
            count = len(thunks)
            at = self.offset(first, 8 * (count + 1), f"{dll}'s import address table")
            # until it is bound (a time stamp), the address table is a copy of the lookup table
            if not stamp and struct.unpack_from(f"<{count + 1}Q", self.data, at) != (*thunks, 0):
                self.fail(f"{dll}'s import address table ({first:#x}) is not its lookup table's copy")
            if iat[1] and not iat[0] <= first and first + 8 * (count + 1) <= iat[0] + iat[1]:
                self.fail(f"{dll}'s import address table ({first:#x}) lies outside the IAT directory")
        self.fail("the import directory has no terminating (all-zero) descriptor")

    def _thunks(self, rva: int, what: str) -> list[int]:
        """The entries of an import lookup table, each checked; it ends with a zero."""
        thunks: list[int] = []
        while True:
            count = len(thunks)
            (thunk,) = struct.unpack_from("<Q", self.data, self.offset(rva + 8 * count, 8, what))
            if not thunk:
                return thunks
            if thunk >> 63:  # by ordinal: bits 16 to 62 must be zero
                if thunk & 0x7FFFFFFFFFFF0000:
                    self.fail(f"entry {count} of {what} ({thunk:#x}) is not an ordinal")
            elif thunk >> 31:
                self.fail(f"entry {count} of {what} ({thunk:#x}) is not a hint/name address")
            else:
                self.offset(thunk, 2, f"entry {count} of {what}")
                self.string(thunk + 2, f"the name of entry {count} of {what}")
            thunks.append(thunk)

    def _relocations(self, rva: int, size: int) -> None:
        at = self.offset(rva, size, "the base relocation directory")
        end = at + size
        while at < end:
            page, block = struct.unpack_from("<II", self.data, at)
            where = f"the base relocation block at {rva + size - (end - at):#x}"
            if block < 8 or block % 4 or at + block > end:
                self.stop(f"{where} has size {block}: not a multiple of 4 of at least 8 within "
                          "the directory")
            if page % 0x1000 or page >= self.size_of_image:
                self.stop(f"{where} is for page {page:#x}, not a page of the image")
            for entry in struct.unpack_from(f"<{(block - 8) // 2}H", self.data, at + 8):
                kind, target = entry >> 12, page + (entry & 0xFFF)
                if kind == IMAGE_REL_BASED_DIR64:
                    self.in_image(target, 8, f"a relocation target of {where}")
                elif kind != IMAGE_REL_BASED_ABSOLUTE:  # the loader refuses other kinds here
                    self.fail(f"{where} has an entry of type {kind}, which a PE32+ image does not use")
            at += block

    def _exceptions(self, rva: int, size: int) -> None:
        entry = 12 if self.machine == MACHINE_AMD64 else 8
        if size % entry:
            self.fail(f"the exception directory's size {size} is not a whole number of entries")
        at = self.offset(rva, size, "the exception directory")
        last = 0
        for i in range(size // entry):
            begin, second = struct.unpack_from("<II", self.data, at + i * entry)
            # the unwinder binary-searches the table by start address
            if begin < last:
                self.fail(f"exception entry {i} ({begin:#x}) is out of order")
                return
            self.in_image(begin, 1, f"exception entry {i}'s function", executable=True)
            if entry == 12:  # x86-64: end address, then the unwind information's
                (unwind,) = struct.unpack_from("<I", self.data, at + i * entry + 8)
                if second < begin:
                    self.fail(f"exception entry {i} ends ({second:#x}) before it begins")
                self.in_image(unwind & ~1, 4, f"exception entry {i}'s unwind information")
                last = second
            else:  # Arm64: unwind information's address, or packed unwind data (low bits set)
                if not second & 3:
                    self.in_image(second, 4, f"exception entry {i}'s unwind information")
                last = begin + 1

    def _tls(self, rva: int, size: int) -> None:
        at = self.offset(rva, _TLS64.size, "the TLS directory")
        start, end, index, callbacks, _, _ = _TLS64.unpack_from(self.data, at)
        base = self.image_base
        if not base <= start <= end or (end - start and self.section_of(start - base, end - start) is None):
            self.fail(f"the TLS template ({start:#x} to {end:#x}) lies outside a section")
        section = self.section_of(index - base, 4)
        if section is None or not section[5] & IMAGE_SCN_MEM_WRITE:
            self.fail(f"the TLS index slot ({index:#x}) lies outside a writable section")
        if callbacks:
            # the loader calls each address of this zero-terminated list
            i = 0
            while True:
                (callback,) = struct.unpack_from("<Q", self.data, self.offset(
                    callbacks - base + 8 * i, 8, "the TLS callback list"))
                if not callback:
                    break
                self.in_image(callback - base, 1, f"TLS callback {i}", executable=True)
                i += 1

    def _load_config(self, rva: int, size: int) -> None:
        at = self.offset(rva, 4, "the load configuration")
        (own_size,) = struct.unpack_from("<I", self.data, at)
        self.offset(rva, max(own_size, 4), "the load configuration's own size")

    def _debug(self, rva: int, size: int) -> None:
        if size % _DEBUG.size:
            self.fail(f"the debug directory's size {size} is not a whole number of entries")
        at = self.offset(rva, size, "the debug directory")
        for i in range(size // _DEBUG.size):
            *_, length, address, pointer = _DEBUG.unpack_from(self.data, at + i * _DEBUG.size)
            if length and (pointer + length > len(self.data)
                           or (address and self.section_of(address, length) is None)):
                self.fail(f"debug entry {i} ({length} bytes at {address:#x}, file offset "
                          f"{pointer:#x}) lies outside the file or the image")
