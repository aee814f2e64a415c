"""Shared test set-up: make `tests/oracle.py` importable from every test folder, and check
the IR's invariants on the frontend's output and after every pass in every test (xdist
workers inherit the variable).

Every test gets a compile cache of its own in its tmp folder (CUVIL_CACHE_DIR, inherited by
the builds it starts in subprocesses; and the default folder, for projects loaded with an
environment of their own), so tests never write to the user's cache nor see each other's
entries. Builds made outside a test's own scope (module- and session-scoped fixtures, set up
before the per-test cache exists) run with the cache off (CUVIL_CACHE=0), as before it existed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("CUVIL_VERIFY_IR", "1")
os.environ["CUVIL_CACHE"] = "0"  # outside a test's own cache: see _private_compile_cache


@pytest.fixture(autouse=True)
def _private_compile_cache(tmp_path_factory: pytest.TempPathFactory,
                           monkeypatch: pytest.MonkeyPatch) -> Path:
    from cuvil.build_backend import cache as compile_cache

    folder = tmp_path_factory.mktemp("compile-cache")
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(folder))
    monkeypatch.delenv("CUVIL_CACHE")
    monkeypatch.setattr(compile_cache, "default_cache_dir", lambda: folder)
    return folder


@pytest.fixture
def fifo(tmp_path: Path):
    """`fifo(path)` makes a FIFO (named pipe) at `path`, and the test fails instead of hanging
    if anything opens it: opening a FIFO waits for a writer, here for at most 20 s."""
    import signal

    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this system")

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError("blocked for 20 s: something opened the FIFO")

    def make(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        return path

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    try:
        yield make
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
