"""The outcome of checking one wheel: named checks, each passed or failed with a reason."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CHECK_KINDS", "CheckReport", "CheckResult"]

# What each check is called, without the library it ran on ("digits/_x.so: SONAME" is a
# "SONAME" check): the names `check-warnings` in [tool.cuvil] accepts.
CHECK_KINDS = (
    "archive", "wheel file name", "layout", "WHEEL", "METADATA", "RECORD", "manifest", "platform tag",
    "format", "ELF header", "ELF structure", "exported symbols", "SONAME", "RPATH/RUNPATH", "DT_NEEDED",
    "libc", "glibc versions", "Mach-O slices", "Mach-O structure", "install name", "dependencies",
    "macOS version", "code signature", "PE header", "PE structure", "DLL name", "imports", "ABI checksum",
    "auditwheel", "load",
)


@dataclass(frozen=True)
class CheckResult:
    """One check: `name`, whether it passed, and what was found (or why it was skipped).

    It unpacks like the tuple `(name, ok, message)`.
    """

    name: str
    ok: bool
    message: str
    skipped: bool = False

    def __iter__(self) -> Iterator[object]:
        return iter((self.name, self.ok, self.message))

    @property
    def kind(self) -> str:
        """The name without the library it ran on (and the model, for ABI checksums)."""
        kind = self.name.rpartition(": ")[2]
        return "ABI checksum" if kind.startswith("ABI checksum of ") else kind

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else ("PASS" if self.ok else "FAIL")

    def __str__(self) -> str:
        return f"{self.status} {self.name}: {self.message}"


@dataclass
class CheckReport:
    """Every check run on the wheel at `path`, in the order they ran."""

    path: Path
    results: list[CheckResult] = field(default_factory=list)

    def add(self, name: str, ok: bool, message: str) -> CheckResult:
        result = CheckResult(name, bool(ok), message)
        self.results.append(result)
        return result

    def passed(self, name: str, message: str) -> CheckResult:
        return self.add(name, True, message)

    def failed(self, name: str, message: str) -> CheckResult:
        return self.add(name, False, message)

    def skip(self, name: str, message: str) -> CheckResult:
        result = CheckResult(name, True, message, skipped=True)
        self.results.append(result)
        return result

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    def __iter__(self) -> Iterator[CheckResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, name: str) -> CheckResult:
        """The result of the check called `name` (KeyError if it did not run)."""
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no check named {name!r}; ran: {', '.join(r.name for r in self.results)}")

    def format(self) -> str:
        lines = [f"{self.path.name}:"]
        lines += [f"  {r}" for r in self.results]
        lines.append(f"  {self.summary()}")
        return "\n".join(lines)

    def summary(self) -> str:
        """"OK: all 15 checks passed", "OK: 14 passed, 1 skipped" or "FAILED: 2 of 15 checks failed"."""
        failed = len(self.failures)
        skipped = sum(r.skipped for r in self.results)
        passed = len(self.results) - failed - skipped
        if failed:
            also = f" ({passed} passed, {skipped} skipped)" if skipped else ""
            return f"FAILED: {failed} of {len(self.results)} checks failed{also}"
        if skipped:
            return f"OK: {passed} passed, {skipped} skipped"
        return f"OK: all {passed} checks passed"
