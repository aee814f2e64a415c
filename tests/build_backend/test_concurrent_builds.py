"""Builds of one project at once, with different settings, each give the wheel a solo build
gives: every build compiles in a folder of its own (issue: they used to share
build/cuvil/<target>/<model>/ and mix their objects)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits"

pytestmark = pytest.mark.slow

# one backend build in its own process, as pip runs it: wheel into argv[1], opt-level argv[2]
BUILD = """
import sys
from cuvil.build_backend import build_wheel
print(build_wheel(sys.argv[1], {"opt-level": sys.argv[2]}))
"""


def start(project: Path, out: Path, opt_level: str) -> subprocess.Popen[str]:
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", BUILD, str(out), opt_level], cwd=project,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], out: Path) -> dict[str, bytes]:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    with zipfile.ZipFile(out / stdout.strip().splitlines()[-1]) as wheel:
        return {name: wheel.read(name) for name in wheel.namelist()}


def test_concurrent_builds_with_different_settings_do_not_mix(tmp_path: Path) -> None:
    project = tmp_path / "digits"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("build", "dist", "__pycache__"))
    solo = {}
    for level in ("3", "0"):
        out = tmp_path / f"solo{level}"
        solo[level] = finish(start(project, out, level), out)
    library = next(n for n in solo["3"] if n.endswith(".so"))
    assert solo["3"][library] != solo["0"][library]  # the settings do change the code
    for attempt in range(2):
        outs = {level: tmp_path / f"pair{attempt}-{level}" for level in ("3", "0")}
        procs = {level: start(project, out, level) for level, out in outs.items()}
        for level, proc in procs.items():
            assert finish(proc, outs[level]) == solo[level], f"opt-level {level}, pair {attempt}"
    # only the last build's intermediate files remain, no private folders
    assert sorted(p.name for p in (project / "build" / "cuvil").iterdir()) == ["x86_64-linux"]


def test_a_build_never_sees_files_of_one_running_at_the_same_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the worst interleaving, made deterministic: a second build runs from start to end while
    # the first is between writing its objects and linking them
    import cuvil.build_backend as backend
    from cuvil.config import load_project

    project_dir = tmp_path / "digits"
    shutil.copytree(EXAMPLE, project_dir, ignore=shutil.ignore_patterns("build", "dist"))
    project = load_project(project_dir, {}, {})
    target = backend._get_target(None)
    metadata = types.SimpleNamespace(name="digits-cuvil", version="1.0.0")
    seen = []

    def fake_compile(proj: object, workdir: Path, log: object, target: object) -> dict[str, bytes]:
        name = f"opt{len(seen)}"
        seen.append(workdir)
        (workdir / "model.o").write_text(name)
        if len(seen) == 1:
            inner = backend._compile(project, metadata, target)
            assert inner == {"lib": b"opt1"}
        return {"lib": (workdir / "model.o").read_bytes()}

    monkeypatch.setattr(backend, "_build_package_files", fake_compile)
    monkeypatch.setattr(backend, "_log", lambda message: None)
    assert backend._compile(project, metadata, target) == {"lib": b"opt0"}
    assert seen[0] != seen[1]
    assert (project_dir / "build" / "cuvil" / target.name / "model.o").read_text() == "opt0"
