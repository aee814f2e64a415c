"""Editable installs (PEP 660): what decides a recompile, and the import hook of mixed projects.

An editable install of a mixed project holds no copy of the project's Python files: its `.pth`
file imports a small module that puts a finder first on `sys.meta_path`. The finder gives the
package two folders, as scikit-build-core's "redirect" mode does: the project's source folder
(searched first) and the build folder with the compiled models and generated modules; the
package's `__init__.py` is the user's when there is one, else the generated one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import cuvil
from cuvil.build_backend._custom_ops import ops_state
from cuvil.build_backend._python import models_module
from cuvil.build_backend._sdist import model_files
from cuvil.build_backend.cache import sources_digest

if TYPE_CHECKING:
    from cuvil.config import ProjectConfig

__all__ = ["fingerprint", "render_finder"]


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
    return f"cuvil editable install tree; rebuilt by pip install -e when this changes:\n{digest}\n"


def render_finder(package: str, source: Path, build: Path) -> bytes:
    """The module the editable wheel's .pth file imports: it installs the package's finder."""
    return f'''\
"""Editable install of the package {package!r}, written by cuvil: `import {package}` reads its
Python files from {str(source)!r} and its compiled models from {str(build)!r}."""

import importlib.util
import os
import sys

_PACKAGE = {package!r}
_FOLDERS = [{str(source)!r}, {str(build)!r}]


class _CuvilEditableFinder:
    package = _PACKAGE

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != _PACKAGE:
            return None  # submodules are found in the package's __path__, the two folders
        init = next(
            (os.path.join(f, "__init__.py") for f in _FOLDERS
             if os.path.isfile(os.path.join(f, "__init__.py"))),
            None,
        )
        if init is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=list(_FOLDERS)
        )

    @classmethod
    def invalidate_caches(cls):
        pass


if not any(getattr(f, "__name__", None) == "_CuvilEditableFinder"
           and getattr(f, "package", None) == _PACKAGE for f in sys.meta_path):
    sys.meta_path.insert(0, _CuvilEditableFinder)
'''.encode()
