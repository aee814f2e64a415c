"""Build the C/C++ sources of custom-op kernels (`[tool.cuvil.custom-ops.<name>]`) for a target.

CMake drives the build, through the zig toolchain file `cmake.write_cmake_toolchain` writes
(so cross targets build from one host): one static library per custom op, compiled with hidden
visibility (the toolchain file's presets), which the model's library links; the kernels stay
internal to it. CMake comes from the `cmake` package of PyPI when installed (the build backend
asks for it when the project declares custom ops and none is found), else from PATH; Ninja
likewise, else make. Targets CMake toolchain files do not cover (Windows), or a machine without
CMake or a build tool, compile each source with zig cc directly, with the same flags.

A failing compile is a BuildError naming the table's `sources` key and the file, with the
compiler's messages.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Optional

from cuvil.config import CustomOpConfig
from cuvil.errors import BuildError, ToolchainError
from cuvil.runtime import CUSTOM_OP_HEADER
from cuvil.toolchains._targets import Arch, Target
from cuvil.toolchains.cmake import write_cmake_toolchain
from cuvil.toolchains.zig import compile_c

__all__ = ["build_custom_ops", "find_build_tool", "find_cmake", "link_libraries"]

Log = Optional[Callable[[str], None]]

_CXX_SUFFIXES = {".cc", ".cpp", ".cxx", ".C"}


def _from_package(module: str, attribute: str, program: str) -> str | None:
    """`program` from the bin folder a PyPI package (cmake, ninja) names, if installed."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        folder = getattr(__import__(module), attribute)
    except (ImportError, AttributeError):
        return None
    path = Path(folder) / program
    return str(path) if path.is_file() else None


def find_cmake() -> str | None:
    return _from_package("cmake", "CMAKE_BIN_DIR", "cmake") or shutil.which("cmake")


def find_build_tool() -> tuple[str, str] | None:
    """(CMake generator, program) for Ninja, else make; None when neither is there."""
    ninja = _from_package("ninja", "BIN_DIR", "ninja") or shutil.which("ninja")
    if ninja:
        return "Ninja", ninja
    make = shutil.which("make")
    return ("Unix Makefiles", make) if make else None


def link_libraries(ops: Sequence[CustomOpConfig]) -> tuple[str, ...]:
    """What the model's library must link for the kernels: zig's libc++ (static) for C++."""
    return ("c++",) if any(p.suffix in _CXX_SUFFIXES for op in ops for p in op.sources) else ()


def build_custom_ops(ops: Sequence[CustomOpConfig], target: Target, workdir: Path,
                     include_dirs: Sequence[Path] = (), log: Log = None) -> dict[str, list[Path]]:
    """Compile every op's sources for each arch of `target`; returns arch name -> the files
    (static libraries or objects) to link into the model's library."""
    say = log or (lambda _msg: None)
    includes = [CUSTOM_OP_HEADER.parent, *include_dirs]
    cmake, tool = find_cmake(), find_build_tool()
    built = {}
    for arch in target.arches:
        folder = Path(workdir) / arch.name
        why_not = ("CMake is not installed" if cmake is None else
                   "neither Ninja nor make is installed" if tool is None else
                   "CMake toolchain files cover Linux and macOS targets only"
                   if arch.os not in ("linux", "macos") else "")
        start = time.perf_counter()
        if why_not:
            say(f"cuvil: custom ops: {why_not}; compiling with zig cc directly for {arch.zig_target}")
            built[arch.name] = _zig_build(ops, arch, folder, includes, log)
        else:
            assert cmake is not None and tool is not None
            built[arch.name] = _cmake_build(ops, target, arch, folder, includes, cmake, tool, log)
        say(f"cuvil: custom ops {', '.join(op.name for op in ops)} built for {arch.zig_target} "
            f"in {time.perf_counter() - start:.1f} s")
    return built


def _cmake_string(path: Path) -> str:
    return '"' + path.as_posix().replace("\\", "\\\\").replace('"', '\\"') + '"'


def _cmake_build(ops: Sequence[CustomOpConfig], target: Target, arch: Arch, folder: Path,
                 includes: Sequence[Path], cmake: str, tool: tuple[str, str], log: Log) -> list[Path]:
    source_dir, build_dir = folder / "src", folder / "build"
    source_dir.mkdir(parents=True, exist_ok=True)
    toolchain = write_cmake_toolchain(target, arch, folder / "toolchain" / f"{arch.name}.cmake")
    cxx = any(p.suffix in _CXX_SUFFIXES for op in ops for p in op.sources)
    lines = ["cmake_minimum_required(VERSION 3.15)",
             f"project(cuvil_custom_ops LANGUAGES C{' CXX' if cxx else ''})"]
    for op in ops:
        dirs = [*includes, *dict.fromkeys(p.parent for p in op.sources)]
        lines += [f"add_library(cuvil_op_{op.name} STATIC "
                  + " ".join(_cmake_string(p) for p in op.sources) + ")",
                  f"target_include_directories(cuvil_op_{op.name} PRIVATE "
                  + " ".join(_cmake_string(d) for d in dirs) + ")"]
    (source_dir / "CMakeLists.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    generator, program = tool
    _run([cmake, "-S", str(source_dir), "-B", str(build_dir), "-G", generator,
          f"-DCMAKE_MAKE_PROGRAM={program}", f"-DCMAKE_TOOLCHAIN_FILE={toolchain}",
          "-DCMAKE_BUILD_TYPE=Release"], ops, arch, log, configure=True)
    _run([cmake, "--build", str(build_dir)], ops, arch, log)
    suffix = ".lib" if arch.os == "windows" else ".a"
    prefix = "" if arch.os == "windows" else "lib"
    return [build_dir / f"{prefix}cuvil_op_{op.name}{suffix}" for op in ops]


def _run(cmd: list[str], ops: Sequence[CustomOpConfig], arch: Arch, log: Log,
         configure: bool = False) -> None:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if log is not None:
        log(f"cuvil: $ {shlex.join(cmd)}  # {time.perf_counter() - start:.2f} s")
    if proc.returncode == 0:
        return
    output = proc.stdout + proc.stderr
    if configure:
        raise BuildError(f"custom ops: configuring the CMake build for {arch.zig_target} failed "
                         f"(exit code {proc.returncode}).\ncommand: {shlex.join(cmd)}\n"
                         f"{output.strip()[-6000:]}")
    raise _compile_error(ops, arch, _diagnostics(output))


def _diagnostics(output: str) -> str:
    """The compiler's messages in a build tool's output, without progress and command lines."""
    kept = [line for line in output.splitlines()
            if not re.match(r"\s*(\[\s*\d+%?\]|\[\d+/\d+\]|FAILED:|ninja:|gmake|make(\[\d+\])?:|"
                            r"Consolidate compiler|Scanning|Building|Linking)", line)
            and " -c " not in line]
    return "\n".join(kept).strip()[-6000:] or output.strip()[-6000:]


def _compile_error(ops: Sequence[CustomOpConfig], arch: Arch, messages: str) -> BuildError:
    """An error naming the table and the source files the compiler's messages point at."""
    failing = [(op, p) for op in ops for p in op.sources if p.name in messages]
    if not failing:
        failing = [(op, p) for op in ops for p in op.sources]
    tables = ", ".join(dict.fromkeys(f"tool.cuvil.custom-ops.{op.name}.sources" for op, _ in failing))
    files = ", ".join(str(p) for _, p in failing)
    return BuildError(f"{tables}: compiling {files} for {arch.zig_target} failed:\n{messages}\n"
                      "Fix the source; it is compiled as C (C++ for .cc, .cpp, .cxx) with "
                      "cuvil_op.h on the include path.")


def _zig_build(ops: Sequence[CustomOpConfig], arch: Arch, folder: Path, includes: Sequence[Path],
               log: Log) -> list[Path]:
    objects = []
    for op in ops:
        dirs = [*includes, *dict.fromkeys(p.parent for p in op.sources)]
        for i, source in enumerate(op.sources):
            output = folder / f"{op.name}.{i}.{source.stem}.o"
            try:
                objects.append(compile_c(source, output, arch, include_dirs=dirs, opt="-O3",
                                         defines={"NDEBUG": None}, log=log))
            except ToolchainError as exc:
                text = str(exc)
                messages = text.split("\n", 2)[2] if text.count("\n") >= 2 else text
                raise _compile_error([op], arch, messages) from None
    return objects
