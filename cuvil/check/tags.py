"""The wheel's file name and tags: `py3-none-<platform>`, and the platform of the recorded target."""

from __future__ import annotations

from cuvil.check._archive import WheelArchive
from cuvil.check._platform import macos_version, manylinux_glibc, tag_arches
from cuvil.check._report import CheckReport
from cuvil.errors import CuvilError

__all__ = ["check_filename", "check_platform"]


def check_filename(wheel: WheelArchive, report: CheckReport) -> None:
    name = "wheel file name"
    if wheel.filename_error is not None:
        report.failed(
            name,
            f"{wheel.path.name!r} is not a valid wheel file name ({wheel.filename_error}); the name must be "
            "<distribution>-<version>-py3-none-<platform>.whl as cuvil writes it",
        )
        return
    bad = sorted(str(t) for t in wheel.tags if t.interpreter != "py3" or t.abi != "none")
    if bad:
        report.failed(
            name,
            f"tags {', '.join(bad)} are not py3-none-<platform>: a cuvil library does not depend on the "
            "Python version or ABI, so the wheel must say py3-none",
        )
        return
    generic = [p for p in wheel.platforms if p == "any"]
    if generic:
        native = wheel.native_members()
        held = (
            f"but it holds native libraries ({', '.join(native)})"
            if native
            else "but a cuvil wheel holds its models' native libraries, and this one holds none"
        )
        report.failed(
            name, f"platform tag 'any' claims a pure-Python wheel, {held}; rebuild it with `cuvil build`"
        )
        return
    report.passed(name, f"{wheel.name} {wheel.version}, tags {', '.join(sorted(map(str, wheel.tags)))}")


def _family(platform: str) -> tuple[str, tuple[int, int] | None]:
    """The tag's kind (manylinux with its legacy names, musllinux, macosx, ...) and version."""
    if (glibc := manylinux_glibc(platform)) is not None:
        return "manylinux", glibc
    if (macos := macos_version(platform)) is not None:
        return "macosx", macos
    if platform.startswith("musllinux_"):
        major, minor = platform.split("_")[1:3]
        return "musllinux", (int(major), int(minor))
    return platform, None


def _same_platform_newer(found: list[str], expected: list[str]) -> bool:
    """Whether every tag found is the target's kind of tag for its arches, at its version or a
    newer one: what MACOSX_DEPLOYMENT_TARGET or AUDITWHEEL_PLAT make of the target's tag. The
    libraries' own minimum OS and glibc are checked against each tag by the ELF and Mach-O checks."""
    oldest = dict(_family(p) for p in expected)
    arches = {tag_arches(p) for p in expected}
    for platform in found:
        kind, version = _family(platform)
        if kind not in oldest or tag_arches(platform) not in arches:
            return False
        floor = oldest[kind]
        if version is None or floor is None or version < floor:
            return False
    return True


def check_platform(wheel: WheelArchive, report: CheckReport) -> None:
    """The platform tags equal the recorded target's, and name the architectures it builds."""
    name = "platform tag"
    if wheel.filename_error is not None or not wheel.tags:
        report.failed(name, "cannot compare: the wheel file name has no valid tags")
        return
    if wheel.manifest is None:
        report.failed(name, f"cannot compare: {wheel.manifest_error}")
        return
    target_name = wheel.manifest.get("target")
    if not isinstance(target_name, str):
        report.failed(name, f"{wheel.manifest_path} records no target")
        return
    from cuvil.toolchains import get_target

    try:
        target = get_target(target_name)
    except CuvilError as exc:
        report.failed(
            name,
            f"{wheel.manifest_path} records target {target_name!r}, unknown here ({exc}); "
            "check the wheel on a machine that has its toolchain file",
        )
        return
    expected = sorted(target.platform_tag.split("."))
    found = wheel.platforms
    if found != expected and not _same_platform_newer(found, expected):
        report.failed(
            name,
            f"the file name says platform {'.'.join(found)}, but the libraries were built for target "
            f"{target.name}, whose platform tag is {target.platform_tag}; rename nothing by hand: rebuild "
            f"with `cuvil build --target {target.name}`",
        )
        return
    built = {a.name for a in target.arches}
    for platform in found:
        arches = tag_arches(platform)
        if arches is not None and arches != built:
            report.failed(
                name,
                f"platform {platform} means arch(es) {', '.join(sorted(arches))}, but target {target.name} "
                f"builds {', '.join(sorted(built))} (toolchain file {target.source})",
            )
            return
    how = "is" if found == expected else f"holds to (its own: {target.platform_tag})"
    report.passed(name, f"{'.'.join(found)} {how} the platform tag of target {target.name}")
