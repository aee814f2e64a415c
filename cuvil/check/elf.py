"""ELF libraries (Linux wheels): header, exported symbols, SONAME, search paths, dependencies, the C
library (glibc or musl, the one the tag names) and glibc versions."""

from __future__ import annotations

from cuvil.check._archive import Library, WheelArchive
from cuvil.check._elf import ElfFormatError, ElfLibrary, read_elf
from cuvil.check._elf_structure import structure_problems
from cuvil.check._platform import arch_problems, manylinux_glibc, tag_libc
from cuvil.check._report import CheckReport
from cuvil.check._structure import report_structure

__all__ = ["ALLOWED_NEEDED", "GLIBC_NEEDED", "MUSL_NEEDED", "check_elf_library"]

# What every manylinux system has, and all a cuvil library may need.
GLIBC_NEEDED = ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2")
# musl is one library (libc, libm, pthreads and the dynamic loader): what musllinux allows
MUSL_NEEDED = ("libc.so",)
ALLOWED_NEEDED = GLIBC_NEEDED + MUSL_NEEDED


def check_elf_library(wheel: WheelArchive, library: Library, report: CheckReport) -> ElfLibrary | None:
    """Run every ELF check on `library`; return the parsed file for the ABI check (None if unreadable)."""
    label = library.path
    try:
        elf = read_elf(library.data)
    except ElfFormatError as exc:
        report.failed(f"{label}: ELF header", str(exc))
        return None
    _header(wheel, elf, label, report)
    if elf.elfclass == 64 and elf.little_endian:
        report_structure(report, f"{label}: ELF structure", structure_problems(library.data),
                         "the dynamic loader would read outside the file or the image, or crash",
                         "program headers, dynamic table, symbol, string, hash and relocation "
                         "tables consistent and within the file")
    _exports(library, elf, label, report)
    _soname(library, elf, label, report)
    _search_paths(elf, label, report)
    _needed(elf, label, report)
    _libc(wheel, elf, label, report)
    _glibc(wheel, elf, label, report)
    return elf


def _header(wheel: WheelArchive, elf: ElfLibrary, label: str, report: CheckReport) -> None:
    name = f"{label}: ELF header"
    problems = []
    if elf.elfclass != 64 or not elf.little_endian:
        problems.append(
            f"ELF{elf.elfclass} {'little' if elf.little_endian else 'big'}-endian, "
            "expected ELF64 little-endian"
        )
    if elf.e_type != "ET_DYN":
        problems.append(f"e_type is {elf.e_type}, expected ET_DYN (a shared library)")
    problems += arch_problems(wheel.platforms, elf.arch, f"e_machine {elf.e_machine} ({elf.arch})")
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(name, f"ELF64 shared library for {elf.arch} ({elf.e_machine})")


def _exports(library: Library, elf: ElfLibrary, label: str, report: CheckReport) -> None:
    name = f"{label}: exported symbols"
    found = set(elf.exported)
    problems = library.export_problems(
        found, "every other symbol must be hidden (link with -fvisibility=hidden)"
    )
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(name, f"exactly {', '.join(sorted(found))}")


def _soname(library: Library, elf: ElfLibrary, label: str, report: CheckReport) -> None:
    name = f"{label}: SONAME"
    if elf.sonames == [library.file_name]:
        report.passed(name, f"DT_SONAME is {library.file_name}")
    elif not elf.sonames:
        report.failed(
            name, f"no DT_SONAME; expected {library.file_name} (link with -Wl,-soname,{library.file_name})"
        )
    else:
        report.failed(
            name,
            f"DT_SONAME is {', '.join(elf.sonames)}, expected the file name {library.file_name}: "
            "the dynamic loader would look for another file",
        )


def _search_paths(elf: ElfLibrary, label: str, report: CheckReport) -> None:
    name = f"{label}: RPATH/RUNPATH"
    found = [f"DT_RPATH {p!r}" for p in elf.rpaths] + [f"DT_RUNPATH {p!r}" for p in elf.runpaths]
    if found:
        report.failed(
            name,
            f"has {', '.join(found)}: a wheel's library must not make the loader search other folders "
            "(it depends on no library outside the system)",
        )
    else:
        report.passed(name, "none")


def _needed(elf: ElfLibrary, label: str, report: CheckReport) -> None:
    name = f"{label}: DT_NEEDED"
    other = [n for n in elf.needed if n not in ALLOWED_NEEDED]
    if other:
        report.failed(
            name,
            f"depends on {', '.join(other)}; a cuvil library may need only {', '.join(ALLOWED_NEEDED)}",
        )
    else:
        report.passed(name, ", ".join(elf.needed) or "no dependencies")


def _libc_evidence(elf: ElfLibrary) -> dict[str, list[str]]:
    """What ties the library to glibc or to musl: its DT_NEEDED, versioned glibc symbols and
    PT_INTERP (a shared library rarely has one; when it does, it is that libc's loader)."""
    found: dict[str, list[str]] = {"glibc": [], "musl": []}
    for needed in elf.needed:
        if needed in GLIBC_NEEDED:
            found["glibc"].append(f"DT_NEEDED {needed}")
        elif needed in MUSL_NEEDED:
            found["musl"].append(f"DT_NEEDED {needed}")
    versions = elf.glibc_versions()
    if versions:
        found["glibc"].append(f"versioned symbols up to {versions[-1][1]}")
    if elf.interpreter:
        kind = "musl" if "ld-musl-" in elf.interpreter else "glibc"
        found[kind].append(f"PT_INTERP {elf.interpreter}")
    return found


def _libc(wheel: WheelArchive, elf: ElfLibrary, label: str, report: CheckReport) -> None:
    name = f"{label}: libc"
    found = _libc_evidence(elf)
    wanted = {libc: p for p in wheel.platforms if (libc := tag_libc(p)) is not None}
    problems = []
    for libc, platform in sorted(wanted.items()):
        other = "musl" if libc == "glibc" else "glibc"
        if found[other]:
            fix = ("x86_64-linux-musl or aarch64-linux-musl" if libc == "musl"
                   else "x86_64-linux or aarch64-linux")
            problems.append(f"the library is linked against {other} ({', '.join(found[other])}), but "
                            f"tag {platform} is for {libc} systems, where it would not load; build "
                            f"it for a {libc} target ({fix})")
    if len(wanted) > 1:
        problems.append(f"tags {', '.join(sorted(wanted.values()))} promise both glibc and musl")
    if problems:
        report.failed(name, "; ".join(problems))
        return
    linked = [f"{libc} ({', '.join(ev)})" for libc, ev in found.items() if ev]
    report.passed(name, ", ".join(linked) or "needs no C library")


def _glibc(wheel: WheelArchive, elf: ElfLibrary, label: str, report: CheckReport) -> None:
    name = f"{label}: glibc versions"
    versions = elf.glibc_versions()
    limits = [(limit, p) for p in wheel.platforms if (limit := manylinux_glibc(p)) is not None]
    private = sorted(n for names in elf.version_needs.values() for n in names if n == "GLIBC_PRIVATE")
    if private:
        report.failed(name, "needs GLIBC_PRIVATE symbols, which no manylinux policy allows")
        return
    if not limits:
        report.passed(
            name,
            "no manylinux tag to hold to; needs "
            + (versions[-1][1] if versions else "no versioned glibc symbols"),
        )
        return
    if not versions:
        report.passed(name, "no versioned glibc symbols")
        return
    newest, newest_name = versions[-1]
    for (major, minor), platform in limits:
        if newest[:2] > (major, minor):
            too_new = sorted({n for v, n in versions if v[:2] > (major, minor)})
            report.failed(
                name,
                f"needs {', '.join(too_new)}, newer than glibc {major}.{minor} that tag {platform} promises; "
                f"build for the target's zig-target with glibc {major}.{minor} "
                f"(e.g. x86_64-linux-gnu.{major}.{minor})",
            )
            return
    report.passed(name, f"newest required is {newest_name}, within {', '.join(p for _, p in limits)}")
