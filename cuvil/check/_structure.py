"""What the structure checks (ELF, Mach-O, PE) share: the problems a walk through a library's
loader tables finds, collected until the walk cannot go on or enough have been found."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import NoReturn

from cuvil.check._report import CheckReport

__all__ = ["Problems", "report_structure", "walk_problems"]

#: reported problems at most: a damaged file shows a few, not thousands
MAX_PROBLEMS = 8


class _Stop(Exception):
    """Ends the walk: later tables depend on what failed, or enough was found."""


class Problems:
    """The problems found so far; `stop` ends the walk, `fail` only after `MAX_PROBLEMS`."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def fail(self, text: str) -> None:
        self.found.append(text)
        if len(self.found) >= MAX_PROBLEMS:
            raise _Stop

    def stop(self, text: str) -> NoReturn:
        self.found.append(text)
        raise _Stop


def walk_problems(walk: Callable[[Problems], None]) -> list[str]:
    """What `walk` finds; a table it reads past the end of the file is one more problem, never
    an exception."""
    problems = Problems()
    try:
        walk(problems)
    except _Stop:
        pass
    except (struct.error, IndexError, OverflowError) as exc:
        problems.found.append(f"a table cannot be read ({exc})")
    return problems.found[:MAX_PROBLEMS]


def report_structure(report: CheckReport, name: str, problems: list[str], refused: str,
                     walked: str) -> None:
    """The structure check's line: FAIL listing `problems` and what the loader would do with
    them (`refused`), or PASS saying what was `walked`."""
    if problems:
        report.failed(name, "; ".join(problems) + f": {refused}")
    else:
        report.passed(name, walked)
