"""The build backend follows the platform variables cibuildwheel sets (cuvil/build_backend/_platform_env.py).

The environments below are those cibuildwheel documents and sets for each build identifier:
on macOS `MACOSX_DEPLOYMENT_TARGET` (its default: 10.9 for CPython < 3.12, 10.13 for 3.12 and
3.13, 10.15 for 3.14, 11.0 for arm64), `_PYTHON_HOST_PLATFORM` (always macosx-10.9-x86_64 /
-universal2 or macosx-11.0-arm64, whatever the deployment target) and `ARCHFLAGS`; on Linux the
manylinux/musllinux image's `AUDITWHEEL_PLAT`; on Windows `VSCMD_ARG_TGT_ARCH`. The expected tags
are what `auditwheel repair` and delocate would write (tests/build_backend/test_cibuildwheel.py runs them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cuvil.build_backend import _platform_env
from cuvil.build_backend._platform_env import resolve_platform, target_name_for
from cuvil.errors import ConfigError, ToolchainError
from cuvil.toolchains import Target, get_target

MACOS_X86 = {"_PYTHON_HOST_PLATFORM": "macosx-10.9-x86_64", "ARCHFLAGS": "-arch x86_64"}
MACOS_ARM = {"_PYTHON_HOST_PLATFORM": "macosx-11.0-arm64", "ARCHFLAGS": "-arch arm64",
             "MACOSX_DEPLOYMENT_TARGET": "11.0"}
MACOS_UNIVERSAL2 = {"_PYTHON_HOST_PLATFORM": "macosx-10.9-universal2",
                    "ARCHFLAGS": "-arch arm64 -arch x86_64"}


def resolve(env: dict[str, str], explicit: str | None = None, host: str = "linux") -> tuple[Target, str]:
    chosen = resolve_platform(explicit, get_target, env, host_os=host)
    return chosen.target, chosen.platform_tag


def versions(target: Target) -> dict[str, tuple[str, str]]:
    return {a.name: (a.zig_target, a.llvm_triple) for a in target.arches}


@pytest.mark.parametrize(
    ("identifier", "env", "host", "name", "tag"),
    [
        ("cp312-manylinux_x86_64", {"AUDITWHEEL_PLAT": "manylinux_2_28_x86_64"}, "linux",
         "x86_64-linux", "manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64"),
        ("cp312-manylinux_x86_64 (manylinux2014 image)", {"AUDITWHEEL_PLAT": "manylinux2014_x86_64"},
         "linux", "x86_64-linux", "manylinux2014_x86_64.manylinux_2_17_x86_64"),
        ("cp312-manylinux_aarch64", {"AUDITWHEEL_PLAT": "manylinux_2_28_aarch64"}, "linux",
         "aarch64-linux", "manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64"),
        ("cp312-macosx_x86_64", {**MACOS_X86, "MACOSX_DEPLOYMENT_TARGET": "10.13"}, "macos",
         "x86_64-macos", "macosx_10_13_x86_64"),
        ("cp314-macosx_x86_64", {**MACOS_X86, "MACOSX_DEPLOYMENT_TARGET": "10.15"}, "macos",
         "x86_64-macos", "macosx_10_15_x86_64"),
        ("cp312-macosx_arm64", MACOS_ARM, "macos", "arm64-macos", "macosx_11_0_arm64"),
        ("cp312-macosx_universal2", {**MACOS_UNIVERSAL2, "MACOSX_DEPLOYMENT_TARGET": "10.13"},
         "macos", "universal2-macos", "macosx_10_13_universal2"),
        # the report, on a Linux host: the variables alone pick the macOS target
        ("macOS arm64 from Linux", {"_PYTHON_HOST_PLATFORM": "macosx-11.0-arm64",
                                    "ARCHFLAGS": "-arch arm64"}, "linux",
         "arm64-macos", "macosx_11_0_arm64"),
    ],
)
def test_cibuildwheel_environments_choose_target_and_tag(
    identifier: str, env: dict[str, str], host: str, name: str, tag: str
) -> None:
    target, found = resolve(env, host=host)
    assert (target.name, found) == (name, tag), identifier
    assert target.platform_tag == found or "linux" in name


def test_deployment_target_sets_tag_and_minimum_os_of_every_slice() -> None:
    target, tag = resolve({"MACOSX_DEPLOYMENT_TARGET": "12.0"}, explicit="arm64-macos")
    assert tag == "macosx_12_0_arm64"
    assert versions(target) == {"aarch64": ("aarch64-macos.12.0", "arm64-apple-macosx12.0.0")}
    target, tag = resolve({**MACOS_UNIVERSAL2, "MACOSX_DEPLOYMENT_TARGET": "10.15"}, host="macos")
    assert tag == "macosx_10_15_universal2"
    # an arm64 slice never goes below macOS 11, the first on Apple silicon
    assert versions(target) == {
        "x86_64": ("x86_64-macos.10.15", "x86_64-apple-macosx10.15.0"),
        "aarch64": ("aarch64-macos.11.0", "arm64-apple-macosx11.0.0"),
    }
    target, tag = resolve({**MACOS_ARM, "MACOSX_DEPLOYMENT_TARGET": "10.13"}, host="macos")
    assert (tag, versions(target)["aarch64"][0]) == ("macosx_11_0_arm64", "aarch64-macos.11.0")


def test_deployment_target_after_11_has_no_minor_version_in_tag_or_library() -> None:
    chosen = resolve_platform("arm64-macos", get_target, {"MACOSX_DEPLOYMENT_TARGET": "13.4"})
    assert chosen.platform_tag == "macosx_13_0_arm64"
    assert chosen.target.arches[0].zig_target == "aarch64-macos.13.0"
    assert any("13.0" in note for note in chosen.notes)


def test_deployment_target_below_the_targets_minimum_is_an_error() -> None:
    # cibuildwheel's default for CPython < 3.12; delocate-wheel would reject the library after
    with pytest.raises(ConfigError, match=r"MACOSX_DEPLOYMENT_TARGET=10\.9 is older than macOS "
                       r"10\.13.*set MACOSX_DEPLOYMENT_TARGET=10\.13"):
        resolve({**MACOS_X86, "MACOSX_DEPLOYMENT_TARGET": "10.9"}, host="macos")
    with pytest.raises(ConfigError, match="not a macOS version"):
        resolve({"MACOSX_DEPLOYMENT_TARGET": "high sierra"}, explicit="x86_64-macos")


def test_variables_of_another_os_leave_the_target_alone() -> None:
    target, tag = resolve({"MACOSX_DEPLOYMENT_TARGET": "12.0", "ARCHFLAGS": "-arch arm64"},
                          explicit="x86_64-linux")
    assert (target.name, tag) == ("x86_64-linux", "manylinux_2_17_x86_64")
    assert target == get_target("x86_64-linux")
    target, tag = resolve({"AUDITWHEEL_PLAT": "manylinux_2_28_aarch64"}, explicit="arm64-macos")
    assert (target.name, tag) == ("arm64-macos", "macosx_11_0_arm64")


def test_named_target_must_agree_with_the_environment_of_its_os() -> None:
    with pytest.raises(ConfigError, match=r"target 'x86_64-linux' is named.*aarch64-linux"):
        resolve({"AUDITWHEEL_PLAT": "manylinux2014_aarch64"}, explicit="x86_64-linux")
    with pytest.raises(ConfigError, match=r"universal2-macos.*x86_64-macos"):
        resolve(MACOS_X86, explicit="universal2-macos", host="macos")


def test_disagreeing_or_malformed_variables_are_errors() -> None:
    with pytest.raises(ConfigError, match=r"disagree.*ARCHFLAGS=-arch x86_64"):
        resolve({"_PYTHON_HOST_PLATFORM": "macosx-11.0-arm64", "ARCHFLAGS": "-arch x86_64"})
    with pytest.raises(ConfigError, match="ARCHFLAGS=arm64: expected '-arch x86_64'"):
        resolve({"_PYTHON_HOST_PLATFORM": "macosx-11.0-arm64", "ARCHFLAGS": "arm64"})
    with pytest.raises(ConfigError, match="not a manylinux or musllinux policy"):
        resolve({"AUDITWHEEL_PLAT": "linux_x86_64"})
    with pytest.raises(ConfigError, match="no wheels for architecture 'i686'"):
        resolve({"AUDITWHEEL_PLAT": "manylinux2014_i686"})
    with pytest.raises(ConfigError, match="_PYTHON_HOST_PLATFORM=freebsd-14-amd64: not a platform"):
        resolve({"_PYTHON_HOST_PLATFORM": "freebsd-14-amd64"})


def test_policy_older_than_the_targets_glibc_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"manylinux2010_x86_64 asks for glibc 2\.12, older than "
                       r"the glibc 2\.17 that target x86_64-linux links against"):
        resolve({"AUDITWHEEL_PLAT": "manylinux2010_x86_64"})


@pytest.mark.parametrize(
    ("env", "host", "name"),
    [
        ({"AUDITWHEEL_PLAT": "musllinux_1_2_x86_64"}, "linux", "x86_64-linux-musl"),
        ({"AUDITWHEEL_PLAT": "musllinux_1_2_aarch64"}, "linux", "aarch64-linux-musl"),
        ({"VSCMD_ARG_TGT_ARCH": "x64"}, "windows", "x86_64-windows"),
        ({"VSCMD_ARG_TGT_ARCH": "arm64"}, "windows", "aarch64-windows"),
        ({"_PYTHON_HOST_PLATFORM": "win-arm64"}, "linux", "aarch64-windows"),
    ],
)
def test_platform_without_a_toolchain_file_is_not_available(
    env: dict[str, str], host: str, name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # as if this cuvil had no file for the target (whether or not it ships one)
    monkeypatch.setattr(_platform_env, "toolchain_search_path", lambda: [tmp_path])

    def known_only(wanted: str | None) -> Target:
        raise ToolchainError(f"unknown target {wanted!r}")

    with pytest.raises(ToolchainError, match=f"target not available in this cuvil: .*'{name}'"):
        resolve_platform(None, known_only, env, host_os=host)


MUSL_TOOLCHAIN = """
name = "x86_64-linux-musl"
object-format = "elf"
platform-tag = "musllinux_1_2_x86_64"
library-suffix = ".so"

[[arch]]
name = "x86_64"
llvm-triple = "x86_64-unknown-linux-musl"
zig-target = "x86_64-linux-musl"
cpu = "x86-64-v2"
"""


def test_musllinux_policy_picks_the_musl_target_when_there_is_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "x86_64-linux-musl.toml").write_text(MUSL_TOOLCHAIN)
    monkeypatch.setenv("CUVIL_TOOLCHAIN_PATH", str(tmp_path))
    target, tag = resolve({"AUDITWHEEL_PLAT": "musllinux_1_2_x86_64"})
    assert (target.name, tag) == ("x86_64-linux-musl", "musllinux_1_2_x86_64")
    target, tag = resolve({"AUDITWHEEL_PLAT": "musllinux_1_3_x86_64"})
    assert tag == "musllinux_1_2_x86_64.musllinux_1_3_x86_64"
    with pytest.raises(ConfigError, match=r"environment \(AUDITWHEEL_PLAT=manylinux_2_28_x86_64\) asks "
                       r"for x86_64-linux"):
        resolve({"AUDITWHEEL_PLAT": "manylinux_2_28_x86_64"}, explicit="x86_64-linux-musl")


def test_target_names_for_every_platform() -> None:
    two = frozenset({"x86_64", "aarch64"})
    assert target_name_for("macos", two) == "universal2-macos"
    assert target_name_for("linux", frozenset({"aarch64"}), "musl") == "aarch64-linux-musl"
    assert target_name_for("windows", frozenset({"x86_64"})) == "x86_64-windows"
    assert target_name_for("linux", two) is None


def test_no_variables_no_change(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = resolve_platform("aarch64-linux", get_target, {"PATH": "/bin", "ARCHFLAGS": " "})
    assert chosen.target == get_target("aarch64-linux")
    assert (chosen.platform_tag, chosen.notes) == ("manylinux_2_17_aarch64", ())


def test_check_accepts_the_targets_kind_of_tag_at_its_version_or_newer() -> None:
    from cuvil.check.tags import _same_platform_newer as accepted

    assert accepted(["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"],
                    ["manylinux_2_17_x86_64"])
    assert accepted(["macosx_12_0_arm64"], ["macosx_11_0_arm64"])
    assert not accepted(["manylinux_2_12_x86_64"], ["manylinux_2_17_x86_64"])  # older than built for
    assert not accepted(["macosx_10_9_x86_64"], ["macosx_10_13_x86_64"])
    assert not accepted(["manylinux_2_28_aarch64"], ["manylinux_2_17_x86_64"])  # another arch
    assert not accepted(["musllinux_1_2_x86_64"], ["manylinux_2_17_x86_64"])  # another libc
    assert not accepted(["macosx_11_0_universal2"], ["macosx_11_0_arm64"])
