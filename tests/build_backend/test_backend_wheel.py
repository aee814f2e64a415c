"""Wheels and editable wheels written by the PEP 517/660 hooks, with a fake package generator."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import stat
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
from packaging.metadata import Metadata
from packaging.tags import Tag
from packaging.utils import parse_wheel_filename
from packaging.version import Version

import cuvil.build_backend as backend
from cuvil.build_backend import _reproducible
from cuvil.config import CompileOptions
from cuvil.errors import ConfigError, CuvilError, ModelError

PYPROJECT = """\
[build-system]
requires = ["cuvil"]
build-backend = "cuvil.build_backend"

[project]
name = "Digits.Cuvil"
version = "1.0.0"
description = "Digit classifier"
readme = "README.md"
license = "MIT"
scripts = { digits-predict = "digits_cli:main" }  # another distribution's module: not checked

[tool.cuvil]
package = "digits"

[tool.cuvil.models.classifier]
source = "models/classifier.onnx"
"""

PACKAGE_FILES = {
    "digits/__init__.py": b"from digits._models import classifier\n",
    "digits/_models.py": b"classifier = 'compiled'\n",
    "digits/_classifier.so": b"\x7fELF fake library",
    "digits/classifier.h": b"/* header */\n",
    "digits/__init__.pyi": b"classifier: str\n",
    "digits/py.typed": b"",
}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A model project in tmp_path/project (the cwd), with config, target and generator faked."""
    root = tmp_path / "project"
    (root / "models").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "README.md").write_text("# Digits\n")
    (root / "LICENSE").write_text("MIT License\n")
    (root / "models" / "classifier.onnx").write_bytes(b"onnx")
    monkeypatch.chdir(root)
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)

    state = types.SimpleNamespace(root=root, files=dict(PACKAGE_FILES), calls=[], settings=[])

    def load_project(config_settings: Any) -> Any:
        if sys.version_info >= (3, 11):
            import tomllib
        else:
            import tomli as tomllib
        state.settings.append(config_settings)
        data = tomllib.loads((Path.cwd() / "pyproject.toml").read_text())
        return types.SimpleNamespace(
            root=Path.cwd(),
            pyproject=Path.cwd() / "pyproject.toml",
            project=data["project"],
            name=data["project"]["name"],
            package="digits",
            models=(
                types.SimpleNamespace(
                    name="classifier",
                    source=Path.cwd() / "models/classifier.onnx",
                    calibration=None,
                    inputs={},
                    quantize="none",
                    precision="float32",
                    transformed_weights="library",
                ),
            ),
            settings=types.SimpleNamespace(
                target=(config_settings or {}).get("target"),
                build_dir=Path.cwd() / "build" / "cuvil",
                cpu=None,
                opt_level=3,
                verbose=False,
                editable_rebuild="auto",
            ),
            python_source=None,
            python_package=None,
            version=None,
            custom_ops=(),
            op_modules=(),
            compile_options=lambda model: CompileOptions(),
        )

    def build_package_files(
        project: Any, workdir: Path, log: Callable[[str], None], target: Any
    ) -> dict[str, bytes]:
        assert workdir.is_dir()
        state.calls.append(workdir)
        log("generated the package")
        if isinstance(state.files, Exception):
            raise state.files
        return dict(state.files)

    monkeypatch.setattr(backend, "_load_project", load_project)
    monkeypatch.setattr(
        backend,
        "_get_target",
        lambda name: types.SimpleNamespace(
            name=name or "x86_64-linux", platform_tag="manylinux_2_17_x86_64"
        ),
    )
    monkeypatch.setattr(backend, "_build_package_files", build_package_files)
    # the fake package is no valid cuvil wheel: the checks run on real builds in test_backend_checks.py
    state.checked = []
    monkeypatch.setattr(backend, "_wheel_check", lambda project: state.checked.append)
    return state


def build(out: Path, config_settings: dict[str, str] | None = None) -> Path:
    out.mkdir(exist_ok=True)
    name = backend.build_wheel(str(out), config_settings)
    return out / name


def read_record(archive: zipfile.ZipFile, dist_info: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(archive.read(f"{dist_info}/RECORD").decode())))


def test_wheel_name_tags_and_layout(project: types.SimpleNamespace, tmp_path: Path) -> None:
    wheel = build(tmp_path / "dist")
    assert wheel.name == "digits_cuvil-1.0.0-py3-none-manylinux_2_17_x86_64.whl"
    name, version, build_tag, tags = parse_wheel_filename(wheel.name)
    assert (name, version, build_tag) == ("digits-cuvil", Version("1.0.0"), ())
    assert tags == frozenset({Tag("py3", "none", "manylinux_2_17_x86_64")})

    dist_info = "digits_cuvil-1.0.0.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert names == [
            *sorted(PACKAGE_FILES),
            f"{dist_info}/METADATA",
            f"{dist_info}/WHEEL",
            f"{dist_info}/entry_points.txt",
            f"{dist_info}/licenses/LICENSE",
            f"{dist_info}/RECORD",
        ]
        for file, data in PACKAGE_FILES.items():
            assert archive.read(file) == data
        assert archive.read(f"{dist_info}/WHEEL").decode() == (
            "Wheel-Version: 1.0\n"
            f"Generator: cuvil {__import__('cuvil').__version__}\n"
            "Root-Is-Purelib: false\n"
            "Tag: py3-none-manylinux_2_17_x86_64\n"
        )
        assert (
            archive.read(f"{dist_info}/entry_points.txt")
            == b"[console_scripts]\ndigits-predict = digits_cli:main\n"
        )
        assert archive.read(f"{dist_info}/licenses/LICENSE") == b"MIT License\n"
        metadata = Metadata.from_email(archive.read(f"{dist_info}/METADATA"), validate=True)
    assert metadata.name == "Digits.Cuvil"
    assert metadata.license_expression == "MIT"
    assert metadata.license_files == ["LICENSE"]
    assert metadata.description == "# Digits\n"


def test_record_hashes_and_sizes_verify(project: types.SimpleNamespace, tmp_path: Path) -> None:
    wheel = build(tmp_path / "dist")
    dist_info = "digits_cuvil-1.0.0.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        rows = read_record(archive, dist_info)
        assert [row[0] for row in rows] == archive.namelist()
        assert rows[-1] == [f"{dist_info}/RECORD", "", ""]
        for path, digest, size in rows[:-1]:
            data = archive.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}"
            assert int(size) == len(data)


def test_wheel_tool_accepts_the_wheel(project: types.SimpleNamespace, tmp_path: Path) -> None:
    wheel = build(tmp_path / "dist")
    # `wheel unpack` checks every RECORD hash while it extracts.
    subprocess.run(
        [sys.executable, "-m", "wheel", "unpack", "-d", str(tmp_path / "unpacked"), str(wheel)],
        check=True,
        capture_output=True,
    )
    unpacked = tmp_path / "unpacked" / "digits_cuvil-1.0.0"
    assert (unpacked / "digits" / "_classifier.so").read_bytes() == PACKAGE_FILES[
        "digits/_classifier.so"
    ]


def test_pip_installs_the_wheel(project: types.SimpleNamespace, tmp_path: Path) -> None:
    wheel = build(tmp_path / "dist")
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    assert (target / "digits" / "__init__.py").exists()
    assert os.access(target / "digits" / "_classifier.so", os.X_OK)
    assert (target / "bin" / "digits-predict").exists()


def test_modes_and_timestamps(project: types.SimpleNamespace, tmp_path: Path) -> None:
    wheel = build(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            mode = info.external_attr >> 16
            assert stat.S_ISREG(mode)
            expected = 0o755 if info.filename.endswith(".so") else 0o644
            assert stat.S_IMODE(mode) == expected, info.filename
            assert info.date_time == (1980, 1, 1, 0, 0, 0)
            assert info.compress_type == zipfile.ZIP_DEFLATED
            assert info.create_system == 3


def test_source_date_epoch_sets_timestamps(
    project: types.SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # 2023-11-14T22:13:20Z
    with zipfile.ZipFile(build(tmp_path / "dist")) as archive:
        assert {info.date_time for info in archive.infolist()} == {(2023, 11, 14, 22, 13, 20)}


@pytest.mark.parametrize("epoch", [None, "1700000000"])
def test_builds_are_byte_identical(
    project: types.SimpleNamespace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    epoch: str | None,
) -> None:
    if epoch is not None:
        monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
    first = build(tmp_path / "one").read_bytes()
    os.utime(project.root / "README.md", (2_000_000_000, 2_000_000_000))  # file times do not matter
    project.files = dict(reversed(list(PACKAGE_FILES.items())))  # nor the generator's order
    second = build(tmp_path / "two").read_bytes()
    assert first == second


def test_source_date_epoch_is_clamped_and_checked() -> None:
    assert _reproducible.source_date_epoch({}) == _reproducible.DEFAULT_EPOCH
    assert _reproducible.source_date_epoch({"SOURCE_DATE_EPOCH": "0"}) == 315532800
    assert _reproducible.source_date_epoch({"SOURCE_DATE_EPOCH": " 1700000000 "}) == 1700000000
    assert _reproducible.source_date_epoch({"SOURCE_DATE_EPOCH": "99999999999"}) == 4354819198
    with pytest.raises(ConfigError, match="SOURCE_DATE_EPOCH"):
        _reproducible.source_date_epoch({"SOURCE_DATE_EPOCH": "yesterday"})


def test_config_settings_and_progress(
    project: types.SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = build(tmp_path / "dist", {"target": "aarch64-linux"})
    assert project.settings == [{"target": "aarch64-linux"}]
    # compiled in a private folder, kept afterwards as the target's folder
    (workdir,) = project.calls
    assert workdir.parent == project.root / "build" / "cuvil"
    assert workdir.name.startswith("aarch64-linux.building-")
    assert (project.root / "build" / "cuvil" / "aarch64-linux").is_dir() and not workdir.exists()
    err = capsys.readouterr().err
    assert "cuvil: compiling model classifier for aarch64-linux" in err
    assert "cuvil: generated the package" in err
    assert f"cuvil: writing wheel {wheel.name}" in err


@pytest.mark.parametrize(
    "error", [ModelError("models/classifier.onnx: node Conv_3: bad"), RuntimeError("crash")]
)
def test_failed_build_leaves_no_file(
    project: types.SimpleNamespace,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
) -> None:
    out = tmp_path / "dist"
    out.mkdir()
    project.files = error
    with pytest.raises(type(error)):
        backend.build_wheel(str(out))
    assert list(out.iterdir()) == []
    if isinstance(error, CuvilError):
        assert "cuvil: error: models/classifier.onnx: node Conv_3: bad" in capsys.readouterr().err


def test_failure_while_writing_leaves_no_file(
    project: types.SimpleNamespace, tmp_path: Path
) -> None:
    out = tmp_path / "dist"
    out.mkdir()
    project.files = {"../escape.py": b""}  # rejected while the archive is being written
    with pytest.raises(CuvilError, match="invalid wheel path"):
        backend.build_wheel(str(out))
    assert list(out.iterdir()) == []


def test_metadata_error_is_reported(
    project: types.SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        (project.root / "pyproject.toml")
        .read_text()
        .replace('version = "1.0.0"', 'version = "one"')
    )
    (project.root / "pyproject.toml").write_text(text)
    with pytest.raises(ConfigError):
        build(tmp_path / "dist")
    err = capsys.readouterr().err
    assert "cuvil: error:" in err and "project.version" in err
    assert list((tmp_path / "dist").iterdir()) == []


def test_compressed_platform_tags(
    project: types.SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = "manylinux_2_17_aarch64.manylinux2014_aarch64"
    monkeypatch.setattr(
        backend,
        "_get_target",
        lambda name: types.SimpleNamespace(name="aarch64-linux", platform_tag=tag),
    )
    wheel = build(tmp_path / "dist")
    assert parse_wheel_filename(wheel.name)[3] == frozenset(
        {Tag("py3", "none", "manylinux_2_17_aarch64"), Tag("py3", "none", "manylinux2014_aarch64")}
    )
    with zipfile.ZipFile(wheel) as archive:
        wheel_file = archive.read("digits_cuvil-1.0.0.dist-info/WHEEL").decode()
    assert (
        "Tag: py3-none-manylinux_2_17_aarch64\nTag: py3-none-manylinux2014_aarch64\n" in wheel_file
    )


# Editable installs (PEP 660)


def build_editable(out: Path) -> Path:
    out.mkdir(exist_ok=True)
    return out / backend.build_editable(str(out))


def test_editable_wheel_points_at_compiled_tree(
    project: types.SimpleNamespace, tmp_path: Path
) -> None:
    wheel = build_editable(tmp_path / "dist")
    assert wheel.name == "digits_cuvil-1.0.0-py3-none-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        pth = archive.read("digits_cuvil.pth").decode()
    assert [n for n in names if not n.startswith("digits_cuvil-1.0.0.dist-info/")] == [
        "_cuvil_editable_digits_cuvil.py", "digits_cuvil.pth"
    ]
    # the build folder on sys.path, and the import hook that checks it is not stale
    folder, hook = pth.splitlines()
    tree = Path(folder)
    assert tree == project.root / "build" / "cuvil" / "editable"
    assert hook == "import _cuvil_editable_digits_cuvil"
    for file, data in PACKAGE_FILES.items():
        assert (tree / file).read_bytes() == data
    assert stat.S_IMODE((tree / "digits" / "_classifier.so").stat().st_mode) == 0o755
    assert stat.S_IMODE((tree / "digits" / "__init__.py").stat().st_mode) == 0o644


def test_editable_install_imports_and_refreshes(
    project: types.SimpleNamespace, tmp_path: Path
) -> None:
    wheel = build_editable(tmp_path / "dist")
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    code = f"import site; site.addsitedir({str(site)!r}); import digits; print(digits.classifier)"
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path
    ).stdout.strip()
    assert run() == "compiled"

    # Unchanged models and settings: the tree is kept, nothing is compiled.
    calls = len(project.calls)
    project.files = {**PACKAGE_FILES, "digits/_models.py": b"classifier = 'recompiled'\n"}
    build_editable(tmp_path / "dist")
    assert len(project.calls) == calls and run() == "compiled"

    # A changed model recompiles; the new files are swapped in and the ones the generator no
    # longer writes are dropped.
    (project.root / "models" / "classifier.onnx").write_bytes(b"onnx, retrained")
    del project.files["digits/classifier.h"]
    build_editable(tmp_path / "dist")
    assert run() == "recompiled"
    tree = project.root / "build" / "cuvil" / "editable"
    assert not (tree / "digits" / "classifier.h").exists()
    assert sorted(p.name for p in tree.parent.iterdir()) == ["editable", "x86_64-linux"]


def test_editable_keeps_old_tree_when_compiling_fails(
    project: types.SimpleNamespace, tmp_path: Path
) -> None:
    build_editable(tmp_path / "dist")
    project.files = ModelError("bad model")
    (project.root / "models" / "classifier.onnx").write_bytes(b"onnx, broken")
    with pytest.raises(ModelError):
        build_editable(tmp_path / "dist2")
    assert (project.root / "build" / "cuvil" / "editable" / "digits" / "__init__.py").exists()
    assert list((tmp_path / "dist2").iterdir()) == []


def test_editable_refuses_a_foreign_folder(project: types.SimpleNamespace, tmp_path: Path) -> None:
    foreign = project.root / "build" / "cuvil" / "editable"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CuvilError, match="not written by cuvil"):
        build_editable(tmp_path / "dist")
    assert (foreign / "notes.txt").read_text() == "mine"
