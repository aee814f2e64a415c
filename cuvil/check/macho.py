"""Mach-O libraries (macOS wheels, thin or universal): slices, their structure as dyld reads it,
install name, exports, code signature."""

from __future__ import annotations

from cuvil.check._archive import Library, WheelArchive
from cuvil.check._macho import CPU_TYPE_ARM64, MH_DYLIB, MachOFormatError, MachOImage, parse_macho
from cuvil.check._macho_structure import structure_problems, universal_problems
from cuvil.check._platform import macos_version, tag_arches
from cuvil.check._report import CheckReport
from cuvil.check._structure import report_structure

__all__ = ["ALLOWED_DYLIBS", "LINKER_SYMBOLS", "check_macho_library"]

# libSystem is on every Mac and is all a cuvil library may link against.
ALLOWED_DYLIBS = ("/usr/lib/libSystem.B.dylib",)
# zig's linker exports these from every dylib (ld64 keeps them private), at a __DATA address of
# the image; harmless for cuvil's libraries: see tests/toolchains/test_macho_linker_symbols.py.
LINKER_SYMBOLS = frozenset({"_mh_dylib_header", "__dso_handle"})
# Apple silicon Macs start at macOS 11: an arm64 slice may require it whatever the tag says.
_ARM64_FIRST_MACOS = (11, 0)


def check_macho_library(wheel: WheelArchive, library: Library, report: CheckReport) -> list[MachOImage]:
    """Run every Mach-O check on `library`; return its images for the ABI check ([] if unreadable)."""
    label = library.path
    try:
        fat, images = parse_macho(library.data, library.file_name)
    except MachOFormatError as exc:
        report.failed(f"{label}: Mach-O slices", str(exc))
        return []
    _slices(wheel, fat, images, label, report)
    _structure(library.data, fat, images, label, report)
    _install_name(library, images, label, report)
    _exports(library, images, label, report)
    _dependencies(images, label, report)
    _deployment_target(wheel, images, label, report)
    _code_signature(images, label, report)
    return images


def _slices(
    wheel: WheelArchive, fat: bool, images: list[MachOImage], label: str, report: CheckReport
) -> None:
    name = f"{label}: Mach-O slices"
    arches = sorted(im.arch for im in images)
    problems = []
    if len(set(arches)) != len(arches):
        problems.append(f"two slices for the same arch: {', '.join(arches)}")
    not_dylib = [im.arch for im in images if im.filetype != MH_DYLIB]
    if not_dylib:
        problems.append(f"slice(s) {', '.join(not_dylib)} are not dynamic libraries (MH_DYLIB)")
    for platform in wheel.platforms:
        wanted = tag_arches(platform)
        if wanted is not None and wanted != set(arches):
            problems.append(
                f"cputypes {', '.join(arches)} do not match platform tag {platform}, which needs "
                f"{' + '.join(sorted(wanted))}"
            )
    kind = f"universal ({len(images)} slices)" if fat else "thin"
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(name, f"{kind}: {', '.join(arches)}, MH_DYLIB")


def _structure(data: bytes, fat: bool, images: list[MachOImage], label: str, report: CheckReport) -> None:
    name = f"{label}: Mach-O structure"
    problems = universal_problems(data, images) if fat else []
    for im in images:
        problems += [f"{im.arch} slice: {p}" for p in structure_problems(im)]
    report_structure(report, name, problems, "dyld would refuse the library or read outside it",
                     "load commands, segments and sections, the link-edit blobs in __LINKEDIT, "
                     "the symbol tables, rebase and bind opcodes and export trie of every slice "
                     "consistent and within it")


def _install_name(library: Library, images: list[MachOImage], label: str, report: CheckReport) -> None:
    name = f"{label}: install name"
    expected = f"@rpath/{library.file_name}"
    wrong = [f"{im.arch}: {im.id_dylib or '(no LC_ID_DYLIB)'}" for im in images if im.id_dylib != expected]
    if wrong:
        report.failed(
            name,
            f"expected {expected} in every slice, found {'; '.join(wrong)} "
            f"(link with -Wl,-install_name,{expected})",
        )
    else:
        report.passed(name, expected)


def _exports(library: Library, images: list[MachOImage], label: str, report: CheckReport) -> None:
    name = f"{label}: exported symbols"
    expected = library.expected_exports()
    problems = []
    sources = set()
    tolerated: set[str] = set()
    for im in images:
        try:
            found, source = im.exported_names()
        except MachOFormatError as exc:  # its message names the slice's arch
            problems.append(str(exc))
            continue
        sources.add(source)
        tolerated |= found & LINKER_SYMBOLS
        found -= LINKER_SYMBOLS
        problems += library.export_problems(found, "every other symbol must be hidden", f"{im.arch} slice ")
    if problems:
        report.failed(name, "; ".join(problems))
        return
    note = f" (and the linker's {', '.join(sorted(tolerated))})" if tolerated else ""
    report.passed(
        name, f"exactly {', '.join(sorted(expected))}{note}, read from {' and '.join(sorted(sources))}"
    )


def _dependencies(images: list[MachOImage], label: str, report: CheckReport) -> None:
    name = f"{label}: dependencies"
    problems = []
    for im in images:
        other = [d for d in im.dylibs if d not in ALLOWED_DYLIBS]
        if other:
            problems.append(
                f"{im.arch} slice links {', '.join(other)}; only {', '.join(ALLOWED_DYLIBS)} is allowed"
            )
        if im.rpaths:
            problems.append(
                f"{im.arch} slice has LC_RPATH {', '.join(map(repr, im.rpaths))}: a wheel's library must not "
                "add search paths"
            )
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        linked = sorted({d for im in images for d in im.dylibs})
        report.passed(name, f"{', '.join(linked) or 'nothing'}; no LC_RPATH")


def _deployment_target(
    wheel: WheelArchive, images: list[MachOImage], label: str, report: CheckReport
) -> None:
    name = f"{label}: macOS version"
    limits = [(v, p) for p in wheel.platforms if (v := macos_version(p)) is not None]
    problems, found = [], []
    for im in images:
        if im.min_os is None:
            problems.append(f"{im.arch} slice has no LC_BUILD_VERSION or LC_VERSION_MIN_MACOSX")
            continue
        text = ".".join(map(str, im.min_os[:2]))
        found.append(f"{im.arch} {text}")
        for version, platform in limits:
            allowed = max(version, _ARM64_FIRST_MACOS) if im.cputype == CPU_TYPE_ARM64 else version
            if im.min_os > (*allowed, 0):  # 10.13.1 does not load on the 10.13.0 the tag allows
                oldest = ".".join(map(str, allowed))
                problems.append(
                    f"{im.arch} slice needs macOS {text}, newer than the {oldest} that tag {platform} "
                    f"promises; build with a zig-target of macOS {oldest}"
                )
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(name, f"minimum macOS: {', '.join(found)}")


def _code_signature(images: list[MachOImage], label: str, report: CheckReport) -> None:
    name = f"{label}: code signature"
    problems, notes = [], []
    for im in images:
        try:
            signature = im.verify_code_signature()
        except MachOFormatError as exc:
            problems.append(f"{im.arch}: {exc}")
            continue
        if signature is None:
            if im.cputype == CPU_TYPE_ARM64:
                problems.append(
                    f"{im.arch} slice has no code signature; macOS refuses to load unsigned arm64 code "
                    "(sign it ad hoc: codesign -s - FILE, or link with zig, which does)"
                )
            else:
                notes.append(f"{im.arch}: unsigned (allowed for x86_64)")
            continue
        if signature.ok:
            notes.append(f"{im.arch}: {signature.summary()}")
        else:
            problems.append(f"{im.arch} slice: invalid code signature: {'; '.join(signature.problems)}")
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(name, "; ".join(notes))
