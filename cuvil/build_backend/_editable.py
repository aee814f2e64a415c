"""Editable installs (PEP 660): what decides a recompile, and the import hook.

An editable install holds no copy of the project's files: its `.pth` file imports a small
module (`_editable_hook.py`) that puts a finder first on `sys.meta_path`. At the package's
first import the finder checks that the build is not stale (the models' files and the
[tool.cuvil] table against the record of the build; `fingerprint` decides whether a rebuild
compiles). For a mixed project it also gives the package two folders, as scikit-build-core's
"redirect" mode does: the project's source folder (searched first) and the build folder with
the compiled models and generated modules; the package's `__init__.py` is the user's when
there is one, else the generated one. A models-only project's build folder is on sys.path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cuvil
from cuvil.build_backend import _editable_hook
from cuvil.build_backend._custom_ops import custom_op_files, ops_state
from cuvil.build_backend._editable_hook import TABLE
from cuvil.build_backend._python import models_module
from cuvil.build_backend._sdist import model_files
from cuvil.build_backend.cache import sources_digest

if TYPE_CHECKING:
    from cuvil.config import ProjectConfig

__all__ = ["fingerprint", "render_finder", "watched_inputs"]


def fingerprint(project: ProjectConfig, target: str, user_files: Mapping[str, Path]) -> str:
    """A text naming everything the generated files depend on: the models' bytes and
    CompileOptions (config.py: their settings and the build settings that shape code), the
    target, cuvil's version and compiler sources (an editable cuvil that changed recompiles)
    and the package layout.

    Python files of the project are not part of it: editing them needs no recompile.
    """
    state = {
        "cuvil": cuvil.__version__,
        "cuvil_sources": sources_digest(),
        "target": target,
        "package": project.package,
        "loader": models_module(project.package, user_files),
        "py.typed": f"{project.package}/py.typed" in user_files,
        "ops": ops_state(project),
        "models": [
            {
                "name": model.name,
                "options": project.compile_options(model).key_state(),
                "files": {
                    key: hashlib.sha256(path.read_bytes()).hexdigest()
                    for key, path in model_files(project.root, model)
                },
            }
            for model in project.models
        ],
    }
    digest = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()
    return f"cuvil editable install tree; rebuilt when this changes:\n{digest}\n"


def watched_inputs(project: ProjectConfig) -> list[tuple[str, str]]:
    """(label, file) of what the import hook watches: the [tool.cuvil] table and every file
    the models' builds read (models, external data, calibration data, native kernels)."""
    def label(key: str) -> str:
        kind, rest = key.removeprefix("tool.cuvil.").split(".", 1)
        name, field = rest.rsplit(".", 1)  # e.g. "classifier", "source (external data)"
        what = f"model {name}" if kind == "models" else f"custom op {name}"
        return what if field == "source" else f"{what}'s {field}"

    inputs = [(TABLE, str(project.pyproject.resolve()))]
    for model in project.models:
        inputs += [(label(k), str(p.resolve())) for k, p in model_files(project.root, model)]
    inputs += [(label(k), str(p.resolve())) for k, p in custom_op_files(project)]
    return inputs


def render_finder(
    package: str, project: Path, tree: Path, folders: list[Path] | None,
    config_settings: Mapping[str, Any],
) -> bytes:
    """The module the editable wheel's .pth file imports: the import hook's source
    (`_editable_hook.py`) and the call that installs the package's finder. `folders` are the
    package's folders of a mixed project (None: the build folder is on sys.path)."""
    hook = Path(_editable_hook.__file__).read_text(encoding="utf-8")
    paths = None if folders is None else [str(f) for f in folders]
    return (
        f'"""Editable install of the package {package!r}, written by cuvil from the project in\n'
        f'{str(project)!r}; see the end of this file."""\n'
        + hook.split('"""', 2)[2]  # the hook without its docstring
        + f"\n\ninstall({package!r}, {str(project)!r}, {str(tree)!r}, {paths!r},\n"
        f"        {dict(config_settings)!r})\n"
    ).encode()
