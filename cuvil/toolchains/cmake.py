"""CMake toolchain files that build native custom-op sources with cuvil's zig, for any target.

`write_cmake_toolchain` writes `<path>` plus small compiler wrapper scripts next to it
(`<stem>-cc`, `<stem>-c++`, `<stem>-ar`, `<stem>-ranlib`), each running
`<zig from the ziglang package> <tool> -target <zig target>`. Pass the file to CMake (or scikit-build-core)
with `-DCMAKE_TOOLCHAIN_FILE=<path>`.
"""

from __future__ import annotations

import os
import shlex
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from cuvil.errors import ToolchainError
from cuvil.toolchains._targets import Arch, Target, _host_os_arch
from cuvil.toolchains.zig import zig_command, zig_mcpu

__all__ = ["write_cmake_toolchain"]

_SYSTEM_NAMES = {"linux": "Linux", "macos": "Darwin"}


def _cmake_str(value: str | Path) -> str:
    text = str(value).replace("\\", "/") if os.name == "nt" else str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def _write_wrapper(
    path: Path, argv: list[str], compile_only: Sequence[str] = (), link_only: Sequence[str] = ()
) -> Path:
    """A script running `argv "$@"`; `compile_only` flags when compiling (-c), else `link_only`.

    zig builds and caches its libc stubs and compiler-rt per cpu and build mode, so links
    use the same baseline cpu and -O2 as `link_shared` (later user flags still win); this
    keeps CMake's first configure from paying another slow first link.
    """
    if os.name == "nt":
        path = path.with_suffix(".cmd")
        line = " ".join(f'"{a}"' for a in [*argv, *compile_only]) + " %*"
        text = f"@echo off\r\n{line}\r\n"
    else:
        cmd = " ".join(shlex.quote(a) for a in argv)
        text = "#!/bin/sh\n# Written by cuvil: runs zig from the ziglang Python package.\n"
        if compile_only or link_only:
            extra = " ".join(shlex.quote(a) for a in compile_only)
            text += 'for arg in "$@"; do\n  if [ "$arg" = "-c" ]; then\n'
            text += f'    exec {cmd} {extra} "$@"\n  fi\ndone\n'
        link = " ".join(shlex.quote(a) for a in [*argv, *link_only])
        text += f'exec {link} "$@"\n'
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    mode = tmp.stat().st_mode
    tmp.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, path)
    return path


def write_cmake_toolchain(target: Target, arch: Arch, path: Path) -> Path:
    """Write a CMake toolchain file for one `arch` of `target`; returns `path`.

    For a universal2 target, configure one build per arch and fuse the libraries with
    `cuvil.toolchains.zig.fuse_universal`.
    """
    path = Path(path).absolute()
    if arch not in target.arches:
        raise ToolchainError(f"arch {arch.name!r} is not part of target {target.name} ({target.source})")
    system = _SYSTEM_NAMES.get(arch.os)
    if system is None:
        raise ToolchainError(
            f"target {target.name} ({target.source}): no CMake system name for {arch.llvm_triple!r}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    zig = zig_command()
    flags = ["-target", arch.zig_target]
    mcpu = zig_mcpu(arch)
    # zig cc (unlike clang) turns UBSan on when no -O is given; its runtime is not linked
    # into release builds, so keep it off unless asked for (a later -fsanitize wins).
    compile_flags = [*([f"-mcpu={mcpu}"] if mcpu else []), "-fno-sanitize=undefined"]
    link_flags = ["-O2"]
    stem = path.stem
    cc = _write_wrapper(path.with_name(f"{stem}-cc"), [*zig, "cc", *flags], compile_flags, link_flags)
    cxx = _write_wrapper(path.with_name(f"{stem}-c++"), [*zig, "c++", *flags], compile_flags, link_flags)
    ar = _write_wrapper(path.with_name(f"{stem}-ar"), [*zig, "ar"])
    ranlib = _write_wrapper(path.with_name(f"{stem}-ranlib"), [*zig, "ranlib"])
    cross = _host_os_arch() != (arch.os, arch.name)
    # CMake calls aarch64 "arm64" on Darwin; elsewhere the usual uname spelling.
    processor = "arm64" if (arch.os == "macos" and arch.name == "aarch64") else arch.name
    lines = [
        f"# CMake toolchain file written by cuvil for target {target.name}, arch {arch.name}",
        f"# ({arch.zig_target}; from {target.source.name}). Compilers are zig via the ziglang package.",
        f"set(CMAKE_SYSTEM_NAME {system})",
        f"set(CMAKE_SYSTEM_PROCESSOR {processor})",
        f"set(CMAKE_C_COMPILER {_cmake_str(cc)})",
        f"set(CMAKE_CXX_COMPILER {_cmake_str(cxx)})",
        f'set(CMAKE_AR {_cmake_str(ar)} CACHE FILEPATH "archiver")',
        f'set(CMAKE_RANLIB {_cmake_str(ranlib)} CACHE FILEPATH "ranlib")',
        # Try-compiles build static libraries: no link, so no slow first zig link at configure.
        "set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)",
        "set(CMAKE_POSITION_INDEPENDENT_CODE ON)",
        "set(CMAKE_C_VISIBILITY_PRESET hidden)",
        "set(CMAKE_CXX_VISIBILITY_PRESET hidden)",
        "set(CMAKE_VISIBILITY_INLINES_HIDDEN ON)",
        "set(CUVIL_TARGET " + _cmake_str(target.name) + ")",
        "set(CUVIL_ARCH " + _cmake_str(arch.name) + ")",
        "set(CUVIL_LIBRARY_SUFFIX " + _cmake_str(target.library_suffix) + ")",
    ]
    if system == "Darwin":
        # zig's -target already fixes arch and minimum macOS; keep CMake from adding -arch/-isysroot.
        lines += [
            'set(CMAKE_OSX_ARCHITECTURES "" CACHE STRING "")',
            'set(CMAKE_OSX_SYSROOT "" CACHE STRING "")',
        ]
    if cross:
        lines += [
            "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)",
            "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
            "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)",
            "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)",
        ]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


if __name__ == "__main__":  # pragma: no cover - manual use: python -m cuvil.toolchains.cmake TARGET OUT
    from cuvil.toolchains import get_target

    t = get_target(sys.argv[1] if len(sys.argv) > 1 else None)
    out = Path(sys.argv[2] if len(sys.argv) > 2 else f"{t.name}.cmake")
    print(write_cmake_toolchain(t, t.arches[0], out))
