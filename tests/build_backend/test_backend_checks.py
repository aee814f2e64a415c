"""The build backend runs the checks of `cuvil check` on every wheel it writes.

A copy of the digits example is compiled once (x86_64-linux); each test then builds its wheel
from those package files, some changed to break one check, and looks at what the hook did:
the build fails naming the check and leaves nothing in the output folder, or, with the check
listed in `check-warnings`, writes the wheel and warns. The independent judge of the written
wheels is `cuvil check` itself, run on them afterwards.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cuvil.build_backend as backend
from cuvil import cli
from cuvil.build_backend._package import build_package_files
from cuvil.check import check_wheel
from cuvil.errors import BuildError, ConfigError
from cuvil.toolchains import get_target

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"
LIBRARY = "digits/_classifier.so"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="builds with the host's default target"),
]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The digits package files for x86_64-linux, compiled once."""
    from cuvil.config import load_project

    project = load_project(DIGITS, {"target": "x86_64-linux",
                                    "build-dir": str(tmp_path_factory.mktemp("build"))})
    workdir = project.settings.build_dir / "x86_64-linux"
    workdir.mkdir(parents=True)
    return build_package_files(project, workdir, lambda message: None, get_target("x86_64-linux"))


@pytest.fixture
def build(
    compiled: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., str]:
    """build(check_warnings=..., change=...) -> wheel name, built from a copy of the project in
    tmp_path/project into tmp_path/dist, with `change` applied to the compiled files."""
    root = tmp_path / "project"
    shutil.copytree(DIGITS, root, ignore=shutil.ignore_patterns("build", "dist"))
    monkeypatch.chdir(root)
    calls: list[Path] = []

    def run(
        check_warnings: list[str] | None = None,
        change: Callable[[dict[str, bytes]], None] | None = None,
        hook: Callable[..., str] = backend.build_wheel,
    ) -> str:
        if check_warnings is not None:
            text = (root / "pyproject.toml").read_text()
            setting = f"check-warnings = {json.dumps(check_warnings)}\n"
            (root / "pyproject.toml").write_text(text.replace("[tool.cuvil]\n", "[tool.cuvil]\n" + setting))

        def package_files(
            project: Any, workdir: Path, log: Callable[[str], None], target: Any
        ) -> dict[str, bytes]:
            calls.append(workdir)
            files = dict(compiled)
            if change is not None:
                change(files)
            return files

        monkeypatch.setattr(backend, "_build_package_files", package_files)
        return hook(str(tmp_path / "dist"), {"target": "x86_64-linux", "build-dir": str(tmp_path / "b")})

    run.calls = calls  # type: ignore[attr-defined]
    return run


def break_abi_checksum(files: dict[str, bytes]) -> None:
    """One hex digit of the library's exported ABI checksum changed: the ABI checksum check fails."""
    checksum = json.loads(files["digits/_models.json"])["models"][0]["checksum"].encode()
    library = files[LIBRARY]
    at = library.index(checksum + b"\0") + 3
    files[LIBRARY] = library[:at] + (b"0" if library[at : at + 1] != b"0" else b"1") + library[at + 1 :]


def test_a_good_wheel_is_checked_and_the_summary_logged(
    build: Callable[..., str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    name = build()
    err = capfd.readouterr().err
    assert f"cuvil: checked {name}: OK: all " in err, err
    assert [p.name for p in (tmp_path / "dist").iterdir()] == [name]  # no staging folder left
    assert check_wheel(tmp_path / "dist" / name).ok


def test_a_failed_check_fails_the_build_and_leaves_no_wheel(
    build: Callable[..., str], tmp_path: Path
) -> None:
    with pytest.raises(BuildError) as caught:
        build(change=break_abi_checksum)
    message = str(caught.value)
    assert "fails 1 of the" in message and "so it was not written" in message
    assert f"FAIL {LIBRARY}: ABI checksum of classifier" in message
    assert 'check-warnings = ["ABI checksum"]' in message
    assert list((tmp_path / "dist").iterdir()) == []


def test_check_warnings_turns_a_named_check_into_a_warning(
    build: Callable[..., str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    name = build(check_warnings=["ABI checksum"], change=break_abi_checksum)
    err = capfd.readouterr().err
    assert f"cuvil: warning: check {LIBRARY}: ABI checksum of classifier failed" in err
    assert "1 failed as warnings" in err
    # the wheel is written, and `cuvil check` still finds what the build only warned about
    code = cli.main(["check", "--no-auditwheel", str(tmp_path / "dist" / name)])
    assert code == 1 and f"FAIL {LIBRARY}: ABI checksum of classifier" in capfd.readouterr().out


def test_check_warnings_names_are_checked_before_compiling(build: Callable[..., str]) -> None:
    with pytest.raises(ConfigError, match=r"check-warnings: no check is named 'ABI checksums'; "
                                          r"did you mean 'ABI checksum'\?"):
        build(check_warnings=["ABI checksums"])
    assert build.calls == []  # type: ignore[attr-defined]


def test_archive_cannot_be_a_warning(build: Callable[..., str]) -> None:
    with pytest.raises(ConfigError, match='"archive" cannot be a warning'):
        build(check_warnings=["archive"])


def test_a_skipped_check_is_reported_as_skipped(
    build: Callable[..., str],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cuvil.check.auditwheel

    monkeypatch.setattr(cuvil.check.auditwheel, "auditwheel_command", lambda: None)
    name = build()
    err = capfd.readouterr().err
    assert "cuvil: check auditwheel skipped: auditwheel is not installed" in err
    report = check_wheel(tmp_path / "dist" / name, load=True)  # as the backend checks it
    assert report.ok and report["auditwheel"].skipped and not report["load"].skipped
    summary = f"OK: {len(report) - 1} passed, 1 skipped"
    assert f"cuvil: checked {name}: {summary}" in err
    assert cli.main(["check", "--load", str(tmp_path / "dist" / name)]) == 0
    out = capfd.readouterr().out
    assert "SKIP auditwheel" in out and summary in out and "all" not in out.splitlines()[-1]


def test_an_editable_build_checks_the_package_first(build: Callable[..., str], tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="ABI checksum of classifier"):
        build(change=break_abi_checksum, hook=backend.build_editable)
    assert not (tmp_path / "b" / "editable").exists()
    assert not (tmp_path / "dist").exists() or list((tmp_path / "dist").iterdir()) == []
