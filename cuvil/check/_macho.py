"""A small, strict reader of Mach-O dynamic libraries (thin and universal), for static checks.

It reads what `cuvil check` needs and nothing more: load commands, segments and sections, the
symbol table, the export trie, dylib names, rpaths, and the embedded code signature, whose page
hashes it verifies. Every offset is bounds-checked: a damaged file raises `MachOFormatError`
naming what is wrong, never IndexError or a struct error. Nothing is executed or loaded.

Layouts follow Apple's <mach-o/loader.h>, <mach-o/fat.h>, <mach-o/nlist.h> and the code
signing blob formats (<kern/cs_blobs.h>); code signature blobs are big-endian, everything else
in an arm64 or x86-64 image is little-endian.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any

from cuvil.errors import CheckError

__all__ = [
    "ARCH_NAMES",
    "CPU_TYPE_ARM64",
    "CPU_TYPE_X86_64",
    "CodeSignature",
    "MachOFormatError",
    "MachOImage",
    "Section",
    "Segment",
    "Symbol",
    "parse_macho",
]

FAT_MAGIC = 0xCAFEBABE
FAT_MAGIC_64 = 0xCAFEBABF
MH_MAGIC_64 = 0xFEEDFACF
MH_MAGIC = 0xFEEDFACE
MH_DYLIB = 0x6

CPU_TYPE_X86_64 = 0x01000007
CPU_TYPE_ARM64 = 0x0100000C
ARCH_NAMES = {CPU_TYPE_X86_64: "x86_64", CPU_TYPE_ARM64: "aarch64"}

LC_REQ_DYLD = 0x80000000
LC_SYMTAB = 0x2
LC_DYSYMTAB = 0xB
LC_LOAD_DYLIB = 0xC
LC_ID_DYLIB = 0xD
LC_LOAD_WEAK_DYLIB = 0x18 | LC_REQ_DYLD
LC_SEGMENT_64 = 0x19
LC_CODE_SIGNATURE = 0x1D
LC_REEXPORT_DYLIB = 0x1F | LC_REQ_DYLD
LC_DYLD_INFO = 0x22
LC_DYLD_INFO_ONLY = 0x22 | LC_REQ_DYLD
LC_LOAD_UPWARD_DYLIB = 0x23 | LC_REQ_DYLD
LC_RPATH = 0x1C | LC_REQ_DYLD
LC_LAZY_LOAD_DYLIB = 0x20
LC_DYLD_EXPORTS_TRIE = 0x33 | LC_REQ_DYLD
LC_VERSION_MIN_MACOSX = 0x24
LC_BUILD_VERSION = 0x32
PLATFORM_MACOS = 1
_DEPENDENCY_COMMANDS = {
    LC_LOAD_DYLIB,
    LC_LOAD_WEAK_DYLIB,
    LC_REEXPORT_DYLIB,
    LC_LOAD_UPWARD_DYLIB,
    LC_LAZY_LOAD_DYLIB,
}

# nlist n_type bits
N_STAB = 0xE0
N_PEXT = 0x10
N_TYPE = 0x0E
N_EXT = 0x01
N_SECT = 0xE

# section types whose content is not in the file
_ZEROFILL_TYPES = {0x1, 0xC, 0x12}

# export trie flags
_EXPORT_REEXPORT = 0x08
_EXPORT_STUB_AND_RESOLVER = 0x10

# code signing (big-endian blobs)
CSMAGIC_EMBEDDED_SIGNATURE = 0xFADE0CC0
CSMAGIC_CODEDIRECTORY = 0xFADE0C02
CSMAGIC_BLOBWRAPPER = 0xFADE0B01
CSSLOT_CODEDIRECTORY = 0
CSSLOT_ALTERNATE_CODEDIRECTORIES = range(0x1000, 0x1005)
CSSLOT_SIGNATURESLOT = 0x10000
CS_ADHOC = 0x2
CS_LINKER_SIGNED = 0x20000
# blob slot type -> special slot index (hash stored at hashOffset - index * hashSize)
_SPECIAL_SLOTS = {2: 2, 5: 5, 7: 7}  # requirements, entitlements, DER entitlements
_HASH_TYPES = {1: ("sha1", 20), 2: ("sha256", 32), 3: ("sha256", 20), 4: ("sha384", 48)}


class MachOFormatError(CheckError):
    """The bytes are not a well-formed Mach-O library."""


def _unpack(fmt: str, data: bytes, offset: int, what: str) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    if offset < 0 or offset + size > len(data):
        raise MachOFormatError(f"{what} at offset {offset:#x} runs past the end ({len(data)} bytes)")
    return struct.unpack_from(fmt, data, offset)


def _cstring(data: bytes, offset: int, what: str, limit: int | None = None) -> str:
    end_limit = len(data) if limit is None else min(limit, len(data))
    if not 0 <= offset < end_limit:
        raise MachOFormatError(f"{what} at offset {offset:#x} lies outside its table")
    end = data.find(b"\0", offset, end_limit)
    if end < 0:
        raise MachOFormatError(f"{what} at offset {offset:#x} is not NUL-terminated")
    return data[offset:end].decode("utf-8", "replace")


def _uleb(data: bytes, offset: int, end: int, what: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if offset >= end:
            raise MachOFormatError(f"{what}: truncated ULEB128 number")
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7
        if shift > 63:
            raise MachOFormatError(f"{what}: ULEB128 number longer than 64 bits")


@dataclass(frozen=True)
class Section:
    index: int  # 1-based, as nlist.n_sect counts
    segname: str
    sectname: str
    addr: int
    size: int
    offset: int
    flags: int
    reserved1: int = 0  # pointer and stub sections: their first entry in the indirect symbol table
    reserved2: int = 0  # stub sections: the size of one stub

    @property
    def zerofill(self) -> bool:
        return (self.flags & 0xFF) in _ZEROFILL_TYPES

    def __str__(self) -> str:
        return f"{self.segname},{self.sectname}"


@dataclass(frozen=True)
class Segment:
    name: str
    vmaddr: int
    vmsize: int
    fileoff: int
    filesize: int
    maxprot: int = 0
    initprot: int = 0
    nsects: int = 0  # its sections follow those of the segments before it in `sections`
    flags: int = 0


@dataclass(frozen=True)
class Symbol:
    name: str  # as stored, with the leading underscore of C names
    type: int
    sect: int
    desc: int
    value: int

    @property
    def exported(self) -> bool:
        """External, not private-extern (hidden), defined in a section, not a debug entry."""
        return (
            not self.type & N_STAB
            and bool(self.type & N_EXT)
            and not self.type & N_PEXT
            and (self.type & N_TYPE) == N_SECT
        )


@dataclass
class CodeSignature:
    """What verifying one slice's embedded signature found."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    identifier: str = ""
    adhoc: bool = False
    linker_signed: bool = False
    hash_name: str = ""
    page_size: int = 0
    code_limit: int = 0
    pages: int = 0
    code_directories: int = 0
    has_cms: bool = False

    def summary(self) -> str:
        kind = "ad-hoc" if self.adhoc else ("CMS-signed (CMS not verified)" if self.has_cms else "signed")
        if self.linker_signed:
            kind += ", linker-signed"
        return (
            f"{kind}, identifier {self.identifier!r}, {self.pages} page(s) of {self.page_size} bytes "
            f"hashed with {self.hash_name} up to byte {self.code_limit}"
        )


@dataclass
class MachOImage:
    """One thin Mach-O image: a whole file, or one slice of a universal file."""

    data: bytes  # the slice's bytes; every offset below is relative to them
    offset_in_file: int
    cputype: int
    cpusubtype: int
    filetype: int
    flags: int
    commands: list[tuple[int, int, int]]  # (cmd, offset, cmdsize)
    segments: list[Segment]
    sections: list[Section]
    id_dylib: str | None
    dylibs: list[str]
    rpaths: list[str]
    symtab: tuple[int, int, int, int] | None  # symoff, nsyms, stroff, strsize
    export_trie: tuple[int, int] | None  # offset, size
    export_trie_source: str
    code_signature: tuple[int, int] | None  # dataoff, datasize
    min_os: tuple[int, int, int] | None  # oldest macOS it loads on (LC_BUILD_VERSION / LC_VERSION_MIN_MACOSX)
    build_platform: int | None

    @property
    def arch(self) -> str:
        return ARCH_NAMES.get(self.cputype, f"cputype {self.cputype:#x}")

    # ------------------------------------------------------------------------ symbols
    def symbols(self) -> list[Symbol]:
        if self.symtab is None:
            return []
        symoff, nsyms, stroff, strsize = self.symtab
        if stroff + strsize > len(self.data):
            raise MachOFormatError(f"{self.arch}: the string table runs past the end of the file")
        out = []
        for i in range(nsyms):
            strx, ntype, sect, desc, value = _unpack("<IBBHQ", self.data, symoff + 16 * i, "nlist_64")
            name = _cstring(self.data, stroff + strx, f"{self.arch}: name of symbol {i}", stroff + strsize)
            out.append(Symbol(name, ntype, sect, desc, value))
        return out

    def trie_exports(self) -> dict[str, int | None]:
        """Export trie: C name (with '_') -> address from the image base (None for re-exports)."""
        if self.export_trie is None:
            return {}
        start, size = self.export_trie
        end = start + size
        if end > len(self.data):
            raise MachOFormatError(f"{self.arch}: the export trie runs past the end of the file")
        what = f"{self.arch}: export trie"
        found: dict[str, int | None] = {}
        seen: set[int] = set()
        stack: list[tuple[int, str]] = [(0, "")]
        if size == 0:
            return found
        while stack:
            node, prefix = stack.pop()
            if node in seen or not 0 <= node < size:
                raise MachOFormatError(f"{what}: bad or repeated node offset {node:#x}")
            seen.add(node)
            terminal, p = _uleb(self.data, start + node, end, what)
            if terminal:
                info_end = p + terminal
                flags, q = _uleb(self.data, p, info_end, what)
                if flags & _EXPORT_REEXPORT:
                    found[prefix] = None
                else:
                    address, q = _uleb(self.data, q, info_end, what)
                    found[prefix] = address
                p = info_end
            if p >= end:
                raise MachOFormatError(f"{what}: node {node:#x} has no child count")
            children = self.data[p]
            p += 1
            for _ in range(children):
                label_end = self.data.find(b"\0", p, end)
                if label_end < 0:
                    raise MachOFormatError(f"{what}: unterminated edge label")
                label = self.data[p:label_end].decode("utf-8", "replace")
                child, p = _uleb(self.data, label_end + 1, end, what)
                stack.append((child, prefix + label))
        return found

    def exported_names(self) -> tuple[set[str], str]:
        """The exported C names (leading '_' removed) and where they were read from."""
        if self.export_trie is not None:
            names = set(self.trie_exports())
            source = self.export_trie_source
        else:
            names = {s.name for s in self.symbols() if s.exported}
            source = "the symbol table (no export trie)"
        return {n[1:] if n.startswith("_") else n for n in names}, source

    # -------------------------------------------------------------------- reading data
    def image_base(self) -> int:
        for seg in self.segments:
            if seg.fileoff == 0 and seg.filesize > 0:
                return seg.vmaddr
        return 0

    def read_address(self, address: int, size: int, what: str) -> bytes:
        """`size` bytes at virtual address `address`, from the segment holding them."""
        for seg in self.segments:
            if seg.vmaddr <= address and address + size <= seg.vmaddr + seg.filesize:
                start = seg.fileoff + address - seg.vmaddr
                if start + size > len(self.data):
                    raise MachOFormatError(f"{what}: segment {seg.name} runs past the end of the file")
                return self.data[start : start + size]
        raise MachOFormatError(
            f"{what}: address {address:#x} (+{size}) is not in the file part of any segment"
        )

    def read_symbol(self, c_name: str, size: int) -> tuple[bytes, str]:
        """`size` bytes at the exported symbol `c_name` and a description of where they are."""
        mangled = "_" + c_name
        for sym in self.symbols():
            if sym.name == mangled and (sym.type & N_TYPE) == N_SECT and not sym.type & N_STAB:
                if not 1 <= sym.sect <= len(self.sections):
                    raise MachOFormatError(
                        f"{self.arch}: symbol {c_name} names section {sym.sect}, which does not exist"
                    )
                sect = self.sections[sym.sect - 1]
                if sect.zerofill:
                    raise MachOFormatError(f"{self.arch}: symbol {c_name} lies in zero-fill section {sect}")
                rel = sym.value - sect.addr
                if rel < 0 or rel + size > sect.size:
                    raise MachOFormatError(
                        f"{self.arch}: symbol {c_name} at {sym.value:#x} does not hold {size} bytes "
                        f"inside section {sect} ({sect.addr:#x}+{sect.size:#x})"
                    )
                start = sect.offset + rel
                if start + size > len(self.data):
                    raise MachOFormatError(f"{self.arch}: section {sect} runs past the end of the file")
                return self.data[
                    start : start + size
                ], f"section {sect}, file offset {start + self.offset_in_file:#x}"
        exports = self.trie_exports()
        address = exports.get(mangled)
        if address is not None:
            where = self.image_base() + address
            return self.read_address(
                where, size, f"{self.arch}: {c_name}"
            ), f"address {where:#x} (export trie)"
        raise MachOFormatError(f"{self.arch}: no symbol {c_name} is defined")

    # ------------------------------------------------------------------ code signature
    def verify_code_signature(self) -> CodeSignature | None:
        """Check every hash of the embedded signature; None when the slice has none."""
        if self.code_signature is None:
            return None
        dataoff, datasize = self.code_signature
        result = CodeSignature(ok=False)
        problems = result.problems
        if dataoff + datasize > len(self.data):
            problems.append(f"the signature ({dataoff:#x}+{datasize:#x}) runs past the end of the file")
            return result
        blob = self.data[dataoff : dataoff + datasize]
        try:
            magic, length, count = _unpack(">III", blob, 0, "code signature SuperBlob")
            if magic != CSMAGIC_EMBEDDED_SIGNATURE:
                problems.append(
                    f"the signature does not start with an embedded-signature SuperBlob "
                    f"(magic {magic:#x}, expected {CSMAGIC_EMBEDDED_SIGNATURE:#x})"
                )
                return result
            if length > len(blob):
                problems.append(f"the SuperBlob says {length} bytes, but LC_CODE_SIGNATURE holds {len(blob)}")
                return result
            index = [_unpack(">II", blob, 12 + 8 * i, "SuperBlob index entry") for i in range(count)]
            slots = dict(index)
            for slot_type, offset in index:
                if slot_type == CSSLOT_SIGNATURESLOT:
                    result.has_cms = _unpack(">I", blob, offset, "CMS blob")[0] == CSMAGIC_BLOBWRAPPER
            directories = [
                t for t in slots if t == CSSLOT_CODEDIRECTORY or t in CSSLOT_ALTERNATE_CODEDIRECTORIES
            ]
            if CSSLOT_CODEDIRECTORY not in slots:
                problems.append("the signature has no CodeDirectory")
                return result
            for slot_type in sorted(directories):
                self._verify_directory(blob, slots, slots[slot_type], dataoff, result)
            result.code_directories = len(directories)
        except MachOFormatError as exc:
            problems.append(str(exc))
        result.ok = not problems
        return result

    def _verify_directory(
        self, blob: bytes, slots: dict[int, int], offset: int, dataoff: int, result: CodeSignature
    ) -> None:
        problems = result.problems
        (
            magic,
            length,
            version,
            flags,
            hash_offset,
            ident_offset,
            n_special,
            n_code,
            code_limit,
            hash_size,
            hash_type,
            _platform,
            page_log2,
            _spare2,
        ) = _unpack(">IIIIIIIIIBBBBI", blob, offset, "CodeDirectory")
        if magic != CSMAGIC_CODEDIRECTORY:
            problems.append(
                f"CodeDirectory at {offset:#x} has magic {magic:#x}, expected {CSMAGIC_CODEDIRECTORY:#x}"
            )
            return
        cd = blob[offset : offset + length]
        if len(cd) != length:
            problems.append("a CodeDirectory runs past the end of the signature")
            return
        if version >= 0x20300:
            (code_limit64,) = _unpack(">Q", cd, 56, "CodeDirectory codeLimit64")
            if code_limit64:
                code_limit = code_limit64
        if hash_type not in _HASH_TYPES:
            problems.append(f"CodeDirectory hash type {hash_type} is unknown")
            return
        hash_name, expected_size = _HASH_TYPES[hash_type]
        if hash_size != expected_size:
            problems.append(
                f"CodeDirectory hash size {hash_size} does not fit hash type {hash_type} ({hash_name})"
            )
            return
        page_size = 1 << page_log2 if page_log2 else 0
        primary = offset == slots.get(CSSLOT_CODEDIRECTORY)
        if primary:
            result.identifier = _cstring(cd, ident_offset, "CodeDirectory identifier")
            result.adhoc = bool(flags & CS_ADHOC)
            result.linker_signed = bool(flags & CS_LINKER_SIGNED)
            result.hash_name = hash_name + ("/20" if hash_type == 3 else "")
            result.page_size = page_size
            result.code_limit = code_limit
        if code_limit != dataoff:
            problems.append(
                f"the CodeDirectory covers bytes 0..{code_limit:#x}, but the signature starts at "
                f"{dataoff:#x}; every byte before the signature must be hashed"
            )
        if code_limit > len(self.data):
            problems.append(f"the CodeDirectory's codeLimit {code_limit:#x} lies past the end of the file")
            return
        expected_pages = (code_limit + page_size - 1) // page_size if page_size else int(code_limit > 0)
        if n_code != expected_pages:
            problems.append(
                f"the CodeDirectory has {n_code} page hashes, but {code_limit} bytes in pages of "
                f"{page_size} need {expected_pages}"
            )
            return
        if hash_offset - n_special * hash_size < 0 or hash_offset + n_code * hash_size > length:
            problems.append("the CodeDirectory's hash slots lie outside it")
            return
        bad_pages = []
        for i in range(n_code):
            start = i * page_size if page_size else 0
            stop = min(start + page_size, code_limit) if page_size else code_limit
            digest = hashlib.new(hash_name, self.data[start:stop]).digest()[:hash_size]
            stored = cd[hash_offset + i * hash_size : hash_offset + (i + 1) * hash_size]
            if digest != stored:
                bad_pages.append(i)
        if bad_pages:
            shown = ", ".join(
                f"{i} (bytes {i * page_size:#x}..{min((i + 1) * page_size, code_limit):#x})"
                for i in bad_pages[:5]
            )
            more = f" and {len(bad_pages) - 5} more" if len(bad_pages) > 5 else ""
            problems.append(
                f"{len(bad_pages)} of {n_code} page hash(es) do not match the file: page {shown}{more}; "
                "the library was modified after it was signed"
            )
        for slot_type, special in _SPECIAL_SLOTS.items():
            if special > n_special:
                continue
            stored = cd[hash_offset - special * hash_size : hash_offset - (special - 1) * hash_size]
            if slot_type not in slots:
                continue
            blob_offset = slots[slot_type]
            _, blob_length = _unpack(">II", blob, blob_offset, f"signature blob {slot_type}")
            digest = hashlib.new(hash_name, blob[blob_offset : blob_offset + blob_length]).digest()[
                :hash_size
            ]
            if digest != stored:
                problems.append(f"special slot -{special} does not match signature blob {slot_type}")
        if primary:
            result.pages = n_code


def _parse_thin(data: bytes, offset_in_file: int, label: str) -> MachOImage:
    magic, cputype, cpusubtype, filetype, ncmds, sizeofcmds, flags, _reserved = _unpack(
        "<IiiIIIII", data, 0, f"{label}: mach_header_64"
    )
    if magic == MH_MAGIC:
        raise MachOFormatError(f"{label}: a 32-bit Mach-O image; cuvil builds 64-bit libraries only")
    if magic != MH_MAGIC_64:
        raise MachOFormatError(f"{label}: not a Mach-O image (magic {magic:#x})")
    cputype &= 0xFFFFFFFF
    if 32 + sizeofcmds > len(data):
        raise MachOFormatError(f"{label}: load commands ({sizeofcmds} bytes) run past the end of the file")
    commands = []
    segments: list[Segment] = []
    sections: list[Section] = []
    id_dylib = None
    dylibs: list[str] = []
    rpaths: list[str] = []
    symtab = None
    trie = None
    trie_source = ""
    signature = None
    min_os = None
    build_platform = None
    offset = 32
    for i in range(ncmds):
        cmd, cmdsize = _unpack("<II", data, offset, f"{label}: load command {i}")
        if cmdsize < 8 or offset + cmdsize > 32 + sizeofcmds:
            raise MachOFormatError(f"{label}: load command {i} ({cmd:#x}) has a bad size {cmdsize}")
        commands.append((cmd, offset, cmdsize))
        body = data[offset : offset + cmdsize]
        what = f"{label}: load command {i} ({cmd:#x})"
        if cmd == LC_SEGMENT_64:
            segname, vmaddr, vmsize, fileoff, filesize, maxprot, initprot, nsects, seg_flags = _unpack(
                "<16sQQQQIIII", body, 8, what
            )
            segments.append(
                Segment(segname.rstrip(b"\0").decode("ascii", "replace"), vmaddr, vmsize, fileoff, filesize,
                        maxprot, initprot, nsects, seg_flags)
            )
            for j in range(nsects):
                (
                    sectname,
                    sect_segname,
                    addr,
                    size,
                    sect_offset,
                    _align,
                    _reloff,
                    _nreloc,
                    sect_flags,
                    reserved1,
                    reserved2,
                    _r3,
                ) = _unpack("<16s16sQQIIIIIIII", body, 72 + 80 * j, f"{what} section {j}")
                sections.append(
                    Section(
                        len(sections) + 1,
                        sect_segname.rstrip(b"\0").decode("ascii", "replace"),
                        sectname.rstrip(b"\0").decode("ascii", "replace"),
                        addr,
                        size,
                        sect_offset,
                        sect_flags,
                        reserved1,
                        reserved2,
                    )
                )
        elif cmd == LC_SYMTAB:
            symtab = _unpack("<IIII", body, 8, what)
        elif cmd in (LC_DYLD_INFO, LC_DYLD_INFO_ONLY):
            export_off, export_size = _unpack("<II", body, 40, what)
            if export_size:
                trie = (export_off, export_size)
                trie_source = "the export trie of LC_DYLD_INFO_ONLY"
        elif cmd == LC_DYLD_EXPORTS_TRIE:
            trie = _unpack("<II", body, 8, what)
            trie_source = "the export trie of LC_DYLD_EXPORTS_TRIE"
        elif cmd == LC_CODE_SIGNATURE:
            signature = _unpack("<II", body, 8, what)
        elif cmd == LC_ID_DYLIB or cmd in _DEPENDENCY_COMMANDS:
            (name_offset,) = _unpack("<I", body, 8, what)
            name = _cstring(body, name_offset, f"{what} name")
            if cmd == LC_ID_DYLIB:
                id_dylib = name
            else:
                dylibs.append(name)
        elif cmd == LC_BUILD_VERSION:
            build_platform, minos = _unpack("<II", body, 8, what)
            min_os = _version(minos)
        elif cmd == LC_VERSION_MIN_MACOSX:
            (version,) = _unpack("<I", body, 8, what)
            min_os, build_platform = _version(version), PLATFORM_MACOS
        elif cmd == LC_RPATH:
            (path_offset,) = _unpack("<I", body, 8, what)
            rpaths.append(_cstring(body, path_offset, f"{what} path"))
        offset += cmdsize
    return MachOImage(
        data=data,
        offset_in_file=offset_in_file,
        cputype=cputype,
        cpusubtype=cpusubtype & 0xFFFFFFFF,
        filetype=filetype,
        flags=flags,
        commands=commands,
        segments=segments,
        sections=sections,
        id_dylib=id_dylib,
        dylibs=dylibs,
        rpaths=rpaths,
        symtab=symtab,
        export_trie=trie,
        export_trie_source=trie_source,
        code_signature=signature,
        min_os=min_os,
        build_platform=build_platform,
    )


def _version(packed: int) -> tuple[int, int, int]:
    """xxxx.yy.zz packed in nibbles, as load commands store OS versions."""
    return packed >> 16, (packed >> 8) & 0xFF, packed & 0xFF


def is_macho(data: bytes) -> bool:
    head = data[:4]
    return len(head) == 4 and (
        struct.unpack(">I", head)[0] in (FAT_MAGIC, FAT_MAGIC_64)
        or struct.unpack("<I", head)[0] in (MH_MAGIC_64, MH_MAGIC)
    )


def parse_macho(data: bytes, label: str = "Mach-O file") -> tuple[bool, list[MachOImage]]:
    """(is it a universal file, its images): one image for a thin file, one per slice for a fat one."""
    if len(data) < 8:
        raise MachOFormatError(f"{label}: too short for a Mach-O file ({len(data)} bytes)")
    (magic,) = struct.unpack(">I", data[:4])
    if magic not in (FAT_MAGIC, FAT_MAGIC_64):
        return False, [_parse_thin(data, 0, label)]
    (count,) = struct.unpack(">I", data[4:8])
    entry = ">iiIII" if magic == FAT_MAGIC else ">iiQQII"
    entry_size = struct.calcsize(entry)
    if count == 0 or count > 64:
        raise MachOFormatError(f"{label}: a universal file with {count} slices")
    images = []
    for i in range(count):
        fields = _unpack(entry, data, 8 + entry_size * i, f"{label}: fat_arch {i}")
        cputype, _cpusubtype, offset, size, align = fields[:5]
        if offset + size > len(data):
            raise MachOFormatError(
                f"{label}: slice {i} ({offset:#x}+{size:#x}) runs past the end of the file"
            )
        if align > 31 or offset % (1 << align):
            raise MachOFormatError(f"{label}: slice {i} at {offset:#x} is not aligned to 2^{align}")
        image = _parse_thin(data[offset : offset + size], offset, f"{label} slice {i}")
        if image.cputype != cputype & 0xFFFFFFFF:
            raise MachOFormatError(
                f"{label}: slice {i} is listed as cputype {cputype & 0xFFFFFFFF:#x} "
                f"but holds {image.cputype:#x}"
            )
        images.append(image)
    return True, images
