"""tests/host_tools.py: a test needing qemu, musl, wine or valgrind skips before its fixtures
compile anything, naming the Debian package; in CI it does not skip but fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import host_tools
import pytest

TESTS = Path(__file__).resolve().parent


def test_tests_needing_a_missing_tool_skip_at_collection_naming_the_package() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["CUVIL_TEST_WITHOUT"] = "qemu-aarch64-static,valgrind"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0",
         "--setup-plan",  # fixtures are listed, not run: a skip must come from a mark
         "tests/toolchains/test_harness.py::test_aarch64_under_qemu",
         "tests/kernels/test_int8_gemm_kernel.py::test_aarch64_kernels_under_qemu",
         "tests/fuzz/test_fuzz_valgrind.py"],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    for name in ("test_harness.py", "test_int8_gemm_kernel.py", "test_fuzz_valgrind.py"):
        assert any(name in line for line in skips), out
    for line in skips:
        package = "valgrind" if "valgrind" in line else "qemu-user-static"
        assert f"apt-get install {package}" in line, line
    # every test skipped: none got to its body (which --setup-plan does not run)
    assert out.strip().splitlines()[-1].split()[1:3] == ["skipped", "in"], out


def test_in_ci_a_missing_tool_fails_instead_of_skipping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUVIL_TEST_WITHOUT", str(host_tools.WINE))
    monkeypatch.setenv("CI", "true")
    (condition,) = host_tools.needs(str(host_tools.WINE)).args
    assert condition is False
    with pytest.raises(pytest.fail.Exception, match=r"apt-get install wine64.*CI must run this test"):
        host_tools.tool(str(host_tools.WINE))
    monkeypatch.delenv("CI")
    (condition,) = host_tools.needs(str(host_tools.WINE)).args
    assert condition is True
    with pytest.raises(pytest.skip.Exception, match="apt-get install wine64"):
        host_tools.tool(str(host_tools.WINE))
