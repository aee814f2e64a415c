"""cuvil with setuptools: a setuptools project compiles the models of its `[tool.cuvil]` table
into its own package, configured in pyproject.toml alone (no setup.py).

```toml
[build-system]
requires = ["setuptools>=70.1", "cuvil"]
build-backend = "cuvil.build_backend.setuptools"
```

This module is that backend: setuptools' own PEP 517 backend (`setuptools.build_meta`), with
cuvil's `-C` settings taken out of the config settings (the others go to setuptools) and every
wheel checked as `cuvil check` checks it before it is moved into the output folder.
`finalize_distribution_options`, which setuptools calls for every project through cuvil's
`setuptools.finalize_distribution_options` entry point, adds to a project with a
`[tool.cuvil]` table:

- the `build` sub-command `build_cuvil`, which compiles the models (with the compile cache)
  into the package in the build folder, writes an editable wheel's import hook instead for
  `pip install -e`, and names the model files for the sdist (`get_source_files`);
- a `bdist_wheel` that tags the wheel `py3-none-<platform>` (the target's, not the host
  interpreter's).

Everything else (the project's packages, data files, entry points, metadata) is setuptools'.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from setuptools import Command
from setuptools import build_meta as _setuptools
from setuptools.dist import Distribution

from cuvil.build_backend import _log, _report_errors
from cuvil.build_backend._plugins import (
    PluginBuild,
    build_requirements,
    build_sources,
    start,
    write_files,
)
from cuvil.errors import ConfigError

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "finalize_distribution_options",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

HOST = "setuptools"

# cuvil's -C settings while one of this backend's hooks runs; None outside them
_settings: dict[str, Any] | None = None


def _cuvil_keys() -> set[str]:
    from cuvil.config import iter_options

    return {option.key for option in iter_options() if option.settable}


@contextlib.contextmanager
def _hook(config_settings: Mapping[str, Any] | None) -> Iterator[dict[str, Any]]:
    """Run a setuptools hook with cuvil's settings set aside; yields setuptools' own."""
    global _settings
    keys = _cuvil_keys()
    given = dict(config_settings or {})
    previous, _settings = _settings, {k: v for k, v in given.items() if k in keys}
    try:
        yield {k: v for k, v in given.items() if k not in keys}
    finally:
        _settings = previous


def get_requires_for_build_wheel(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    with _hook(config_settings) as rest:
        return [*_setuptools.get_requires_for_build_wheel(rest),
                *build_requirements(Path.cwd(), _settings, HOST)]


def get_requires_for_build_editable(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    with _hook(config_settings) as rest:
        return [*_setuptools.get_requires_for_build_editable(rest),
                *build_requirements(Path.cwd(), _settings, HOST)]


def get_requires_for_build_sdist(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    with _hook(config_settings) as rest:
        return list(_setuptools.get_requires_for_build_sdist(rest))


def prepare_metadata_for_build_wheel(metadata_directory: str,
                                     config_settings: Mapping[str, Any] | None = None) -> str:
    with _hook(config_settings) as rest:
        return str(_setuptools.prepare_metadata_for_build_wheel(metadata_directory, rest))


def prepare_metadata_for_build_editable(metadata_directory: str,
                                        config_settings: Mapping[str, Any] | None = None) -> str:
    with _hook(config_settings) as rest:
        return str(_setuptools.prepare_metadata_for_build_editable(metadata_directory, rest))


def build_sdist(sdist_directory: str, config_settings: Mapping[str, Any] | None = None) -> str:
    with _hook(config_settings) as rest:
        return str(_setuptools.build_sdist(sdist_directory, rest))


@_report_errors
def build_wheel(wheel_directory: str, config_settings: Mapping[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    with _hook(config_settings) as rest:
        return _checked(wheel_directory, lambda d: _setuptools.build_wheel(d, rest, metadata_directory))


@_report_errors
def build_editable(wheel_directory: str, config_settings: Mapping[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    with _hook(config_settings) as rest:
        return str(_setuptools.build_editable(wheel_directory, rest, metadata_directory))


def _checked(wheel_directory: str, build: Any) -> str:
    """Have setuptools write the wheel into a private folder, check it there and move it into
    `wheel_directory` only if it passes."""
    from cuvil.build_backend._verify import wheel_verifier
    from cuvil.config import load_project

    project = load_project(Path.cwd(), _settings, backend=HOST)
    os.makedirs(wheel_directory, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".cuvil-", dir=wheel_directory))
    try:
        wheel = staging / str(build(str(staging)))
        _log(f"checking {wheel.name}")
        wheel_verifier(project.check_warnings, project.pyproject, _log)(wheel)
        os.replace(wheel, Path(wheel_directory) / wheel.name)
        return wheel.name
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _plan(dist: Distribution) -> PluginBuild:
    """The build of `dist`, read once per distribution (the command and the tag share it)."""
    plan: PluginBuild | None = getattr(dist, "_cuvil_build", None)
    if plan is None:
        plan = start(Path.cwd(), _settings, HOST, dist.get_name(), dist.get_version())
        dist._cuvil_build = plan
    return plan


class build_cuvil(Command):
    """Compile the models of [tool.cuvil] into the package."""

    description = "compile the models of [tool.cuvil] into the package (cuvil)"
    user_options: list[tuple[str, str | None, str]] = []  # noqa: RUF012 (distutils' API)

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False
        self._outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        plan = _plan(self.distribution)
        if self.editable_mode:
            # setuptools writes what `install` holds into the editable wheel as it is
            folder = self.get_finalized_command("install").install_lib
            write_files(plan.editable_files(), Path(folder))
            return
        assert self.build_lib is not None
        self._outputs = list(write_files(plan.package_files(), Path(self.build_lib)))

    def get_outputs(self) -> list[str]:
        return self._outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        from cuvil.config import load_project

        return build_sources(load_project(Path.cwd(), _settings, backend=HOST))


def finalize_distribution_options(dist: Distribution) -> None:
    """setuptools' hook: add cuvil's commands to a project whose pyproject.toml has [tool.cuvil]."""
    if not _declares_cuvil(Path.cwd() / "pyproject.toml"):
        return
    if _settings is None:
        raise ConfigError(
            f"{Path.cwd() / 'pyproject.toml'}: the project has a [tool.cuvil] table, but "
            "setuptools runs it without cuvil's backend, so its models would not be compiled; "
            'set build-backend = "cuvil.build_backend.setuptools" under [build-system] '
            '(with requires = ["setuptools>=70.1", "cuvil"])'
        )
    build = dist.get_command_class("build")
    bdist_wheel = dist.get_command_class("bdist_wheel")

    class build_with_cuvil(build):  # type: ignore[valid-type,misc]
        sub_commands = [*build.sub_commands, ("build_cuvil", None)]  # noqa: RUF012

    class bdist_wheel_cuvil(bdist_wheel):  # type: ignore[valid-type,misc]
        def get_tag(self) -> tuple[str, str, str]:
            return "py3", "none", _plan(self.distribution).platform_tag

    dist.cmdclass.update(build=build_with_cuvil, bdist_wheel=bdist_wheel_cuvil,
                         build_cuvil=build_cuvil)
    # the package holds native libraries: it installs to platlib, the wheel's root, as a
    # package with extension modules does (bdist_wheel and install ask this)
    dist.has_ext_modules = lambda: True


def _declares_cuvil(pyproject: Path) -> bool:
    from cuvil.config import read_pyproject

    if not pyproject.is_file():
        return False
    tool = read_pyproject(pyproject).get("tool")
    return isinstance(tool, dict) and "cuvil" in tool
