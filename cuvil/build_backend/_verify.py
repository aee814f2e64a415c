"""The checks of `cuvil check`, run on every wheel the backend writes before it is moved into place."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from pathlib import Path

from cuvil.errors import BuildError, ConfigError

__all__ = ["wheel_verifier"]


def wheel_verifier(
    warnings: Sequence[str], pyproject: Path, log: Callable[[str], None]
) -> Callable[[Path], None]:
    """A function that checks a finished wheel and raises BuildError if a check fails, except
    for the check kinds in `warnings` (tool.cuvil.check-warnings), which are logged instead.

    The names are checked here, before anything is compiled.
    """
    from cuvil.check import CHECK_KINDS

    where = f"{pyproject}: tool.cuvil.check-warnings"
    for name in warnings:
        if name == "archive":
            raise ConfigError(
                f'{where}: "archive" cannot be a warning: a wheel that is unsafe to unpack is never '
                "published; remove it from the list"
            )
        if name not in CHECK_KINDS:
            close = difflib.get_close_matches(name, CHECK_KINDS, n=1)
            guess = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{where}: no check is named {name!r}{guess}. Checks: {', '.join(CHECK_KINDS[1:])}"
            )
    warned_kinds = set(warnings)

    def verify(wheel: Path) -> None:
        from cuvil.check import check_wheel

        report = check_wheel(wheel, load=True)
        for result in report:
            if result.skipped:
                log(f"check {result.name} skipped: {result.message}")
        warned = [r for r in report.failures if r.kind in warned_kinds]
        failed = [r for r in report.failures if r.kind not in warned_kinds]
        for result in warned:
            log(f"warning: check {result.name} failed (only a warning by check-warnings): {result.message}")
        if failed:
            lines = "\n".join(f"  {r}" for r in failed)
            kinds = ", ".join(sorted({f'"{r.kind}"' for r in failed if r.kind != "archive"}))
            hint = (
                f"; if a check does not apply to this project, list it in check-warnings = [{kinds}] "
                "under [tool.cuvil]"
                if kinds
                else ""
            )
            raise BuildError(
                f"the wheel {wheel.name} fails {len(failed)} of the {len(report)} checks of `cuvil check`, "
                f"so it was not written:\n{lines}\nFix the cause and build again{hint}"
            )
        summary = report.summary()
        if warned:
            skipped = sum(r.skipped for r in report)
            passed = len(report) - len(report.failures) - skipped
            summary = f"{passed} passed, {len(warned)} failed as warnings, {skipped} skipped"
        log(f"checked {wheel.name}: {summary}")

    return verify
