"""A Mach-O dylib slice as dyld reads it, checked for consistency.

dyld validates a slice before it maps it (dyld3's MachOAnalyzer and the mach_o::Header of
later releases: load command sizes, segments, the link-edit layout, the symbol tables) and
refuses one that breaks a rule; what it does not validate, it trusts, and a damaged table then
sends it outside the file or the image. `structure_problems` keeps dyld's rules and adds the
consistency that ld64 and zig always give (sections where their segment maps them, link-edit
blobs inside __LINKEDIT, the slice ending where __LINKEDIT ends), with plain `struct` reads of
the slice `_macho.parse_macho` found. The arm64 slice is also covered by its code signature; an
x86_64 slice need not be signed, so this is what stands between its bytes and dyld.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterator
from typing import NoReturn

from cuvil.check._macho import (
    CPU_TYPE_ARM64,
    CPU_TYPE_X86_64,
    FAT_MAGIC,
    LC_BUILD_VERSION,
    LC_CODE_SIGNATURE,
    LC_DYLD_EXPORTS_TRIE,
    LC_DYLD_INFO,
    LC_DYLD_INFO_ONLY,
    LC_DYSYMTAB,
    LC_ID_DYLIB,
    LC_LAZY_LOAD_DYLIB,
    LC_LOAD_DYLIB,
    LC_LOAD_UPWARD_DYLIB,
    LC_LOAD_WEAK_DYLIB,
    LC_REEXPORT_DYLIB,
    LC_REQ_DYLD,
    LC_RPATH,
    LC_SEGMENT_64,
    LC_SYMTAB,
    LC_VERSION_MIN_MACOSX,
    MH_DYLIB,
    N_STAB,
    N_TYPE,
    MachOFormatError,
    MachOImage,
    Section,
    Segment,
)
from cuvil.check._structure import Problems, walk_problems

__all__ = ["structure_problems", "universal_problems"]

LC_UUID, LC_LOAD_DYLINKER, LC_ID_DYLINKER, LC_SOURCE_VERSION = 0x1B, 0xE, 0xF, 0x2A
LC_MAIN = 0x28 | LC_REQ_DYLD
LC_SEGMENT_SPLIT_INFO, LC_FUNCTION_STARTS, LC_DATA_IN_CODE, LC_DYLIB_CODE_SIGN_DRS = 0x1E, 0x26, 0x29, 0x2B
LC_LINKER_OPTIMIZATION_HINT, LC_DYLD_CHAINED_FIXUPS, LC_ATOM_INFO = 0x2E, 0x34 | LC_REQ_DYLD, 0x36
LC_VERSION_MIN_IPHONEOS, LC_VERSION_MIN_TVOS, LC_VERSION_MIN_WATCHOS = 0x25, 0x2F, 0x30
LC_ENCRYPTION_INFO_64, LC_NOTE = 0x2C, 0x31
#: load commands of one linkedit_data_command each: what dyld calls their blob
_LINKEDIT_DATA = {LC_CODE_SIGNATURE: "code signature", LC_SEGMENT_SPLIT_INFO: "split segment info",
                  LC_FUNCTION_STARTS: "function starts", LC_DATA_IN_CODE: "data in code",
                  LC_DYLIB_CODE_SIGN_DRS: "code signing requirements",
                  LC_LINKER_OPTIMIZATION_HINT: "linker optimization hints",
                  LC_DYLD_EXPORTS_TRIE: "exports trie", LC_DYLD_CHAINED_FIXUPS: "chained fixups",
                  LC_ATOM_INFO: "atom info"}
#: the size dyld requires of each fixed-size load command
_SIZES = {LC_SYMTAB: 24, LC_DYSYMTAB: 80, LC_DYLD_INFO: 48, LC_DYLD_INFO_ONLY: 48, LC_UUID: 24,
          LC_VERSION_MIN_MACOSX: 16, LC_VERSION_MIN_IPHONEOS: 16, LC_VERSION_MIN_TVOS: 16,
          LC_VERSION_MIN_WATCHOS: 16, LC_SOURCE_VERSION: 16, LC_MAIN: 24, LC_ENCRYPTION_INFO_64: 24,
          LC_NOTE: 40, **dict.fromkeys(_LINKEDIT_DATA, 16)}
#: load commands holding a string: where the string's offset is, and the command's fixed part
_STRINGS = {**dict.fromkeys((LC_ID_DYLIB, LC_LOAD_DYLIB, LC_LOAD_WEAK_DYLIB, LC_REEXPORT_DYLIB,
                             LC_LOAD_UPWARD_DYLIB, LC_LAZY_LOAD_DYLIB), 24),
            **dict.fromkeys((LC_RPATH, LC_LOAD_DYLINKER, LC_ID_DYLINKER), 12)}
#: dyld refuses a required load command it does not know
_KNOWN_REQUIRED = {LC_LOAD_WEAK_DYLIB, LC_RPATH, LC_REEXPORT_DYLIB, LC_DYLD_INFO_ONLY,
                   LC_LOAD_UPWARD_DYLIB, LC_MAIN, LC_DYLD_EXPORTS_TRIE, LC_DYLD_CHAINED_FIXUPS}
#: at most one of each in an image
_ONCE = {LC_SYMTAB: "LC_SYMTAB", LC_DYSYMTAB: "LC_DYSYMTAB", LC_UUID: "LC_UUID",
         LC_ID_DYLIB: "LC_ID_DYLIB", LC_SOURCE_VERSION: "LC_SOURCE_VERSION",
         LC_VERSION_MIN_MACOSX: "LC_VERSION_MIN_MACOSX",
         **{cmd: f"the {name} command" for cmd, name in _LINKEDIT_DATA.items()}}
#: the page size of each architecture's macOS: segments are mapped with mmap, page by page
_PAGE = {CPU_TYPE_X86_64: 0x1000, CPU_TYPE_ARM64: 0x4000}
#: cpusubtypes dyld loads for each cputype (capability bits masked off)
_SUBTYPES = {CPU_TYPE_X86_64: {3, 8}, CPU_TYPE_ARM64: {0, 1, 2}}
VM_PROT_READ, VM_PROT_EXECUTE = 1, 4
N_UNDF, N_ABS, N_INDR, N_PBUD, N_SECT, N_EXT = 0x0, 0x2, 0xA, 0xC, 0xE, 0x1
INDIRECT_SYMBOL_LOCAL, INDIRECT_SYMBOL_ABS = 0x80000000, 0x40000000
SG_NORELOC, SG_READ_ONLY = 0x4, 0x10
MH_DYLIB_IN_CACHE = 0x80000000
#: the section type dyld acts on for the sections of these names (initializers it calls,
#: pointers it binds, zero-fill it maps, thread-local variables it sets up)
_SECTION_TYPES = {"__mod_init_func": 0x9, "__mod_term_func": 0xA, "__init_offsets": 0x16,
                  "__got": 0x6, "__nl_symbol_ptr": 0x6, "__la_symbol_ptr": 0x7, "__stubs": 0x8,
                  "__bss": 0x1, "__common": 0x1, "__thread_data": 0x11, "__thread_bss": 0x12,
                  "__thread_vars": 0x13, "__thread_ptrs": 0x14}
#: sections whose entries are slots of the indirect symbol table: type -> entry size (0: stubs)
_INDIRECT_SECTIONS = {0x6: 8, 0x7: 8, 0x8: 0, 0x10: 8, 0x14: 8}


def structure_problems(image: MachOImage) -> list[str]:
    """What in dyld's path through `image` (one slice) is inconsistent; empty when nothing is."""
    return walk_problems(lambda problems: _Slice(image, problems).walk())


def universal_problems(data: bytes, images: list[MachOImage]) -> list[str]:
    """What is wrong with how a universal file lays out its slices (`images`, as parsed)."""
    problems = []
    ranges = sorted((im.offset_in_file, im.offset_in_file + len(im.data), im.arch) for im in images)
    magic, fat_count = struct.unpack_from(">II", data)
    entry = 20 if magic == FAT_MAGIC else 32
    if ranges and ranges[0][0] < 8 + entry * fat_count:
        problems.append(f"the {ranges[0][2]} slice overlaps the universal header")
    for i, im in enumerate(images):  # dyld picks the slice by the header's cputype and subtype
        (subtype,) = struct.unpack_from(">I", data, 8 + entry * i + 4)
        if subtype != im.cpusubtype:
            problems.append(f"the universal header lists the {im.arch} slice with cpusubtype "
                            f"{subtype:#x}, but the slice says {im.cpusubtype:#x}")
    for (_, end, arch), (start, _, other) in zip(ranges, ranges[1:]):
        if end > start:
            problems.append(f"the {arch} and {other} slices overlap")
    for im in images:
        page = _PAGE.get(im.cputype, 0x1000)
        if im.offset_in_file % page:
            problems.append(f"the {im.arch} slice starts at {im.offset_in_file:#x}, not on a "
                            f"{page // 1024} KiB page: dyld maps it page by page")
    return problems


class _Slice:
    def __init__(self, image: MachOImage, problems: Problems) -> None:
        self.image = image
        self.data = image.data
        self.fail = problems.fail
        self.problems = problems
        self.linkedit: Segment | None = None

    def stop(self, text: str) -> NoReturn:
        self.problems.stop(text)

    def walk(self) -> None:
        image = self.image
        subtype = image.cpusubtype & 0x00FFFFFF
        if subtype not in _SUBTYPES.get(image.cputype, {subtype}):
            self.fail(f"the header's cpusubtype {subtype} is not one dyld loads for {image.arch}")
        if image.flags & MH_DYLIB_IN_CACHE:
            self.fail("the header says the image is in the dyld shared cache (MH_DYLIB_IN_CACHE)")
        commands = self._commands()
        self._segments()
        blobs = self._linkedit(commands)
        self._symbols(commands)
        if LC_DYLD_INFO_ONLY in commands or LC_DYLD_INFO in commands:
            self._opcodes(commands.get(LC_DYLD_INFO_ONLY, commands.get(LC_DYLD_INFO, 0)))
        self._exports(blobs)

    # ------------------------------------------------------------------ load commands
    def _commands(self) -> dict[int, int]:
        """Each load command checked alone; returns cmd -> offset of the last one of its kind."""
        data, image = self.data, self.image
        (sizeofcmds,) = struct.unpack_from("<I", data, 20)
        if sum(size for _, _, size in image.commands) != sizeofcmds:
            self.fail(f"the load commands take {sum(s for _, _, s in image.commands)} bytes, but "
                      f"the header's sizeofcmds says {sizeofcmds}")
        found: dict[int, int] = {}
        seen: dict[int, int] = {}
        dylibs: list[bytes] = []
        for index, (cmd, at, size) in enumerate(image.commands):
            what = f"load command {index} ({cmd:#x})"
            if cmd & LC_REQ_DYLD and cmd not in _KNOWN_REQUIRED:
                self.stop(f"{what} is a required command dyld does not know")
            expected = _SIZES.get(cmd)
            if cmd == LC_SEGMENT_64:
                expected = 72 + 80 * struct.unpack_from("<I", data, at + 64)[0]
            elif cmd == LC_BUILD_VERSION:
                expected = 24 + 8 * struct.unpack_from("<I", data, at + 20)[0]
            if expected is not None and size != expected:
                self.stop(f"{what} is {size} bytes; dyld requires {expected}")
            if cmd in _STRINGS:
                (offset,) = struct.unpack_from("<I", data, at + 8)
                if not _STRINGS[cmd] <= offset < size or b"\0" not in data[at + offset:at + size]:
                    self.stop(f"{what}: its name (at {offset}) does not lie within the command "
                              f"({size} bytes), NUL-terminated")
                path = data[at + offset:data.index(b"\0", at + offset)]
                if cmd == LC_LAZY_LOAD_DYLIB:
                    self.fail(f"{what} is LC_LAZY_LOAD_DYLIB, which dyld no longer supports")
                elif cmd != LC_ID_DYLIB and _STRINGS[cmd] == 24:  # a library it links
                    if path in dylibs:
                        self.fail(f"{what} links {path.decode(errors='replace')} a second time")
                    dylibs.append(path)
            seen[cmd] = seen.get(cmd, 0) + 1
            found[cmd] = at
        for cmd, name in _ONCE.items():
            if seen.get(cmd, 0) > 1:
                self.fail(f"{name} appears {seen[cmd]} times")
        if seen.get(LC_DYLD_INFO, 0) + seen.get(LC_DYLD_INFO_ONLY, 0) > 1:
            self.fail("more than one LC_DYLD_INFO(_ONLY)")
        if image.filetype == MH_DYLIB and LC_ID_DYLIB not in seen:
            self.fail("a dylib without LC_ID_DYLIB")
        if not dylibs:
            self.fail("no LC_LOAD_DYLIB: dyld requires every image to link libSystem")
        if LC_UUID not in seen:
            self.fail("no LC_UUID: dyld requires one of images built with current SDKs")
        for needed in (LC_SYMTAB, LC_DYSYMTAB):
            if needed not in seen:
                self.stop(f"no {_ONCE[needed]}")
        return found

    # ----------------------------------------------------------------------- segments
    def _segments(self) -> None:
        image, fail = self.image, self.fail
        page = _PAGE.get(image.cputype, 0x1000)
        names = [s.name for s in image.segments]
        for name in ("__TEXT", "__LINKEDIT"):
            if names.count(name) != 1:
                self.stop(f"{names.count(name)} {name} segments, expected 1")
        (sizeofcmds,) = struct.unpack_from("<I", self.data, 20)
        for segment in image.segments:
            where = f"segment {segment.name}"
            if segment.fileoff + segment.filesize > len(self.data):
                self.stop(f"{where} ({segment.filesize} bytes at {segment.fileoff:#x}) runs past "
                          f"the slice ({len(self.data)} bytes)")
            if segment.filesize > segment.vmsize and (segment.vmsize or segment.initprot):
                self.stop(f"{where} maps {segment.filesize} bytes of the file into {segment.vmsize}")
            if segment.vmaddr + segment.vmsize >= 1 << 64:
                self.stop(f"{where}'s addresses wrap around")
            if (segment.initprot | segment.maxprot) & ~7 or segment.initprot & ~segment.maxprot:
                fail(f"{where}'s protections {segment.initprot:#x}/{segment.maxprot:#x} are invalid")
            # dyld makes a segment marked read-only so once it has fixed it up
            if segment.flags & ~(SG_NORELOC | SG_READ_ONLY) or (
                    segment.flags & SG_READ_ONLY and not segment.name.endswith("_CONST")):
                fail(f"{where} has flags {segment.flags:#x}: unknown, or read-only for a segment "
                     "that is written to")
            if segment.vmsize and (segment.vmaddr % page or segment.fileoff % page):
                self.stop(f"{where} at address {segment.vmaddr:#x}, offset {segment.fileoff:#x} is "
                          f"not aligned to the {page // 1024} KiB pages mmap maps")
            if segment.name == "__TEXT" and (
                    segment.fileoff or segment.initprot != VM_PROT_READ | VM_PROT_EXECUTE
                    or min(segment.filesize, segment.vmsize) < 32 + sizeofcmds):
                self.stop("__TEXT must start the file, be r-x and hold the header and load commands")
            if segment.name == "__LINKEDIT":
                if segment.initprot != VM_PROT_READ:
                    fail("__LINKEDIT must be read-only (r--)")
                if segment.fileoff + segment.filesize != len(self.data):
                    fail(f"__LINKEDIT ends at {segment.fileoff + segment.filesize:#x}, but the "
                         f"slice at {len(self.data):#x}: the linker puts it last")
                self.linkedit = segment
        segments = self.image.segments
        for a, b in zip(segments, segments[1:]):  # dyld: load command order is address order
            if b.vmaddr < a.vmaddr + a.vmsize or (b.filesize and b.fileoff < a.fileoff + a.filesize):
                self.stop(f"segment {b.name} overlaps segment {a.name} or comes before it")
            # the linkers lay segments out end to end, a page apart at most
            if b.vmaddr != -(-(a.vmaddr + a.vmsize) // page) * page:
                fail(f"segment {b.name} starts at {b.vmaddr:#x}, not on the page where {a.name} "
                     f"ends ({a.vmaddr + a.vmsize:#x})")
        for segment, sections in self._grouped():
            for section in sections:
                self._section(segment, section)

    def _grouped(self) -> Iterator[tuple[Segment, list[Section]]]:
        at = 0
        for segment in self.image.segments:
            yield segment, self.image.sections[at:at + segment.nsects]
            at += segment.nsects

    def _section(self, segment: Segment, section: Section) -> None:
        where = f"section {section}"
        if section.segname != segment.name:
            self.fail(f"{where} lies in the load command of segment {segment.name}")
        kind = section.flags & 0xFF
        if kind > 0x16 or _SECTION_TYPES.get(section.sectname, kind) != kind:
            self.fail(f"{where} has section type {kind:#x}, not one dyld knows for it")
        if not segment.vmaddr <= section.addr <= section.addr + section.size <= \
                segment.vmaddr + segment.vmsize:
            self.stop(f"{where} ({section.size} bytes at {section.addr:#x}) lies outside its "
                      f"segment ({segment.vmsize} bytes at {segment.vmaddr:#x})")
        if section.zerofill or not section.size:
            return
        # where the segment maps the section's address is where its bytes must be in the file
        mapped = segment.fileoff + section.addr - segment.vmaddr
        if section.offset != mapped or section.addr + section.size > segment.vmaddr + segment.filesize:
            self.stop(f"{where}: its {section.size} bytes at file offset {section.offset:#x} are "
                      f"not where segment {segment.name} maps its address ({mapped:#x})")

    # ---------------------------------------------------------------------- link-edit
    def _linkedit(self, commands: dict[int, int]) -> dict[str, tuple[int, int]]:
        """Every link-edit blob inside __LINKEDIT, aligned, none overlapping (dyld's
        validLinkeditLayout); returns them by name."""
        data, linkedit = self.data, self.linkedit
        assert linkedit is not None
        blobs: list[tuple[str, int, int, int]] = []  # name, offset, size, alignment
        if LC_SYMTAB in commands:
            symoff, nsyms, stroff, strsize = struct.unpack_from("<IIII", data, commands[LC_SYMTAB] + 8)
            if nsyms > 0x10000000:
                self.stop(f"the symbol table's {nsyms} symbols are more than dyld accepts")
            blobs += [("symbol table", symoff, 16 * nsyms, 8), ("string table", stroff, strsize, 1)]
        if LC_DYSYMTAB in commands:
            fields = struct.unpack_from("<18I", data, commands[LC_DYSYMTAB] + 8)
            indirect_at, nindirect, extrel_at, nextrel, locrel_at, nlocrel = fields[12:]
            blobs += [("indirect symbol table", indirect_at, 4 * nindirect, 4),
                      ("external relocations", extrel_at, 8 * nextrel, 8),
                      ("local relocations", locrel_at, 8 * nlocrel, 8)]
            if nextrel or nlocrel:
                self.fail("relocations in LC_DYSYMTAB: dyld refuses them beside LC_DYLD_INFO_ONLY "
                          "and cuvil's linkers write none")
        info = commands.get(LC_DYLD_INFO_ONLY, commands.get(LC_DYLD_INFO))
        if info is not None:
            fields = struct.unpack_from("<10I", data, info + 8)
            for i, name in enumerate(("rebase opcodes", "bind opcodes", "weak bind opcodes",
                                      "lazy bind opcodes", "export trie")):
                blobs.append((name, fields[2 * i], fields[2 * i + 1], 8))
        for cmd, name in _LINKEDIT_DATA.items():
            if cmd in commands:
                blobs.append((name, *struct.unpack_from("<II", data, commands[cmd] + 8), 8))
        if info is None and LC_DYLD_CHAINED_FIXUPS not in commands:
            self.stop("neither LC_DYLD_INFO_ONLY nor LC_DYLD_CHAINED_FIXUPS: dyld cannot bind")
        end = linkedit.fileoff + linkedit.filesize
        previous, previous_end = "the start of __LINKEDIT", linkedit.fileoff
        for name, offset, size, alignment in sorted((b for b in blobs if b[2]), key=lambda b: b[1]):
            if offset < previous_end:
                self.stop(f"the {name} ({size} bytes at {offset:#x}) overlaps {previous}")
            if offset + size > end:
                self.stop(f"the {name} ({size} bytes at {offset:#x}) runs past __LINKEDIT, which "
                          f"ends at {end:#x}")
            if offset % alignment:
                self.fail(f"the {name} at {offset:#x} is not aligned to {alignment} bytes")
            previous, previous_end = f"the {name}", offset + size
        return {name: (offset, size) for name, offset, size, _ in blobs}

    # ------------------------------------------------------------------------ symbols
    def _symbols(self, commands: dict[int, int]) -> None:
        try:
            symbols = self.image.symbols()  # each name NUL-terminated within the string table
        except MachOFormatError as exc:
            self.stop(f"the symbol table: {exc}")
        nsects = len(self.image.sections)
        for i, symbol in enumerate(symbols):
            kind = symbol.type & N_TYPE
            if symbol.type & N_STAB:
                continue
            if kind not in (N_UNDF, N_ABS, N_INDR, N_PBUD, N_SECT) or \
                    (kind == N_SECT and not 1 <= symbol.sect <= nsects):
                self.fail(f"symbol {i} ({symbol.name}) has type {symbol.type:#x} in section "
                          f"{symbol.sect} of {nsects}")
        fields = struct.unpack_from("<18I", self.data, commands[LC_DYSYMTAB] + 8)
        nsyms = len(symbols)
        # the three ranges of LC_DYSYMTAB: local, external defined and undefined symbols, which
        # the linkers write in this order, covering the table
        if fields[2] != fields[0] + fields[1] or fields[4] != fields[2] + fields[3] or \
                fields[0] or fields[4] + fields[5] != nsyms:
            self.fail(f"LC_DYSYMTAB's local, external and undefined symbols ({fields[0]}+{fields[1]}, "
                      f"{fields[2]}+{fields[3]}, {fields[4]}+{fields[5]}) do not cover the {nsyms} "
                      "symbols in order")
        for (first, count), name, test in zip(
                (fields[0:2], fields[2:4], fields[4:6]), ("local", "external", "undefined"),
                (lambda t: not t & N_EXT or bool(t & N_STAB),
                 lambda t: bool(t & N_EXT) and t & N_TYPE != N_UNDF,
                 lambda t: bool(t & N_EXT) and t & N_TYPE in (N_UNDF, N_PBUD))):
            if first + count > nsyms:
                self.stop(f"LC_DYSYMTAB's {name} symbols ({count} from {first}) run past the "
                          f"{nsyms} symbols")
            wrong = [first + i for i, s in enumerate(symbols[first:first + count]) if not test(s.type)]
            if wrong:
                self.fail(f"LC_DYSYMTAB's {name} symbols include symbols {wrong[:3]}, which are not")
        indirect_at, nindirect = fields[12:14]
        indirect = struct.unpack_from(f"<{nindirect}I", self.data, indirect_at)
        bad = [i for i, n in enumerate(indirect) if n >= nsyms and n not in (
            INDIRECT_SYMBOL_LOCAL, INDIRECT_SYMBOL_ABS, INDIRECT_SYMBOL_LOCAL | INDIRECT_SYMBOL_ABS)]
        if bad:
            self.fail(f"indirect symbol table entries {bad[:3]} name no symbol of the {nsyms}")
        for section in self.image.sections:
            entry = _INDIRECT_SECTIONS.get(section.flags & 0xFF)
            if entry is None:
                continue
            entry = entry or section.reserved2
            if not entry or section.size % entry or \
                    section.reserved1 + section.size // entry > nindirect:
                self.fail(f"section {section}'s {section.size} bytes of slots (from indirect "
                          f"symbol {section.reserved1}) run past the {nindirect} indirect symbols")

    # ---------------------------------------------------------------- dyld info opcodes
    def _opcodes(self, at: int) -> None:
        """The rebase and bind opcodes as dyld runs them: every fixup in a writable segment,
        every symbol name terminated, every library ordinal one the image links."""
        fields = struct.unpack_from("<10I", self.data, at + 8)
        ndylibs = sum(1 for cmd, _, _ in self.image.commands if cmd in (
            LC_LOAD_DYLIB, LC_LOAD_WEAK_DYLIB, LC_REEXPORT_DYLIB, LC_LOAD_UPWARD_DYLIB, LC_LAZY_LOAD_DYLIB))
        for i, name in enumerate(("rebase opcodes", "bind opcodes", "weak bind opcodes",
                                  "lazy bind opcodes")):
            offset, size = fields[2 * i], fields[2 * i + 1]
            if size:
                problem = _run_opcodes(self.data[offset:offset + size], name, list(self._grouped()),
                                       ndylibs)
                if problem:
                    self.fail(f"the {name}: {problem}")

    def _exports(self, blobs: dict[str, tuple[int, int]]) -> None:
        try:
            exports = self.image.trie_exports()
        except MachOFormatError as exc:
            self.stop(f"the export trie: {exc}")
        base = self.image.image_base()
        segments = self.image.segments
        for name, address in exports.items():
            if address is not None and not any(
                    s.vmaddr <= base + address < s.vmaddr + s.vmsize for s in segments):
                self.fail(f"the export trie puts {name} at {address:#x}, outside every segment")


_MASK = (1 << 64) - 1  # dyld's offsets are 64-bit: a large addition moves backwards


def _uleb(blob: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = blob[at]  # IndexError past the blob: reported by walk_problems
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _run_opcodes(blob: bytes, kind: str, grouped: list[tuple[Segment, list[Section]]],  # noqa: C901  (dyld's rebase and bind opcodes, one interpreter loop as dyld writes it)
                 ndylibs: int) -> str | None:
    """What is wrong with a rebase or bind opcode stream (None when nothing): mach-o/loader.h's
    REBASE_OPCODE_* and BIND_OPCODE_*, whose opcodes share their numbers up to 0x90."""
    segments = [segment for segment, _ in grouped]
    ranges = [sorted((s.addr, s.addr + s.size) for s in sections if not s.zerofill)
              for _, sections in grouped]
    starts = [[start for start, _ in r] for r in ranges]
    ends = [[end for _, end in r] for r in ranges]
    rebase, lazy = kind.startswith("rebase"), kind.startswith("lazy")
    # weak binds name a symbol to coalesce, from whichever image defines it: no library
    at, segment, offset, ordinal_set = 0, None, 0, kind.startswith("weak")
    pointer = 8

    def fixup(count: int, stride: int) -> str | None:
        if segment is None:
            return "a fixup before its segment is set"
        target = segments[segment]
        for i in range(count):
            at_offset = offset + i * stride
            address = target.vmaddr + at_offset
            if not target.initprot & 2 or at_offset + pointer > target.vmsize:
                return (f"a fixup at {at_offset:#x} of segment {target.name}, which is not "
                        "writable or not that long")
            # the linker fixes up pointers in sections: elsewhere is padding or nothing
            j = bisect.bisect_right(starts[segment], address) - 1
            if j < 0 or address + pointer > ends[segment][j]:
                return f"a fixup at {address:#x} of segment {target.name} lies in none of its sections"
        return None

    while at < len(blob):
        byte = blob[at]
        at += 1
        opcode, immediate = byte & 0xF0, byte & 0x0F
        problem = None
        if opcode == 0x00:  # DONE (or the stream's end); lazy binding holds one run per symbol
            if not lazy:
                return None
        elif opcode == 0x10 and rebase:  # SET_TYPE_IMM
            if immediate not in (1, 2, 3):
                return f"rebase type {immediate} is unknown"
        elif opcode == 0x10:  # SET_DYLIB_ORDINAL_IMM
            if immediate > ndylibs:
                return f"library ordinal {immediate} of {ndylibs}"
            ordinal_set = True
        elif opcode == 0x20 and rebase:  # SET_SEGMENT_AND_OFFSET_ULEB
            segment = immediate
            offset, at = _uleb(blob, at)
        elif opcode == 0x20:  # SET_DYLIB_ORDINAL_ULEB
            ordinal, at = _uleb(blob, at)
            if ordinal > ndylibs:
                return f"library ordinal {ordinal} of {ndylibs}"
            ordinal_set = True
        elif opcode == 0x30 and rebase:  # ADD_ADDR_ULEB
            add, at = _uleb(blob, at)
            offset = (offset + add) & _MASK
        elif opcode == 0x30:  # SET_DYLIB_SPECIAL_IMM: self, main executable, flat lookup
            ordinal_set = True
        elif opcode == 0x40 and rebase:  # ADD_ADDR_IMM_SCALED
            offset += immediate * pointer
        elif opcode == 0x40:  # SET_SYMBOL_TRAILING_FLAGS_IMM: a name follows
            end = blob.find(b"\0", at)
            if end < 0:
                return "a symbol name runs past the stream"
            at = end + 1
        elif opcode == 0x50 and rebase:  # DO_REBASE_IMM_TIMES
            problem = fixup(immediate, pointer)
            offset += immediate * pointer
        elif opcode == 0x50:  # SET_TYPE_IMM
            if immediate not in (1, 2, 3):
                return f"bind type {immediate} is unknown"
        elif opcode == 0x60 and rebase:  # DO_REBASE_ULEB_TIMES
            count, at = _uleb(blob, at)
            problem = fixup(count, pointer)
            offset += count * pointer
        elif opcode == 0x60:  # SET_ADDEND_SLEB
            _, at = _uleb(blob, at)
        elif opcode == 0x70:  # rebase: DO_REBASE_ADD_ADDR_ULEB; bind: SET_SEGMENT_AND_OFFSET_ULEB
            if rebase:
                problem = fixup(1, pointer)
                add, at = _uleb(blob, at)
                offset = (offset + pointer + add) & _MASK
            else:
                segment = immediate
                offset, at = _uleb(blob, at)
        elif opcode == 0x80:  # rebase: DO_REBASE_ULEB_TIMES_SKIPPING_ULEB; bind: ADD_ADDR_ULEB
            if rebase:
                count, at = _uleb(blob, at)
                skip, at = _uleb(blob, at)
                problem = fixup(count, pointer + skip)
                offset += count * (pointer + skip)
            else:
                add, at = _uleb(blob, at)
                offset = (offset + add) & _MASK
        elif opcode == 0x90 and not rebase:  # DO_BIND
            problem = fixup(1, pointer) or (None if ordinal_set else "a bind before its library")
            offset += pointer
        elif opcode == 0xA0 and not rebase:  # DO_BIND_ADD_ADDR_ULEB
            problem = fixup(1, pointer)
            add, at = _uleb(blob, at)
            offset = (offset + pointer + add) & _MASK
        elif opcode == 0xB0 and not rebase:  # DO_BIND_ADD_ADDR_IMM_SCALED
            problem = fixup(1, pointer)
            offset += pointer + immediate * pointer
        elif opcode == 0xC0 and not rebase:  # DO_BIND_ULEB_TIMES_SKIPPING_ULEB
            count, at = _uleb(blob, at)
            skip, at = _uleb(blob, at)
            problem = fixup(count, pointer + skip)
            offset += count * (pointer + skip)
        else:
            return f"opcode {byte:#x} at {at - 1} is unknown"
        if segment is not None and segment >= len(segments):
            return f"segment {segment} of {len(segments)}"
        if problem:
            return problem
    return None
