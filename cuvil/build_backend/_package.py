"""Generate the files of a model package: libraries, Python wrapper, header, stubs."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from cuvil.config import ProjectConfig


def build_package_files(
    project: ProjectConfig, workdir: Path, log: Callable[[str], None]
) -> dict[str, bytes]:
    """Compile every model of `project` for `project.settings.target`; return wheel paths -> bytes."""
    raise NotImplementedError("being written")
