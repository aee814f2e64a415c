"""An ELF64 little-endian shared library as the dynamic loader reads it, checked for consistency.

The other ELF checks read the section headers (through pyelftools); the dynamic loader ignores
those and follows the program headers to the dynamic table, and from there to the symbol,
string, hash and relocation tables. A byte changed in that path can crash the process in
`dlopen` (or abort it: ld.so asserts on a malformed hash table) while every section-based
check passes. `structure_problems` walks the loader's path with plain `struct` reads and
reports what would send it outside the file or the image, and where the two views of the file
disagree. It cannot tell a changed relocation addend or instruction from the real one: the
load test (`cuvil check --load`) is what runs the code.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import NoReturn

from cuvil.check._structure import Problems, walk_problems

__all__ = ["structure_problems"]

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_DYN = struct.Struct("<qQ")
_SYM = struct.Struct("<IBBHQQ")
_RELA = struct.Struct("<QQq")

PT_LOAD, PT_DYNAMIC, PT_PHDR = 1, 2, 6
PF_X, PF_W = 1, 2
DT_NULL, DT_NEEDED, DT_PLTRELSZ, DT_HASH, DT_STRTAB, DT_SYMTAB, DT_RELA, DT_RELASZ, DT_RELAENT, \
    DT_STRSZ, DT_SYMENT, DT_SONAME, DT_RPATH, DT_JMPREL, DT_RUNPATH = \
    0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 14, 15, 23, 29
DT_INIT, DT_FINI, DT_INIT_ARRAY, DT_FINI_ARRAY, DT_INIT_ARRAYSZ, DT_FINI_ARRAYSZ = 12, 13, 25, 26, 27, 28
DT_PLTREL = 20
DT_GNU_HASH, DT_VERSYM, DT_VERNEED, DT_VERDEF = 0x6FFFFEF5, 0x6FFFFFF0, 0x6FFFFFFE, 0x6FFFFFFC
DT_VERNEEDNUM, DT_VERDEFNUM = 0x6FFFFFFF, 0x6FFFFFFD
#: address-valued tags and the tag holding their size in bytes (None: the size is implied)
_TABLES = {DT_STRTAB: DT_STRSZ, DT_RELA: DT_RELASZ, DT_JMPREL: DT_PLTRELSZ,
           DT_INIT_ARRAY: DT_INIT_ARRAYSZ, DT_FINI_ARRAY: DT_FINI_ARRAYSZ, DT_SYMTAB: None,
           DT_GNU_HASH: None, DT_HASH: None, DT_VERSYM: None, DT_VERNEED: None, DT_VERDEF: None,
           DT_INIT: None, DT_FINI: None}
_TAG_NAMES = {DT_STRTAB: "DT_STRTAB", DT_RELA: "DT_RELA", DT_JMPREL: "DT_JMPREL",
              DT_INIT_ARRAY: "DT_INIT_ARRAY", DT_FINI_ARRAY: "DT_FINI_ARRAY",
              DT_SYMTAB: "DT_SYMTAB", DT_GNU_HASH: "DT_GNU_HASH", DT_HASH: "DT_HASH",
              DT_VERSYM: "DT_VERSYM", DT_VERNEED: "DT_VERNEED", DT_VERDEF: "DT_VERDEF",
              DT_INIT: "DT_INIT", DT_FINI: "DT_FINI"}
#: tags whose value is an offset into the string table
_STRING_TAGS = {DT_NEEDED: "DT_NEEDED", DT_SONAME: "DT_SONAME", DT_RPATH: "DT_RPATH",
                DT_RUNPATH: "DT_RUNPATH"}
#: relocation types a shared library of cuvil's may hold: e_machine -> {type: name}
_RELOCATIONS = {
    62: {1: "R_X86_64_64", 6: "R_X86_64_GLOB_DAT", 7: "R_X86_64_JUMP_SLOT",
         8: "R_X86_64_RELATIVE", 16: "R_X86_64_DTPMOD64", 17: "R_X86_64_DTPOFF64",
         18: "R_X86_64_TPOFF64", 37: "R_X86_64_IRELATIVE"},
    183: {257: "R_AARCH64_ABS64", 1025: "R_AARCH64_GLOB_DAT", 1026: "R_AARCH64_JUMP_SLOT",
          1027: "R_AARCH64_RELATIVE", 1028: "R_AARCH64_TLS_DTPMOD", 1029: "R_AARCH64_TLS_DTPREL",
          1030: "R_AARCH64_TLS_TPREL", 1031: "R_AARCH64_TLSDESC", 1032: "R_AARCH64_IRELATIVE"},
}
_RELATIVE = {62: 8, 183: 1027}
_JUMP_SLOT = {62: 7, 183: 1026}
_GLOB_DAT = {62: 6, 183: 1025}


def structure_problems(data: bytes) -> list[str]:
    """What in the loader's path through `data` (an ELF64 little-endian shared library) is
    inconsistent; empty when nothing is."""
    return walk_problems(lambda problems: _Library(data, problems).walk())


#: a PT_LOAD segment: (address, memory size, file offset, file size, flags)
_Load = tuple[int, int, int, int, int]


class _Library:
    """One walk through a library, table by table in the loader's order: each table is found
    through the ones before it, so a step that cannot go on stops the walk."""

    def __init__(self, data: bytes, problems: Problems) -> None:
        self.data, self.problems = data, problems
        self.fail = problems.fail
        self.loads: list[_Load] = []
        self.tags: dict[int, list[int]] = {}
        self.sections: dict[str, tuple[int, int, int]] = {}

    def stop(self, text: str) -> NoReturn:
        self.problems.stop(text)

    def walk(self) -> None:
        self.header()
        self.segments()
        self.dynamic_table()
        self.table_tags()
        self.string_table()
        self.section_views()
        _versions(self.data, self.tags, self.nsyms, self.strsz, self.strings, self.sections,
                  self.file_range, self.fail)
        self.symbols()
        self.relocations()

    def header(self) -> None:
        data, fail, stop = self.data, self.fail, self.stop
        if len(data) < _EHDR.size:
            stop("the file is shorter than an ELF header")
        (ident, _, self.machine, version, _, phoff, shoff, _, ehsize, phentsize, phnum,
         shentsize, shnum, shstrndx) = _EHDR.unpack_from(data)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            stop("not an ELF64 little-endian file")
        if ident[6] != 1 or version != 1:
            fail(f"ELF version {ident[6]}/{version}, expected 1")
        if ehsize != _EHDR.size or phentsize != _PHDR.size or (shnum and shentsize != _SHDR.size):
            stop(f"header sizes {ehsize}/{phentsize}/{shentsize} are not ELF64's "
                 f"({_EHDR.size}/{_PHDR.size}/{_SHDR.size})")
        if not phnum or phoff + phnum * _PHDR.size > len(data):
            stop(f"the program headers ({phnum} at {phoff:#x}) lie outside the file")
        if shnum and (shoff + shnum * _SHDR.size > len(data) or shstrndx >= shnum):
            fail(f"the section headers ({shnum} at {shoff:#x}, names in {shstrndx}) lie outside "
                 "the file")
            shnum = 0  # the checks that compare with the sections have none to compare with
        self.phoff, self.phnum, self.shoff, self.shnum, self.shstrndx = \
            phoff, phnum, shoff, shnum, shstrndx

    def segments(self) -> None:
        """The program headers: PT_LOAD segments inside the file, aligned, apart; the other
        segments inside them; one PT_DYNAMIC."""
        data, fail, stop = self.data, self.fail, self.stop
        phoff, phnum = self.phoff, self.phnum
        loads, dynamic, others = self.loads, [], []
        for i in range(phnum):
            p_type, flags, offset, vaddr, _, filesz, memsz, align = _PHDR.unpack_from(
                data, phoff + i * _PHDR.size)
            if p_type == PT_PHDR and (offset != phoff or filesz != memsz
                                      or filesz != phnum * _PHDR.size):
                stop(f"PT_PHDR ({filesz} bytes at {offset:#x}) is not the program headers "
                     f"({phnum * _PHDR.size} bytes at {phoff:#x})")
            if p_type not in (PT_LOAD, 0) and filesz:
                others.append((i, offset, vaddr, filesz))
            if p_type == PT_LOAD:
                if offset + filesz > len(data) or filesz > memsz:
                    stop(f"PT_LOAD {i}: {filesz} bytes at {offset:#x} (of {memsz} in memory) lie "
                         "outside the file")
                if align > 1 and (align & (align - 1) or (vaddr - offset) % align):
                    stop(f"PT_LOAD {i}: address {vaddr:#x} and offset {offset:#x} disagree "
                         f"modulo its alignment {align:#x}")
                loads.append((vaddr, memsz, offset, filesz, flags))
            elif p_type == PT_DYNAMIC:
                dynamic.append((offset, vaddr, filesz))
        loads.sort()
        if not loads:
            stop("no PT_LOAD segment")
        for (v1, m1, *_), (v2, *_) in zip(loads, loads[1:]):
            if v1 + m1 > v2:
                stop(f"PT_LOAD segments overlap at {v2:#x}")
        by_offset = sorted((o, o + f) for _, _, o, f, _ in loads if f)
        for (_, end), (start, _) in zip(by_offset, by_offset[1:]):
            if end > start:
                stop(f"PT_LOAD segments share the file's bytes at {start:#x}")
        headers_end = self.shoff + self.shnum * _SHDR.size
        if self.shnum and any(o < headers_end and self.shoff < e for o, e in by_offset):
            stop("a PT_LOAD segment maps the section headers into memory")
        for i, offset, vaddr, filesz in others:
            if not any(v <= vaddr and vaddr + filesz <= v + f and o + vaddr - v == offset
                       for v, _, o, f, _ in loads):
                fail(f"segment {i} ({filesz} bytes at {vaddr:#x}, offset {offset:#x}) is not "
                     "part of a PT_LOAD segment's file-backed bytes")
        if len(dynamic) != 1:
            stop(f"{len(dynamic)} PT_DYNAMIC segments, expected 1")
        self.dyn_offset, self.dyn_vaddr, self.dyn_size = dynamic[0]

    def file_range(self, addr: int, size: int, what: str) -> int:
        """The file offset of [addr, addr + size) of the image, which must lie in the file."""
        for vaddr, _, offset, filesz, _ in self.loads:
            if vaddr <= addr and addr + size <= vaddr + filesz:
                return offset + addr - vaddr
        return self.stop(f"{what} ({size} bytes at {addr:#x}) lies outside the file-backed image")

    def dynamic_table(self) -> None:
        """The dynamic table's entries up to its DT_NULL, by tag."""
        if self.file_range(self.dyn_vaddr, self.dyn_size, "the dynamic table") != self.dyn_offset:
            self.stop(f"PT_DYNAMIC's offset {self.dyn_offset:#x} and address "
                      f"{self.dyn_vaddr:#x} disagree")
        end = self.dyn_offset + self.dyn_size - _DYN.size + 1
        for at in range(self.dyn_offset, end, _DYN.size):
            tag, value = _DYN.unpack_from(self.data, at)
            if tag == DT_NULL:
                break
            self.tags.setdefault(tag, []).append(value)
        else:
            self.stop("the dynamic table has no DT_NULL end")

    def one(self, tag: int, name: str) -> int | None:
        values = self.tags.get(tag, [])
        if len(values) > 1:
            self.fail(f"{name} appears {len(values)} times")
        return values[0] if values else None

    def table_tags(self) -> None:
        """Each table's address (and size) once, inside the file; entry sizes ELF64's."""
        tags, fail = self.tags, self.fail
        for tag, size_tag in _TABLES.items():
            addr = self.one(tag, _TAG_NAMES[tag])
            size = (self.one(size_tag, f"the size of {_TAG_NAMES[tag]}")
                    if size_tag is not None else None)
            if addr is not None:
                if size_tag is not None and size is None:
                    fail(f"{_TAG_NAMES[tag]} without its size")
                self.file_range(addr, size or 1, _TAG_NAMES[tag])
            elif size:
                fail(f"a size for {_TAG_NAMES[tag]}, which is absent")
        strtab, symtab = tags.get(DT_STRTAB, [None])[0], tags.get(DT_SYMTAB, [None])[0]
        self.strsz = tags.get(DT_STRSZ, [0])[0]
        if strtab is None or symtab is None or not self.strsz:
            self.stop("DT_STRTAB, DT_STRSZ or DT_SYMTAB is missing")
        self.strtab, self.symtab = strtab, symtab
        for tag, name, want in ((DT_SYMENT, "DT_SYMENT", _SYM.size),
                                (DT_RELAENT, "DT_RELAENT", _RELA.size)):
            if self.one(tag, name) not in (None, want):
                fail(f"{name} is {tags[tag][0]}, expected {want}")
        if self.one(DT_PLTREL, "DT_PLTREL") not in (None, DT_RELA):
            fail(f"DT_PLTREL is {tags[DT_PLTREL][0]}, expected DT_RELA ({DT_RELA})")
        for size_tag, name in ((DT_INIT_ARRAYSZ, "DT_INIT_ARRAYSZ"),
                               (DT_FINI_ARRAYSZ, "DT_FINI_ARRAYSZ")):
            if tags.get(size_tag, [0])[0] % 8:
                fail(f"{name} {tags[size_tag][0]} is not a whole number of pointers")

    def string_table(self) -> None:
        """The dynamic string table ends with a NUL; the names the tags give lie in it."""
        at = self.file_range(self.strtab, self.strsz, "DT_STRTAB")
        self.strings = self.data[at:][:self.strsz]
        if not self.strings.endswith(b"\0"):
            self.fail("the dynamic string table does not end with a NUL")
        for tag, name in _STRING_TAGS.items():
            for offset in self.tags.get(tag, []):
                self.string_problem(offset, name)

    def string_problem(self, offset: int, what: str) -> None:
        if offset >= self.strsz or b"\0" not in self.strings[offset:]:
            self.fail(f"{what}'s name lies outside the dynamic string table")

    def section_views(self) -> None:
        """The section headers' view agrees with the loader's: segments end where their
        sections do, the loader's tables are the sections of their names; the symbol count
        (from the hash tables)."""
        tags, fail = self.tags, self.fail
        sections = self.sections
        if self.shnum:
            sections.update(_sections(self.data, self.shoff, self.shnum, self.shstrndx))
        for vaddr, memsz, offset, filesz, _ in self.loads:
            ends = [o + s for a, s, o in sections.values() if a and vaddr <= a < vaddr + memsz]
            if ends and offset + filesz != max(ends):
                fail(f"the PT_LOAD at {vaddr:#x} maps {filesz} bytes of the file, but its "
                     f"sections end {max(ends) - offset} bytes in")
        self.nsyms = _symbol_count(self.data, tags, self.symtab, sections, self.file_range,
                                   self.stop)
        for name, tag, size_tag in _SECTION_TABLES:
            if name not in sections:
                continue
            addr, size, offset = sections[name]
            want = ((self.dyn_vaddr, self.dyn_size) if tag is None else
                    (tags.get(tag, [None])[0], tags.get(size_tag, [size])[0] if size_tag else size))
            if (addr, size) != want or (tag is None and offset != self.dyn_offset):
                fail(f"section {name} ({size} bytes at {addr:#x}) is not where the dynamic "
                     f"table says ({want[1]} bytes at "
                     f"{want[0] if want[0] is None else hex(want[0])})")
        if sections.get(".dynsym") and sections[".dynsym"][1] != self.nsyms * _SYM.size:
            fail("the symbol table's size disagrees with the hash table's symbol count")

    def symbols(self) -> None:
        """Each symbol's name in the string table; a defined object or function inside the
        image, a function in an executable segment."""
        sym_at = self.file_range(self.symtab, self.nsyms * _SYM.size, "the symbol table")
        for i in range(self.nsyms):
            st_name, info, _, shndx, value, size = _SYM.unpack_from(self.data,
                                                                    sym_at + i * _SYM.size)
            self.string_problem(st_name, f"symbol {i}")
            if shndx and shndx < 0xFF00 and info & 0xF in (1, 2):  # a defined object or function
                seg = next((s for s in self.loads if s[0] <= value and value + size <= s[0] + s[1]),
                           None)
                if seg is None:
                    self.fail(f"symbol {i} ({size} bytes at {value:#x}) lies outside the image")
                elif info & 0xF == 2 and not seg[4] & PF_X:
                    self.fail(f"function symbol {i} at {value:#x} lies in a segment that is not "
                              "executable")

    def relocations(self) -> None:
        """Each relocation of a type this machine's libraries use, writing an aligned slot of
        the writable image that no other relocation writes (a lazy-binding slot in .got.plt,
        a data symbol's address in .got: written elsewhere, its slot stays unfilled for a
        call that comes later), naming a symbol of the table; RELATIVE addends inside the
        image."""
        machine, tags, loads = self.machine, self.tags, self.loads
        relocations = _RELOCATIONS.get(machine)
        if relocations is None:
            return
        image = (loads[0][0], loads[-1][0] + loads[-1][1])
        targets: set[int] = set()
        slots = {_JUMP_SLOT.get(machine): self.sections.get(".got.plt"),
                 _GLOB_DAT.get(machine): self.sections.get(".got")}
        for tag, size_tag in ((DT_RELA, DT_RELASZ), (DT_JMPREL, DT_PLTRELSZ)):
            addr, size = tags.get(tag, [None])[0], tags.get(size_tag, [0])[0]
            if addr is None:
                continue
            if size % _RELA.size:
                self.fail(f"{_TAG_NAMES[tag]}'s size {size} is not a whole number of entries")
            at = self.file_range(addr, size, _TAG_NAMES[tag])
            for j in range(size // _RELA.size):
                offset, info, addend = _RELA.unpack_from(self.data, at + j * _RELA.size)
                kind, sym = info & 0xFFFFFFFF, info >> 32
                where = f"relocation {j} of {_TAG_NAMES[tag]}"
                problem = self.relocation_problem(kind, sym, offset, addend, slots.get(kind),
                                                  targets, image)
                if problem:
                    self.fail(f"{where} {problem}")
                targets.add(offset)

    def relocation_problem(self, kind: int, sym: int, offset: int, addend: int,
                           slot: tuple[int, int, int] | None, targets: set[int],
                           image: tuple[int, int]) -> str | None:
        relocations = _RELOCATIONS[self.machine]
        if kind not in relocations:
            return f"has type {kind}, which a library of this machine does not use"
        if offset % 8 or offset in targets or not any(
                v <= offset and offset + 8 <= v + m and f & PF_W for v, m, _, _, f in self.loads):
            return (f"writes at {offset:#x}: unaligned, outside the writable image or where "
                    "another relocation writes")
        if slot is not None and not slot[0] <= offset < slot[0] + slot[1]:
            return f"({relocations[kind]}) writes at {offset:#x}, outside the table of such slots"
        if sym >= self.nsyms:
            return f"names symbol {sym} of {self.nsyms}"
        if kind == _RELATIVE.get(self.machine) and not image[0] <= addend <= image[1]:
            return f"points at {addend:#x}, outside the image [{image[0]:#x}, {image[1]:#x}]"
        return None


#: the sections holding the loader's tables, and the tags giving each one's address and size
#: (None: the dynamic table itself; no size tag: the section's size is not checked)
_SECTION_TABLES = ((".dynamic", None, None), (".dynsym", DT_SYMTAB, None),
                   (".dynstr", DT_STRTAB, DT_STRSZ), (".gnu.hash", DT_GNU_HASH, None),
                   (".rela.dyn", DT_RELA, DT_RELASZ), (".rela.plt", DT_JMPREL, DT_PLTRELSZ),
                   (".init_array", DT_INIT_ARRAY, DT_INIT_ARRAYSZ),
                   (".fini_array", DT_FINI_ARRAY, DT_FINI_ARRAYSZ),
                   (".gnu.version", DT_VERSYM, None), (".gnu.version_r", DT_VERNEED, None),
                   (".hash", DT_HASH, None))


def _sections(data: bytes, shoff: int, shnum: int,
              shstrndx: int) -> Iterator[tuple[str, tuple[int, int, int]]]:
    """(name, (address, size, offset)) of the sections the loader's tables live in."""
    headers = [_SHDR.unpack_from(data, shoff + i * _SHDR.size) for i in range(shnum)]
    names_at, names_size = headers[shstrndx][4], headers[shstrndx][5]
    names = data[names_at:names_at + names_size]
    for name_off, sh_type, _, addr, offset, size, *_ in headers:
        if sh_type != 8:  # SHT_NOBITS has no bytes to compare
            end = names.find(b"\0", name_off)
            yield names[name_off:end].decode("ascii", "replace"), (addr, size, offset)


_FileRange = Callable[[int, int, str], int]


def _symbol_count(data: bytes, tags: dict[int, list[int]], symtab: int,
                  sections: dict[str, tuple[int, int, int]], file_range: _FileRange,
                  stop: Callable[[str], NoReturn]) -> int:
    """Symbols in the dynamic symbol table, as the loader knows them: from DT_HASH's chain
    count, or from DT_GNU_HASH's buckets and chains, whose header is checked on the way."""
    count = None
    if DT_HASH in tags:
        at = file_range(tags[DT_HASH][0], 8, "DT_HASH")
        nbucket, nchain = struct.unpack_from("<II", data, at)
        file_range(tags[DT_HASH][0], 8 + 4 * (nbucket + nchain), "DT_HASH's buckets and chains")
        entries = struct.unpack_from(f"<{nbucket + nchain}I", data, at + 8)
        if not nbucket or any(e >= nchain for e in entries):
            stop(f"the SysV hash table ({nbucket} buckets, {nchain} chains) points past its symbols")
        count = nchain
    if DT_GNU_HASH not in tags:
        if count is None:
            stop("neither DT_GNU_HASH nor DT_HASH")
        return int(count)
    addr = tags[DT_GNU_HASH][0]
    at = file_range(addr, 16, "DT_GNU_HASH")
    nbuckets, symoffset, bloom_size, bloom_shift = struct.unpack_from("<IIII", data, at)
    if not nbuckets or not bloom_size or bloom_size & (bloom_size - 1) or bloom_shift >= 64:
        stop(f"the GNU hash table's header ({nbuckets} buckets, bloom filter of {bloom_size} "
             f"words shifted {bloom_shift}) is malformed")
    buckets_at = at + 16 + 8 * bloom_size
    file_range(addr + 16 + 8 * bloom_size, 4 * nbuckets, "DT_GNU_HASH's buckets")
    buckets = struct.unpack_from(f"<{nbuckets}I", data, buckets_at)
    chains_at = buckets_at + 4 * nbuckets
    last = max(buckets)
    if last and last < symoffset:
        stop(f"a GNU hash bucket points at symbol {last}, below its first hashed symbol {symoffset}")
    limit = (sections[".dynsym"][1] // _SYM.size) if ".dynsym" in sections else 1 << 20
    gnu_count = symoffset
    while last:  # the last bucket's chain ends at the last symbol
        if last - symoffset >= limit or chains_at + 4 * (last - symoffset) + 4 > len(data):
            stop("the GNU hash table's chains run past the symbol table")
        (h,) = struct.unpack_from("<I", data, chains_at + 4 * (last - symoffset))
        last += 1
        if h & 1:
            gnu_count = last
            break
    if count is not None and count != gnu_count:
        stop(f"the SysV and GNU hash tables count {count} and {gnu_count} symbols")
    return gnu_count


def _versions(data: bytes, tags: dict[int, list[int]], nsyms: int, strsz: int, strings: bytes,
              sections: dict[str, tuple[int, int, int]], file_range: _FileRange,
              fail: Callable[[str], None]) -> None:
    """The symbol versions: each needed version's names within the string table and its hash
    right, and every symbol's version index one the library defines or needs (the loader
    indexes its version array with it)."""
    indices = {0, 1}
    problem = _needed_versions(data, tags, strsz, strings, sections, file_range, indices)
    if problem:
        fail(problem)
        return
    if DT_VERDEF in tags:
        indices.update(range(2, 2 + tags.get(DT_VERDEFNUM, [0])[0]))
    if DT_VERSYM in tags:
        at = file_range(tags[DT_VERSYM][0], 2 * nsyms, "DT_VERSYM")
        bad = [i for i, v in enumerate(struct.unpack_from(f"<{nsyms}H", data, at))
               if v & 0x7FFF not in indices]
        if bad:
            fail(f"symbols {bad[:5]} have version indices the library neither defines nor needs")


def _needed_versions(data: bytes, tags: dict[int, list[int]], strsz: int, strings: bytes,
                     sections: dict[str, tuple[int, int, int]], file_range: _FileRange,
                     indices: set[int]) -> str | None:
    """What is wrong with the needed-version entries (DT_VERNEED), or None; their version
    indices added to `indices`."""
    if DT_VERNEED not in tags:
        return None
    needed = {_string(strings, offset) for offset in tags.get(DT_NEEDED, [])}
    count = tags.get(DT_VERNEEDNUM, [0])[0]
    at = file_range(tags[DT_VERNEED][0], 16, "DT_VERNEED")
    end = at + sections[".gnu.version_r"][1] if ".gnu.version_r" in sections else len(data)
    for i in range(count):
        if at + 16 > end:
            return "DT_VERNEED's entries run past their table"
        version, cnt, name, aux, nxt = struct.unpack_from("<HHIII", data, at)
        # the loader follows the next-links until a 0, whatever the counts say
        if version != 1 or name >= strsz or not cnt or (nxt == 0) != (i == count - 1):
            return f"a needed-version entry at {at:#x} is malformed"
        if _string(strings, name) not in needed:  # ld.so asserts the library is loaded
            return (f"a needed-version entry at {at:#x} names a library the library does not "
                    "need (DT_NEEDED)")
        vat = at + aux
        for j in range(cnt):
            if vat + 16 > end:
                return "a needed version runs past its table"
            vhash, _, other, vname, vnext = struct.unpack_from("<IHHII", data, vat)
            if (vnext == 0) != (j == cnt - 1):
                return f"the needed version at {vat:#x} links past its entry's count"
            if vname >= strsz or _elf_hash(_string(strings, vname)) != vhash:
                return (f"the needed version at {vat:#x} has a name outside the string table "
                        "or a hash that is not its name's")
            indices.add(other & 0x7FFF)
            vat += vnext
        at += nxt
    return None


def _string(strings: bytes, offset: int) -> bytes:
    return strings[offset:strings.find(b"\0", offset)]


def _elf_hash(name: bytes) -> int:
    """The SysV ELF hash of a name (what version entries carry)."""
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h
