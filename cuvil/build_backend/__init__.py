"""cuvil's build backend (PEP 517 and PEP 660): `build-backend = "cuvil.build_backend"`.

Every hook reads the project with `cuvil.config.load_project` (PEP 517 `config_settings`,
i.e. `-C key=value`, are passed on unchanged), converts `[project]` to core metadata and
writes the archive. Heavy modules (the compiler, onnx, llvmlite) are imported inside the
hooks that need them, so that importing the backend stays fast.

Without a named target, the build follows the platform variables cibuildwheel sets
(`_PYTHON_HOST_PLATFORM`, `ARCHFLAGS`, `AUDITWHEEL_PLAT`, ...); `MACOSX_DEPLOYMENT_TARGET` and
`AUDITWHEEL_PLAT` set the tag (see `_platform_env`).

Every wheel is checked as `cuvil check` checks it before it is moved into the output folder;
a failed check fails the build, unless `tool.cuvil.check-warnings` turns it into a warning.

Progress goes to stderr as lines starting with "cuvil: " (`pip wheel -v` shows them); with the
verbose setting (`-C verbose=true`, `CUVIL_VERBOSE=1`) each step also gives its duration and
every command it runs ("cuvil: $ ..."). A `CuvilError` is printed as "cuvil: error: ..." before
it propagates, and no partial archive is ever left in the output folder.

A mixed project's own Python package ships next to the generated files (`_python.py`); its
editable install reads the Python files from the source folder and the compiled models from
the build folder, and recompiles only when the models or their settings change.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

# marks a folder as cuvil's editable install tree, so a refresh never deletes anything else
from cuvil.build_backend._editable_hook import MARKER as _EDITABLE_MARKER

if TYPE_CHECKING:
    from cuvil.build_backend._metadata import CoreMetadata
    from cuvil.build_backend._platform_env import BuildPlatform
    from cuvil.config import ProjectConfig
    from cuvil.toolchains import Target

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
    "rebuild_editable",
]

ConfigSettings = Mapping[str, Any]
_Hook = TypeVar("_Hook", bound=Callable[..., Any])

#: the start of the line the build prints for each model once all are built (`cuvil build`
#: keeps these on screen)
SUMMARY_PREFIX = "cuvil: built model "


def _log(message: str) -> None:
    # the compiler and toolchain parts prefix their own lines already
    line = message if message.startswith("cuvil: ") else f"cuvil: {message}"
    print(line, file=sys.stderr, flush=True)


# Lines of the verbose setting only: the commands the toolchain runs, and step durations.
_VERBOSE_PREFIXES = ("cuvil: $ ", "$ ")


def _step_log(project: ProjectConfig) -> Callable[[str], None]:
    """The log the compiler gets: every line when verbose, else all but the commands."""
    if project.settings.verbose:
        return _log
    return lambda message: None if message.startswith(_VERBOSE_PREFIXES) else _log(message)


@contextlib.contextmanager
def _step(project: ProjectConfig, what: str) -> Iterator[None]:
    """Time one build step; its duration is printed with the verbose setting."""
    start = time.perf_counter()
    yield
    if project.settings.verbose:
        _log(f"{what} took {time.perf_counter() - start:.2f} s")


def _report_errors(hook: _Hook) -> _Hook:
    """Print a CuvilError's message plainly (frontends show stderr), then let it propagate.

    Under a build frontend (pip, build), whose hook runner would print the exception's
    traceback after our message, exit with status 1 instead: the message says all there is.
    """

    @functools.wraps(hook)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from cuvil.errors import CuvilError

        try:
            return hook(*args, **kwargs)
        except CuvilError as error:
            print(f"\ncuvil: error: {error}\n", file=sys.stderr, flush=True)
            if _under_build_frontend():
                raise SystemExit(1) from None
            raise

    return wrapper  # type: ignore[return-value]


def _under_build_frontend() -> bool:
    # pip and build run hooks through pyproject_hooks' `_in_process.py` script
    return Path(sys.argv[0]).name == "_in_process.py"


# The parts this backend calls, behind one name each (tests replace them with fakes).


def _load_project(config_settings: ConfigSettings | None) -> ProjectConfig:
    from cuvil.config import load_project

    return load_project(Path.cwd(), config_settings)


def _get_target(name: str | None) -> Target:
    from cuvil.toolchains import get_target

    return get_target(name)


def _platform(project: ProjectConfig) -> BuildPlatform:
    """The target and wheel tag: the named target, else what the environment asks for."""
    from cuvil.build_backend._platform_env import resolve_platform

    chosen = resolve_platform(project.settings.target, _get_target, os.environ)
    for note in chosen.notes:
        _log(note)
    return chosen


def _build_package_files(
    project: ProjectConfig, workdir: Path, log: Callable[[str], None], target: Target
) -> dict[str, bytes]:
    from cuvil.build_backend._package import build_package_files

    return build_package_files(project, workdir, log, target)


def _wheel_check(project: ProjectConfig) -> Callable[[Path], None]:
    """The checks of `cuvil check`, run on each wheel before it is moved into place."""
    from cuvil.build_backend._verify import wheel_verifier

    return wheel_verifier(project.check_warnings, project.pyproject, _log)


# Requirements: cuvil's own dependencies are all a build needs, but for quantize = "int8",
# which takes onnxruntime's quantizer at build time (the wheel does not depend on it), and for
# custom-op kernels: CMake and a build tool from PyPI when the machine has none (as
# scikit-build-core asks).


def _build_requirements(config_settings: ConfigSettings | None) -> list[str]:
    from cuvil.errors import CuvilError

    try:
        project = _load_project(config_settings)
    except CuvilError:
        return []  # the build hook that follows reports it, with the backend's context
    return _project_requirements(project)


def _project_requirements(project: ProjectConfig) -> list[str]:
    requires = []
    if any(model.quantize == "int8" for model in project.models):
        from cuvil.compiler.frontend.quantize import ONNXRUNTIME_REQUIREMENT

        requires.append(ONNXRUNTIME_REQUIREMENT)
    if project.custom_ops:
        from cuvil.toolchains.custom_ops import find_build_tool, find_cmake

        requires += ([] if find_cmake() is not None else ["cmake>=3.15"]) + \
            ([] if find_build_tool() is not None else ["ninja"])
    return requires


def get_requires_for_build_wheel(config_settings: ConfigSettings | None = None) -> list[str]:
    return _build_requirements(config_settings)


def get_requires_for_build_sdist(config_settings: ConfigSettings | None = None) -> list[str]:
    return []


def get_requires_for_build_editable(config_settings: ConfigSettings | None = None) -> list[str]:
    return _build_requirements(config_settings)


# Metadata


def _read(
    config_settings: ConfigSettings | None, project: ProjectConfig | None = None
) -> tuple[ProjectConfig, CoreMetadata]:
    from cuvil.build_backend._metadata import read_metadata

    project = project or _load_project(config_settings)
    metadata = read_metadata(
        project.project, project.root, project.pyproject, version=project.version
    )
    return project, metadata


def _user_files(project: ProjectConfig, metadata: CoreMetadata) -> dict[str, Path]:
    """The project's own Python files (wheel path -> file), with its entry points checked
    against what the wheel will ship: before compiling, so a typo fails fast."""
    from cuvil.build_backend._python import check_entry_points, python_files

    files = python_files(project)
    check_entry_points(project, metadata.entry_points, files)
    return files


def _prepare_metadata(metadata_directory: str, config_settings: ConfigSettings | None) -> str:
    from cuvil.build_backend._wheel import write_dist_info

    project, metadata = _read(config_settings)
    return write_dist_info(metadata, _platform(project).platform_tag, Path(metadata_directory))


@_report_errors
def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: ConfigSettings | None = None
) -> str:
    return _prepare_metadata(metadata_directory, config_settings)


@_report_errors
def prepare_metadata_for_build_editable(
    metadata_directory: str, config_settings: ConfigSettings | None = None
) -> str:
    return _prepare_metadata(metadata_directory, config_settings)


# Archives


def _compile(project: ProjectConfig, metadata: CoreMetadata, target: Target) -> dict[str, bytes]:
    _log(f"building {metadata.name} {metadata.version} for {target.name}")
    names = ", ".join(model.name for model in project.models)
    plural = "s" if len(project.models) != 1 else ""
    _log(f"compiling model{plural} {names} for {target.name}")
    # each build compiles in a folder of its own: two builds of one project at once (say,
    # with different settings) must not read each other's half-written objects
    build_dir = project.settings.build_dir
    build_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"{target.name}.building-", dir=build_dir))
    try:
        with _step(project, f"compiling model{plural} {names}"):
            files = _build_package_files(project, workdir, _step_log(project), target)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    _keep_as_latest(workdir, build_dir / target.name)
    return files


def _keep_as_latest(workdir: Path, latest: Path) -> None:
    """Leave the intermediate files of the last finished build at `latest` for inspection;
    a build that finishes while another swaps its own in just drops its files."""
    retired = Path(tempfile.mkdtemp(prefix=f"{latest.name}.old-", dir=latest.parent))
    try:
        if latest.exists():
            os.replace(latest, retired / latest.name)
        os.replace(workdir, latest)
    except OSError:
        shutil.rmtree(workdir, ignore_errors=True)
    finally:
        shutil.rmtree(retired, ignore_errors=True)


@_report_errors
def build_wheel(
    wheel_directory: str,
    config_settings: ConfigSettings | None = None,
    metadata_directory: str | None = None,
) -> str:
    # metadata_directory is ignored: the metadata is computed again from the same inputs,
    # so it equals what prepare_metadata_for_build_wheel wrote.
    from cuvil.build_backend._wheel import wheel_name, write_wheel

    start = time.perf_counter()
    project, metadata = _read(config_settings)
    chosen = _platform(project)
    target, tag = chosen.target, chosen.platform_tag
    verify = _wheel_check(project)
    user_files = _user_files(project, metadata)
    if project.settings.verbose:
        _log(f"reading the project took {time.perf_counter() - start:.2f} s")
    files = _compile(project, metadata, target)
    files.update((name, path.read_bytes()) for name, path in user_files.items())
    _log(f"writing wheel {wheel_name(metadata, tag)}")
    with _step(project, "writing and checking the wheel"):
        return write_wheel(
            Path(wheel_directory), metadata, files, tag, verify=verify
        )


@_report_errors
def build_editable(
    wheel_directory: str,
    config_settings: ConfigSettings | None = None,
    metadata_directory: str | None = None,
) -> str:
    """Compile into `<build_dir>/editable/` and write a wheel that imports the package from there.

    Running it again (or `pip install -e .` again) recompiles and swaps the folder's content,
    so the installed package picks up model and config changes; when neither the models nor
    the settings that shape the generated files changed, the folder is kept as it is. The
    package is checked as `build_wheel` checks its wheel before anything is written there.

    The wheel holds an import hook (`_editable_hook.py`): at the package's first import it
    rebuilds the folder, or refuses to import it, when a model or [tool.cuvil] changed (the
    editable-rebuild setting). A mixed project's Python files are not copied: the hook makes
    the package read them from the source folder (edits show at the next import) and the
    generated files from the build folder.
    """
    from cuvil.build_backend._wheel import wheel_name, write_wheel

    project, metadata = _read(config_settings)
    chosen = _platform(project)
    extra = _editable_files(project, metadata, chosen.target, chosen.platform_tag,
                            config_settings or {})
    _log(f"writing editable wheel {wheel_name(metadata, chosen.platform_tag)}")
    return write_wheel(Path(wheel_directory), metadata, extra, chosen.platform_tag)


def _editable_files(project: ProjectConfig, metadata: CoreMetadata, target: Target, tag: str,
                    config_settings: ConfigSettings) -> dict[str, bytes]:
    """Refresh `<build_dir>/editable/` and return the files an editable wheel carries to
    import the package from there: a `.pth` file and the package's import hook."""
    from cuvil.build_backend._editable import render_finder

    tree = _refresh_editable_tree(project, metadata, target, tag)
    hook = f"_cuvil_editable_{metadata.distribution}"
    source = project.python_package
    # a mixed project's Python files stay where they are; else the build folder is on sys.path
    folders = None if source is None else [source, tree / project.package]
    finder = render_finder(project.package, project.root, tree, folders, config_settings)
    pth = ("" if source is not None else f"{tree}\n") + f"import {hook}\n"
    return {f"{metadata.distribution}.pth": pth.encode(), f"{hook}.py": finder}


def rebuild_editable(project_dir: str, config_settings: ConfigSettings | None = None) -> str:
    """Bring the editable install's build folder up to date (as `build_editable` does, with
    no wheel); its import hook calls this when a model or [tool.cuvil] changed, and reports
    its errors. Returns the folder, which stays as it was when the build fails."""
    from cuvil.config import load_project

    project = load_project(Path(project_dir), config_settings)
    _, metadata = _read(config_settings, project)
    chosen = _platform(project)
    return str(_refresh_editable_tree(project, metadata, chosen.target, chosen.platform_tag))


def _refresh_editable_tree(project: ProjectConfig, metadata: CoreMetadata, target: Target,
                           tag: str) -> Path:
    """Compile the project into `<build_dir>/editable/` unless its fingerprint is unchanged
    (checked as a wheel first); either way, record the inputs the import hook watches."""
    from cuvil.build_backend._editable import fingerprint, watched_inputs
    from cuvil.build_backend._editable_hook import snapshot, write_record
    from cuvil.build_backend._wheel import write_wheel

    verify = _wheel_check(project)
    user_files = _user_files(project, metadata)
    tree = (project.settings.build_dir / "editable").resolve()
    # before the fingerprint reads the files: an edit made meanwhile shows at the next import
    record = snapshot(watched_inputs(project), project.settings.editable_rebuild)
    stamp = fingerprint(project, target.name, user_files)
    if _tree_stamp(tree) == stamp:
        from cuvil.build_backend._python import check_no_clash

        kept = [p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()]
        check_no_clash(project, user_files, kept)
        _log(f"the models and their settings are unchanged: keeping the compiled package in {tree}")
        write_record(str(tree), record)
    else:
        files = _compile(project, metadata, target)
        with tempfile.TemporaryDirectory() as scratch:  # checked as the wheel it would be
            everything = {**files, **{n: p.read_bytes() for n, p in user_files.items()}}
            write_wheel(Path(scratch), metadata, everything, tag, verify=verify)
        _log(f"writing the editable package into {tree}")
        _replace_tree(tree, files, stamp, record)
    return tree


def _tree_stamp(tree: Path) -> str | None:
    try:
        return (tree / _EDITABLE_MARKER).read_text(encoding="utf-8")
    except OSError:
        return None


def _replace_tree(
    tree: Path, files: Mapping[str, bytes], stamp: str = "", record: Mapping[str, Any] | None = None
) -> None:
    """Make `tree` hold exactly `files`; the old content stays until the new one is complete.
    The marker file holds `stamp`, what the tree was built from; `record` is the import hook's
    record of the inputs."""
    from cuvil.build_backend import _reproducible
    from cuvil.build_backend._editable_hook import write_record
    from cuvil.build_backend._wheel import check_archive_path
    from cuvil.errors import BuildError

    if tree.exists() and not (tree / _EDITABLE_MARKER).exists():
        raise BuildError(
            f"{tree} exists but was not written by cuvil; remove it, or choose another build "
            "folder (the build_dir setting)"
        )
    tree.parent.mkdir(parents=True, exist_ok=True)
    # private names: a concurrent refresh of the same tree must not write into this one's
    staging = Path(tempfile.mkdtemp(prefix=tree.name + ".new-", dir=tree.parent))
    retired = Path(tempfile.mkdtemp(prefix=tree.name + ".old-", dir=tree.parent)) / tree.name
    for name, data in files.items():
        check_archive_path(name)
        path = staging.joinpath(*name.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.chmod(path, _reproducible.mode_for_name(name))
    if record is not None:
        write_record(str(staging), dict(record))
    # written last: a tree whose marker holds a stamp is complete
    (staging / _EDITABLE_MARKER).write_text(stamp, encoding="utf-8")
    try:
        if tree.exists():
            os.replace(tree, retired)
        os.replace(staging, tree)
    except OSError:
        if not tree.exists():  # else a concurrent refresh put its complete tree in place
            raise
    finally:
        shutil.rmtree(retired.parent, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)


@_report_errors
def build_sdist(sdist_directory: str, config_settings: ConfigSettings | None = None) -> str:
    from cuvil.build_backend._sdist import sdist_name, write_sdist

    project, metadata = _read(config_settings)
    _log(f"writing sdist {sdist_name(metadata)}")
    return write_sdist(Path(sdist_directory), project, metadata)
