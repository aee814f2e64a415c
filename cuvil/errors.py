"""Errors a user can cause. Each message says what went wrong, where (file, key, node) and how to fix it."""

from __future__ import annotations

__all__ = [
    "BuildError",
    "CheckError",
    "ConfigError",
    "CuvilError",
    "MissingDependencyError",
    "ModelError",
    "ToolchainError",
    "UnsupportedOpError",
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
