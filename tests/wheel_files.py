"""A wheel's files read into a dict and written back, RECORD recomputed: for tests that change
a built wheel the way a damaged download or a careless repack would (a RECORD that matches)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from collections.abc import Mapping
from pathlib import Path


def read_entries(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def write_wheel(path: Path, files: Mapping[str, bytes], record: bool = True) -> Path:
    """A wheel of `files`; RECORD (recomputed here) unless `record` is False (then kept as given)."""
    files = dict(files)
    dist_info = next(p.split("/")[0] for p in files if p.split("/")[0].endswith(".dist-info"))
    record_name = f"{dist_info}/RECORD"
    if record:
        files.pop(record_name, None)
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for name, data in files.items():
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            writer.writerow((name, f"sha256={digest}", len(data)))
        writer.writerow((record_name, "", ""))
        files[record_name] = out.getvalue().encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path
