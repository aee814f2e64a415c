"""The project's own Python package in a mixed project, and the checks of what the wheel ships.

A mixed project keeps a Python package `<package>/` (pre- and post-processing, a command line)
in `tool.cuvil.python-source` (default: `src/` or the project root). Its files ship in the
wheel next to the generated ones, which never replace a user file:

- no user `__init__.py`: cuvil writes `<package>/__init__.py`, which loads the models, so
  `<package>.<model>` works as in a project without Python code;
- a user `__init__.py`: the models load in the generated module `<package>._cuvil_models`,
  and the user's `__init__` re-exports what it wants (`from ._cuvil_models import classifier`).

Entry points that name a module of the package are checked against the modules the wheel
ships, statically (with `ast`, never importing user code).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from cuvil.errors import ConfigError
from cuvil.runtime import LOADER_SOURCE, SESSION_SOURCE

if TYPE_CHECKING:
    from cuvil.config import ProjectConfig

__all__ = ["MODELS_MODULE", "check_entry_points", "models_module", "python_files"]

# The generated module that loads the models when the user writes `__init__.py`.
MODELS_MODULE = "_cuvil_models"
RUNTIME_MODULE = "_cuvil_runtime"
# The onnxruntime-style session the loader imports when asked (`Model.session()`).
SESSION_MODULE = SESSION_SOURCE.stem


def python_files(project: ProjectConfig) -> dict[str, Path]:
    """Wheel paths -> files of the project's Python package ({} when it has none).

    Left out: `__pycache__` folders, compiled `.pyc`/`.pyo` files and hidden (dot) files.
    """
    folder = project.python_package
    if folder is None:
        return {}
    files = {}
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if any(p == "__pycache__" or p.startswith(".") for p in parts):
            continue
        if path.suffix in (".pyc", ".pyo") or not path.is_file():
            continue
        files["/".join((project.package, *parts))] = path
    return files


def models_module(package: str, user_files: Iterable[str]) -> str:
    """The module that loads the models: the package itself unless the user wrote its __init__."""
    return f"{package}.{MODELS_MODULE}" if f"{package}/__init__.py" in user_files else package


def check_no_clash(project: ProjectConfig, user_files: Mapping[str, Path], generated: Iterable[str]) -> None:
    """Refuse a user file at a path cuvil generates (it would be silently replaced), and a
    model whose library `<package>/_<model>.so` would shadow a module of the same name: Python
    imports a compiled library before a .py file, so a model named `cuvil_runtime` (beside the
    generated `_cuvil_runtime.py`) made a wheel that cannot be imported."""
    generated = set(generated)
    for name in sorted(generated & set(user_files)):
        raise ConfigError(
            f"{user_files[name]}: cuvil generates {name} in the wheel (from the models of "
            f"{project.pyproject}), so the project's own file there would be lost; rename it"
        )
    folder = f"{project.package}/"
    modules: dict[str, str] = {}
    for path in sorted(generated | set(user_files)):
        rest = path[len(folder):] if path.startswith(folder) else ""
        if rest.endswith(".py") and "/" not in rest:
            modules.setdefault(rest[:-3], path)
        elif rest.endswith("/__init__.py") and rest.count("/") == 1:
            modules.setdefault(rest.split("/")[0], path)
    for model in project.models:
        module = modules.get(f"_{model.name}")
        if module is not None:
            raise ConfigError(
                f"{project.pyproject}: [tool.cuvil.models.{model.name}]: the model's library "
                f"{folder}_{model.name}.so would shadow the module {module} (Python imports a "
                f"compiled library before a .py file of the same name), so `import "
                f"{project.package}` would fail; rename the model"
            )


def check_entry_points(
    project: ProjectConfig,
    entry_points: Mapping[str, Mapping[str, str]],
    user_files: Mapping[str, Path],
) -> None:
    """Every entry point naming a module of the package must name a shipped module and one of
    its top-level names; a ConfigError names the key, the module and what is missing."""
    modules = _shipped_modules(project, user_files)
    shipped = ", ".join(sorted(modules))
    for group, entries in sorted(entry_points.items()):
        key = {"console_scripts": "scripts", "gui_scripts": "gui-scripts"}.get(
            group, f"entry-points.{group}"
        )
        for name, reference in sorted(entries.items()):
            module, _, attribute = reference.partition(":")
            if module.split(".")[0] != project.package:
                continue  # another distribution's module: nothing to check it against here
            where = f"{project.pyproject}: project.{key}.{name}"
            if module not in modules:
                raise ConfigError(
                    f"{where}: {reference!r} names the module {module}, which the wheel does not "
                    f"ship (it ships {shipped}); create it in the Python package "
                    f"({_package_hint(project)}) or correct the reference"
                )
            if not attribute:
                continue
            names, origin = modules[module]
            first = attribute.split(".")[0]
            if names is not None and first not in names:
                raise ConfigError(
                    f"{where}: {reference!r} names {first} in {module} ({origin}), which defines "
                    f"no such top-level name; define it there or correct the reference"
                )


def _package_hint(project: ProjectConfig) -> str:
    if project.python_package is not None:
        return str(project.python_package)
    return f"src/{project.package}/ or {project.package}/, or set tool.cuvil.python-source"


def _shipped_modules(
    project: ProjectConfig, user_files: Mapping[str, Path]
) -> dict[str, tuple[set[str] | None, str]]:
    """Module name -> (its top-level names, None if they cannot be told statically; origin)."""
    modules: dict[str, tuple[set[str] | None, str]] = {}
    for name, path in user_files.items():
        parts = name[: -len(".py")].split("/") if name.endswith(".py") else None
        if parts is None:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        for depth in range(1, len(parts)):  # folders without __init__.py: namespace packages
            modules.setdefault(".".join(parts[:depth]), (set(), "a namespace package"))
        modules[".".join(parts)] = (_names_in(path, project), str(path))
    pkg = project.package
    generated = {m.name for m in project.models} | {"__all__"}
    modules[models_module(pkg, user_files)] = (generated, "generated by cuvil: the models")
    for module, source in ((RUNTIME_MODULE, LOADER_SOURCE), (SESSION_MODULE, SESSION_SOURCE)):
        modules[f"{pkg}.{module}"] = (
            _top_level_names(ast.parse(source.read_text(encoding="utf-8"))),
            "generated by cuvil",
        )
    return modules


def _names_in(path: Path, project: ProjectConfig) -> set[str] | None:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as error:
        raise ConfigError(
            f"{path}:{error.lineno}: {error.msg}; project.scripts or entry-points in "
            f"{project.pyproject} name this module, so fix the syntax error"
        ) from None
    return _top_level_names(tree)


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """Names a module binds at top level (in if/try/with blocks too); None if a star import
    or a module `__getattr__` makes them unknowable."""
    names: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
        for block in ("body", "orelse", "finalbody"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                pending.extend(getattr(node, block, []))
        for handler in getattr(node, "handlers", []):
            pending.extend(handler.body)
    return None if "__getattr__" in names else names
