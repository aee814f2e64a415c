"""cuvil as a hatchling build hook: a hatchling project compiles the models of its
`[tool.cuvil]` table into its own package.

```toml
[build-system]
requires = ["hatchling>=1.24", "cuvil"]
build-backend = "hatchling.build"

[tool.hatch.build.hooks.cuvil]     # turns the hook on; cuvil's settings stay in [tool.cuvil]
```

hatchling finds the hook through cuvil's `hatch` entry point. For a wheel, it compiles every
model (with the compile cache) and hands hatchling the generated files to add to the package,
with the tag `py3-none-<platform>`; the finished wheel is checked as `cuvil check` checks it
and removed if it fails. An editable wheel imports the compiled models from the build folder,
as cuvil's own backend's does. An sdist compiles nothing.

hatchling gives its plugins no PEP 517 config settings (pypa/hatch#1072), so `-C key=value`
is read from the frame of hatchling's PEP 517 hook, whose parameter PEP 517 names
`config_settings`; `CUVIL_*` variables and `[tool.cuvil]` work as with cuvil's own backend.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from hatchling.plugin import hookimpl

from cuvil.build_backend import _log, _report_errors
from cuvil.build_backend._plugins import (
    PluginBuild,
    build_requirements,
    check_wheel,
    remove,
    staging_folder,
    start,
    write_files,
)
from cuvil.errors import ConfigError

__all__ = ["CuvilBuildHook", "hatch_register_build_hook"]

# the keys hatchling itself reads in every hook's table
_HATCH_KEYS = {"dependencies", "require-runtime-dependencies", "require-runtime-features",
               "enable-by-default"}


class CuvilBuildHook(BuildHookInterface):
    PLUGIN_NAME = "cuvil"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._build: PluginBuild | None = None
        self._staging: Path | None = None

    def dependencies(self) -> list[str]:
        if self.target_name != "wheel":
            return []
        return build_requirements(Path(self.root), _frontend_settings(), "hatchling")

    @_report_errors
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return  # an sdist carries the sources; the models compile when a wheel is built
        self._check_table()
        build = start(Path(self.root), _frontend_settings(), "hatchling",
                      self.metadata.name, self.metadata.version)
        self._staging = staging_folder(build.project)
        try:
            if version == "editable":  # hatchling tags editable wheels itself (py3-none-any)
                files = build.editable_files()
            else:
                files = build.package_files()
                build_data["tag"] = build.wheel_tag
                build_data["pure_python"] = False
            build_data["force_include"].update(write_files(files, self._staging))
        except BaseException:
            remove(self._staging)
            raise
        self._build = build

    @_report_errors
    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        build, self._build = self._build, None
        remove(self._staging)
        if build is not None and version != "editable":
            check_wheel(build, Path(artifact_path))
            _log(f"wrote {Path(artifact_path).name}")

    def _check_table(self) -> None:
        unknown = sorted(set(self.config) - _HATCH_KEYS)
        if unknown:
            raise ConfigError(
                f"{Path(self.root) / 'pyproject.toml'}: tool.hatch.build.hooks.cuvil: unknown "
                f"key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; cuvil reads its "
                "models and settings from [tool.cuvil] (docs/plugins.md), so move them there"
            )


def _frontend_settings() -> dict[str, Any]:
    """The `-C` settings of the PEP 517 hook of hatchling running this build ({} for builds
    that run no such hook, such as `hatch build`)."""
    import hatchling.build as hooks

    codes = {inspect.unwrap(hook).__code__ for hook in (hooks.build_wheel, hooks.build_editable,
                                                        hooks.get_requires_for_build_wheel,
                                                        hooks.get_requires_for_build_editable)}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return dict(frame.f_locals.get("config_settings") or {})
        frame = frame.f_back  # type: ignore[assignment]
    return {}


@hookimpl
def hatch_register_build_hook() -> type[BuildHookInterface]:
    return CuvilBuildHook
