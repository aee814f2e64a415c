"""ONNX -> cuvil IR: `loader` reads and checks the file, `importer` builds the typed graph."""

from __future__ import annotations

from cuvil.compiler.frontend.importer import import_model, unsupported_ops_advice
from cuvil.compiler.frontend.loader import check_and_upgrade, load_onnx

__all__ = ["check_and_upgrade", "import_model", "load_onnx", "unsupported_ops_advice"]
