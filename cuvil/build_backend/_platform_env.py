"""The platform a build environment asks for, read from the variables cibuildwheel sets.

cibuildwheel (and other wheel builders) tell a PEP 517 backend what to build through
environment variables, not config settings:

- `_PYTHON_HOST_PLATFORM`: the interpreter's sysconfig platform, e.g. `macosx-11.0-arm64`,
  `linux-aarch64`, `win-arm64`. Only its OS and architecture are read: cibuildwheel writes
  `macosx-10.9-x86_64` for every x86_64 build, whatever the deployment target.
- `ARCHFLAGS` (macOS): `-arch x86_64`, `-arch arm64` or both (universal2).
- `VSCMD_ARG_TGT_ARCH` (Windows): `x64` or `arm64`.
- `AUDITWHEEL_PLAT` (the manylinux and musllinux images): the policy the wheel is for.
- `MACOSX_DEPLOYMENT_TARGET`: the oldest macOS the wheel is for.

The first four choose the target when none is named (-C target, CUVIL_TARGET, [tool.cuvil]);
a named target must agree with those of its own OS. AUDITWHEEL_PLAT and
MACOSX_DEPLOYMENT_TARGET then set the wheel's tag (and, on macOS, the libraries' minimum OS),
so that `auditwheel repair` and `delocate-wheel` find nothing to change.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Callable

from cuvil.errors import ConfigError, ToolchainError
from cuvil.toolchains import Target, toolchain_search_path

__all__ = ["ENV_VARS", "BuildPlatform", "resolve_platform", "target_name_for"]

ENV_VARS = (
    "_PYTHON_HOST_PLATFORM",
    "ARCHFLAGS",
    "VSCMD_ARG_TGT_ARCH",
    "AUDITWHEEL_PLAT",
    "MACOSX_DEPLOYMENT_TARGET",
)

# platform spellings (sysconfig, ARCHFLAGS, wheel tags, MSVC) -> cuvil arch names
_ARCH_NAMES = {
    "x86_64": "x86_64", "amd64": "x86_64", "x64": "x86_64",
    "aarch64": "aarch64", "arm64": "aarch64",
}
# Apple silicon Macs start at macOS 11: an arm64 slice is never built for less
_ARM64_FIRST_MACOS = (11, 0)
# PEP 600's legacy names
_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
_POLICY_RE = re.compile(
    r"^(?:(?P<family>manylinux|musllinux)_(?P<major>\d+)_(?P<minor>\d+)"
    r"|(?P<legacy>manylinux1|manylinux2010|manylinux2014))_(?P<arch>[a-z0-9_]+)$"
)
_VERSION_RE = re.compile(r"^(\d+)(?:\.(\d+))?(?:\.\d+)?$")


@dataclass(frozen=True)
class BuildPlatform:
    """What to build: the target (with the macOS version asked for) and the wheel's tag."""

    target: Target
    platform_tag: str
    notes: tuple[str, ...] = ()  # what the environment changed, for the build log


@dataclass(frozen=True)
class _Ask:
    """The OS, architectures and libc the environment asks for, and which variables said so."""

    os: str | None = None
    arches: frozenset[str] | None = None
    libc: str | None = None
    said: tuple[str, ...] = ()


def target_name_for(os_name: str, arches: frozenset[str], libc: str = "gnu") -> str | None:
    """The name cuvil gives the target for this OS/arch/libc (whether or not it exists here)."""
    if os_name == "macos":
        return {frozenset({"x86_64"}): "x86_64-macos", frozenset({"aarch64"}): "arm64-macos",
                frozenset({"x86_64", "aarch64"}): "universal2-macos"}.get(arches)
    if len(arches) != 1:
        return None
    (arch,) = arches
    if arch not in ("x86_64", "aarch64"):
        return None
    if os_name == "linux":
        return f"{arch}-linux" if libc == "gnu" else f"{arch}-linux-musl"
    if os_name == "windows":
        return f"{arch}-windows"
    return None


def resolve_platform(
    explicit: str | None,
    get_target: Callable[[str | None], Target],
    environ: Mapping[str, str],
    host_os: str | None = None,
) -> BuildPlatform:
    """The target and tag for a build: `explicit` (a named target) or the environment's."""
    env = {k: environ[k].strip() for k in ENV_VARS if environ.get(k, "").strip()}
    if not env:  # the common case: nothing to read, nothing to change
        target = get_target(explicit)
        return BuildPlatform(target, target.platform_tag)
    host = host_os or _host_os()
    if explicit is not None:
        target = get_target(explicit)
        _agree(target, _ask(env, _target_os(target)), explicit)
    else:
        ask = _ask(env, host)
        target = _named_target(ask, host, get_target) if ask.said else get_target(None)
    return _adjust(target, env)


# ------------------------------------------------------------------------ which target


def _host_os() -> str:
    return {"Darwin": "macos", "Windows": "windows"}.get(platform.system(), "linux")


def _host_arch() -> str:
    machine = platform.machine().lower()
    return _ARCH_NAMES.get(machine, machine)


def _target_os(target: Target) -> str:
    return target.arches[0].os


def _target_libc(target: Target) -> str:
    return "musl" if "musl" in target.arches[0].zig_target else "gnu"


def _arch(spelling: str, variable: str, value: str) -> str:
    arch = _ARCH_NAMES.get(spelling.lower())
    if arch is None:
        raise ConfigError(
            f"environment variable {variable}={value}: cuvil builds no wheels for architecture "
            f"{spelling!r} (it builds x86_64 and arm64/aarch64); skip these builds (cibuildwheel: "
            'archs = ["auto64"] or skip = ["*_i686", "*-win32"])'
        )
    return arch


def _ask(env: Mapping[str, str], fallback_os: str) -> _Ask:
    """Read the platform-choosing variables; those of another OS than the one asked are ignored."""
    os_name, arches, libc, said = None, None, None, []

    def merge(new: frozenset[str], variable: str) -> None:
        nonlocal arches
        if arches is not None and arches != new:
            raise ConfigError(
                f"environment variables disagree: {said[-1]} asks for {'+'.join(sorted(arches))}, "
                f"{variable}={env[variable]} for {'+'.join(sorted(new))}; unset one of them"
            )
        arches = new
        said.append(f"{variable}={env[variable]}")

    host_platform = env.get("_PYTHON_HOST_PLATFORM")
    if host_platform:
        os_name, found = _parse_host_platform(host_platform)
        merge(found, "_PYTHON_HOST_PLATFORM")
    os_name = os_name or fallback_os
    if os_name == "macos" and "ARCHFLAGS" in env:
        merge(_parse_archflags(env["ARCHFLAGS"]), "ARCHFLAGS")
    if os_name == "windows" and "VSCMD_ARG_TGT_ARCH" in env:
        value = env["VSCMD_ARG_TGT_ARCH"]
        merge(frozenset({_arch(value, "VSCMD_ARG_TGT_ARCH", value)}), "VSCMD_ARG_TGT_ARCH")
    if os_name == "linux" and "AUDITWHEEL_PLAT" in env:
        family, _version, arch = _parse_policy(env["AUDITWHEEL_PLAT"])
        libc = "musl" if family == "musllinux" else "gnu"
        merge(frozenset({arch}), "AUDITWHEEL_PLAT")
    return _Ask(os_name, arches, libc, tuple(said))


def _parse_host_platform(value: str) -> tuple[str, frozenset[str]]:
    where = f"environment variable _PYTHON_HOST_PLATFORM={value}"
    m = re.match(r"^macosx-[\d.]+-(\w+)$", value)
    if m:
        if m.group(1) == "universal2":
            return "macos", frozenset({"x86_64", "aarch64"})
        return "macos", frozenset({_arch(m.group(1), "_PYTHON_HOST_PLATFORM", value)})
    m = re.match(r"^(linux|win)-(\w+)$", value)
    if m:
        os_name = "linux" if m.group(1) == "linux" else "windows"
        return os_name, frozenset({_arch(m.group(2), "_PYTHON_HOST_PLATFORM", value)})
    raise ConfigError(
        f"{where}: not a platform cuvil builds for; expected e.g. macosx-11.0-arm64, "
        "macosx-10.13-universal2, linux-aarch64 or win-amd64 (or unset it and name a target "
        "with -C target=...)"
    )


def _parse_archflags(value: str) -> frozenset[str]:
    words = value.split()
    if len(words) < 2 or len(words) % 2 or any(w != "-arch" for w in words[::2]):
        raise ConfigError(
            f"environment variable ARCHFLAGS={value}: expected '-arch x86_64', '-arch arm64' or "
            "'-arch arm64 -arch x86_64'"
        )
    return frozenset(_arch(a, "ARCHFLAGS", value) for a in words[1::2])


def _parse_policy(value: str) -> tuple[str, tuple[int, int], str]:
    """(family, libc version, cuvil arch) of an AUDITWHEEL_PLAT value."""
    m = _POLICY_RE.match(value)
    if m is None:
        raise ConfigError(
            f"environment variable AUDITWHEEL_PLAT={value}: not a manylinux or musllinux policy "
            "such as manylinux2014_x86_64, manylinux_2_28_aarch64 or musllinux_1_2_x86_64"
        )
    if m.group("legacy"):
        family, version = "manylinux", _LEGACY_MANYLINUX[m.group("legacy")]
    else:
        family, version = m.group("family"), (int(m.group("major")), int(m.group("minor")))
    return family, version, _arch(m.group("arch"), "AUDITWHEEL_PLAT", value)


def _named_target(ask: _Ask, host_os: str, get_target: Callable[[str | None], Target]) -> Target:
    os_name = ask.os or host_os
    arches = ask.arches or frozenset({_host_arch()})
    libc = ask.libc or "gnu"
    said = ", ".join(ask.said)
    name = target_name_for(os_name, arches, libc)
    if name is None:
        raise ConfigError(
            f"the environment ({said}) asks for {os_name} {'+'.join(sorted(arches))}, which cuvil "
            "has no target for; run `cuvil targets` for those it has"
        )
    try:
        return get_target(name)
    except ToolchainError:
        if any((d / f"{name}.toml").is_file() for d in toolchain_search_path()):
            raise  # the file exists but is broken: its own message says how
        raise ToolchainError(
            f"target not available in this cuvil: the environment ({said}) asks for target "
            f"{name!r}, and this cuvil has no toolchain file for it. Upgrade cuvil, add "
            f"{name}.toml to a folder on $CUVIL_TOOLCHAIN_PATH, or skip these builds "
            '(cibuildwheel: skip = ["*-musllinux_*"] or archs = [...] under '
            "[tool.cibuildwheel])"
        ) from None


def _agree(target: Target, ask: _Ask, explicit: str) -> None:
    """A named target must be the one the environment's variables for its OS ask for."""
    if not ask.said or ask.os != _target_os(target):
        return
    built = frozenset(a.name for a in target.arches)
    libc_differs = ask.libc is not None and _target_os(target) == "linux" and ask.libc != _target_libc(target)
    if (ask.arches is not None and ask.arches != built) or libc_differs:
        wanted = target_name_for(ask.os, ask.arches or built, ask.libc or "gnu") or "another target"
        raise ConfigError(
            f"target {explicit!r} is named (by -C target, CUVIL_TARGET or tool.cuvil.target), but "
            f"the environment ({', '.join(ask.said)}) asks for {wanted}: under cibuildwheel, "
            "remove the target setting so that each build follows its platform"
        )


# ------------------------------------------------------------------------------ the tag


def _adjust(target: Target, env: Mapping[str, str]) -> BuildPlatform:
    os_name = _target_os(target)
    if os_name == "macos" and "MACOSX_DEPLOYMENT_TARGET" in env:
        return _deployment_target(target, env["MACOSX_DEPLOYMENT_TARGET"])
    if os_name == "linux" and "AUDITWHEEL_PLAT" in env:
        return _policy_tag(target, env["AUDITWHEEL_PLAT"])
    return BuildPlatform(target, target.platform_tag)


def _zig_macos_version(zig_target: str) -> tuple[int, int]:
    m = re.search(r"-macos\.(\d+)\.(\d+)", zig_target)
    return (int(m.group(1)), int(m.group(2))) if m else (10, 13)


def _deployment_target(target: Target, value: str) -> BuildPlatform:
    where = f"environment variable MACOSX_DEPLOYMENT_TARGET={value}"
    m = _VERSION_RE.match(value)
    if m is None:
        raise ConfigError(f"{where}: not a macOS version such as 10.13, 11.0 or 14")
    asked = (int(m.group(1)), int(m.group(2) or 0))
    notes = []
    if asked[0] >= 11 and asked[1]:
        # wheel tags of macOS 11 and later carry no minor version (pip asks for X_0 only)
        notes.append(f"{where}: macOS {asked[0]}.{asked[1]} is tagged and built as {asked[0]}.0")
        asked = (asked[0], 0)
    arches, versions = [], {}
    for arch in target.arches:
        oldest = _zig_macos_version(arch.zig_target)
        if arch.name == "aarch64":
            oldest = max(oldest, _ARM64_FIRST_MACOS)
            version = max(asked, oldest)  # every arm64 Mac runs 11+: lower asks for nothing more
        elif asked < oldest:
            # delocate-wheel, which cibuildwheel runs next, reads the same variable and would
            # reject the library as too new; a raised tag would not be what was asked either
            raise ConfigError(
                f"{where} is older than macOS {oldest[0]}.{oldest[1]}, the oldest the "
                f"{arch.name} code of target {target.name} runs on ({target.source}); set "
                f"MACOSX_DEPLOYMENT_TARGET={oldest[0]}.{oldest[1]} or newer (cibuildwheel: "
                "[tool.cibuildwheel.macos.environment])"
            )
        else:
            version = asked
        versions[arch.name] = version
        text = f"{version[0]}.{version[1]}"
        arches.append(replace(
            arch,
            zig_target=re.sub(r"-macos(\.[\d.]+)?", f"-macos.{text}", arch.zig_target, count=1),
            llvm_triple=re.sub(r"macosx[\d.]*", f"macosx{text}.0", arch.llvm_triple, count=1),
        ))
    tag_version = versions.get("x86_64", versions.get("aarch64", asked))
    suffix = target.platform_tag.split(".")[0].split("_", 3)[3]  # macosx_10_13_<suffix>
    tag = f"macosx_{tag_version[0]}_{tag_version[1]}_{suffix}"
    if tag != target.platform_tag:
        notes.append(f"{where}: wheel tag {tag}")
    return BuildPlatform(replace(target, arches=tuple(arches), platform_tag=tag), tag, tuple(notes))


def _manylinux_names(version: tuple[int, int], arch_tag: str) -> set[str]:
    names = {f"manylinux_{version[0]}_{version[1]}_{arch_tag}"}
    names |= {f"{legacy}_{arch_tag}" for legacy, v in _LEGACY_MANYLINUX.items() if v == version}
    return names


def _policy_tag(target: Target, value: str) -> BuildPlatform:
    where = f"environment variable AUDITWHEEL_PLAT={value}"
    family, asked, arch = _parse_policy(value)
    arch_tag = value.rsplit("_", 1)[1] if not value.endswith("_x86_64") else "x86_64"
    try:
        own = _parse_policy(target.platform_tag.split(".")[0])
    except ConfigError:
        raise ConfigError(
            f"{where}: target {target.name} ({target.source}) is tagged {target.platform_tag}, "
            "not for a manylinux or musllinux policy; unset AUDITWHEEL_PLAT for it"
        ) from None
    libc = "musl" if family == "musllinux" else "glibc"
    if own[0] != family or own[2] != arch:
        raise ConfigError(
            f"{where} asks for a {family} {arch} wheel, but target {target.name} builds "
            f"{target.platform_tag}; remove the target setting, or build in the matching image"
        )
    if asked < own[1]:
        raise ConfigError(
            f"{where} asks for {libc} {asked[0]}.{asked[1]}, older than the {libc} "
            f"{own[1][0]}.{own[1][1]} that target {target.name} links against ({target.source}): "
            f"its library would not satisfy that policy. Build in a {own[0]}_{own[1][0]}_{own[1][1]} "
            "image or newer (cibuildwheel: manylinux-*-image / musllinux-*-image)"
        )
    # as `auditwheel repair` tags: the policy asked for and, when the library meets an older
    # one, that one too, each with its legacy alias
    if family == "manylinux":
        names = _manylinux_names(asked, arch_tag) | _manylinux_names(own[1], arch_tag)
    else:
        names = {f"musllinux_{v[0]}_{v[1]}_{arch_tag}" for v in {asked, own[1]}}
    tag = ".".join(sorted(names))
    notes = (f"{where}: wheel tag {tag}",) if tag != target.platform_tag else ()
    return BuildPlatform(target, tag, notes)
