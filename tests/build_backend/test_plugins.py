"""The hatchling and setuptools plugins (cuvil/build_backend/hatch.py, setuptools.py).

Two projects with their own package (a module, a data file, a console script) and one model
are built with isolated builds whose cuvil is this checkout's wheel: `pip wheel`, `python -m
build --wheel` and `uv build` (sdist, then the wheel from it), for the host; one cross build
each (aarch64-linux, named with -C: by uv for hatchling, by pip for setuptools). Every wheel
is checked for its tag, the user's files and entry point, the compiled model and `cuvil
check`; each is installed in turn into one fresh venv (numpy only) whose package and console
script must give onnxruntime's outputs, and so must editable installs of both projects. The
builds share one compile cache, so the model compiles once per target.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
from projects import write_model

from cuvil.build_backend import _plugins
from cuvil.config import load_project
from cuvil.errors import BuildError, ConfigError

ROOT = Path(__file__).resolve().parents[2]
HOST_TAG = "py3-none-manylinux_2_17_x86_64"
CROSS_TAG = "py3-none-manylinux_2_17_aarch64"

linux_x86 = pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine != "x86_64",
    reason="the wheel-building tests target x86_64 Linux",
)

HATCH_BUILD = """\
[build-system]
requires = ["hatchling>=1.24", "cuvil"]
build-backend = "hatchling.build"

[tool.hatch.build.hooks.cuvil]
"""
SETUPTOOLS_BUILD = """\
[build-system]
requires = ["setuptools>=70.1", "cuvil"]
build-backend = "cuvil.build_backend.setuptools"

[tool.setuptools.package-data]
PACKAGE = ["data/*.json"]
"""
PROJECT = """
[project]
name = "NAME"
version = "0.2.0"
dependencies = ["numpy"]
dynamic = DYNAMIC

[project.scripts]
NAME = "PACKAGE.cli:main"

[tool.cuvil.models.net]
source = "models/net.onnx"
"""
INIT = "from ._cuvil_models import net\n\n__all__ = ['net']\n"
CLI = """\
import json
from importlib.resources import files

import numpy as np

from PACKAGE import net


def main():
    rows = json.loads(files("PACKAGE").joinpath("data/input.json").read_text())
    print(json.dumps(net(np.array(rows, np.float32)).tolist()))
"""
INPUT = [[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 2.0, -3.0], [0.25, -2.0, 1.5, 0.0]]


def write_project(root: Path, host: str, name: str, dynamic: str = "[]") -> Path:
    package = name.replace("-", "_")
    build = HATCH_BUILD if host == "hatchling" else SETUPTOOLS_BUILD
    text = build + PROJECT.replace("DYNAMIC", dynamic)
    (root / "pyproject.toml").parent.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(text.replace("NAME", name).replace("PACKAGE", package))
    source = root / "src" / package
    (source / "data").mkdir(parents=True)
    (source / "__init__.py").write_text(INIT)
    (source / "cli.py").write_text(CLI.replace("PACKAGE", package))
    (source / "data" / "input.json").write_text(json.dumps(INPUT))
    write_model(root / "models" / "net.onnx", seed=5)
    return root


# -- fast: configuration and the checks ----------------------------------------------------------


def test_plugin_projects_leave_the_version_and_sdist_to_their_backend(tmp_path: Path) -> None:
    root = write_project(tmp_path / "p", "hatchling", "dyn-model", dynamic='["version"]')
    text = (root / "pyproject.toml").read_text().replace('version = "0.2.0"\n', "")
    (root / "pyproject.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"tool\.cuvil\.metadata\.version\.regex"):
        load_project(root)  # cuvil's own backend reads the version itself
    assert load_project(root, backend="hatchling").version is None

    (root / "pyproject.toml").write_text(text + '\n[tool.cuvil.sdist]\ninclude = ["x"]\n')
    with pytest.raises(ConfigError) as error:
        load_project(root, backend="hatchling")
    assert "tool.cuvil.sdist: is read by cuvil's own build backend only, but hatchling builds" \
        in str(error.value)


def test_setuptools_without_cuvils_backend_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from setuptools.dist import Distribution

    from cuvil.build_backend import setuptools as plugin

    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "plain"\nversion = "1"\n')
    dist = Distribution()
    plugin.finalize_distribution_options(dist)  # no [tool.cuvil]: setuptools as it is
    assert "build_cuvil" not in dist.cmdclass and not dist.has_ext_modules()

    write_project(tmp_path, "setuptools", "st-model")
    with pytest.raises(ConfigError, match=r'set build-backend = "cuvil\.build_backend\.setuptools"'):
        plugin.finalize_distribution_options(Distribution())
    with plugin._hook({"target": "aarch64-linux", "--build-option": "--quiet"}) as rest:
        assert rest == {"--build-option": "--quiet"}  # setuptools' own settings pass on
        assert plugin._settings == {"target": "aarch64-linux"}
        dist = Distribution()
        plugin.finalize_distribution_options(dist)
        assert dist.cmdclass["build_cuvil"] is plugin.build_cuvil and dist.has_ext_modules()
        assert ("build_cuvil", None) in dist.get_command_class("build").sub_commands
        assert dist.get_command_obj("build_cuvil").get_source_files() == ["models/net.onnx"]
    assert plugin._settings is None


def test_the_hatch_hook_takes_no_settings_of_its_own(tmp_path: Path) -> None:
    from cuvil.build_backend.hatch import CuvilBuildHook

    root = write_project(tmp_path, "hatchling", "hatch-model")
    hook = CuvilBuildHook(str(root), {"target": "aarch64-linux", "dependencies": []}, None, None,
                          str(tmp_path / "dist"), "wheel")
    with pytest.raises(ConfigError, match="unknown key target; cuvil reads its models and "
                                          r"settings from \[tool.cuvil\]"):
        hook._check_table()
    sdist = CuvilBuildHook(str(root), {}, None, None, str(tmp_path / "dist"), "sdist")
    build_data: dict = {"force_include": {}}
    sdist.initialize("standard", build_data)  # an sdist compiles nothing
    assert build_data == {"force_include": {}} and not (root / "build").exists()


def test_a_wheel_failing_the_checks_is_removed(tmp_path: Path) -> None:
    from cuvil.build_backend._verify import wheel_verifier

    root = write_project(tmp_path / "p", "hatchling", "bad-model")
    project = load_project(root, backend="hatchling")
    build = _plugins.PluginBuild(project, None, None, "manylinux_2_17_x86_64",  # type: ignore[arg-type]
                                 wheel_verifier([], project.pyproject, lambda _: None), {})
    wheel = tmp_path / f"bad_model-0.2.0-{HOST_TAG}.whl"
    with zipfile.ZipFile(wheel, "w") as archive:  # what a host backend without cuvil writes
        archive.writestr("bad_model/__init__.py", "")
    with pytest.raises(BuildError, match="so it was not written"):
        _plugins.check_wheel(build, wheel)
    assert not wheel.exists()


# -- slow: real builds ---------------------------------------------------------------------------


def run(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Isolated builds find this checkout's cuvil wheel (pip, build and uv alike) and share a
    compile cache; one CPU variant keeps the compile short."""
    dist = tmp_path_factory.mktemp("cuvil-dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True)
    links = " ".join(filter(None, [os.environ.get("PIP_FIND_LINKS"), str(dist)]))
    # no PYTHONPATH: the builds take cuvil from its wheel and the venv has no outer packages
    kept = {k: v for k, v in os.environ.items() if not k.startswith("CUVIL_") and k != "PYTHONPATH"}
    return {**kept,
            "PIP_FIND_LINKS": links, "UV_FIND_LINKS": str(dist), "CUVIL_CPU": "x86-64",
            "CUVIL_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    top = tmp_path_factory.mktemp("projects")
    return {host: write_project(top / host, host, name) for host, name in NAMES.items()}


def build_with(frontend: str, project: Path, out: Path, env: dict[str, str], *args: str) -> Path:
    shutil.rmtree(project / "build", ignore_errors=True)  # each build starts from the sources
    if frontend == "pip":
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), *args, str(project)],
            env)
    elif frontend == "build":
        # uv installs the isolated environment: the same build, in a third of the time
        run([sys.executable, "-m", "build", "--wheel", "--installer", "uv", "-o", str(out), *args,
             str(project)], env)
    else:  # uv builds the sdist, then the wheel from it
        run(["uv", "build", "-o", str(out), *args, str(project)], env)
    (wheel,) = out.glob("*.whl")
    return wheel


FRONTENDS = ["pip", "build", "uv"]
NAMES = {"hatchling": "hatch-model", "setuptools": "setup-model"}
BUILDS = [(host, frontend) for host in ("hatchling", "setuptools") for frontend in FRONTENDS]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory, projects: dict[str, Path],
           env: dict[str, str]) -> dict[tuple[str, str], Path]:
    if shutil.which("uv") is None:
        pytest.skip("uv is not installed (pip install uv)")
    return {(host, frontend): build_with(frontend, projects[host],
                                         tmp_path_factory.mktemp(f"{host}-{frontend}"), env)
            for host, frontend in BUILDS}


def onnxruntime_outputs(project: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(project / "models" / "net.onnx"),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@linux_x86
@pytest.mark.slow
@pytest.mark.parametrize(("host", "frontend"), BUILDS)
def test_wheel_holds_the_projects_files_and_the_compiled_model(
    wheels: dict[tuple[str, str], Path], host: str, frontend: str
) -> None:
    from cuvil.check import check_wheel

    wheel = wheels[host, frontend]
    package = NAMES[host].replace("-", "_")
    assert wheel.name == f"{package}-0.2.0-{HOST_TAG}.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = f"{package}-0.2.0.dist-info"
        wheel_file = archive.read(f"{dist_info}/WHEEL").decode()
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    user = {f"{package}/{n}" for n in ("__init__.py", "cli.py", "data/input.json")}
    generated = {f"{package}/{n}" for n in ("_net.so", "net.h", "_models.json",
                                            "_cuvil_models.py", "_cuvil_runtime.py")}
    assert user | generated <= names
    assert f"Tag: {HOST_TAG}" in wheel_file and "Root-Is-Purelib: false" in wheel_file
    assert f"{package.replace('_', '-')} = {package}.cli:main" in entry_points
    report = check_wheel(wheel, load=True)
    assert not report.failures, report.summary()


@linux_x86
@pytest.mark.slow
def test_installed_wheels_and_editable_installs_give_onnxruntimes_outputs(
    wheels: dict[tuple[str, str], Path], projects: dict[str, Path], env: dict[str, str],
    tmp_path: Path
) -> None:
    run([sys.executable, "-m", "venv", str(tmp_path / "venv")], env)  # no outer packages
    python, bin_dir = str(tmp_path / "venv" / "bin" / "python"), tmp_path / "venv" / "bin"
    run([python, "-m", "pip", "install", "-q", "numpy"], env)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent("""
        import importlib, importlib.util, sys
        import numpy as np
        assert importlib.util.find_spec("cuvil") is None and importlib.util.find_spec("onnx") is None
        package = importlib.import_module(sys.argv[1])
        np.save(sys.argv[3], package.net(np.load(sys.argv[2])))
    """)

    def check(host: str, how: str) -> None:
        package = NAMES[host].replace("-", "_")
        run([python, "-c", script, package, str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
            env, cwd=tmp_path)
        expected = onnxruntime_outputs(projects[host], x)
        np.testing.assert_allclose(np.load(tmp_path / "y.npy"), expected, rtol=1e-5, atol=1e-6,
                                   err_msg=how)
        printed = run([str(bin_dir / package.replace("_", "-"))], env, cwd=tmp_path)
        expected = onnxruntime_outputs(projects[host], np.array(INPUT, np.float32))
        np.testing.assert_allclose(json.loads(printed), expected, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{how}: console script")

    for (host, frontend), wheel in wheels.items():
        run([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], env)
        check(host, f"{host} wheel built by {frontend}")
    for host, project in projects.items():
        run([python, "-m", "pip", "uninstall", "-q", "-y", NAMES[host]], env)
        shutil.rmtree(project / "build", ignore_errors=True)
        run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(project)], env)
        check(host, f"{host} editable install")


@linux_x86
@pytest.mark.slow
@pytest.mark.parametrize("host", ["hatchling", "setuptools"])
def test_a_cross_build_named_with_config_settings(
    projects: dict[str, Path], env: dict[str, str], tmp_path: Path, host: str
) -> None:
    from cuvil.check import check_wheel

    frontend = "pip" if host == "setuptools" else "uv"
    cross = {k: v for k, v in env.items() if k != "CUVIL_CPU"}  # an x86 CPU: not for aarch64
    wheel = build_with(frontend, projects[host], tmp_path, cross, "-C", "target=aarch64-linux")
    assert wheel.name.endswith(f"-{CROSS_TAG}.whl")
    report = check_wheel(wheel)
    assert not report.failures, report.summary()
    with zipfile.ZipFile(wheel) as archive:
        manifest = json.loads(archive.read(f"{wheel.name.split('-')[0]}/_models.json"))
    assert manifest["target"] == "aarch64-linux"
