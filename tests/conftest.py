"""Shared test set-up: make `tests/oracle.py` importable from every test folder, and check
the IR's invariants on the frontend's output and after every pass in every test (xdist
workers inherit the variable).

Every test gets a compile cache of its own in its tmp folder (CUVIL_CACHE_DIR, inherited by
the builds it starts in subprocesses; and the default folder, for projects loaded with an
environment of their own), so tests never write to the user's cache nor see each other's
entries."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("CUVIL_VERIFY_IR", "1")


@pytest.fixture(autouse=True)
def _private_compile_cache(tmp_path_factory: pytest.TempPathFactory,
                           monkeypatch: pytest.MonkeyPatch) -> Path:
    from cuvil.build_backend import cache as compile_cache

    folder = tmp_path_factory.mktemp("compile-cache")
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(folder))
    monkeypatch.setattr(compile_cache, "default_cache_dir", lambda: folder)
    return folder
