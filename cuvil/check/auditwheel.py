"""A second opinion on manylinux wheels from `auditwheel show --json` (it has no Python API)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

from cuvil.check._archive import WheelArchive
from cuvil.check._platform import manylinux_glibc, tag_arches
from cuvil.check._report import CheckReport

__all__ = ["auditwheel_command", "check_auditwheel"]

_TIMEOUT = 300


# What a Python program started from PATH must not inherit from this one: an isolated build
# (pip, build) points PYTHONPATH at its own site setup, which hides auditwheel's environment.
_OUR_PYTHON_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH")


def auditwheel_command() -> list[str] | None:
    """How to run auditwheel: from this Python's environment, else from PATH; None if absent."""
    if importlib.util.find_spec("auditwheel") is not None:
        return [sys.executable, "-m", "auditwheel"]
    found = shutil.which("auditwheel")
    return [found] if found else None


def _environment(command: list[str]) -> dict[str, str] | None:
    """None (ours) for auditwheel in this Python; without our Python variables for one on PATH."""
    if command[0] == sys.executable:
        return None
    return {k: v for k, v in os.environ.items() if k not in _OUR_PYTHON_VARIABLES}


def check_auditwheel(wheel: WheelArchive, report: CheckReport) -> None:
    name = "auditwheel"
    limits = [(limit, p) for p in wheel.platforms if (limit := manylinux_glibc(p)) is not None]
    if not limits:
        return  # not a manylinux wheel: auditwheel has nothing to say
    command = auditwheel_command()
    if command is None:
        report.skip(
            name,
            "auditwheel is not installed (python -m pip install auditwheel); its policy check did not run",
        )
        return
    argv = [*command, "show", "--json", str(wheel.path)]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, errors="replace", timeout=_TIMEOUT,
            env=_environment(command),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        report.failed(name, f"could not run {' '.join(argv)}: {exc}")
        return
    if proc.returncode != 0:
        output = (proc.stderr.strip() or proc.stdout.strip() or "(no output)")[-2000:]
        report.failed(name, f"auditwheel show failed (exit code {proc.returncode}): {output}")
        return
    try:
        result = json.loads(proc.stdout)
        overall = str(result["overall_tag"])
    except (ValueError, KeyError, TypeError) as exc:
        report.failed(name, f"cannot read auditwheel's JSON output ({exc}): {proc.stdout[:500]}")
        return
    problems = []
    if result.get("external_libs"):
        problems.append(
            f"it finds libraries that would have to be bundled: {', '.join(result['external_libs'])}"
        )
    if result.get("unsupported_isa"):
        problems.append("it finds instructions outside the architecture's baseline")
    policy = manylinux_glibc(overall)
    if policy is None:
        problems.append(f"the wheel meets no manylinux policy (best tag: {overall})")
    else:
        for (major, minor), platform in limits:
            if policy > (major, minor):
                problems.append(f"the wheel needs {overall}, newer than its tag {platform}")
            arches = tag_arches(platform)
            if arches != tag_arches(overall):
                problems.append(f"its best tag {overall} is for another architecture than {platform}")
    if problems:
        report.failed(name, "; ".join(problems))
    else:
        report.passed(
            name, f"within policy {overall} (tag {', '.join(p for _, p in limits)} is the same or newer)"
        )
