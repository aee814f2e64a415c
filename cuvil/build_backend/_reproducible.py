"""Reproducible archives: one timestamp, normalized permissions and ownership for every writer.

Two builds of the same sources give byte-identical wheels and sdists. The timestamp comes from
`SOURCE_DATE_EPOCH` (https://reproducible-builds.org/specs/source-date-epoch/); when it is not
set, cuvil uses 1980-01-01T00:00:00Z, the earliest time a zip file can store, rather than the
current time, so that reproducibility does not depend on the caller remembering the variable.
"""

from __future__ import annotations

import os
import stat
import tarfile
import time
import zipfile
from collections.abc import Mapping

from cuvil.errors import ConfigError

__all__ = [
    "DEFAULT_EPOCH",
    "DIRECTORY_MODE",
    "EXECUTABLE_MODE",
    "FILE_MODE",
    "mode_for_name",
    "source_date_epoch",
    "tar_info",
    "zip_info",
]

DEFAULT_EPOCH = 315532800  # 1980-01-01T00:00:00Z
_ZIP_MIN_EPOCH = 315532800  # the DOS date format starts in 1980
_ZIP_MAX_EPOCH = 4354819198  # 2107-12-31T23:59:58Z, the last even second it can store

FILE_MODE = 0o644
EXECUTABLE_MODE = 0o755
DIRECTORY_MODE = 0o755

# Shared libraries must be executable on some systems (and `cuvil check` expects it).
_EXECUTABLE_SUFFIXES = (".so", ".dylib", ".dll", ".pyd")


def source_date_epoch(environ: Mapping[str, str] | None = None) -> int:
    """The archive timestamp: `SOURCE_DATE_EPOCH` clamped to what zip can store, or 1980-01-01."""
    env = os.environ if environ is None else environ
    value = env.get("SOURCE_DATE_EPOCH", "").strip()
    if not value:
        return DEFAULT_EPOCH
    try:
        epoch = int(value)
    except ValueError:
        raise ConfigError(
            f"environment variable SOURCE_DATE_EPOCH={value!r} is not an integer; set it to "
            "seconds since 1970-01-01 UTC (e.g. `git log -1 --format=%ct`) or unset it"
        ) from None
    return min(max(epoch, _ZIP_MIN_EPOCH), _ZIP_MAX_EPOCH)


def mode_for_name(name: str, executable: bool = False) -> int:
    """0o755 for shared libraries and files marked executable, 0o644 for everything else."""
    if executable or name.endswith(_EXECUTABLE_SUFFIXES):
        return EXECUTABLE_MODE
    return FILE_MODE


def zip_info(name: str, epoch: int, mode: int) -> zipfile.ZipInfo:
    """A zip entry for a regular file with a fixed time, Unix permissions and compression."""
    info = zipfile.ZipInfo(name, date_time=time.gmtime(epoch)[:6])
    info.create_system = 3  # Unix, so that external_attr carries the permissions everywhere
    info.external_attr = (stat.S_IFREG | mode) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def tar_info(
    name: str, epoch: int, mode: int, size: int = 0, directory: bool = False
) -> tarfile.TarInfo:
    """A tar entry owned by root:root (no names), with a fixed time and permissions."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.size = 0 if directory else size
    info.mtime = epoch
    info.mode = mode
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
