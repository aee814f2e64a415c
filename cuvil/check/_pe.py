"""What the checks read from a PE/COFF DLL (Windows wheels), through pefile, without loading it."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import pefile

from cuvil.errors import CheckError

__all__ = ["PE_MACHINES", "PeFormatError", "PeImage", "is_pe", "read_pe"]

#: IMAGE_FILE_HEADER.Machine -> cuvil arch name (the names _platform.tag_arches uses)
PE_MACHINES = {0x8664: "x86_64", 0xAA64: "aarch64", 0x014C: "i386", 0x01C4: "arm"}
_PE32_PLUS = 0x20B  # OptionalHeader.Magic of a 64-bit image


class PeFormatError(CheckError):
    """The bytes are not a well-formed PE/COFF image."""


def is_pe(data: bytes) -> bool:
    """Whether the file starts like a PE image (the DOS header's "MZ")."""
    return data[:2] == b"MZ"


@dataclass
class PeImage:
    machine: int
    is_dll: bool
    pe32_plus: bool
    dll_name: str | None  # the export directory's name of the DLL
    exported: dict[str, int] = field(default_factory=dict)  # name -> RVA
    forwarded: list[str] = field(default_factory=list)  # exports that name another DLL's symbol
    imports: dict[str, list[str]] = field(default_factory=dict)  # DLL -> imported names
    delay_imports: list[str] = field(default_factory=list)  # DLLs
    sections: list[tuple[str, int, int, int]] = field(default_factory=list)  # name, RVA, raw size, offset
    data: bytes = b""

    @property
    def arch(self) -> str:
        return PE_MACHINES.get(self.machine, f"machine {self.machine:#06x}")

    def read_symbol(self, name: str, size: int) -> tuple[bytes, str]:
        """`size` bytes at the exported symbol `name`: its RVA -> section -> file offset."""
        if name not in self.exported:
            raise PeFormatError(f"no exported symbol {name}")
        rva = self.exported[name]
        for sect_name, start, raw_size, offset in self.sections:
            if start <= rva and rva + size <= start + raw_size:
                at = offset + rva - start
                if at + size > len(self.data):
                    raise PeFormatError(f"section {sect_name} runs past the end of the file")
                return self.data[at : at + size], f"section {sect_name}, file offset {at:#x}"
        raise PeFormatError(f"symbol {name} at RVA {rva:#x} lies in no section's bytes in the file")


def read_pe(data: bytes) -> PeImage:
    try:
        return _read(data)
    except (pefile.PEFormatError, struct.error, ValueError, KeyError, IndexError, AttributeError,
            TypeError) as exc:
        raise PeFormatError(f"not a readable PE file ({type(exc).__name__}: {exc})") from None


def _text(raw: bytes | None) -> str:
    return raw.decode("ascii", "replace") if raw is not None else ""


def _read(data: bytes) -> PeImage:
    pe = pefile.PE(data=data, fast_load=True)
    directories = pefile.DIRECTORY_ENTRY
    pe.parse_data_directories(directories=[directories["IMAGE_DIRECTORY_ENTRY_EXPORT"],
                                           directories["IMAGE_DIRECTORY_ENTRY_IMPORT"],
                                           directories["IMAGE_DIRECTORY_ENTRY_DELAY_IMPORT"]])
    image = PeImage(machine=pe.FILE_HEADER.Machine, is_dll=pe.is_dll(),
                    pe32_plus=pe.OPTIONAL_HEADER.Magic == _PE32_PLUS, dll_name=None, data=data)
    for section in pe.sections:
        name = section.Name.rstrip(b"\0").decode("ascii", "replace")
        image.sections.append((name, section.VirtualAddress, section.SizeOfRawData,
                               section.PointerToRawData))
    exports = getattr(pe, "DIRECTORY_ENTRY_EXPORT", None)
    if exports is not None:
        image.dll_name = _text(pe.get_string_at_rva(exports.struct.Name)) or None
        for symbol in exports.symbols:
            name = _text(symbol.name) or f"#{symbol.ordinal}"  # exported by ordinal only
            if symbol.forwarder:
                image.forwarded.append(name)
            image.exported[name] = symbol.address
    for entry in getattr(pe, "DIRECTORY_ENTRY_IMPORT", []):
        image.imports.setdefault(_text(entry.dll), []).extend(
            _text(i.name) or f"#{i.ordinal}" for i in entry.imports)
    image.delay_imports = [_text(e.dll) for e in getattr(pe, "DIRECTORY_ENTRY_DELAY_IMPORT", [])]
    return image
