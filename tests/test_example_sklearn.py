"""examples/sklearn: the wheel built from a trained scikit-learn Pipeline (skl2onnx, ai.onnx.ml)
installs into a virtual environment and its check.py agrees with onnxruntime's stored results.

One build for the module, without build isolation and with one CPU variant (CUVIL_CPU), so
the compile stays short; train.py is not run here (it needs skl2onnx and onnxruntime, and
the committed model is what users build)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "sklearn"
WHEEL = "loan_risk_cuvil-1.0.0-py3-none-manylinux_2_17_x86_64.whl"
ENV = {**os.environ, "CUVIL_CPU": "x86-64", "PYTHONPATH": str(ROOT)}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                       reason="the wheel-building tests target x86_64 Linux"),
]


def run(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = tmp_path_factory.mktemp("example") / "sklearn"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("build", "dist", "__pycache__"))
    out = tmp_path_factory.mktemp("wheels")
    run([sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps",
         "--no-build-isolation", "-w", str(out), str(project)], ENV)
    return out / WHEEL


def test_the_pipeline_wheel_needs_only_numpy_and_matches_onnxruntime(wheel: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read("loan_risk_cuvil-1.0.0.dist-info/METADATA").decode()
    assert {"loan_risk/__init__.py", "loan_risk/_classifier.so"} <= names
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and all(line.startswith("Requires-Dist: numpy") for line in requires)
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp_path / "venv")], env)
    python = str(tmp_path / "venv" / "bin" / "python")
    run([python, "-m", "pip", "--disable-pip-version-check", "install", "--no-deps", "--no-index",
         str(wheel)], env)
    # from outside the source tree, so that `import loan_risk` finds the installed package
    proc = run([python, str(EXAMPLE / "check.py")], env, cwd=tmp_path)
    assert "40 applicants: labels equal onnxruntime's" in proc.stdout
