"""Validation of built wheels before they are published: `check_wheel(path) -> CheckReport`.

Each module checks one concern and adds named results to the report:

- `_archive` ("archive"): the zip is safe to unpack: regular files only, relative paths, no
  setuid bits, no member twice, and sizes, counts and compression ratios within
  `ArchiveLimits`; it is read in bounded memory, so a zip bomb fails this check only;
- `tags`: the file name is `<dist>-<version>-py3-none-<platform>.whl`, and the platform is the
  one of the target recorded in `_models.json`;
- `record`: layout (only the package and the .dist-info), WHEEL, METADATA, RECORD hashes;
- `manifest`: `_models.json` follows the loader's schema (runtime `ModelSignature`), is
  consistent and names every native file;
- `elf` / `macho` / `pe`: each library's structure as its platform's loader reads it (offsets
  and sizes within the file, tables consistent: `_elf_structure`, `_macho_structure`,
  `_pe_structure`), header, exported symbols (exactly the models' C ABI),
  SONAME, install name or DLL name, search paths, dependencies or imports, the C library
  (glibc or musl: the one of the tag) and its versions, macOS versions, Mach-O code
  signatures;
- `abi`: the checksum each library exports matches its signature, read statically per slice;
- `auditwheel`: `auditwheel show` agrees with the manylinux tag (when auditwheel is installed);
- `load` (with `load=True`: `cuvil check --load`, and the build backend): the package imported
  in a fresh interpreter and each model called once, where this machine can run the wheel.

Apart from `load`, nothing is loaded or executed: every architecture can be checked on any
host. A library damaged where no static check looks can still crash at its first call; the
load test is what catches that, on the machines that can run it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cuvil.check._archive import ArchiveLimits, WheelArchive, read_wheel
from cuvil.check._report import CHECK_KINDS, CheckReport, CheckResult
from cuvil.errors import CheckError

if TYPE_CHECKING:
    from cuvil.check._elf import ElfLibrary
    from cuvil.check._macho import MachOImage
    from cuvil.check._pe import PeImage

__all__ = ["CHECK_KINDS", "ArchiveLimits", "CheckReport", "CheckResult", "check_wheel", "read_wheel"]


def check_wheel(
    path: str | Path, *, auditwheel: bool = True, limits: ArchiveLimits | None = None,
    load: bool = False,
) -> CheckReport:
    """Run every check on the wheel at `path`.

    A file that is not a zip archive, or not a safe one within `limits` (see `ArchiveLimits`),
    gives a report with one failed check, "archive". `auditwheel=False` leaves out the (slower,
    subprocess) auditwheel check; `load=True` adds the load test (in a subprocess; skipped
    where this machine cannot run the wheel, or when another check failed).
    """
    from cuvil.check import manifest, record, tags
    from cuvil.check.auditwheel import check_auditwheel

    path = Path(path)
    report = CheckReport(path)
    try:
        wheel = read_wheel(path, limits)
    except CheckError as exc:
        report.failed("archive", str(exc))
        return report
    total = sum(m.size for m in wheel.members.values())
    report.passed("archive", f"{len(wheel.members)} regular files, {total} bytes, within the archive limits")
    tags.check_filename(wheel, report)
    record.check_layout(wheel, report)
    record.check_wheel_file(wheel, report)
    record.check_metadata(wheel, report)
    record.check_record(wheel, report)
    manifest.check_manifest(wheel, report)
    tags.check_platform(wheel, report)
    try:
        _check_libraries(wheel, report)
    except CheckError as exc:  # a library could not be read again
        report.failed("archive", str(exc))
    if auditwheel:
        check_auditwheel(wheel, report)
    if load:
        _check_load(path, report)
    return report


def _check_load(path: Path, report: CheckReport) -> None:
    from cuvil.check.doctor import load_test

    if not report.ok:
        report.skip("load", "not tried: the wheel fails the checks above")
        return
    ok, message = load_test(path)
    if ok is None:
        report.skip("load", message)
    elif ok:
        report.passed("load", message)
    else:
        report.failed("load", message)


def _check_libraries(wheel: WheelArchive, report: CheckReport) -> None:
    from cuvil.check import abi, elf, macho, pe
    from cuvil.check.manifest import native_kind

    for library in wheel.libraries():
        images: list[tuple[str, ElfLibrary | MachOImage | PeImage]]
        kind = native_kind(library.data[:8])
        _check_format(wheel, library.path, kind, report)
        if kind == "elf":
            parsed = elf.check_elf_library(wheel, library, report)
            images = [(parsed.arch, parsed)] if parsed is not None else []
        elif kind == "macho":
            images = [(im.arch, im) for im in macho.check_macho_library(wheel, library, report)]
        elif kind == "coff":
            image = pe.check_pe_library(wheel, library, report)
            images = [(image.arch, image)] if image is not None else []
        else:
            continue
        if images:
            abi.check_abi_checksums(library, images, report)


_FORMATS = {"linux": "elf", "macos": "macho", "windows": "coff"}
_FORMAT_NAMES = {"elf": "ELF", "macho": "Mach-O", "coff": "PE/COFF",
                 None: "neither ELF, Mach-O nor PE/COFF"}


def _check_format(wheel: WheelArchive, path: str, kind: str | None, report: CheckReport) -> None:
    """A Linux tag needs ELF libraries, a macOS tag Mach-O ones, a Windows tag PE/COFF DLLs."""
    from cuvil.check._platform import tag_os

    wanted = {_FORMATS[os] for p in wheel.platforms if (os := tag_os(p)) in _FORMATS}
    if kind is not None and (not wanted or wanted == {kind}):
        return
    expected = " or ".join(sorted(_FORMAT_NAMES[w] for w in wanted)) or "ELF, Mach-O or PE/COFF"
    tags = ", ".join(wheel.platforms) or "(none)"
    report.failed(
        f"{path}: format", f"the library is {_FORMAT_NAMES[kind]}, but platform tag(s) {tags} need {expected}"
    )
