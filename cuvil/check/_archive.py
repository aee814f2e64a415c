"""Reading a wheel once for every check: its name, entries and the cuvil manifest."""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from cuvil.errors import CheckError

__all__ = ["CHECKSUM_SIZE", "EXPORTED_PARTS", "MANIFEST", "Library", "WheelArchive", "read_wheel"]

MANIFEST = "_models.json"
# every model's library exports cuvil_<model>_<part> for these parts (see cuvil/compiler/codegen/header.py)
EXPORTED_PARTS = ("abi_checksum", "cpu_check", "workspace_size", "run", "run_profiled",
                  "thread_pool", "use_thread_pool", "set_thread_limit")
CHECKSUM_SIZE = 65  # 64 hex digits and a NUL


@dataclass(frozen=True)
class Library:
    """A native library of the wheel and the models the manifest says it holds."""

    path: str  # archive path
    data: bytes
    models: tuple[dict[str, Any], ...]

    @property
    def file_name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def model_names(self) -> list[str]:
        return [str(m.get("name")) for m in self.models]

    def expected_exports(self) -> set[str]:
        """The C ABI of its models, and nothing else: what the library must export."""
        return {f"cuvil_{m}_{part}" for m in self.model_names for part in EXPORTED_PARTS}


@dataclass
class WheelArchive:
    path: Path
    files: dict[str, bytes]  # archive path -> bytes, directories left out
    duplicates: list[str] = field(default_factory=list)
    name: str | None = None  # normalized distribution name from the file name
    version: str | None = None
    tags: frozenset[Tag] = frozenset()
    filename_error: str | None = None
    manifest_path: str | None = None
    manifest: dict[str, Any] | None = None
    manifest_error: str | None = None

    @property
    def platforms(self) -> list[str]:
        return sorted({t.platform for t in self.tags})

    @property
    def package(self) -> str | None:
        return self.manifest_path.split("/", 1)[0] if self.manifest_path else None

    def dist_info_dirs(self) -> list[str]:
        return sorted({p.split("/", 1)[0] for p in self.files if p.split("/", 1)[0].endswith(".dist-info")})

    def libraries(self) -> list[Library]:
        """The libraries the manifest names, in manifest order (each once), that are in the wheel."""
        if not self.manifest or not self.package:
            return []
        by_file: dict[str, list[dict[str, Any]]] = {}
        for model in self.manifest.get("models", []):
            if isinstance(model, dict) and isinstance(model.get("library"), str):
                by_file.setdefault(model["library"], []).append(model)
        out = []
        for file_name, models in by_file.items():
            path = f"{self.package}/{file_name}"
            if path in self.files:
                out.append(Library(path, self.files[path], tuple(models)))
        return out


def read_wheel(path: str | Path) -> WheelArchive:
    """Read the wheel at `path`; CheckError if it is not a zip archive at all."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise CheckError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckError(f"{path}: not a wheel (cannot read it as a zip archive: {exc})") from None
    files: dict[str, bytes] = {}
    duplicates = []
    with archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            if info.filename in files:
                duplicates.append(info.filename)
            try:
                files[info.filename] = archive.read(info)
            except (zipfile.BadZipFile, OSError, ValueError) as exc:
                raise CheckError(f"{path}: entry {info.filename!r} cannot be read: {exc}") from None
    wheel = WheelArchive(path=path, files=files, duplicates=duplicates)
    try:
        name, version, _build, tags = parse_wheel_filename(path.name)
        wheel.name, wheel.version, wheel.tags = str(name), str(version), frozenset(tags)
    except InvalidWheelFilename as exc:
        wheel.filename_error = str(exc)
    _read_manifest(wheel)
    return wheel


def _read_manifest(wheel: WheelArchive) -> None:
    candidates = sorted(
        p
        for p in wheel.files
        if p.count("/") == 1 and p.endswith("/" + MANIFEST) and not p.split("/")[0].endswith(".dist-info")
    )
    if not candidates:
        wheel.manifest_error = (
            f"no <package>/{MANIFEST} in the wheel: it was not built by cuvil, or the package "
            "folder is missing; rebuild it with `cuvil build`"
        )
        return
    if len(candidates) > 1:
        wheel.manifest_error = f"several cuvil manifests in one wheel: {', '.join(candidates)}"
        return
    wheel.manifest_path = candidates[0]
    try:
        manifest = json.loads(wheel.files[candidates[0]].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        wheel.manifest_error = f"{candidates[0]} is not valid JSON: {exc}"
        return
    if not isinstance(manifest, dict) or not isinstance(manifest.get("models"), list):
        wheel.manifest_error = f"{candidates[0]} has no list of models"
        return
    wheel.manifest = manifest
