"""PE/COFF DLLs (Windows wheels): header and machine, the structure the Windows loader reads,
exported symbols, DLL name, imports."""

from __future__ import annotations

import re

from cuvil.check._archive import Library, WheelArchive
from cuvil.check._pe import PeFormatError, PeImage, read_pe
from cuvil.check._pe_structure import structure_problems
from cuvil.check._platform import arch_problems
from cuvil.check._report import CheckReport
from cuvil.check._structure import report_structure

__all__ = ["ALLOWED_IMPORTS", "check_pe_library"]

#: what every Windows 10 has, and all a cuvil DLL may import: KERNEL32 and the Universal C
#: Runtime (its API sets, which all are version l1-1-0, or ucrtbase itself), or the older msvcrt;
#: a set of another name is one no Windows has, and the DLL would not load
ALLOWED_IMPORTS = re.compile(
    r"^(kernel32|ucrtbase|msvcrt|api-ms-win-crt-(conio|convert|environment|filesystem|heap|locale|math"
    r"|multibyte|private|process|runtime|stdio|string|time|utility)-l1-1-0)\.dll$", re.I)
_ALLOWED_TEXT = "KERNEL32.dll and the C runtime (api-ms-win-crt-*.dll, ucrtbase.dll, msvcrt.dll)"


def check_pe_library(wheel: WheelArchive, library: Library, report: CheckReport) -> PeImage | None:
    """Run every PE check on `library`; return the parsed file for the ABI check (None if unreadable)."""
    label = library.path
    image: PeImage | None = None
    try:
        image = read_pe(library.data)
    except PeFormatError as exc:
        report.failed(f"{label}: PE header", str(exc))
    if image is not None:
        _header(wheel, image, label, report)
    # pefile accepts many damaged files: the loader's path is walked on its own
    report_structure(report, f"{label}: PE structure", structure_problems(library.data),
                     "the Windows loader would refuse the DLL or read outside it",
                     "headers, section table, data directories, exports, imports, base "
                     "relocations, exception, TLS and debug tables consistent and within the "
                     "file and the image")
    if image is None:
        return None
    _exports(library, image, label, report)
    _dll_name(library, image, label, report)
    _imports(image, label, report)
    return image


def _header(wheel: WheelArchive, image: PeImage, label: str, report: CheckReport) -> None:
    name = f"{label}: PE header"
    problems = []
    if not image.is_dll:
        problems.append("IMAGE_FILE_DLL is not set: the file is an executable, not a DLL")
    if not image.pe32_plus:
        problems.append("the optional header is PE32, expected PE32+ (a 64-bit image)")
    problems += arch_problems(
        wheel.platforms, image.arch, f"Machine {image.machine:#06x} ({image.arch})",
        ": rebuild for the target of that tag",
    )
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(name, f"PE32+ DLL for {image.arch} (Machine {image.machine:#06x})")


def _exports(library: Library, image: PeImage, label: str, report: CheckReport) -> None:
    name = f"{label}: exported symbols"
    found = set(image.exported)
    parts = library.export_problems(
        found,
        "a DLL must export only those (mark nothing else __declspec(dllexport); with no "
        "dllexport at all, MinGW linkers export every symbol)",
    )
    if image.forwarded:
        parts.append(f"forwards {', '.join(sorted(image.forwarded))} to another DLL")
    if parts:
        report.failed(name, "; ".join(parts))
    else:
        report.passed(name, f"exactly {', '.join(sorted(found))}")


def _dll_name(library: Library, image: PeImage, label: str, report: CheckReport) -> None:
    name = f"{label}: DLL name"
    if image.dll_name is None:
        report.failed(name, "no export directory, so no DLL name")
    elif image.dll_name.lower() != library.file_name.lower():
        report.failed(name, f"the export directory names {image.dll_name}, but the file is "
                            f"{library.file_name}: link it under its own file name")
    else:
        report.passed(name, image.dll_name)


def _imports(image: PeImage, label: str, report: CheckReport) -> None:
    name = f"{label}: imports"
    other = sorted(d for d in image.imports if not ALLOWED_IMPORTS.match(d))
    problems = []
    if other:
        problems.append(f"imports from {', '.join(other)}; a cuvil DLL may import only {_ALLOWED_TEXT} "
                        "(link other libraries statically)")
    if image.delay_imports:
        problems.append(f"delay-loads {', '.join(image.delay_imports)}")
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(name, ", ".join(sorted(image.imports)) or "nothing")
