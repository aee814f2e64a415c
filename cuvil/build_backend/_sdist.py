"""Write the source distribution: everything `load_project` and the compiler need, reproducibly.

An sdist holds one folder `{name}-{version}/` with PKG-INFO, pyproject.toml, the readme and
license files, every model source, external-data and calibration file the config names, the
project's Python package and the file a dynamic version is read from, at the same paths
relative to the project root, so `pip wheel name-1.0.tar.gz` builds the same wheel. On top come
the files `[tool.cuvil.sdist] include` names, minus those `exclude` names (never one of the
files a rebuild needs).
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from cuvil.build_backend import _reproducible
from cuvil.build_backend._custom_ops import custom_op_files
from cuvil.build_backend._metadata import CoreMetadata
from cuvil.build_backend._python import python_files
from cuvil.build_backend._wheel import atomic_output
from cuvil.errors import BuildError, ConfigError

if TYPE_CHECKING:
    from cuvil.config import ModelConfig, ProjectConfig

__all__ = ["model_files", "sdist_files", "sdist_name", "write_sdist"]


def sdist_name(metadata: CoreMetadata) -> str:
    return f"{metadata.distribution}-{metadata.version}.tar.gz"


def sdist_files(project: ProjectConfig, metadata: CoreMetadata) -> dict[str, Path]:
    """Archive paths relative to the top folder -> source files, for every file the build needs."""
    root = project.root
    files: dict[str, Path] = {}

    def add(path: Path, key: str) -> None:
        relative = _relative(path, root)
        if relative is None:
            raise BuildError(
                f"{project.pyproject}: {key} names {path}, which is outside the project folder "
                f"{root}; an sdist can only hold files inside it: move the file into the project"
            )
        if not path.is_file():
            raise BuildError(f"{project.pyproject}: {key} names {path}, which is not a file")
        files.setdefault(relative, path)

    add(project.pyproject, "the project file")
    for path in metadata.source_files:
        add(path, "project.readme or project.license")
    for _, path in metadata.license_files:
        add(path, "project.license-files")
    for model in project.models:
        for key, path in model_files(root, model):
            add(path, key)
    for path in python_files(project).values():
        add(path, "tool.cuvil.python-source (the Python package)")
    if project.version_file is not None:
        add(project.version_file, "tool.cuvil.metadata.version.input")
    for key, path in custom_op_files(project):
        add(path, key)

    required = set(files)
    excluded = {
        relative
        for index, pattern in enumerate(project.sdist.exclude)
        for relative in _glob(project, pattern, f"tool.cuvil.sdist.exclude[{index}]")
    }
    for relative in sorted(required & excluded):
        raise ConfigError(
            f"{project.pyproject}: tool.cuvil.sdist.exclude: {relative} is needed to build the "
            "wheel from the sdist, so it cannot be left out; narrow the pattern"
        )
    for index, pattern in enumerate(project.sdist.include):
        key = f"tool.cuvil.sdist.include[{index}]"
        matches = _glob(project, pattern, key)
        if not matches:
            raise ConfigError(
                f"{project.pyproject}: {key}: {pattern!r} matches no file in {root}; correct "
                "the pattern or remove it"
            )
        for relative in matches:
            if relative not in excluded:
                files.setdefault(relative, root / relative)
    return files


def model_files(root: Path, model: ModelConfig) -> Iterator[tuple[str, Path]]:
    """(config key, file) of every file a model's build reads: source, external data, calibration."""
    key = f"tool.cuvil.models.{model.name}"
    yield f"{key}.source", model.source
    for data in _external_data(model.source):
        yield f"{key}.source (external data)", data
    if isinstance(model.calibration, Path):  # not an entry point "module:function"
        yield f"{key}.calibration", model.calibration


def _glob(project: ProjectConfig, pattern: str, key: str) -> list[str]:
    """Project-relative paths of the files `pattern` names (a folder: every file in it), leaving
    out the build folder, version control folders and Python caches."""
    root = project.root
    if not pattern or Path(pattern).is_absolute() or ".." in Path(pattern).parts:
        raise ConfigError(
            f"{project.pyproject}: {key}: {pattern!r} is not a glob relative to the project "
            'root; write e.g. "scripts/*.py" or "docs"'
        )
    found = set()
    for match in root.glob(pattern):
        for path in [match] if match.is_file() else match.rglob("*"):
            relative = _relative(path, root)
            if relative is None or not path.is_file() or _skipped(project, path, relative):
                continue
            found.add(relative)
    return sorted(found)


def _skipped(project: ProjectConfig, path: Path, relative: str) -> bool:
    parts = relative.split("/")
    if any(p in (".git", ".hg", ".svn", "__pycache__") for p in parts[:-1]):
        return True
    if path.suffix in (".pyc", ".pyo"):
        return True
    build_dir = project.settings.build_dir
    return path.resolve() == build_dir.resolve() or build_dir.resolve() in path.resolve().parents


def write_sdist(
    directory: Path, project: ProjectConfig, metadata: CoreMetadata, epoch: int | None = None
) -> str:
    """Write `{name}-{version}.tar.gz` into `directory`; return its file name."""
    if epoch is None:
        epoch = _reproducible.source_date_epoch()
    top = f"{metadata.distribution}-{metadata.version}"
    members: dict[str, bytes | Path] = {"PKG-INFO": metadata.as_bytes()}
    for relative, path in sdist_files(project, metadata).items():
        members.setdefault(relative, path)

    filename = sdist_name(metadata)
    with atomic_output(directory / filename) as stream:
        _write_tar(stream, top, members, epoch)
    return filename


def _write_tar(stream: BinaryIO, top: str, members: Mapping[str, bytes | Path], epoch: int) -> None:
    # filename="" and mtime=0 keep the gzip header free of names and times.
    compressed = gzip.GzipFile(filename="", mode="wb", fileobj=stream, mtime=0)
    with (
        compressed,
        tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as archive,
    ):
        for folder in sorted(_folders(top, members)):
            info = _reproducible.tar_info(
                folder, epoch, _reproducible.DIRECTORY_MODE, directory=True
            )
            archive.addfile(info)
        for relative in sorted(members):
            source = members[relative]
            if isinstance(source, Path):
                data = source.read_bytes()
                executable = os.access(source, os.X_OK)
            else:
                data, executable = source, False
            mode = _reproducible.mode_for_name(relative, executable)
            info = _reproducible.tar_info(f"{top}/{relative}", epoch, mode, size=len(data))
            archive.addfile(info, io.BytesIO(data))


def _relative(path: Path, root: Path) -> str | None:
    """`path` relative to `root` as written (symlinks kept), else after resolving both."""
    candidates = (
        (Path(os.path.abspath(path)), Path(os.path.abspath(root))),
        (path.resolve(), root.resolve()),
    )
    for full, base in candidates:
        try:
            return full.relative_to(base).as_posix()
        except ValueError:
            continue
    return None


def _folders(top: str, names: Iterable[str]) -> set[str]:
    folders = {top}
    for name in names:
        parts = name.split("/")[:-1]
        for index in range(1, len(parts) + 1):
            folders.add(top + "/" + "/".join(parts[:index]))
    return folders


def _external_data(source: Path) -> list[Path]:
    """Files holding a model's external tensor data (they sit next to the .onnx file)."""
    try:
        data = source.read_bytes()
        # an external tensor names its file under the key "location", which protobuf stores
        # as these very bytes: without them there is nothing to find (and no second of
        # importing onnx for a rebuild that the compile cache serves)
        if b"location" not in data:
            return []
        import onnx

        model = onnx.load_model(str(source), load_external_data=False)
    except ImportError:  # the compiler needs onnx anyway and will say so when it runs
        return []
    except Exception:  # an unreadable model is reported by the compiler with a better message
        return []
    locations: set[str] = set()
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        tensors = list(graph.initializer)
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    tensors.append(attribute.t)
                tensors.extend(attribute.tensors)
                if attribute.HasField("g"):
                    graphs.append(attribute.g)
                graphs.extend(attribute.graphs)
        for tensor in tensors:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                locations.update(
                    entry.value for entry in tensor.external_data if entry.key == "location"
                )
    return [source.parent / location for location in sorted(locations)]
