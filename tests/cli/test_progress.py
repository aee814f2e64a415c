"""`cuvil build`'s progress on a terminal (cuvil/progress.py): one status line that each
progress line replaces; warnings, errors, summaries and other output stay."""

from __future__ import annotations

import io

import pytest

from cuvil.build_backend import SUMMARY_PREFIX
from cuvil.progress import StatusLine


def test_each_progress_line_replaces_the_last_and_kept_lines_stay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    terminal = io.StringIO()
    status = StatusLine(terminal)
    print("cuvil: building x 1.0 for x86_64-linux", file=status, flush=True)
    status.write("cuvil: model 1 of 2: ")  # a line written in pieces shows once it is whole
    assert terminal.getvalue() == "cuvil: building x 1.0 for x86_64-linux"
    status.write("net\ncuvil: warning: something to see\n")
    print(f"{SUMMARY_PREFIX}net: 1 nodes (1 Gemm), _net.so 12 KiB, compiled in 1.0 s",
          file=status)
    print("cuvil: net: generated code for a long target name that does not fit", file=status)
    status.finish()
    clear = "\r\x1b[K"
    assert terminal.getvalue() == (
        "cuvil: building x 1.0 for x86_64-linux" + clear
        + "cuvil: model 1 of 2: net" + clear
        + "cuvil: warning: something to see\n"
        + f"{SUMMARY_PREFIX}net: 1 nodes (1 Gemm), _net.so 12 KiB, compiled in 1.0 s\n"
        + "cuvil: net: generated code for a long …" + clear)  # cut to 39 columns, then cleared


def test_a_partial_last_line_is_shown_when_the_build_ends() -> None:
    terminal = io.StringIO()
    status = StatusLine(terminal)
    status.write("Traceback (most recent call last)")
    status.finish()
    assert terminal.getvalue() == "Traceback (most recent call last)\n"
