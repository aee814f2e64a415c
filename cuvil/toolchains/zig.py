"""The zig driver: compile C, embed binary blobs, link shared libraries, fuse universal Mach-O.

zig always comes from the `ziglang` wheel (its binary, as `python -m ziglang` runs it), never a
system compiler, so a model build needs nothing but Python packages. Every output is written to a temporary
file next to it and renamed into place, so a failed step never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable, Optional

from cuvil.errors import ToolchainError
from cuvil.toolchains._targets import AARCH64_CPU_FLAGS, Arch, Target, _host_os_arch, cpu_flag_table

__all__ = [
    "FatSlice",
    "compile_c",
    "cpu_flags",
    "embed_blob",
    "fuse_universal",
    "link_library",
    "link_shared",
    "read_universal",
    "zig_command",
    "zig_mcpu",
]

Log = Optional[Callable[[str], None]]

_CXX_SUFFIXES = {".cc", ".cpp", ".cxx", ".c++", ".C"}
_SYMBOL_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_warned_first_link: set[str] = set()


# ------------------------------------------------------------------------------ running


@cache
def zig_command() -> list[str]:
    """The argv prefix that runs zig from the `ziglang` package: its binary, which the
    package's `python -m ziglang` would exec, started directly to spare a Python start-up
    per step (two per model compile); `-m ziglang` if the binary is not where it should be."""
    spec = importlib.util.find_spec("ziglang")
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError(
            f"the 'ziglang' package is not installed for {sys.executable}; "
            "install it with: python -m pip install ziglang"
        )
    binary = Path(next(iter(spec.submodule_search_locations))) / ("zig.exe" if os.name == "nt" else "zig")
    if binary.is_file() and os.access(binary, os.X_OK):
        return [str(binary)]
    return [sys.executable, "-m", "ziglang"]


def _run(
    args: Sequence[str], what: str, cwd: Path | None = None, log: Log = None
) -> subprocess.CompletedProcess[str]:
    """Run zig; `log` gets the exact command line with its duration, as "cuvil: $ ..." (the
    build backend shows these lines with its verbose setting only)."""
    cmd = [*zig_command(), *map(str, args)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, errors="replace")
    except OSError as exc:
        raise ToolchainError(f"{what} failed: cannot run {shlex.join(cmd)}: {exc}") from None
    _log(log, f"cuvil: $ {shlex.join(cmd)}  # {time.perf_counter() - start:.2f} s")
    if proc.returncode != 0:
        output = (proc.stderr.strip() or proc.stdout.strip() or "(no output)")[-6000:]
        raise ToolchainError(
            f"{what} failed (zig exit code {proc.returncode}).\ncommand: {shlex.join(cmd)}\n{output}"
        )
    return proc


@contextlib.contextmanager
def _atomic_output(output: Path) -> Iterator[Path]:
    """A temp path with `output`'s file name, in a fresh folder next to it, moved into place
    on success. The name must stay the same: zig records it (Mach-O code signatures use it
    as their identifier), so a temp name would make builds differ."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        # Not created here: zig then makes the file with its usual permissions.
        tmp = folder / output.name
        yield tmp
        os.replace(tmp, output)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _log(log: Log, message: str) -> None:
    if log is not None:
        log(message)


# ---------------------------------------------------------------------------- cpu names


@cache
def _zig_cpu_table() -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]]]:
    """zig's known cpu and feature names per zig arch, from `zig targets` ({} if unreadable)."""
    try:
        text = _run(["targets"], "zig targets").stdout
    except ToolchainError:
        return {}, {}
    try:  # older zig printed JSON
        data = json.loads(text)
        cpus = {a: frozenset(c) for a, c in data.get("cpus", {}).items()}
        feats = {a: frozenset(f) for a, f in data.get("cpuFeatures", {}).items()}
        return cpus, feats
    except ValueError:
        pass
    # zig 0.14+ prints ZON: `.cpus = .{ .arch = .{ .cpu = .{ "feature", ... }, ... }, ... }`
    cpus_: dict[str, set[str]] = {}
    feats_: dict[str, set[str]] = {}
    section = None
    arch = None
    for line in text.splitlines():
        m = re.match(r"^    \.(\w+) = \.\{", line)
        if m:
            section, arch = m.group(1), None
            continue
        m = re.match(r'^        \.@?"?([\w.]+)"? = \.\{', line)
        if m:
            arch = m.group(1)
            continue
        if arch is None:
            continue
        if section == "cpus":
            m = re.match(r'^            \.@?"?([\w.]+)"? = \.\{', line)
            if m:
                cpus_.setdefault(arch, set()).add(m.group(1))
        elif section == "cpu_features":
            m = re.match(r'^            "([\w.]+)",', line)
            if m:
                feats_.setdefault(arch, set()).add(m.group(1))
    return (
        {a: frozenset(c) for a, c in cpus_.items()},
        {a: frozenset(f) for a, f in feats_.items()},
    )


def _zig_name(llvm_name: str) -> str:
    return llvm_name.replace("-", "_").replace(".", "_")


def zig_mcpu(arch: Arch) -> str | None:
    """The `-mcpu=` value zig understands for `arch.cpu`/`arch.features`, or None to omit it.

    LLVM names map to zig's by '-'/'.' -> '_' (x86-64-v2 -> x86_64_v2, apple-m1 -> apple_m1,
    +fp-armv8 -> +fp_armv8). Names zig does not know are dropped rather than failing: the C
    runtime only needs a correct baseline, the model code gets its cpu from LLVM directly.
    """
    zig_arch = arch.zig_target.split("-", 1)[0]
    if arch.cpu == "native":
        host = _host_os_arch()
        return "native" if host == (arch.os, arch.name) else None
    cpus, feats = _zig_cpu_table()
    known_cpus = cpus.get(zig_arch)
    known_feats = feats.get(zig_arch)
    cpu = _zig_name(arch.cpu)
    if known_cpus is not None and cpu not in known_cpus:
        return None
    parts = [cpu]
    for feature in filter(None, (f.strip() for f in arch.features.split(","))):
        sign, name = feature[0], _zig_name(feature[1:])
        if known_feats is not None and name not in known_feats:
            continue
        parts.append(sign + name)
    return "".join(parts)


def _flag_macro(arch: Arch, flag: str) -> str:
    """The macro clang predefines when code for `arch` may use the CPU flag `flag`."""
    if not arch.is_x86:
        return AARCH64_CPU_FLAGS[flag][0]
    special = {"cx16": "__GCC_HAVE_SYNC_COMPARE_AND_SWAP_16", "sahf": "__LAHF_SAHF__"}
    return special.get(flag, "__" + flag.upper().replace(".", "_") + "__")


@cache
def cpu_flags(arch: Arch) -> tuple[str, ...]:
    """The CPU flags (X86_CPU_FLAGS or AARCH64_CPU_FLAGS names, in the table's order) that
    code for `arch`'s cpu and features may use: what zig's clang predefines for that -mcpu,
    its own reading of LLVM's cpu model. Empty for other architectures."""
    table = cpu_flag_table(arch.llvm_triple)
    if not table:
        return ()
    mcpu = zig_mcpu(arch)
    if mcpu is None:
        raise ToolchainError(
            f"zig does not know the cpu {arch.cpu!r} (features {arch.features!r}), so cuvil "
            "cannot tell which CPU flags the library needs; name an LLVM cpu zig knows, such "
            "as 'x86-64-v2', 'haswell', 'generic' or 'cortex-a76'")
    with tempfile.TemporaryDirectory(prefix="cuvil-cpu-") as tmpdir:
        empty = Path(tmpdir) / "empty.c"
        empty.write_text("")
        text = _run(["cc", "-target", arch.zig_target, f"-mcpu={mcpu}", "-dM", "-E", str(empty)],
                    f"reading the CPU features of {mcpu}").stdout
    defined = {line.split()[1] for line in text.splitlines() if line.startswith("#define ")}
    return tuple(flag for flag in table if _flag_macro(arch, flag) in defined)


# ------------------------------------------------------------------------------ compile


def compile_c(
    source: Path,
    output: Path,
    arch: Arch,
    include_dirs: Sequence[Path | str] = (),
    defines: Sequence[str] | Mapping[str, str | None] = (),
    opt: str = "-O2",
    *,
    extra_args: Sequence[str] = (),
    log: Log = None,
) -> Path:
    """Compile one C (or C++, by suffix) file into an object file for `arch`.

    Symbols are hidden unless marked `__attribute__((visibility("default")))`.
    """
    source, output = Path(source), Path(output)
    if not source.is_file():
        raise ToolchainError(f"cannot compile {source}: no such file")
    driver = "c++" if source.suffix in _CXX_SUFFIXES else "cc"
    args = [driver, "-target", arch.zig_target]
    mcpu = zig_mcpu(arch)
    if mcpu:
        args.append(f"-mcpu={mcpu}")
    args += [opt, "-fPIC", "-fvisibility=hidden", "-ffunction-sections", "-fdata-sections"]
    # zig cc enables UBSan at -O0, whose runtime release links do not carry: opt in via extra_args.
    args.append("-fno-sanitize=undefined")
    if arch.os == "macos":
        # zig 0.17's Mach-O linker crashes on the compact-unwind sections of optimized C that
        # calls pthread functions; the runtime needs no unwind tables (it never throws)
        args += ["-fno-asynchronous-unwind-tables", "-fno-unwind-tables"]
    args += [f"-I{d}" for d in include_dirs]
    if isinstance(defines, Mapping):
        args += [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in defines.items()]
    else:
        args += [f"-D{d}" for d in defines]
    args += list(extra_args)
    _log(log, f"cuvil: compiling {source.name} for {arch.zig_target}")
    with _atomic_output(output) as tmp:
        _run(
            [*args, "-c", str(source.resolve()), "-o", str(tmp)],
            f"compiling {source} for {arch.zig_target}",
            log=log,
        )
    return output


def _asm_string(path: Path) -> str:
    text = str(path.resolve())
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def embed_blob(
    data_path: Path,
    symbol: str,
    output: Path,
    arch: Arch,
    object_format: str,
    alignment: int = 64,
    *,
    log: Log = None,
) -> Path:
    """An object file defining the hidden, read-only, aligned array `symbol` = bytes of `data_path`.

    The assembler's `.incbin` copies the file, so hundreds of MB take about a second. In C:
    `extern const unsigned char symbol[] __attribute__((visibility("hidden")));`.
    An empty file gives a zero-size symbol that still points at valid (padding) memory.
    """
    data_path, output = Path(data_path), Path(output)
    if not _SYMBOL_RE.match(symbol):
        raise ToolchainError(f"blob symbol {symbol!r} is not a C identifier")
    if alignment < 1 or alignment & (alignment - 1):
        raise ToolchainError(f"blob alignment must be a power of two, got {alignment}")
    try:
        size = data_path.stat().st_size
    except OSError as exc:
        raise ToolchainError(f"cannot embed {data_path}: {exc.strerror or exc}") from None
    body = f"\t.incbin {_asm_string(data_path)}\n" if size else ""
    if object_format == "elf":
        asm = (
            f'\t.section .rodata.{symbol},"a",%progbits\n'
            f"\t.globl {symbol}\n"
            f"\t.hidden {symbol}\n"
            f"\t.type {symbol},%object\n"
            f"\t.balign {alignment}\n"
            f"{symbol}:\n"
            f"{body}"
            f"\t.size {symbol}, . - {symbol}\n"
            + ("\t.byte 0\n" if not size else "")
            + '\t.section .note.GNU-stack,"",%progbits\n'
        )
    elif object_format == "macho":
        # Mach-O C symbols carry a leading underscore; private_extern = hidden.
        asm = (
            "\t.section __TEXT,__const\n"
            f"\t.globl _{symbol}\n"
            f"\t.private_extern _{symbol}\n"
            f"\t.p2align {alignment.bit_length() - 1}\n"
            f"_{symbol}:\n"
            f"{body}" + ("\t.byte 0\n" if not size else "")
        )
    elif object_format == "coff":
        # COFF has no visibility: a symbol is exported only when marked dllexport, which
        # this one is not. "dr": initialized read-only data; the section's alignment is the
        # largest .p2align in it.
        asm = (
            f'\t.section .rdata${symbol},"dr"\n'
            f"\t.globl {symbol}\n"
            f"\t.p2align {alignment.bit_length() - 1}\n"
            f"{symbol}:\n"
            f"{body}" + ("\t.byte 0\n" if not size else "")
        )
    else:
        raise ToolchainError(
            f"cannot embed a blob for object format {object_format!r} (expected 'elf', 'macho' "
            "or 'coff')"
        )
    _log(log, f"cuvil: embedding {data_path.name} ({size / 1e6:.1f} MB) as {symbol} for {arch.zig_target}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cuvil-blob-") as tmpdir:
        asm_path = Path(tmpdir) / f"{symbol}.S"
        asm_path.write_text(asm, encoding="utf-8")
        with _atomic_output(output) as tmp:
            _run(
                ["cc", "-target", arch.zig_target, "-g0", "-c", str(asm_path), "-o", str(tmp)],
                f"assembling blob {data_path} for {arch.zig_target}",
                log=log,
            )
    _log(log, f"cuvil: assembled {output.name} in {time.perf_counter() - start:.1f} s")
    return output


# --------------------------------------------------------------------------------- link


def link_shared(
    objects: Sequence[Path],
    output: Path,
    arch: Arch,
    object_format: str,
    soname: str,
    libs: Sequence[str] = ("m",),
    *,
    opt: str = "-O2",
    strip: bool = False,
    extra_args: Sequence[str] = (),
    log: Log = None,
) -> Path:
    """Link object files into a shared library for one arch.

    `opt` picks the build mode of the compiler-rt zig links in (and caches per mode): keep
    -O2/-O3 (zig's ReleaseFast, shared with CMake Release builds); -O0 would add a debug one.

    Only default-visibility symbols are exported (COFF: only dllexport ones). ELF: DT_SONAME =
    `soname`, no RPATH/RUNPATH. Mach-O: install name `@rpath/<soname>`; zig signs arm64
    libraries ad hoc. COFF: a DLL whose export table names `soname`, and no import library.
    """
    output = Path(output)
    objects = [Path(o) for o in objects]
    missing = [str(o) for o in objects if not o.is_file()]
    if missing:
        raise ToolchainError(f"cannot link {output.name}: missing object files: {', '.join(missing)}")
    if not objects:
        raise ToolchainError(f"cannot link {output.name}: no object files")
    if "/" in soname or not soname:
        raise ToolchainError(f"soname must be a bare file name, got {soname!r}")
    args = ["cc", "-target", arch.zig_target, "-shared", opt]
    if object_format == "elf":
        args += [f"-Wl,-soname,{soname}", "-Wl,--gc-sections", "-Wl,-z,noexecstack"]
    elif object_format == "macho":
        args += [f"-Wl,-install_name,@rpath/{soname}", "-Wl,-dead_strip"]
    elif object_format == "coff":
        # the DLL's name is its file name (the export directory records it); no import
        # library: callers load it with LoadLibrary/ctypes, never link against it
        args += ["-Wl,--gc-sections"]
    else:
        raise ToolchainError(f"cannot link for object format {object_format!r} (expected 'elf', "
                             "'macho' or 'coff')")
    if strip:
        args.append("-s")
    args += [str(o.resolve()) for o in objects]
    args += [f"-l{lib}" for lib in libs]
    args += list(extra_args)
    note = ""
    if arch.zig_target not in _warned_first_link:
        _warned_first_link.add(arch.zig_target)
        note = " (zig's first link for a target builds its libc stubs: up to ~40 s, then cached)"
    _log(log, f"cuvil: linking {output.name} for {arch.zig_target}{note}")
    start = time.perf_counter()
    with _atomic_output(output) as tmp:
        _run([*args, "-o", str(tmp)], f"linking {output.name} for {arch.zig_target}", log=log)
    _log(log, f"cuvil: linked {output.name} in {time.perf_counter() - start:.1f} s")
    return output


def link_library(
    target: Target,
    objects: Mapping[str, Sequence[Path]] | Sequence[Path],
    output: Path,
    soname: str | None = None,
    libs: Sequence[str] = ("m",),
    *,
    strip: bool = False,
    log: Log = None,
) -> Path:
    """Link the library for a whole target: one arch, or each slice then a fat file.

    `objects` maps arch name -> object files (a plain list is accepted for one-arch targets).
    `soname` defaults to the output's file name.
    """
    output = Path(output)
    soname = soname or output.name
    if not isinstance(objects, Mapping):
        if target.is_universal:
            raise ToolchainError(
                f"target {target.name} has several arches ({', '.join(a.name for a in target.arches)}): "
                "pass objects as a mapping arch name -> object files"
            )
        objects = {target.arches[0].name: list(objects)}
    for arch in target.arches:
        if arch.name not in objects:
            raise ToolchainError(f"no object files for arch {arch.name!r} of target {target.name}")
    if not target.is_universal:
        arch = target.arches[0]
        return link_shared(
            objects[arch.name], output, arch, target.object_format, soname, libs, strip=strip, log=log
        )
    if target.object_format != "macho":
        raise ToolchainError(
            f"target {target.name} ({target.source}): only Mach-O targets can hold several arches"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".cuvil-slices-", dir=output.parent) as tmpdir:
        slices = []
        for arch in target.arches:
            thin = Path(tmpdir) / arch.name / output.name
            link_shared(
                objects[arch.name], thin, arch, target.object_format, soname, libs, strip=strip, log=log
            )
            slices.append(thin)
        _log(log, f"cuvil: fusing {len(slices)} slices into {output.name}")
        return fuse_universal(slices, output)


# ---------------------------------------------------------------------------- universal

FAT_MAGIC = 0xCAFEBABE
_MH_MAGIC_64 = 0xFEEDFACF
_MH_MAGIC = 0xFEEDFACE
CPU_TYPE_X86_64 = 0x01000007
CPU_TYPE_ARM64 = 0x0100000C
_CPU_TYPE_ARM = 12


@dataclass(frozen=True)
class FatSlice:
    cputype: int
    cpusubtype: int
    offset: int
    size: int
    align: int  # log2 of the alignment


def _mach_header(path: Path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(12)
    if len(head) < 12:
        raise ToolchainError(f"{path} is not a Mach-O file (too short)")
    for order in ("<", ">"):
        magic, cputype, cpusubtype = struct.unpack(order + "III", head)
        if magic in (_MH_MAGIC_64, _MH_MAGIC):
            return cputype, cpusubtype
    if struct.unpack(">I", head[:4])[0] == FAT_MAGIC:
        raise ToolchainError(f"{path} is already a universal (fat) file; pass thin slices")
    raise ToolchainError(f"{path} is not a Mach-O file (magic {head[:4].hex()})")


def fuse_universal(slices: Sequence[Path], output: Path) -> Path:
    """Write a universal (fat) Mach-O holding the thin Mach-O files `slices`, in that order."""
    slices = [Path(s) for s in slices]
    if not slices:
        raise ToolchainError("fuse_universal needs at least one slice")
    headers = [_mach_header(s) for s in slices]
    cputypes = [c for c, _ in headers]
    if len(set(cputypes)) != len(cputypes):
        raise ToolchainError(f"two slices have the same cpu type: {', '.join(map(str, slices))}")
    entries = []
    offset = 8 + 20 * len(slices)
    for path, (cputype, cpusubtype) in zip(slices, headers):
        align = 14 if (cputype & 0xFF) == _CPU_TYPE_ARM else 12  # 16 KiB pages on arm
        offset = (offset + (1 << align) - 1) & ~((1 << align) - 1)
        size = path.stat().st_size
        entries.append(FatSlice(cputype, cpusubtype, offset, size, align))
        offset += size
    if offset >= 1 << 32:
        raise ToolchainError(f"universal file {output} would exceed 4 GiB, which fat headers cannot address")
    with _atomic_output(Path(output)) as tmp:
        with open(tmp, "wb") as out:
            out.write(struct.pack(">II", FAT_MAGIC, len(entries)))
            for e in entries:
                out.write(struct.pack(">IIIII", e.cputype, e.cpusubtype, e.offset, e.size, e.align))
            for path, e in zip(slices, entries):
                out.write(b"\0" * (e.offset - out.tell()))
                with open(path, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        with contextlib.suppress(OSError):
            os.chmod(tmp, 0o755)
    return Path(output)


def read_universal(path: Path) -> list[FatSlice]:
    """The slices of a universal Mach-O file (its fat_arch entries); ToolchainError if it is not one."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or struct.unpack(">I", head[:4])[0] != FAT_MAGIC:
            raise ToolchainError(f"{path} is not a universal (fat) Mach-O file")
        (count,) = struct.unpack(">I", head[4:])
        raw = f.read(20 * count)
    if len(raw) < 20 * count:
        raise ToolchainError(f"{path}: truncated fat header")
    size = path.stat().st_size
    out = []
    for i in range(count):
        e = FatSlice(*struct.unpack_from(">IIIII", raw, 20 * i))
        if e.offset + e.size > size or e.offset % (1 << e.align):
            raise ToolchainError(
                f"{path}: slice {i} (cputype {e.cputype:#x}) lies outside the file or is misaligned"
            )
        out.append(e)
    return out
