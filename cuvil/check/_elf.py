"""What the checks read from an ELF shared library, through pyelftools, without loading it."""

from __future__ import annotations

import io
import re
import struct
from dataclasses import dataclass, field

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection
from elftools.elf.sections import SymbolTableSection
from elftools.elf.segments import InterpSegment

from cuvil.errors import CheckError

__all__ = ["E_MACHINES", "ElfFormatError", "ElfLibrary", "read_elf"]

# e_machine -> cuvil arch name (the names _platform.tag_arches uses)
E_MACHINES = {
    "EM_X86_64": "x86_64",
    "EM_AARCH64": "aarch64",
    "EM_386": "i386",
    "EM_ARM": "arm",
    "EM_PPC64": "ppc64le",
    "EM_S390": "s390x",
    "EM_RISCV": "riscv64",
}
_GLIBC = re.compile(r"^GLIBC_(\d+)\.(\d+)(?:\.(\d+))?$")
#: dynamic tags holding a string: (list of ElfLibrary to fill, attribute of the tag)
_DYNAMIC_STRINGS = {
    "DT_NEEDED": ("needed", "needed"),
    "DT_SONAME": ("sonames", "soname"),
    "DT_RPATH": ("rpaths", "rpath"),
    "DT_RUNPATH": ("runpaths", "runpath"),
}
_EXPORTED_BINDS = {"STB_GLOBAL", "STB_WEAK", "STB_GNU_UNIQUE", "STB_LOOS"}
_EXPORTED_VISIBILITY = {"STV_DEFAULT", "STV_PROTECTED"}


class ElfFormatError(CheckError):
    """The bytes are not a well-formed ELF shared library."""


@dataclass
class ElfLibrary:
    elfclass: int
    little_endian: bool
    e_type: str
    e_machine: str
    needed: list[str] = field(default_factory=list)
    sonames: list[str] = field(default_factory=list)
    rpaths: list[str] = field(default_factory=list)
    runpaths: list[str] = field(default_factory=list)
    exported: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (value, size)
    version_needs: dict[str, list[str]] = field(default_factory=dict)  # library -> version names
    interpreter: str | None = None  # PT_INTERP: the dynamic loader, which names the libc
    sections: list[tuple[str, int, int, int, str]] = field(
        default_factory=list
    )  # name, addr, size, offset, type
    data: bytes = b""

    @property
    def arch(self) -> str:
        return E_MACHINES.get(self.e_machine, self.e_machine)

    def glibc_versions(self) -> list[tuple[tuple[int, ...], str]]:
        """Every GLIBC_x.y[.z] version the library requires, parsed, with its name."""
        out = []
        for names in self.version_needs.values():
            for name in names:
                m = _GLIBC.match(name)
                if m:
                    out.append((tuple(int(g) for g in m.groups() if g is not None), name))
        return sorted(out)

    def read_symbol(self, name: str, size: int) -> tuple[bytes, str]:
        """`size` bytes at the exported symbol `name`: symbol value -> section -> file offset."""
        if name not in self.exported:
            raise ElfFormatError(f"no exported symbol {name}")
        value, sym_size = self.exported[name]
        if sym_size != size:
            raise ElfFormatError(f"symbol {name} has size {sym_size}, expected {size}")
        for sect_name, addr, sect_size, offset, sect_type in self.sections:
            if addr and addr <= value and value + size <= addr + sect_size:
                if sect_type == "SHT_NOBITS":
                    raise ElfFormatError(f"symbol {name} lies in {sect_name}, which has no bytes in the file")
                start = offset + value - addr
                if start + size > len(self.data):
                    raise ElfFormatError(f"section {sect_name} runs past the end of the file")
                return self.data[start : start + size], f"section {sect_name}, file offset {start:#x}"
        raise ElfFormatError(f"symbol {name} at {value:#x} lies in no section of the file")


def read_elf(data: bytes) -> ElfLibrary:
    try:
        return _read(data)
    except (ELFError, struct.error, ValueError, KeyError, IndexError, AttributeError,
            OverflowError, TypeError) as exc:  # pyelftools seeks wherever a field points
        raise ElfFormatError(f"not a readable ELF file ({type(exc).__name__}: {exc})") from None


def _read(data: bytes) -> ElfLibrary:
    elf = ELFFile(io.BytesIO(data))
    lib = ElfLibrary(
        elfclass=elf.elfclass,
        little_endian=elf.little_endian,
        e_type=str(elf.header.e_type),
        e_machine=str(elf.header.e_machine),
        data=data,
    )
    dynamic_found = False
    for segment in elf.iter_segments():
        if isinstance(segment, InterpSegment):
            lib.interpreter = segment.get_interp_name()
    for section in elf.iter_sections():
        lib.sections.append(
            (section.name, section["sh_addr"], section["sh_size"], section["sh_offset"], section["sh_type"])
        )
        if isinstance(section, DynamicSection) and section["sh_type"] == "SHT_DYNAMIC":
            dynamic_found = True
            for tag in section.iter_tags():
                field = _DYNAMIC_STRINGS.get(tag.entry.d_tag)
                if field is not None:
                    # pyelftools sets the string as an attribute named after the tag's kind
                    getattr(lib, field[0]).append(getattr(tag, field[1]))
        elif isinstance(section, SymbolTableSection) and section["sh_type"] == "SHT_DYNSYM":
            for sym in section.iter_symbols():
                if (
                    sym["st_shndx"] != "SHN_UNDEF"
                    and sym["st_info"]["bind"] in _EXPORTED_BINDS
                    and sym["st_other"]["visibility"] in _EXPORTED_VISIBILITY
                    and sym.name
                ):
                    lib.exported[sym.name] = (sym["st_value"], sym["st_size"])
        elif isinstance(section, GNUVerNeedSection):
            for verneed, auxiliaries in section.iter_versions():
                lib.version_needs.setdefault(str(verneed.name), []).extend(aux.name for aux in auxiliaries)
    if not dynamic_found:
        raise ElfFormatError("it has no dynamic section: not a shared library")
    return lib
