"""What the hatchling and setuptools plugins share: the steps of cuvil's own backend, with
another backend writing the wheel.

The plugins compile the models of `[tool.cuvil]` into the project's own package, as a mixed
project's build does (`_python.py`: the models load in `<package>/_cuvil_models.py` when the
package has its own `__init__.py`), read the same settings (`-C`, `CUVIL_*`, `[tool.cuvil]`),
use the compile cache and the same platform rules, and check the finished wheel as `cuvil
check` does. The project's own files, entry points, metadata and sdist stay the host
backend's business: cuvil refuses `[tool.cuvil.metadata]` and `[tool.cuvil.sdist]` there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cuvil import build_backend as backend
from cuvil.build_backend import _reproducible
from cuvil.build_backend._wheel import check_archive_path

if TYPE_CHECKING:
    from cuvil.build_backend._metadata import CoreMetadata
    from cuvil.config import ProjectConfig
    from cuvil.toolchains import Target

__all__ = ["PluginBuild", "build_requirements", "build_sources", "check_wheel", "remove",
           "staging_folder", "start", "write_files"]


@dataclass(frozen=True)
class PluginBuild:
    """One wheel build of a project by a host backend (hatchling, setuptools)."""

    project: ProjectConfig
    metadata: CoreMetadata  # the name and version the host backend computed, nothing more
    target: Target
    platform_tag: str
    verify: Callable[[Path], None]  # the checks of `cuvil check`, on a finished wheel
    config_settings: Mapping[str, Any]  # the -C settings, which an editable install keeps

    @property
    def wheel_tag(self) -> str:
        return f"py3-none-{self.platform_tag}"

    def package_files(self) -> dict[str, bytes]:
        """The generated files of the package (wheel path -> bytes): libraries, loader,
        manifest, headers, stubs; the project's own files are not among them."""
        return backend._compile(self.project, self.metadata, self.target)

    def editable_files(self) -> dict[str, bytes]:
        """The files an editable wheel carries (a `.pth` file and the package's import hook)
        to import the compiled models from `<build_dir>/editable/`, refreshed (and checked)
        first when the models or their settings changed."""
        return backend._editable_files(self.project, self.metadata, self.target,
                                       self.platform_tag, self.config_settings)


def start(root: Path, config_settings: Mapping[str, Any] | None, host: str, name: str,
          version: str) -> PluginBuild:
    """Read the project at `root` and settle the target, the wheel tag and the checks."""
    from cuvil.build_backend._metadata import CoreMetadata
    from cuvil.config import load_project

    project = load_project(root, config_settings, backend=host)
    metadata = CoreMetadata(name=name, version=version, metadata_version="2.1",
                            headers=(("Name", name), ("Version", version)))
    chosen = backend._platform(project)
    verify = backend._wheel_check(project)
    backend._log(f"{host} plugin: compiling into the package {project.package}, "
                 f"wheel tag py3-none-{chosen.platform_tag}")
    return PluginBuild(project, metadata, chosen.target, chosen.platform_tag, verify,
                       dict(config_settings or {}))


def build_requirements(root: Path, config_settings: Mapping[str, Any] | None, host: str) -> list[str]:
    """What a build needs besides cuvil (onnxruntime for int8, CMake for custom ops); [] when
    the project cannot be read (the build step reports why)."""
    from cuvil.config import load_project
    from cuvil.errors import CuvilError

    try:
        project = load_project(root, config_settings, backend=host)
    except CuvilError:
        return []
    return backend._project_requirements(project)


def build_sources(project: ProjectConfig) -> list[str]:
    """Project-relative paths of what a wheel build reads besides the Python package (models
    with their external data and calibration files, custom-op sources), for the host's sdist;
    files outside the project folder are left out (the host's sdist cannot hold them)."""
    from cuvil.build_backend._custom_ops import custom_op_files
    from cuvil.build_backend._sdist import _relative, model_files

    paths = [path for model in project.models for _, path in model_files(project.root, model)]
    paths += [path for _, path in custom_op_files(project)]
    relative = (_relative(path, project.root) for path in paths if path.is_file())
    return sorted({r for r in relative if r is not None})


def write_files(files: Mapping[str, bytes], folder: Path) -> dict[str, str]:
    """Write `files` (wheel path -> bytes) under `folder`; return file path -> wheel path."""
    written = {}
    for name, data in sorted(files.items()):
        check_archive_path(name)
        path = folder.joinpath(*name.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.chmod(path, _reproducible.mode_for_name(name))
        written[str(path)] = name
    return written


def check_wheel(build: PluginBuild, wheel: Path) -> None:
    """Check `wheel`, which the host backend just wrote; one that fails is removed (the error
    says why), so no bad wheel is ever left in the output folder."""
    backend._log(f"checking {wheel.name}")
    try:
        build.verify(wheel)
    except BaseException:
        with contextlib.suppress(OSError):
            wheel.unlink()
        raise


def staging_folder(project: ProjectConfig) -> Path:
    """A private folder in the build folder for files the host backend copies into the wheel."""
    project.settings.build_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="plugin-staging-", dir=project.settings.build_dir))


def remove(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
