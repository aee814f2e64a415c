"""The wheel's own bookkeeping: layout, WHEEL, METADATA and RECORD (the binary distribution format)."""

from __future__ import annotations

import csv
import email.parser
import io

from packaging.metadata import ExceptionGroup, InvalidMetadata, Metadata
from packaging.utils import canonicalize_name, canonicalize_version

from cuvil.check._archive import WheelArchive
from cuvil.check._report import CheckReport

__all__ = ["check_layout", "check_metadata", "check_record", "check_wheel_file"]

# hashes too weak for RECORD (the spec forbids md5 and sha1)
_WEAK_HASHES = {"md5", "sha1"}
_SIGNATURE_FILES = ("RECORD.jws", "RECORD.p7s")


def _dist_info(wheel: WheelArchive) -> str | None:
    dirs = wheel.dist_info_dirs()
    return dirs[0] if len(dirs) == 1 else None


def check_layout(wheel: WheelArchive, report: CheckReport) -> None:
    """Only the package folder and one .dist-info folder, named after the file."""
    name = "layout"
    problems = []  # unsafe paths and repeated entries: read_wheel refuses those already
    dist_infos = wheel.dist_info_dirs()
    if len(dist_infos) != 1:
        problems.append(
            f"expected one .dist-info folder, found {len(dist_infos)}: {', '.join(dist_infos) or '-'}"
        )
    elif wheel.name is not None and wheel.version is not None:
        stem = dist_infos[0][: -len(".dist-info")]
        dist, _, version = stem.partition("-")
        if canonicalize_name(dist) != canonicalize_name(wheel.name) or (
            canonicalize_version(version) != canonicalize_version(wheel.version)
        ):
            problems.append(f"{dist_infos[0]} does not match the file name's {wheel.name} {wheel.version}")
    allowed = set(dist_infos)
    if wheel.package:
        allowed.add(wheel.package)
    outside = sorted(p for p in wheel.members if p.split("/", 1)[0] not in allowed)
    if outside:
        shown = ", ".join(outside[:8]) + (f" and {len(outside) - 8} more" if len(outside) > 8 else "")
        where = f"the package folder {wheel.package}/" if wheel.package else "a package folder"
        problems.append(f"files outside {where} and the .dist-info folder: {shown}")
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(name, f"{len(wheel.members)} files in {wheel.package}/ and {dist_infos[0]}/")


def check_wheel_file(wheel: WheelArchive, report: CheckReport) -> None:
    """WHEEL: version 1.x, not purelib, and the same tags as the file name."""
    name = "WHEEL"
    dist_info = _dist_info(wheel)
    data = wheel.texts.get(f"{dist_info}/WHEEL") if dist_info else None
    if data is None:
        report.failed(name, "no .dist-info/WHEEL file")
        return
    try:
        message = email.parser.BytesParser().parsebytes(data)
    except Exception as exc:  # the email parser is lenient; this is belt and braces
        report.failed(name, f"cannot parse {dist_info}/WHEEL: {exc}")
        return
    problems = []
    version = message.get("Wheel-Version", "")
    if version.split(".")[0] != "1":
        problems.append(f"Wheel-Version is {version!r}, expected 1.x")
    purelib = message.get("Root-Is-Purelib", "").strip().lower()
    if purelib != "false":
        problems.append(f"Root-Is-Purelib is {purelib!r}, expected 'false' for a wheel with native libraries")
    tags = sorted(message.get_all("Tag") or [])
    expected = sorted(str(t) for t in wheel.tags)
    if tags != expected:
        problems.append(
            f"Tag lines {', '.join(tags) or '(none)'} differ from the file name's tags {', '.join(expected)}"
        )
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(name, f"Wheel-Version {version}, Root-Is-Purelib false, tags {', '.join(tags)}")


def check_metadata(wheel: WheelArchive, report: CheckReport) -> None:
    """METADATA is valid core metadata for the name and version in the file name."""
    name = "METADATA"
    dist_info = _dist_info(wheel)
    data = wheel.texts.get(f"{dist_info}/METADATA") if dist_info else None
    if data is None:
        report.failed(name, "no .dist-info/METADATA file")
        return
    try:
        metadata = Metadata.from_email(data, validate=True)
    except ExceptionGroup as group:
        reasons = "; ".join(str(e) for e in group.exceptions)
        report.failed(name, f"{dist_info}/METADATA is not valid core metadata: {reasons}")
        return
    except (InvalidMetadata, ValueError) as exc:
        report.failed(name, f"{dist_info}/METADATA is not valid core metadata: {exc}")
        return
    problems = []
    if wheel.name is not None and canonicalize_name(metadata.name) != wheel.name:
        problems.append(f"Name {metadata.name!r} differs from the file name's {wheel.name!r}")
    if wheel.version is not None and str(metadata.version) != wheel.version:
        problems.append(f"Version {metadata.version} differs from the file name's {wheel.version}")
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(
            name, f"Metadata-Version {metadata.metadata_version}, {metadata.name} {metadata.version}"
        )


def check_record(wheel: WheelArchive, report: CheckReport) -> None:
    """RECORD lists every file once with its right hash and size (and itself without a hash)."""
    name = "RECORD"
    dist_info = _dist_info(wheel)
    record_path = f"{dist_info}/RECORD" if dist_info else None
    data = wheel.texts.get(record_path) if record_path else None
    if data is None:
        report.failed(name, "no .dist-info/RECORD file")
        return
    try:
        rows = list(csv.reader(io.StringIO(data.decode("utf-8"))))
    except (UnicodeDecodeError, csv.Error) as exc:
        report.failed(name, f"{record_path} is not a UTF-8 CSV file: {exc}")
        return
    problems: list[str] = []
    listed: dict[str, int] = {}
    for line, row in enumerate(rows, 1):
        if not row:
            continue
        if len(row) != 3:
            problems.append(f"line {line} has {len(row)} fields, expected 3 (path,hash,size)")
            continue
        path, hash_text, size_text = row
        listed[path] = listed.get(path, 0) + 1
        exempt = path == record_path or path in {f"{dist_info}/{s}" for s in _SIGNATURE_FILES}
        if exempt and not hash_text:
            continue
        member = wheel.members.get(path)
        if member is None:
            problems.append(f"{path} is listed but not in the wheel")
            continue
        algorithm, sep, expected = hash_text.partition("=")
        if not sep:
            problems.append(f"{path} has no hash (expected e.g. sha256=...)")
            continue
        if algorithm in _WEAK_HASHES or algorithm not in member.digests:
            problems.append(f"{path} uses hash {algorithm!r}; RECORD needs sha256 or stronger")
            continue
        actual = member.digests[algorithm]
        if actual != expected:
            problems.append(
                f"{path}: the {algorithm} hash in RECORD is {expected}, but the file's is {actual} "
                "(the file was changed after the wheel was written)"
            )
        if size_text != str(member.size):
            said = size_text or "(no size)"
            problems.append(f"{path}: RECORD says {said} bytes, the file has {member.size}")
    repeated = sorted(p for p, n in listed.items() if n > 1)
    if repeated:
        problems.append(f"listed more than once: {', '.join(repeated)}")
    missing = sorted(p for p in wheel.members if p not in listed)
    if missing:
        problems.append(f"in the wheel but not in RECORD: {', '.join(missing)}")
    if problems:
        shown = problems[:6] + ([f"and {len(problems) - 6} more problems"] if len(problems) > 6 else [])
        report.failed(name, "; ".join(shown))
    else:
        report.passed(name, f"{len(listed)} entries, every hash and size matches")
