"""The generated package's `_models.json`: well formed, self-consistent, naming every library."""

from __future__ import annotations

import re
from typing import Any

from cuvil.check._archive import WheelArchive
from cuvil.check._report import CheckReport

__all__ = ["check_manifest", "native_kind"]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REQUIRED = ("name", "library", "checksum", "symbols", "inputs", "outputs")


def native_kind(data: bytes) -> str | None:
    """ "elf", "macho", "coff" (a PE image) or None, from the file's magic number."""
    if data[:4] == b"\x7fELF":
        return "elf"
    from cuvil.check._macho import is_macho
    from cuvil.check._pe import is_pe

    if is_macho(data):
        return "macho"
    return "coff" if is_pe(data) else None


def _model_problems(model: Any, index: int, package: str, wheel: WheelArchive) -> list[str]:
    from cuvil.runtime import abi_checksum

    if not isinstance(model, dict):
        return [f"models[{index}] is not an object"]
    missing = [k for k in _REQUIRED if k not in model]
    if missing:
        return [f"models[{index}] lacks {', '.join(missing)}"]
    name, library = model["name"], model["library"]
    problems = []
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        problems.append(f"models[{index}].name {name!r} is not a C identifier")
    if not isinstance(library, str) or "/" in library or library in ("", ".", ".."):
        problems.append(f"model {name!r}: library {library!r} is not a file name")
    elif f"{package}/{library}" not in wheel.members:
        problems.append(f"model {name!r}: its library {package}/{library} is not in the wheel")
    try:
        expected = abi_checksum(model)
    except (KeyError, TypeError) as exc:
        problems.append(f"model {name!r}: malformed signature ({type(exc).__name__}: {exc})")
    else:
        if model["checksum"] != expected:
            problems.append(
                f"model {name!r}: recorded checksum {str(model['checksum'])[:16]}... is not the "
                f"checksum of its signature ({expected[:16]}...): the manifest was edited after the build"
            )
    return problems


def check_manifest(wheel: WheelArchive, report: CheckReport) -> None:
    from cuvil.runtime import ABI_VERSION

    name = "manifest"
    if wheel.manifest is None:
        report.failed(name, wheel.manifest_error or "no manifest")
        return
    manifest, package = wheel.manifest, wheel.package or ""
    problems = []
    if manifest.get("package") != package:
        problems.append(f"it names package {manifest.get('package')!r} but lies in {package}/")
    if manifest.get("abi_version") != ABI_VERSION:
        problems.append(
            f"abi_version {manifest.get('abi_version')!r} is not this cuvil's ABI {ABI_VERSION}; "
            "rebuild the wheel with this cuvil version"
        )
    models = manifest["models"]
    if not models:
        problems.append("it lists no models")
    names = [m.get("name") for m in models if isinstance(m, dict)]
    repeated = sorted({str(n) for n in names if names.count(n) > 1})
    if repeated:
        problems.append(f"model names repeat: {', '.join(repeated)}")
    for i, model in enumerate(models):
        problems += _model_problems(model, i, package, wheel)
    named = {
        f"{package}/{m['library']}"
        for m in models
        if isinstance(m, dict) and isinstance(m.get("library"), str)
    }
    stray = [p for p in wheel.native_members() if p not in named]
    if stray:
        problems.append(f"native files that no model names: {', '.join(stray)}")
    if problems:
        report.failed(name, f"{wheel.manifest_path}: " + "; ".join(problems))
    else:
        listed = ", ".join(f"{m['name']} ({m['library']})" for m in models)
        report.passed(name, f"{wheel.manifest_path}: target {manifest.get('target')}, models {listed}")
