"""Targets: what a toolchain file declares, how it is found, and the LLVM machine it maps to."""

from __future__ import annotations

import difflib
import os
import platform
import re
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from cuvil.errors import ToolchainError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.9/3.10 only
    import tomli as tomllib

__all__ = [
    "AARCH64_CPU_FLAGS",
    "ENV_VAR",
    "X86_CPU_FLAGS",
    "Arch",
    "Target",
    "bundled_toolchain_dir",
    "cpu_flag_table",
    "get_target",
    "host_cpu",
    "host_target_name",
    "list_targets",
    "load_toolchain_file",
    "target_machine",
    "toolchain_search_path",
]

ENV_VAR = "CUVIL_TOOLCHAIN_PATH"

_OBJECT_FORMATS = {"elf": "ELF (Linux)", "macho": "Mach-O (macOS)", "coff": "PE/COFF (Windows)"}
#: the object format of each OS a triple names
_OS_FORMATS = {"linux": "elf", "macos": "macho", "windows": "coff"}
_TOP_KEYS = {
    "name": True,
    "description": False,
    "object-format": True,
    "platform-tag": True,
    "library-suffix": True,
    "arch": True,
}
_ARCH_KEYS = {
    "name": True,
    "llvm-triple": True,
    "zig-target": True,
    "cpu": True,
    "features": False,
    "variant": False,
}
_VARIANT_KEYS = {"cpu": True, "features": True, "requires": True}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TAG_RE = re.compile(r"^[a-z0-9_]+$")
_FEATURES_RE = re.compile(r"^[+-][A-Za-z0-9_.-]+$")
# platform.machine() spellings -> cuvil arch names
_MACHINES = {
    "x86_64": "x86_64",
    "amd64": "x86_64",
    "aarch64": "aarch64",
    "arm64": "aarch64",
}


@dataclass(frozen=True)
class Variant:
    """Code for a newer CPU level, picked at run time when the CPU has every `requires` flag."""

    cpu: str
    features: str  # what the cpu implies, spelled out: kernels size their tiles from it
    requires: tuple[str, ...]  # names in the arch's flag table, e.g. ("avx2", "fma")


#: x86 CPU flags a variant can require, as the dispatcher tests them: CPUID leaf, subleaf,
#: register (0-3: EAX, EBX, ECX, EDX), bit, and the XCR0 state bits the OS must enable for
#: the flag's registers (AVX: XMM+YMM = 0x6; AVX-512 also opmask and ZMM = 0xE6). Facts from
#: Intel's SDM vol. 2A (CPUID) and AMD's CPUID specification.
X86_CPU_FLAGS: dict[str, tuple[int, int, int, int, int]] = {
    # x86-64-v2 (with sse4.2 and popcnt below); SSE and SSE2 are part of every x86-64 CPU
    "sse3": (1, 0, 2, 0, 0),
    "ssse3": (1, 0, 2, 9, 0),
    "cx16": (1, 0, 2, 13, 0),  # CMPXCHG16B
    "sse4.1": (1, 0, 2, 19, 0),
    "sahf": (0x80000001, 0, 2, 0, 0),  # LAHF/SAHF in 64-bit mode
    "sse4.2": (1, 0, 2, 20, 0),
    "popcnt": (1, 0, 2, 23, 0),
    "movbe": (1, 0, 2, 22, 0),
    "fma": (1, 0, 2, 12, 0x6),
    "avx": (1, 0, 2, 28, 0x6),
    "f16c": (1, 0, 2, 29, 0x6),
    "bmi": (7, 0, 1, 3, 0),
    "avx2": (7, 0, 1, 5, 0x6),
    "bmi2": (7, 0, 1, 8, 0),
    "avx512f": (7, 0, 1, 16, 0xE6),
    "avx512dq": (7, 0, 1, 17, 0xE6),
    "avx512cd": (7, 0, 1, 28, 0xE6),
    "avx512bw": (7, 0, 1, 30, 0xE6),
    "avx512vl": (7, 0, 1, 31, 0xE6),
    "lzcnt": (0x80000001, 0, 2, 5, 0),
    # newer AVX-512 and VNNI extensions, so that a library pinned to a recent cpu (-C cpu=...)
    # names what it needs
    "avx512ifma": (7, 0, 1, 21, 0xE6),
    "avx512vbmi": (7, 0, 2, 1, 0xE6),
    "avx512vbmi2": (7, 0, 2, 6, 0xE6),
    "avx512vnni": (7, 0, 2, 11, 0xE6),
    "avx512bitalg": (7, 0, 2, 12, 0xE6),
    "avx512vpopcntdq": (7, 0, 2, 14, 0xE6),
    "avx512fp16": (7, 0, 3, 23, 0xE6),
    "avxvnni": (7, 1, 0, 4, 0x6),
    "avx512bf16": (7, 1, 0, 5, 0xE6),
}


#: AArch64 CPU flags (LLVM feature names) as the CPU check reads them: (the clang macro that
#: says code may use the flag, Linux's getauxval word (1: AT_HWCAP, 2: AT_HWCAP2) and bit
#: (the kernel's uapi asm/hwcap.h), macOS's sysctl name ("" when every Apple silicon Mac has
#: the flag: the M1 does), Windows's IsProcessorFeaturePresent constant (0: it cannot be
#: asked, and the flag counts as missing)).
AARCH64_CPU_FLAGS: dict[str, tuple[str, int, int, str, int]] = {
    "crc": ("__ARM_FEATURE_CRC32", 1, 7, "", 31),
    "aes": ("__ARM_FEATURE_AES", 1, 3, "", 30),
    "sha2": ("__ARM_FEATURE_SHA2", 1, 6, "", 30),
    "lse": ("__ARM_FEATURE_ATOMICS", 1, 8, "", 34),
    "fullfp16": ("__ARM_FEATURE_FP16_VECTOR_ARITHMETIC", 1, 10, "", 0),
    "rdm": ("__ARM_FEATURE_QRDMX", 1, 12, "", 0),
    "jsconv": ("__ARM_FEATURE_JCVT", 1, 13, "", 44),
    "complxnum": ("__ARM_FEATURE_COMPLEX", 1, 14, "", 0),
    "rcpc": ("__ARM_FEATURE_RCPC", 1, 15, "", 45),
    "sha3": ("__ARM_FEATURE_SHA3", 1, 17, "", 0),
    "dotprod": ("__ARM_FEATURE_DOTPROD", 1, 20, "", 43),
    "sve": ("__ARM_FEATURE_SVE", 1, 22, "hw.optional.arm.FEAT_SVE", 0),
    "fp16fml": ("__ARM_FEATURE_FP16_FML", 1, 23, "", 0),
    "pauth": ("__ARM_FEATURE_PAUTH", 1, 30, "", 0),
    "sve2": ("__ARM_FEATURE_SVE2", 2, 1, "hw.optional.arm.FEAT_SVE2", 0),
    "fptoint": ("__ARM_FEATURE_FRINT", 2, 8, "hw.optional.arm.FEAT_FRINTTS", 0),
    "i8mm": ("__ARM_FEATURE_MATMUL_INT8", 2, 13, "hw.optional.arm.FEAT_I8MM", 0),
    "bf16": ("__ARM_FEATURE_BF16_VECTOR_ARITHMETIC", 2, 14, "hw.optional.arm.FEAT_BF16", 0),
    "rand": ("__ARM_FEATURE_RNG", 2, 16, "hw.optional.arm.FEAT_RNG", 0),
    "bti": ("__ARM_FEATURE_BTI", 2, 17, "hw.optional.arm.FEAT_BTI", 0),
}


@dataclass(frozen=True)
class Arch:
    """One architecture slice of a target: a single object file / thin library."""

    name: str  # "x86_64" | "aarch64"
    llvm_triple: str
    zig_target: str
    cpu: str  # LLVM cpu name; "native" means the host's
    features: str  # LLVM feature string, may be ""
    #: faster code paths for newer CPUs of this arch, tried in order before the baseline
    variants: tuple[Variant, ...] = ()

    @property
    def os(self) -> str:
        """ "linux", "macos" or "windows", read from the LLVM triple."""
        return _triple_os(self.llvm_triple)

    @property
    def libc(self) -> str:
        """The C library the code links against: "glibc" or "musl" (Linux), "libSystem",
        "ucrt" (Windows), read from the triple's environment."""
        env = self.llvm_triple.lower().split("-")[3:]
        return {"linux": "musl" if any(e.startswith("musl") for e in env) else "glibc",
                "macos": "libSystem", "windows": "ucrt"}.get(self.os, "unknown")

    @property
    def is_x86(self) -> bool:
        """Whether its CPU flags are read with CPUID (X86_CPU_FLAGS)."""
        return self.llvm_triple.startswith(("x86_64", "i686", "i386"))

    @property
    def plain(self) -> Arch:
        """This arch with the architecture's first cpu (x86-64 v1, Armv8.0-A): code compiled
        for it runs on every CPU of the architecture, so it can check the CPU first."""
        return replace(self, cpu="x86-64" if self.is_x86 else "generic", features="",
                       variants=())


@dataclass(frozen=True)
class Target:
    """A platform cuvil builds libraries and wheels for, as declared by one toolchain file."""

    name: str  # "x86_64-linux"
    object_format: str  # "elf" | "macho" | "coff"
    platform_tag: str
    library_suffix: str
    arches: tuple[Arch, ...]  # one, or two for universal2
    source: Path  # the toml file it came from
    description: str = ""

    def is_host(self) -> bool:
        """Whether this machine can load a library built for this target (same OS and arch)."""
        host = _host_os_arch()
        if host is None:
            return False
        host_os, host_arch = host
        libc = _host_libc()
        return any(a.os == host_os and a.name == host_arch and (libc is None or a.libc == libc)
                   for a in self.arches)

    def arch(self, name: str) -> Arch:
        """The slice called `name` ("x86_64", "aarch64")."""
        for a in self.arches:
            if a.name == name:
                return a
        known = ", ".join(a.name for a in self.arches)
        raise ToolchainError(f"target {self.name!r} ({self.source}) has no arch {name!r}; it has: {known}")

    @property
    def is_universal(self) -> bool:
        return len(self.arches) > 1


# ---------------------------------------------------------------------------------- host


def _triple_os(triple: str) -> str:
    parts = triple.lower().split("-")
    rest = "-".join(parts[1:])
    if "apple" in parts or "darwin" in rest or "macos" in rest:
        return "macos"
    if "linux" in rest:
        return "linux"
    if "windows" in rest or "mingw" in rest:
        return "windows"
    return parts[2] if len(parts) > 2 else "unknown"


def _host_os_arch() -> tuple[str, str] | None:
    system = platform.system()
    host_os = {"Linux": "linux", "Darwin": "macos", "Windows": "windows"}.get(system)
    machine = platform.machine()
    if host_os == "windows":
        # the interpreter's arch, which the library must match: an x64 Python on Windows on
        # Arm runs emulated, and the machine may report either arch depending on the process
        machine = sysconfig.get_platform().rsplit("-", 1)[-1]  # win-amd64, win-arm64
    host_arch = _MACHINES.get(machine.lower())
    if host_os is None or host_arch is None:
        return None
    return host_os, host_arch


@cache
def _host_libc() -> str | None:
    """ "glibc" or "musl" on Linux (a musl Python reports no glibc), None elsewhere."""
    if platform.system() != "Linux":
        return None
    return "glibc" if platform.libc_ver()[0] == "glibc" else "musl"


def host_target_name() -> str:
    """The name of the bundled target this machine runs, e.g. "x86_64-linux" or "arm64-macos"."""
    host = _host_os_arch()
    if host is None:
        raise ToolchainError(
            f"cuvil cannot build for this machine ({platform.system()} {platform.machine()}): "
            "supported hosts are Linux (glibc or musl) and Windows on x86_64/aarch64, and macOS "
            "x86_64/arm64. "
            "Cross-build instead with an explicit target, e.g. target='x86_64-linux'."
        )
    host_os, host_arch = host
    if host_os == "macos":
        return "arm64-macos" if host_arch == "aarch64" else "x86_64-macos"
    if host_os == "windows":
        return f"{host_arch}-windows"
    return f"{host_arch}-linux" + ("-musl" if _host_libc() == "musl" else "")


@cache
def host_cpu() -> tuple[str, str]:
    """LLVM's name and feature string for this machine's CPU (for cpu="native")."""
    import llvmlite.binding as llvm

    name = llvm.get_host_cpu_name()
    try:
        features = llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # LLVM cannot read the features on some hosts
        features = ""
    return name, features


# ------------------------------------------------------------------------------ loading


def bundled_toolchain_dir() -> Path:
    """`toolchain-files/` inside an installed cuvil, else at the root of a source checkout."""
    package_dir = Path(__file__).resolve().parent.parent  # cuvil/
    installed = package_dir / "toolchain-files"
    if installed.is_dir():
        return installed
    return package_dir.parent / "toolchain-files"


def toolchain_search_path(search_path: Sequence[Path | str] = ()) -> list[Path]:
    """Directories searched for toolchain files, first match wins.

    Order: `search_path`, then `$CUVIL_TOOLCHAIN_PATH` (os.pathsep-separated), then the
    toolchain files bundled with cuvil. A user's file can so replace a bundled target.
    """
    dirs: list[Path] = [Path(p) for p in search_path]
    env = os.environ.get(ENV_VAR, "")
    dirs += [Path(p) for p in env.split(os.pathsep) if p.strip()]
    dirs.append(bundled_toolchain_dir())
    seen: set[Path] = set()
    unique = []
    for d in dirs:
        key = d.expanduser().resolve()
        if key not in seen:
            seen.add(key)
            unique.append(d.expanduser())
    return unique


def _candidates(search_path: Sequence[Path | str]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in toolchain_search_path(search_path):
        if not d.is_dir():
            continue
        for f in sorted(d.glob("*.toml")):
            found.setdefault(f.stem, f)
    return found


def list_targets(search_path: Sequence[Path | str] = ()) -> list[Target]:
    """Every target found on the search path, sorted by name (a user's file hides a bundled one)."""
    return [load_toolchain_file(p) for _, p in sorted(_candidates(search_path).items())]


def get_target(name: str | None = None, search_path: Sequence[Path | str] = ()) -> Target:
    """The target called `name`; None (or "host") means the machine cuvil runs on."""
    if isinstance(name, Target):
        return name
    if name is None or name == "host":
        name = host_target_name()
    candidates = _candidates(search_path)
    path = candidates.get(name)
    if path is not None:
        return load_toolchain_file(path)
    known = sorted(candidates)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    dirs = ", ".join(str(d) for d in toolchain_search_path(search_path))
    raise ToolchainError(
        f"unknown target {name!r}.{hint} Known targets: {', '.join(known) or '(none)'}. "
        f"To add one, put a toolchain file {name}.toml in a directory listed in "
        f"${ENV_VAR} (searched: {dirs})."
    )


def load_toolchain_file(path: Path | str) -> Target:
    """Read and validate one toolchain file."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        raise ToolchainError(f"cannot read toolchain file {path}: {exc.strerror or exc}") from None
    return _load_cached(path.resolve(), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=64)
def _load_cached(path: Path, _mtime_ns: int, _size: int) -> Target:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ToolchainError(f"cannot read toolchain file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ToolchainError(f"toolchain file {path} is not valid TOML: {exc}") from None
    return _parse(data, path)


def _fail(path: Path, key: str, message: str) -> ToolchainError:
    return ToolchainError(f"toolchain file {path}: key {key!r}: {message}")


def _check_keys(table: dict[str, Any], spec: dict[str, bool], path: Path, where: str) -> None:
    for key in table:
        if key not in spec:
            close = difflib.get_close_matches(key, list(spec), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; allowed keys: {', '.join(spec)}"
            raise _fail(path, f"{where}{key}", f"unknown key{hint}")
    for key, required in spec.items():
        if required and key not in table:
            raise _fail(path, f"{where}{key}", "missing (required)")


def _str(table: dict[str, Any], key: str, path: Path, where: str = "", default: str | None = None) -> str:
    value = table.get(key, default)
    if not isinstance(value, str):
        raise _fail(path, f"{where}{key}", f"expected a string, got {type(value).__name__} {value!r}")
    return value


def _parse(data: dict[str, Any], path: Path) -> Target:
    _check_keys(data, _TOP_KEYS, path, "")
    name = _str(data, "name", path)
    if not _NAME_RE.match(name):
        raise _fail(path, "name", f"{name!r} is not a valid target name (letters, digits, '-', '_', '.')")
    if name != path.stem:
        raise _fail(path, "name", f"{name!r} must match the file name {path.name!r} (rename one)")
    description = _str(data, "description", path, default="")

    fmt = _str(data, "object-format", path)
    if fmt not in _OBJECT_FORMATS:
        raise _fail(path, "object-format", f"{fmt!r} is not one of: {', '.join(map(repr, _OBJECT_FORMATS))}")

    tag = _str(data, "platform-tag", path)
    if not _TAG_RE.match(tag):
        raise _fail(
            path,
            "platform-tag",
            f"{tag!r} is not a wheel platform tag (lower-case letters, digits and '_', "
            "e.g. 'manylinux_2_17_x86_64')",
        )

    suffix = _str(data, "library-suffix", path)
    if not suffix.startswith(".") or len(suffix) < 2 or "/" in suffix:
        raise _fail(path, "library-suffix", f"{suffix!r} must be a file suffix such as '.so' or '.dylib'")

    raw_arches = data["arch"]
    if not isinstance(raw_arches, list) or not raw_arches or not all(isinstance(a, dict) for a in raw_arches):
        raise _fail(path, "arch", "expected one or more [[arch]] tables")
    arches = []
    for i, raw in enumerate(raw_arches):
        arches.append(_parse_arch(raw, path, fmt, f"arch[{i}]."))
    names = [a.name for a in arches]
    if len(set(names)) != len(names):
        raise _fail(path, "arch", f"arch names repeat: {names}")
    if fmt != "macho" and len(arches) != 1:
        raise _fail(path, "arch", f"an {_OBJECT_FORMATS[fmt]} target has exactly one [[arch]] "
                    "(only Mach-O has fat files)")
    return Target(
        name=name,
        object_format=fmt,
        platform_tag=tag,
        library_suffix=suffix,
        arches=tuple(arches),
        source=path,
        description=description,
    )


def _parse_arch(raw: dict[str, Any], path: Path, fmt: str, where: str) -> Arch:
    _check_keys(raw, _ARCH_KEYS, path, where)
    name = _str(raw, "name", path, where)
    if not re.match(r"^[a-z][a-z0-9_]*$", name):
        raise _fail(path, f"{where}name", f"{name!r} is not an arch name such as 'x86_64' or 'aarch64'")
    triple = _str(raw, "llvm-triple", path, where)
    if len(triple.split("-")) < 3 or " " in triple:
        raise _fail(
            path,
            f"{where}llvm-triple",
            f"{triple!r} is not an LLVM triple such as 'x86_64-unknown-linux-gnu'",
        )
    if _OS_FORMATS.get(_triple_os(triple)) != fmt:
        raise _fail(
            path,
            f"{where}llvm-triple",
            f"{triple!r} does not produce {_OBJECT_FORMATS[fmt]} objects (object-format = {fmt!r})",
        )
    zig_target = _str(raw, "zig-target", path, where)
    if len(zig_target.split("-")) < 2 or " " in zig_target:
        raise _fail(
            path, f"{where}zig-target", f"{zig_target!r} is not a zig target such as 'x86_64-linux-gnu.2.17'"
        )
    cpu = _str(raw, "cpu", path, where)
    if not cpu or " " in cpu:
        raise _fail(path, f"{where}cpu", f"{cpu!r} is not an LLVM cpu name such as 'x86-64-v2' or 'generic'")
    features = _str(raw, "features", path, where, default="")
    if features:
        bad = [f for f in features.split(",") if not _FEATURES_RE.match(f.strip())]
        if bad:
            raise _fail(
                path,
                f"{where}features",
                f"{bad[0]!r} is not an LLVM feature; write a comma-separated list such as '+neon,-sve'",
            )
        features = ",".join(f.strip() for f in features.split(","))
    variants = raw.get("variant", [])
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        raise _fail(path, f"{where}variant", "must be an array of tables ([[arch.variant]])")
    table = cpu_flag_table(triple)
    if variants and not table:
        raise _fail(path, f"{where}variant", "cuvil cannot test the CPU flags of this arch "
                    f"({triple}) at run time, so it cannot have CPU variants: remove its "
                    "[[arch.variant]] tables")
    return Arch(name=name, llvm_triple=triple, zig_target=zig_target, cpu=cpu, features=features,
                variants=tuple(_parse_variant(v, path, f"{where}variant[{i}].", table)
                               for i, v in enumerate(variants)))


def cpu_flag_table(triple: str) -> dict[str, Any]:
    """X86_CPU_FLAGS or AARCH64_CPU_FLAGS, by the arch of an LLVM triple; {} for others."""
    if triple.startswith(("x86_64", "i686", "i386")):
        return X86_CPU_FLAGS
    if triple.startswith(("aarch64", "arm64")):
        return AARCH64_CPU_FLAGS
    return {}


def _parse_variant(raw: dict[str, Any], path: Path, where: str, table: dict[str, Any]) -> Variant:
    _check_keys(raw, _VARIANT_KEYS, path, where)
    cpu = _str(raw, "cpu", path, where)
    features = _str(raw, "features", path, where)
    requires = raw["requires"]
    if not isinstance(requires, list) or not requires or not all(isinstance(r, str) for r in requires):
        raise _fail(path, f"{where}requires",
                    "must be a non-empty list of CPU feature names such as [\"avx2\", \"fma\"]")
    unknown = [r for r in requires if r not in table]
    if unknown:
        raise _fail(path, f"{where}requires",
                    f"unknown CPU flag(s) {unknown}; the run-time dispatcher tests "
                    f"{', '.join(sorted(table))}")
    return Variant(cpu=cpu, features=features, requires=tuple(requires))


# ---------------------------------------------------------------------------------- LLVM

def machine_options(
    arch: Arch,
    cpu: str | None = None,
    features: str | None = None,
    opt_level: int = 3,
) -> dict[str, Any]:
    """What `target_machine` builds, as plain data (`llvm.create_target_machine`'s arguments),
    so that a worker process can build the same machine.

    `cpu`/`features` override the toolchain file's baseline; cpu="native" uses this machine's
    CPU and features, which is only allowed when `arch` is the host's.
    """
    cpu = arch.cpu if cpu is None else cpu
    if cpu == "native":
        host = _host_os_arch()
        if host is None or host != (arch.os, arch.name):
            raise ToolchainError(
                f"cpu='native' needs the host's architecture, but {arch.llvm_triple} is not this "
                f"machine ({platform.system()} {platform.machine()}); name a cpu such as {arch.cpu!r}"
            )
        cpu, native_features = host_cpu()
        if features is None:
            features = native_features
    features = arch.features if features is None else features
    if not 0 <= opt_level <= 3:
        raise ToolchainError(f"opt_level must be 0, 1, 2 or 3, got {opt_level!r}")
    return {"triple": arch.llvm_triple, "cpu": cpu, "features": features, "opt_level": opt_level}


def target_machine(
    arch: Arch,
    cpu: str | None = None,
    features: str | None = None,
    opt_level: int = 3,
) -> Any:
    """An llvmlite TargetMachine for `arch` (position-independent code); see `machine_options`."""
    from cuvil.toolchains.llvm import create_target_machine

    options = machine_options(arch, cpu, features, opt_level)
    try:
        return create_target_machine(**options)
    except RuntimeError as exc:
        raise ToolchainError(f"LLVM does not know the triple {arch.llvm_triple!r}: {exc}") from None
