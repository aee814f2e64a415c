"""[project] -> core metadata: every field against the pyproject and core metadata specs."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
from packaging.metadata import Metadata
from packaging.requirements import Requirement

import cuvil.build_backend as backend
from cuvil.build_backend._metadata import read_metadata
from cuvil.errors import ConfigError


def metadata_of(tmp_path: Path, **project: Any) -> Metadata:
    project.setdefault("name", "digits-cuvil")
    project.setdefault("version", "1.0.0")
    core = read_metadata(project, tmp_path, tmp_path / "pyproject.toml")
    return Metadata.from_email(core.as_bytes(), validate=True)


def error_of(tmp_path: Path, **project: Any) -> str:
    project.setdefault("name", "digits-cuvil")
    project.setdefault("version", "1.0.0")
    with pytest.raises(ConfigError) as info:
        read_metadata(project, tmp_path, tmp_path / "pyproject.toml")
    return str(info.value)


def test_minimal_project(tmp_path: Path) -> None:
    metadata = metadata_of(tmp_path, name="Digits.CUVIL", version="01.0")
    assert metadata.metadata_version == "2.3"
    assert metadata.name == "Digits.CUVIL"
    assert str(metadata.version) == "1.0"
    assert metadata.requires_dist == [Requirement("numpy>=1.22")]
    assert metadata.summary is None and metadata.description is None


def test_file_names_use_normalized_name_and_version(tmp_path: Path) -> None:
    core = read_metadata({"name": "Digits.CUVIL", "version": "1.0.0-RC1"}, tmp_path)
    assert core.distribution == "digits_cuvil"
    assert core.version == "1.0.0rc1"
    assert core.dist_info == "digits_cuvil-1.0.0rc1.dist-info"


def test_summary_keywords_classifiers_urls_python(tmp_path: Path) -> None:
    metadata = metadata_of(
        tmp_path,
        description="Digit classifier",
        keywords=["onnx", "digits"],
        classifiers=["Programming Language :: Python :: 3", "Typing :: Typed"],
        urls={"Homepage": "https://example.org", "Source code": "https://example.org/src"},
        **{"requires-python": ">= 3.9"},
    )
    assert metadata.summary == "Digit classifier"
    assert metadata.keywords == ["onnx", "digits"]
    assert metadata.classifiers == ["Programming Language :: Python :: 3", "Typing :: Typed"]
    assert metadata.project_urls == {
        "Homepage": "https://example.org",
        "Source code": "https://example.org/src",
    }
    assert str(metadata.requires_python) == ">=3.9"


@pytest.mark.parametrize(
    ("file", "content_type"),
    [("README.md", "text/markdown"), ("README.RST", "text/x-rst"), ("README.txt", "text/plain")],
)
def test_readme_file_content_type_from_extension(
    tmp_path: Path, file: str, content_type: str
) -> None:
    (tmp_path / file).write_text("Digits ✓\n\nA classifier.\n", encoding="utf-8")
    metadata = metadata_of(tmp_path, readme=file)
    assert metadata.description == "Digits ✓\n\nA classifier.\n"
    assert metadata.description_content_type == content_type


def test_readme_table_with_file_and_text(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "about").write_text("Hello\n")
    metadata = metadata_of(
        tmp_path, readme={"file": "docs/about", "content-type": "text/markdown; variant=GFM"}
    )
    assert metadata.description == "Hello\n"
    assert metadata.description_content_type == "text/markdown; variant=GFM"
    metadata = metadata_of(tmp_path, readme={"text": "Inline", "content-type": "text/x-rst"})
    assert metadata.description == "Inline\n"
    assert metadata.description_content_type == "text/x-rst"


def test_readme_file_is_listed_for_the_sdist(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("x")
    core = read_metadata({"name": "a", "version": "1", "readme": "README.md"}, tmp_path)
    assert core.source_files == (tmp_path / "README.md",)


def test_spdx_license_is_canonicalized(tmp_path: Path) -> None:
    metadata = metadata_of(tmp_path, license="mit OR apache-2.0")
    assert metadata.metadata_version == "2.4"
    assert metadata.license_expression == "MIT OR Apache-2.0"
    assert metadata.license is None


def test_license_files_globs(tmp_path: Path) -> None:
    (tmp_path / "LICENSE").write_text("MIT License\n")
    (tmp_path / "licenses").mkdir()
    (tmp_path / "licenses" / "onnx.txt").write_text("Apache\n")
    (tmp_path / "licenses" / "zlib.txt").write_text("zlib\n")
    project = {
        "name": "a",
        "version": "1",
        "license": "MIT",
        "license-files": ["LICEN[CS]E", "licenses/**/*.txt"],
    }
    core = read_metadata(project, tmp_path)
    metadata = Metadata.from_email(core.as_bytes(), validate=True)
    assert metadata.license_files == ["LICENSE", "licenses/onnx.txt", "licenses/zlib.txt"]
    assert [relative for relative, _ in core.license_files] == metadata.license_files


def test_license_files_default_and_empty(tmp_path: Path) -> None:
    (tmp_path / "LICENSE.txt").write_text("MIT License\n")
    (tmp_path / "NOTICE").write_text("Notice\n")
    (tmp_path / "other.txt").write_text("no\n")
    assert metadata_of(tmp_path).license_files == ["LICENSE.txt", "NOTICE"]
    empty = metadata_of(tmp_path, **{"license-files": []})
    assert empty.license_files is None
    assert empty.metadata_version == "2.3"


def test_legacy_license_table(tmp_path: Path) -> None:
    (tmp_path / "COPYING.md").write_text("Line one\n\n  indented line\n")
    metadata = metadata_of(tmp_path, license={"file": "COPYING.md"})
    assert metadata.license is not None
    lines = [line.strip() for line in metadata.license.splitlines()]
    assert lines == ["Line one", "", "indented line"]
    assert metadata_of(tmp_path, license={"text": "Proprietary"}).license == "Proprietary"


@pytest.mark.parametrize(
    ("people", "fields"),
    [
        ([{"name": "Ada"}], {"author": "Ada"}),
        ([{"email": "ada@example.org"}], {"author_email": "ada@example.org"}),
        ([{"name": "Ada", "email": "ada@example.org"}], {"author_email": "Ada <ada@example.org>"}),
        (
            [
                {"name": "Ada"},
                {"name": "Bob", "email": "bob@example.org"},
                {"email": "c@example.org"},
            ],
            {"author": "Ada", "author_email": "Bob <bob@example.org>, c@example.org"},
        ),
        (
            [{"name": "A. Lovelace", "email": "ada@example.org"}],
            {"author_email": '"A. Lovelace" <ada@example.org>'},
        ),
    ],
)
def test_authors_and_maintainers(
    tmp_path: Path, people: list[dict[str, str]], fields: dict[str, str]
) -> None:
    authors = metadata_of(tmp_path, authors=people)
    maintainers = metadata_of(tmp_path, maintainers=people)
    for field in ("author", "author_email"):
        assert getattr(authors, field) == fields.get(field)
        assert getattr(maintainers, field.replace("author", "maintainer")) == fields.get(field)


def test_dependencies_extras_and_numpy(tmp_path: Path) -> None:
    metadata = metadata_of(
        tmp_path,
        dependencies=["scipy>=1.10", "tomli; python_version < '3.11'"],
        **{
            "optional-dependencies": {
                "Plot_Tools": ["matplotlib>=3"],
                "fast": ["numba; platform_machine == 'x86_64'"],
            }
        },
    )
    assert [str(req) for req in metadata.requires_dist or []] == [
        "scipy>=1.10",
        'tomli; python_version < "3.11"',
        "numpy>=1.22",
        'matplotlib>=3; extra == "plot-tools"',
        'numba; platform_machine == "x86_64" and extra == "fast"',
    ]
    assert metadata.provides_extra == ["plot-tools", "fast"]


def test_numpy_is_not_added_twice(tmp_path: Path) -> None:
    metadata = metadata_of(tmp_path, dependencies=["NumPy>=2"])
    assert [str(req) for req in metadata.requires_dist or []] == ["NumPy>=2"]


def test_entry_points(tmp_path: Path) -> None:
    core = read_metadata(
        {
            "name": "a",
            "version": "1",
            "scripts": {"digits-predict": "digits.cli:main"},
            "gui-scripts": {"digits-gui": "digits.gui:run"},
            "entry-points": {"cuvil.models": {"classifier": "digits:classifier"}},
        },
        tmp_path,
    )
    assert core.entry_points_text() == (
        "[console_scripts]\ndigits-predict = digits.cli:main\n\n"
        "[cuvil.models]\nclassifier = digits:classifier\n\n"
        "[gui_scripts]\ndigits-gui = digits.gui:run\n"
    )
    assert read_metadata({"name": "a", "version": "1"}, tmp_path).entry_points_text() is None


def test_import_names(tmp_path: Path) -> None:
    core = read_metadata({"name": "a", "version": "1", "import-names": ["digits"]}, tmp_path)
    assert core.metadata_version == "2.5"
    assert ("Import-Name", "digits") in core.headers


# Every error names pyproject.toml and the key, and says how to fix it.
ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"name": "-bad-"}, "project.name"),
    ({"name": 3}, "project.name"),
    ({"version": "one"}, "project.version"),
    ({"version": 1}, "project.version"),
    ({"description": "two\nlines"}, "project.description"),
    ({"readme": "README.adoc"}, "project.readme"),
    ({"readme": "MISSING.md"}, "project.readme"),
    ({"readme": {"text": "x"}}, "project.readme.content-type"),
    ({"readme": {"text": "x", "content-type": "text/html"}}, "project.readme.content-type"),
    ({"readme": {"content-type": "text/plain"}}, "project.readme"),
    ({"requires-python": "3.9"}, "project.requires-python"),
    ({"license": "Not A License"}, "project.license"),
    ({"license": {"text": "x", "file": "y"}}, "project.license"),
    ({"license": {"text": "x"}, "license-files": []}, "project.license"),
    (
        {"license": "MIT", "classifiers": ["License :: OSI Approved :: MIT License"]},
        "project.classifiers[0]",
    ),
    ({"license-files": ["../LICENSE"]}, "project.license-files[0]"),
    ({"license-files": ["/LICENSE"]}, "project.license-files[0]"),
    ({"license-files": ["NOPE*"]}, "project.license-files[0]"),
    ({"license-files": "LICENSE"}, "project.license-files"),
    ({"authors": [{"name": "Doe, Jane"}]}, "project.authors[0].name"),
    ({"authors": [{"email": "not an address"}]}, "project.authors[0].email"),
    ({"maintainers": [{"nick": "x"}]}, "project.maintainers[0].nick"),
    ({"maintainers": [{}]}, "project.maintainers[0]"),
    ({"keywords": ["a,b"]}, "project.keywords[0]"),
    ({"classifiers": [1]}, "project.classifiers[0]"),
    ({"urls": {"x" * 33: "https://example.org"}}, "project.urls."),
    ({"dependencies": ["numpy", "scipy", "bad req!"]}, "project.dependencies[2]"),
    (
        {"optional-dependencies": {"plot": ["matplotlib >"]}},
        "project.optional-dependencies.plot[0]",
    ),
    ({"optional-dependencies": {"a_b": [], "A-B": []}}, "project.optional-dependencies.A-B"),
    ({"scripts": {"run": "not a reference"}}, "project.scripts.run"),
    ({"entry-points": {"console_scripts": {"x": "a:b"}}}, "project.entry-points.console_scripts"),
    ({"dynamic": ["version"]}, "project.dynamic[0]"),
    ({"dynamic": ["dependencies"]}, "project.dynamic[0]"),
    ({"dynamic": ["description"], "description": "x"}, "project.dynamic[0]"),
    ({"dynamic": ["name"]}, "project.dynamic[0]"),
    ({"homepage": "https://example.org"}, "project.homepage"),
]


@pytest.mark.parametrize(("project", "key"), ERRORS, ids=[key for _, key in ERRORS])
def test_errors_name_file_and_key(tmp_path: Path, project: dict[str, Any], key: str) -> None:
    (tmp_path / "LICENSE").write_text("MIT\n")
    if project.get("dynamic") == ["version"]:
        project = {"name": "a", **project}
        with pytest.raises(ConfigError) as info:
            read_metadata(project, tmp_path, tmp_path / "pyproject.toml")
        message = str(info.value)
        assert "project.version" in message
    else:
        message = error_of(tmp_path, **project)
    assert "pyproject.toml" in message
    assert key in message
    assert ";" in message  # the problem, then the fix


def test_missing_version_and_project_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pyproject\.toml: project\.version: is missing"):
        read_metadata({"name": "a"}, tmp_path)
    with pytest.raises(ConfigError, match=r"pyproject\.toml: the \[project\] table is missing"):
        read_metadata(None, tmp_path)


def test_license_files_must_be_utf8(tmp_path: Path) -> None:
    (tmp_path / "LICENSE").write_bytes(b"\xff\xfe bad")
    message = error_of(tmp_path, **{"license-files": ["LICENSE"]})
    assert "project.license-files[0]" in message and "UTF-8" in message


def test_prepare_metadata_hook_writes_dist_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "LICENSE").write_text("MIT License\n")
    project = types.SimpleNamespace(
        root=tmp_path,
        pyproject=tmp_path / "pyproject.toml",
        project={"name": "digits-cuvil", "version": "1.0", "scripts": {"d": "digits:main"}},
        settings=types.SimpleNamespace(target=None),
        version=None,
    )
    seen: list[Any] = []

    def fake_load_project(config_settings: Any) -> Any:
        seen.append(config_settings)
        return project

    monkeypatch.setattr(backend, "_load_project", fake_load_project)
    monkeypatch.setattr(
        backend,
        "_get_target",
        lambda name: types.SimpleNamespace(
            name="x86_64-linux", platform_tag="manylinux_2_17_x86_64"
        ),
    )
    out = tmp_path / "meta"
    out.mkdir()
    name = backend.prepare_metadata_for_build_wheel(str(out), {"target": "x86_64-linux"})
    assert name == "digits_cuvil-1.0.dist-info"
    assert seen == [{"target": "x86_64-linux"}]  # config settings go to load_project unchanged
    files = sorted(
        p.relative_to(out / name).as_posix() for p in (out / name).rglob("*") if p.is_file()
    )
    assert files == ["METADATA", "WHEEL", "entry_points.txt", "licenses/LICENSE"]
    metadata = Metadata.from_email((out / name / "METADATA").read_bytes())
    assert metadata.name == "digits-cuvil"
    assert "Tag: py3-none-manylinux_2_17_x86_64" in (out / name / "WHEEL").read_text()
    editable = tmp_path / "meta2"
    editable.mkdir()
    assert backend.prepare_metadata_for_build_editable(str(editable)) == name
    assert (editable / name / "METADATA").read_bytes() == (out / name / "METADATA").read_bytes()


def test_requirements_hooks_are_empty() -> None:
    assert backend.get_requires_for_build_wheel() == []
    assert backend.get_requires_for_build_sdist({"target": "x"}) == []
    assert backend.get_requires_for_build_editable() == []


def test_backend_import_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, cuvil.build_backend; "
        "heavy = ('onnx', 'llvmlite', 'numpy', 'packaging', 'cuvil.config'); "
        "heavy = [m for m in heavy if m in sys.modules]; "
        "print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(backend.__file__).parents[2],
    )
    assert result.stdout.strip() == "[]"
