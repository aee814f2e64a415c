"""A wheel's files read into a dict and written back, RECORD recomputed: for tests that change
a built wheel the way a damaged download or a careless repack would (a RECORD that matches);
and the digits example's wheels those tests start from."""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import os
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

DIGITS = Path(__file__).resolve().parents[1] / "examples" / "digits"


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


@contextlib.contextmanager
def chdir(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


class DigitsWheels:
    """The digits example's wheel per target, each built on first use (once per module)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.build_dir = root / "build"  # holds each build's object files, for relinking
        self._built: dict[str, Path | BaseException] = {}

    def __getitem__(self, target: str) -> Path:
        if target not in self._built:
            import cuvil.build_backend as backend

            try:
                with chdir(DIGITS):
                    config = {"target": target, "build-dir": str(self.build_dir)}
                    self._built[target] = (
                        self.root / "dist" / backend.build_wheel(str(self.root / "dist"), config)
                    )
            except Exception as exc:  # remembered: a failed build is not retried by every test
                self._built[target] = exc
        built = self._built[target]
        if isinstance(built, BaseException):
            raise built
        return built
