"""Write `py3-none-<platform>` wheels (binary distribution format) reproducibly and atomically."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from cuvil.build_backend import _reproducible
from cuvil.build_backend._metadata import CoreMetadata
from cuvil.errors import BuildError

__all__ = [
    "atomic_output",
    "check_archive_path",
    "dist_info_files",
    "wheel_name",
    "write_dist_info",
    "write_wheel",
]


def wheel_name(metadata: CoreMetadata, platform_tag: str) -> str:
    return f"{metadata.distribution}-{metadata.version}-py3-none-{platform_tag}.whl"


def dist_info_files(metadata: CoreMetadata, platform_tag: str) -> dict[str, bytes]:
    """The .dist-info files except RECORD, as archive paths -> bytes."""
    from cuvil import __version__

    prefix = metadata.dist_info + "/"
    # A compressed tag set ("manylinux_2_17_x86_64.manylinux2014_x86_64") expands to one Tag each.
    tags = "".join(f"Tag: py3-none-{platform}\n" for platform in platform_tag.split("."))
    files = {
        prefix + "METADATA": metadata.as_bytes(),
        prefix + "WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: cuvil {__version__}\nRoot-Is-Purelib: false\n{tags}"
        ).encode(),
    }
    entry_points = metadata.entry_points_text()
    if entry_points is not None:
        files[prefix + "entry_points.txt"] = entry_points.encode()
    for relative, path in metadata.license_files:
        files[prefix + "licenses/" + relative] = path.read_bytes()
    return files


def write_dist_info(metadata: CoreMetadata, platform_tag: str, directory: Path) -> str:
    """Write the .dist-info folder into `directory` (prepare_metadata hooks); return its name."""
    for name, data in dist_info_files(metadata, platform_tag).items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return metadata.dist_info


def write_wheel(
    directory: Path,
    metadata: CoreMetadata,
    files: Mapping[str, bytes],
    platform_tag: str,
    epoch: int | None = None,
    verify: Callable[[Path], None] | None = None,
) -> str:
    """Write the wheel of `files` (archive path -> bytes) into `directory`; return its file name.

    `verify` sees the finished wheel before it is moved into place and may refuse it by raising.

    Entries are sorted with the .dist-info last and RECORD at the very end; every entry gets
    the same timestamp and a normalized mode, so equal inputs give byte-identical wheels.
    """
    if epoch is None:
        epoch = _reproducible.source_date_epoch()
    dist_info = dist_info_files(metadata, platform_tag)
    for name in files:
        check_archive_path(name)
    record_name = f"{metadata.dist_info}/RECORD"
    entries = sorted(files.items()) + sorted(dist_info.items())

    filename = wheel_name(metadata, platform_tag)
    with atomic_output(directory / filename, verify) as stream, zipfile.ZipFile(stream, "w") as archive:
        record = io.StringIO()
        writer = csv.writer(record, lineterminator="\n")
        for name, data in entries:
            mode = _reproducible.mode_for_name(name)
            archive.writestr(_reproducible.zip_info(name, epoch, mode), data)
            writer.writerow((name, "sha256=" + _digest(data), len(data)))
        writer.writerow((record_name, "", ""))
        archive.writestr(
            _reproducible.zip_info(record_name, epoch, _reproducible.FILE_MODE),
            record.getvalue().encode(),
        )
    return filename


@contextmanager
def atomic_output(path: Path, verify: Callable[[Path], None] | None = None) -> Iterator[io.BufferedWriter]:
    """A binary stream that becomes `path` only when the block succeeds; no partial file is left.

    The file is written under its final name into a private folder next to `path`, where
    `verify` (if given) sees it complete; it is moved into place only if `verify` returns.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part"))
    temporary = staging / path.name
    try:
        with open(temporary, "xb") as stream:
            yield stream
        if verify is not None:
            verify(temporary)
        os.replace(temporary, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")


def check_archive_path(name: str) -> None:
    """Reject paths that would escape the archive root or land in the .dist-info folder."""
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or any(part in ("", ".", "..") for part in parts)
        or parts[0].endswith(".dist-info")
    ):
        raise BuildError(
            f"the package generator produced an invalid wheel path {name!r}; this is a bug in "
            "cuvil, please report it with your pyproject.toml"
        )
