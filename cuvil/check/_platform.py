"""What a wheel platform tag promises: operating system, architectures, C library and its
oldest version."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "arch_problems", "macos_version", "manylinux_glibc", "musllinux_version", "tag_arches", "tag_libc",
    "tag_os",
]

# legacy manylinux names -> the glibc they stand for (PEP 600)
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(.+)$")
_LEGACY_RE = re.compile(r"^(manylinux1|manylinux2010|manylinux2014)_(.+)$")
_MUSLLINUX = re.compile(r"^musllinux_(\d+)_(\d+)_(.+)$")
_MACOS = re.compile(r"^macosx_(\d+)_(\d+)_(.+)$")
_WINDOWS = re.compile(r"^win_(.+)$")
# tag arch spellings -> cuvil arch names (what toolchain files and ELF/Mach-O headers map to)
_ARCHES = {
    "x86_64": ("x86_64",),
    "amd64": ("x86_64",),
    "aarch64": ("aarch64",),
    "arm64": ("aarch64",),
    "universal2": ("x86_64", "aarch64"),
    "intel": ("i386", "x86_64"),
    "i686": ("i386",),
    "i386": ("i386",),
    "armv7l": ("arm",),
    "ppc64le": ("ppc64le",),
    "s390x": ("s390x",),
    "riscv64": ("riscv64",),
}


def _split(platform: str) -> tuple[str | None, str]:
    """(os, arch spelling) of one platform tag."""
    for pattern, os_name in ((_MANYLINUX, "linux"), (_MUSLLINUX, "linux"), (_MACOS, "macos")):
        m = pattern.match(platform)
        if m:
            return os_name, m.group(3)
    m = _LEGACY_RE.match(platform)
    if m:
        return "linux", m.group(2)
    m = _WINDOWS.match(platform)
    if m:
        return "windows", m.group(1)
    if platform == "win32":
        return "windows", "i386"
    if platform.startswith("linux_"):
        return "linux", platform[len("linux_") :]
    return None, platform


def tag_os(platform: str) -> str | None:
    """ "linux", "macos", "windows", or None for a tag cuvil does not know."""
    return _split(platform)[0]


def tag_arches(platform: str) -> frozenset[str] | None:
    """The architectures a library must hold for this tag (two for universal2), or None if unknown."""
    os_name, arch = _split(platform)
    if os_name is None:
        return None
    arches = _ARCHES.get(arch)
    return frozenset(arches) if arches else frozenset({arch})


def manylinux_glibc(platform: str) -> tuple[int, int] | None:
    """The oldest glibc a manylinux tag promises to run on, or None for other tags."""
    m = _MANYLINUX.match(platform)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = _LEGACY_RE.match(platform)
    if m:
        return _LEGACY[m.group(1)]
    return None


def musllinux_version(platform: str) -> tuple[int, int] | None:
    """The oldest musl a musllinux tag promises to run on, or None for other tags."""
    m = _MUSLLINUX.match(platform)
    return (int(m.group(1)), int(m.group(2))) if m else None


def tag_libc(platform: str) -> str | None:
    """ "glibc" for a manylinux tag, "musl" for a musllinux one, None for others (linux_*
    promises neither)."""
    if manylinux_glibc(platform) is not None:
        return "glibc"
    return "musl" if _MUSLLINUX.match(platform) else None


def macos_version(platform: str) -> tuple[int, int] | None:
    """The oldest macOS a macosx tag promises to run on, or None for other tags."""
    m = _MACOS.match(platform)
    return (int(m.group(1)), int(m.group(2))) if m else None


def arch_problems(platforms: Iterable[str], arch: str, found: str, fix: str = "") -> list[str]:
    """A problem for each platform tag whose architectures are not exactly `arch`; `found`
    says where the file declares it (``e_machine 62 (x86_64)``)."""
    problems = []
    for platform in platforms:
        arches = tag_arches(platform)
        if arches is not None and arches != {arch}:
            problems.append(
                f"{found} does not match platform tag {platform} ({', '.join(sorted(arches))}){fix}"
            )
    return problems
