"""What `cuvil build` shows while the backend works.

The backend writes its progress as "cuvil: ..." lines on stderr (pip shows them with `-v`, uv
always). On a terminal `cuvil build` keeps them to one status line that each new line replaces,
so that a long compile shows where it is without scrolling; warnings, errors and each model's
closing summary stay on screen. Elsewhere (a log file, CI) the lines pass through unchanged.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
from collections.abc import Iterator
from typing import TextIO

from cuvil.build_backend import SUMMARY_PREFIX

#: lines that stay on screen; every other line is replaced by the next one
_KEPT = ("cuvil: warning", "cuvil: error", SUMMARY_PREFIX)


class StatusLine(io.TextIOBase):
    """A text stream that shows each whole line written to it as the terminal's status
    line (cut to the terminal's width), except the lines that stay."""

    def __init__(self, terminal: TextIO) -> None:
        self.terminal = terminal
        self.partial = ""
        self.shown = False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self._show(line)
        return len(text)

    def _show(self, line: str) -> None:
        self.clear()
        if line.startswith(_KEPT) or not line.startswith("cuvil: "):
            self.terminal.write(line + "\n")
        else:
            width = shutil.get_terminal_size().columns - 1
            self.terminal.write(line if len(line) <= width else line[:width - 1] + "…")
            self.shown = True
        self.terminal.flush()

    def clear(self) -> None:
        if self.shown:
            self.terminal.write("\r\x1b[K")
            self.shown = False

    def finish(self) -> None:
        if self.partial:
            self._show(self.partial)
            self.partial = ""
        self.clear()
        self.terminal.flush()


@contextlib.contextmanager
def build_progress(verbose: bool) -> Iterator[None]:
    """Show the build's progress lines: as they come with `verbose` or off a terminal, else on
    one status line."""
    if verbose or not sys.stderr.isatty():
        yield
        return
    status = StatusLine(sys.stderr)
    try:
        with contextlib.redirect_stderr(status):
            yield
    finally:
        status.finish()
