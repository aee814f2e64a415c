"""The project's own ops: Python decompositions (`cuvil.register_op`, from `op-modules` and
the `cuvil.ops` entry points) and what the compile cache keys on for them."""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Any

from cuvil.config import ProjectConfig

_REGISTRY_MODULE = "cuvil.compiler.ops.registered"


def _has_entry_points() -> bool:
    found = metadata.entry_points()
    if hasattr(found, "select"):
        return bool(found.select(group="cuvil.ops"))
    return bool(found.get("cuvil.ops"))  # pragma: no cover - Python 3.9


def load_op_modules(project: ProjectConfig) -> None:
    """Import the entry points of `cuvil.ops` and the project's `op-modules`, whose
    registrations the models may use."""
    from cuvil.compiler.ops.registered import import_op_modules, load_entry_points

    load_entry_points()
    search = [p for p in (project.python_source, project.root) if p is not None]
    import_op_modules(project.op_modules, search, f"{project.pyproject}: tool.cuvil.op-modules")


def ops_state(project: ProjectConfig) -> dict[str, Any]:
    """What the project's ops are made of, for the compile cache and the editable stamp: each
    registered decomposition with the digest of its module's source."""
    if not (project.op_modules or _has_entry_points() or _REGISTRY_MODULE in sys.modules):
        return {}  # nothing registered: the compiler (onnx, llvmlite) stays unloaded
    from cuvil.compiler.ops.registered import load_entry_points, registrations

    load_op_modules(project)
    return {"entry_points": list(load_entry_points()), "decompositions": registrations()}
