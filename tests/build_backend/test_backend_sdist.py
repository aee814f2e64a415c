"""Source distributions: contents, reproducibility, and rebuilding from the unpacked sdist."""

from __future__ import annotations

import gzip
import os
import sys
import tarfile
import types
from pathlib import Path
from typing import Any, Callable

import pytest
from packaging.metadata import Metadata

import cuvil.build_backend as backend
from cuvil.build_backend._metadata import read_metadata
from cuvil.errors import BuildError, CuvilError

onnx = pytest.importorskip("onnx")

PYPROJECT = """\
[build-system]
requires = ["cuvil"]
build-backend = "cuvil.build_backend"

[project]
name = "Digits.Cuvil"
version = "1.0.0"
readme = "README.md"
license = "MIT"
license-files = ["LICENSE", "third_party/**/*.txt"]

[tool.cuvil]
package = "digits"

[tool.cuvil.models.classifier]
source = "models/classifier.onnx"
quantize = "int8"
calibration = "data/calibration.npz"

[tool.cuvil.models.big]
source = "models/big/big.onnx"
"""

TOP = "digits_cuvil-1.0.0"


def save_model(path: Path, external: bool = False) -> None:
    """A tiny real ONNX model (y = x + w), optionally with its weights in an external file."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((1, 4), dtype=np.float32), name="w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="big.weights",
            size_threshold=0,
        )
    else:
        onnx.save_model(model, str(path))


def fake_load_project(config_settings: Any) -> Any:
    """What cuvil.config.load_project returns, for the keys this project uses."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    root = Path.cwd().resolve()
    data = tomllib.loads((root / "pyproject.toml").read_text())
    models = tuple(
        types.SimpleNamespace(
            name=name,
            source=root / table["source"],
            calibration=root / table["calibration"] if "calibration" in table else None,
        )
        for name, table in data["tool"]["cuvil"]["models"].items()
    )
    for model in models:
        for path in (model.source, model.calibration):
            if path is not None and not path.is_file():
                raise CuvilError(f"{path} is missing")
    return types.SimpleNamespace(
        root=root,
        pyproject=root / "pyproject.toml",
        project=data["project"],
        name=data["project"]["name"],
        package="digits",
        models=models,
        settings=types.SimpleNamespace(target=None, build_dir=root / "build" / "cuvil"),
        python_source=None,
        python_package=None,
        sdist=types.SimpleNamespace(include=(), exclude=()),
        version=None,
        version_file=None,
        custom_ops=(),
        op_modules=(),
    )


def real_or_fake_load_project() -> Callable[[Any], Any]:
    try:
        from cuvil.config import load_project
    except ImportError:
        return fake_load_project
    return lambda config_settings: load_project(Path.cwd(), config_settings)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "README.md").write_text("# Digits\n")
    (root / "LICENSE").write_text("MIT License\n")
    (root / "third_party" / "onnx").mkdir(parents=True)
    (root / "third_party" / "onnx" / "LICENSE.txt").write_text("Apache License\n")
    save_model(root / "models" / "classifier.onnx")
    save_model(root / "models" / "big" / "big.onnx", external=True)
    (root / "data").mkdir()
    (root / "data" / "calibration.npz").write_bytes(b"PK fake npz")
    # Files the build does not need stay out of the sdist.
    (root / "train.py").write_text("print('training')\n")
    (root / "build" / "cuvil").mkdir(parents=True)
    (root / "build" / "cuvil" / "junk.o").write_bytes(b"obj")
    monkeypatch.chdir(root)
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    monkeypatch.setattr(backend, "_load_project", fake_load_project)
    return root


def build(out: Path) -> Path:
    out.mkdir(exist_ok=True)
    return out / backend.build_sdist(str(out))


def test_sdist_name_layout_and_contents(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sdist = build(tmp_path / "dist")
    assert sdist.name == f"{TOP}.tar.gz"
    assert f"cuvil: writing sdist {sdist.name}" in capsys.readouterr().err
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
        files = [m.name for m in archive.getmembers() if m.isfile()]
        assert names == sorted(n for n in names if archive.getmember(n).isdir()) + files
        assert files == [
            f"{TOP}/{name}"
            for name in [
                "LICENSE",
                "PKG-INFO",
                "README.md",
                "data/calibration.npz",
                "models/big/big.onnx",
                "models/big/big.weights",
                "models/classifier.onnx",
                "pyproject.toml",
                "third_party/onnx/LICENSE.txt",
            ]
        ]
        assert all(name == TOP or name.startswith(TOP + "/") for name in names)
        pkg_info = archive.extractfile(f"{TOP}/PKG-INFO").read()  # type: ignore[union-attr]
        assert archive.extractfile(f"{TOP}/pyproject.toml").read() == PYPROJECT.encode()  # type: ignore[union-attr]
    metadata = Metadata.from_email(pkg_info, validate=True)
    assert metadata.name == "Digits.Cuvil"
    assert str(metadata.version) == "1.0.0"
    assert metadata.license_files == ["LICENSE", "third_party/onnx/LICENSE.txt"]
    assert metadata.description == "# Digits\n"


def test_sdist_members_are_normalized(project: Path, tmp_path: Path) -> None:
    os.chmod(project / "models" / "classifier.onnx", 0o600)
    sdist = build(tmp_path / "dist")
    with open(sdist, "rb") as stream:
        header = stream.read(10)
    assert header[4:8] == b"\0\0\0\0"  # gzip mtime 0
    assert header[3] & 0x08 == 0  # no file name in the gzip header
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            assert (member.uid, member.gid, member.uname, member.gname) == (0, 0, "", "")
            assert member.mtime == 315532800
            assert member.mode == (0o755 if member.isdir() else 0o644), member.name
    with gzip.open(sdist) as stream:
        assert tarfile.TarFile(fileobj=stream).pax_headers == {}  # type: ignore[arg-type]


def test_sdist_is_byte_identical(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build(tmp_path / "one").read_bytes()
    os.utime(project / "README.md", (2_000_000_000, 2_000_000_000))
    assert build(tmp_path / "two").read_bytes() == first
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    third = build(tmp_path / "three")
    assert build(tmp_path / "four").read_bytes() == third.read_bytes()
    with tarfile.open(third) as archive:
        assert {m.mtime for m in archive.getmembers()} == {1700000000}


def test_rebuild_from_unpacked_sdist(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unpacked sdist loads with load_project (the real one when present) and builds a wheel."""
    sdist = build(tmp_path / "dist")
    with tarfile.open(sdist) as archive:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(tmp_path / "unpacked", **safe)  # type: ignore[arg-type]
    unpacked = tmp_path / "unpacked" / TOP
    monkeypatch.chdir(unpacked)
    load_project = real_or_fake_load_project()
    config = load_project(None)
    assert config.root == unpacked.resolve()
    assert [m.name for m in config.models] == ["classifier", "big"]
    assert all(m.source.is_file() for m in config.models)
    metadata = read_metadata(config.project, config.root, config.pyproject)
    assert metadata.as_bytes() == (unpacked / "PKG-INFO").read_bytes()

    # The hooks work from there: a second sdist equals the first, and a wheel builds.
    monkeypatch.setattr(backend, "_load_project", load_project)
    assert build(tmp_path / "again").read_bytes() == sdist.read_bytes()
    monkeypatch.setattr(
        backend,
        "_get_target",
        lambda name: types.SimpleNamespace(
            name="x86_64-linux", platform_tag="manylinux_2_17_x86_64"
        ),
    )
    monkeypatch.setattr(
        backend, "_build_package_files", lambda project, workdir, log, target: {"digits/__init__.py": b""}
    )
    monkeypatch.setattr(backend, "_wheel_check", lambda project: lambda wheel: None)  # a fake package
    (tmp_path / "wheels").mkdir()
    assert (
        backend.build_wheel(str(tmp_path / "wheels"))
        == "digits_cuvil-1.0.0-py3-none-manylinux_2_17_x86_64.whl"
    )


def test_file_outside_the_project_is_an_error(
    project: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    outside = tmp_path / "shared.onnx"
    save_model(outside)

    def load_project(config_settings: Any) -> Any:
        config = fake_load_project(config_settings)
        first = types.SimpleNamespace(name="classifier", source=outside, calibration=None)
        config.models = (first,)
        return config

    monkeypatch.setattr(backend, "_load_project", load_project)
    (tmp_path / "dist").mkdir()
    with pytest.raises(
        BuildError, match=r"pyproject\.toml: tool\.cuvil\.models\.classifier\.source .* outside"
    ):
        backend.build_sdist(str(tmp_path / "dist"))
    assert list((tmp_path / "dist").iterdir()) == []
    assert "cuvil: error:" in capsys.readouterr().err
