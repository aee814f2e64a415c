"""ABI checksums: the bytes each library exports equal the checksum of the manifest's signature.

The generated package compares the same two values when it is imported; this check does it
statically, for every architecture slice, by reading the symbol's bytes from the file.
"""

from __future__ import annotations

from collections.abc import Sequence

from cuvil.check._archive import CHECKSUM_SIZE, Library
from cuvil.check._elf import ElfFormatError, ElfLibrary
from cuvil.check._macho import MachOFormatError, MachOImage
from cuvil.check._pe import PeFormatError, PeImage
from cuvil.check._report import CheckReport

__all__ = ["check_abi_checksums"]


def check_abi_checksums(
    library: Library, images: Sequence[tuple[str, ElfLibrary | MachOImage | PeImage]],
    report: CheckReport
) -> None:
    """`images`: (arch label, parsed image) for each slice of `library`."""
    from cuvil.runtime import abi_checksum, exported_symbol

    for model in library.models:
        model_name = model.get("name")
        name = f"{library.path}: ABI checksum of {model_name}"
        try:
            expected = abi_checksum(model)
        except (KeyError, TypeError) as exc:
            report.failed(
                name, f"the manifest's signature of {model_name!r} is malformed ({type(exc).__name__}: {exc})"
            )
            continue
        symbol = exported_symbol(str(model_name), "abi_checksum")
        problems, places = [], []
        for arch, image in images:
            try:
                raw, where = image.read_symbol(symbol, CHECKSUM_SIZE)
            except (ElfFormatError, MachOFormatError, PeFormatError) as exc:
                problems.append(f"{arch}: cannot read {symbol}: {exc}")
                continue
            found = raw[:-1].decode("ascii", "replace")
            if raw[-1:] != b"\0":
                problems.append(f"{arch}: {symbol} is not NUL-terminated")
            elif found != expected:
                problems.append(
                    f"{arch}: {symbol} holds {found[:16]}..., but the manifest's signature gives "
                    f"{expected[:16]}...: library and _models.json come from different builds; "
                    "rebuild the wheel"
                )
            else:
                places.append(f"{arch} at {where}")
        if not images:
            problems.append("no readable image")
        if problems:
            report.failed(name, "; ".join(problems))
        else:
            report.passed(name, f"{expected[:16]}... matches ({'; '.join(places)})")
