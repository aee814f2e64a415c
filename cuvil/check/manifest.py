"""The generated package's `_models.json`: well formed, self-consistent, naming every library."""

from __future__ import annotations

from typing import Any

from cuvil.check._archive import WheelArchive
from cuvil.check._report import CheckReport

__all__ = ["check_manifest", "native_kind"]


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
    """What is wrong with one `models` entry: the schema the loader reads it by (every
    expression included), its library in the wheel, its recorded checksum."""
    from cuvil.runtime import ManifestError, ModelSignature, abi_checksum

    where = f"models[{index}]"
    try:
        signature = ModelSignature.from_json(model, where)
        signature.check_expressions(where)
    except ManifestError as exc:
        return [f"{exc} (the package could not be imported)"]
    name, library = signature.name, signature.library
    problems = []
    if f"{package}/{library}" not in wheel.members:
        problems.append(f"model {name!r}: its library {package}/{library} is not in the wheel")
    expected = abi_checksum(signature)
    if signature.checksum != expected:
        problems.append(
            f"model {name!r}: recorded checksum {signature.checksum[:16]}... is not the checksum "
            f"of its signature ({expected[:16]}...): the manifest was edited after the build"
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
    if f"{package}/__init__.py" not in wheel.members:  # cuvil writes one, or keeps the project's
        problems.append(f"{package}/__init__.py is missing: `import {package}` would not load "
                        "the models")
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
