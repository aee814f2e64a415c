"""Errors a user can cause. Each message says what went wrong, where (file, key, node) and how to fix it."""

from __future__ import annotations

import os
import stat

__all__ = [
    "BuildError",
    "CheckError",
    "ConfigError",
    "CuvilError",
    "MissingDependencyError",
    "ModelError",
    "ToolchainError",
    "UnsupportedOpError",
    "not_a_regular_file",
]


class CuvilError(Exception):
    """Base class of every error cuvil raises on purpose."""


class ConfigError(CuvilError):
    """`[tool.cuvil]`, `-C` settings or `CUVIL_*` variables are wrong."""


class ModelError(CuvilError):
    """The ONNX model cannot be read, checked or compiled as it is."""


class UnsupportedOpError(ModelError):
    """The model uses operators (or opsets, dtypes, attributes) cuvil cannot compile."""


class ToolchainError(CuvilError):
    """The target or the zig toolchain cannot do what was asked."""


class BuildError(CuvilError):
    """Building a wheel or sdist failed."""


class CheckError(CuvilError):
    """A built wheel fails validation."""


class MissingDependencyError(CuvilError):
    """A feature that was asked for needs a package that is not installed."""


#: what a path is, by the file type bits of its `stat`, when it is not a regular file
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"))


def not_a_regular_file(path: str | os.PathLike[str]) -> str | None:
    """What `path` is instead of a regular file ("a FIFO (named pipe)", "missing"...), or None
    when it is one (symlinks followed) or cannot be looked at (the open that follows says why).
    Asked before opening a file the user names: opening a FIFO blocks until a writer comes,
    and reading a device may never end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError:
        return None
    return next((kind for test, kind in _FILE_KINDS if test(mode)),
                None if stat.S_ISREG(mode) else "not a regular file")
