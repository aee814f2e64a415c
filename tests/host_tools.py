"""The programs some tests run cross-built code with, and the Debian package of each: qemu-user
(aarch64 code and older x86 CPUs), an aarch64 glibc, musl's dynamic loader, wine64, valgrind.

A test that needs one is marked `@needs(...)`: the mark is evaluated at collection, so the test
skips before its fixtures compile anything, with the package to install in the reason. CI
(CI=true) must run every test (.ci/run installs them): there the mark does not skip, and
`tool()` in the test fails naming the package. CUVIL_TEST_WITHOUT=name,... hides tools, to
see these skips on a machine that has them (tests/test_host_tools.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")
AARCH64_LOADER = AARCH64_SYSROOT / "lib" / "ld-linux-aarch64.so.1"
MUSL_LOADER = {"x86_64": Path("/lib/ld-musl-x86_64.so.1"), "aarch64": Path("/lib/ld-musl-aarch64.so.1")}
WINE = Path("/usr/lib/wine/wine64")
#: each tool (a command, or a file's absolute path) -> its Debian package
PACKAGES = {"qemu-x86_64-static": "qemu-user-static", "qemu-aarch64-static": "qemu-user-static",
            str(AARCH64_SYSROOT): "libc6-arm64-cross", str(AARCH64_LOADER): "libc6-arm64-cross",
            str(MUSL_LOADER["x86_64"]): "musl", str(WINE): "wine64", "valgrind": "valgrind"}
#: what running aarch64-linux programs needs
QEMU_AARCH64 = ("qemu-aarch64-static", str(AARCH64_LOADER))


def _in_ci() -> bool:
    return os.environ.get("CI") == "true"


def find(name: str) -> str | None:
    """The tool's path, or None when it is missing (or hidden by CUVIL_TEST_WITHOUT)."""
    if name in os.environ.get("CUVIL_TEST_WITHOUT", "").split(","):
        return None
    if os.path.isabs(name):
        return name if os.path.exists(name) else None
    return shutil.which(name)


def _reason(names: list[str]) -> str:
    packages = " ".join(dict.fromkeys(PACKAGES.get(n, n) for n in names))
    return f"{', '.join(names)} not installed (Debian: apt-get install {packages})"


def needs(*names: str) -> pytest.MarkDecorator:
    """Skip the test, before its fixtures run, when one of the tools is missing (not in CI)."""
    missing = [n for n in names if find(n) is None]
    return pytest.mark.skipif(bool(missing) and not _in_ci(), reason=_reason(missing))


def tool(name: str) -> str:
    """The tool's path; a missing one skips the test, or fails it in CI."""
    path = find(name)
    if path is None:
        if _in_ci():
            pytest.fail(f"{_reason([name])}; CI must run this test: install it in .ci/run")
        pytest.skip(_reason([name]))
    return path
