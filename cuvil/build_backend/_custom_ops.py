"""The project's own ops: Python decompositions (`cuvil.register_op`, from `op-modules` and
the `cuvil.ops` entry points), native kernels (`[tool.cuvil.custom-ops.<name>]`: their files,
their shape functions), and what the compile cache keys on for both."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuvil.config import ProjectConfig
from cuvil.errors import ConfigError

if TYPE_CHECKING:
    from cuvil.compiler.ops.native import NativeKernel

_REGISTRY_MODULE = "cuvil.compiler.ops.registered"
#: files next to a kernel's sources that #include may read: part of what the cache keys on and
#: of what the sdist carries
_HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".inc", ".inl")


def _has_entry_points() -> bool:
    found = metadata.entry_points()
    if hasattr(found, "select"):
        return bool(found.select(group="cuvil.ops"))
    return bool(found.get("cuvil.ops"))  # pragma: no cover - Python 3.9


def _search_path(project: ProjectConfig) -> list[Path]:
    return [p for p in (project.python_source, project.root) if p is not None]


def load_op_modules(project: ProjectConfig) -> None:
    """Import the entry points of `cuvil.ops` and the project's `op-modules`, whose
    registrations the models may use."""
    from cuvil.compiler.ops.registered import import_op_modules, load_entry_points

    load_entry_points()
    import_op_modules(project.op_modules, _search_path(project),
                      f"{project.pyproject}: tool.cuvil.op-modules")


def custom_op_files(project: ProjectConfig) -> Iterator[tuple[str, Path]]:
    """(config key, file) of every file the native kernels are built from: the sources and
    the headers beside them."""
    for op in project.custom_ops:
        key = f"tool.cuvil.custom-ops.{op.name}.sources"
        for source in op.sources:
            yield key, source
        for folder in dict.fromkeys(p.parent for p in op.sources):
            for header in sorted(folder.iterdir()):
                if header.suffix in _HEADER_SUFFIXES and header.is_file():
                    yield f"{key} (a header beside them)", header


def native_kernels(project: ProjectConfig) -> list[NativeKernel]:
    """The project's custom-op tables, each with its shape function imported."""
    from cuvil.compiler.ops.native import NativeKernel
    from cuvil.compiler.ops.registered import import_op_modules

    kernels = []
    for op in project.custom_ops:
        function: Any = None
        if op.shape_function is not None:
            where = f"{project.pyproject}: tool.cuvil.custom-ops.{op.name}.shape-function"
            module, _, name = op.shape_function.partition(":")
            import_op_modules([module], _search_path(project), where)
            function = sys.modules[module]
            for part in name.split("."):
                function = getattr(function, part, None)
            if not callable(function):
                raise ConfigError(f"{where}: {module} has no function {name!r}. Name a function "
                                  "taking (input shapes, attributes) and returning one shape "
                                  "per output")
        kernels.append(NativeKernel(op, function))
    return kernels


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ops_state(project: ProjectConfig | None) -> dict[str, Any]:
    """What the project's ops are made of, for the compile cache and the editable stamp: each
    registered decomposition with the digest of its module's source; each native kernel's
    table, the digests of its files and of its shape function's module. Without a project
    (`cuvil compile`), the decompositions of installed packages' entry points."""
    state: dict[str, Any] = {}
    if project is not None and project.custom_ops:
        state["native"] = [
            {**dataclasses.asdict(op), "sources": None,
             "shape_module": _module_digest(project, op.shape_function)}
            for op in project.custom_ops]
        state["native_files"] = [[Path(os.path.relpath(p, project.root)).as_posix(),
                                  _file_digest(p)] for _, p in custom_op_files(project)]
    if (project is not None and project.op_modules) or _has_entry_points() \
            or _REGISTRY_MODULE in sys.modules:
        from cuvil.compiler.ops.registered import load_entry_points, registrations

        if project is not None:
            load_op_modules(project)
        state["entry_points"] = list(load_entry_points())
        state["decompositions"] = registrations()
    return state


def _module_digest(project: ProjectConfig, shape_function: str | None) -> str | None:
    if shape_function is None:
        return None
    module = shape_function.partition(":")[0]
    for folder in _search_path(project):
        for path in (folder.joinpath(*module.split(".")).with_suffix(".py"),
                     folder.joinpath(*module.split("."), "__init__.py")):
            if path.is_file():
                return _file_digest(path)
    return module  # an installed module: its version is not known here
