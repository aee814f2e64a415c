"""Editable installs that notice a changed model or [tool.cuvil] at import (the import hook,
build_backend/_editable_hook.py, and the editable-rebuild setting), and `cuvil develop`.

The fast tests drive the hook in-process on a hand-written record; the slow ones install a
project with `cuvil develop` into a fresh venv, edit it, and import it in new processes,
comparing its outputs with onnxruntime's on the model file as it is then.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from projects import write_model
from test_end_to_end import make_venv

import cuvil.build_backend as backend
from cuvil import cli
from cuvil.build_backend import _editable_hook as hook
from cuvil.errors import ConfigError, CuvilError, ModelError

ROOT = Path(__file__).resolve().parents[2]

PYPROJECT = """\
[build-system]
requires = ["cuvil"]
build-backend = "cuvil.build_backend"

[project]
name = "dense"
version = "0.1"

[tool.cuvil]
package = "dense"

[tool.cuvil.models.net]
source = "net.onnx"
inputs = { x = [2, 4] }
"""


# -- fast: the hook on a record written by hand ------------------------------------------------


def project_with_record(root: Path, mode: str = "auto") -> tuple[Path, Path]:
    """A project folder with pyproject.toml and net.onnx, and a build folder whose record holds
    them as they are now (no compiled files: the hook only reads the record)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    write_model(root / "net.onnx", seed=0)
    tree = root / "build" / "cuvil" / "editable"
    tree.mkdir(parents=True)
    inputs = [(hook.TABLE, str(root / "pyproject.toml")), ("model net", str(root / "net.onnx"))]
    hook.write_record(str(tree), hook.snapshot(inputs, mode))
    return root, tree


def finder(root: Path, tree: Path) -> hook.CuvilEditableFinder:
    return hook.CuvilEditableFinder("dense", str(root), str(tree), None, {"opt-level": "2"})


def test_only_content_changes_count_and_a_touch_refreshes_the_record(tmp_path: Path) -> None:
    root, tree = project_with_record(tmp_path / "p")
    record = hook.read_record(str(tree))
    assert record is not None and hook.changed_inputs(record) == ([], None)

    os.utime(root / "net.onnx", ns=(1, 1))  # touched: a new mtime, the same bytes
    pyproject = root / "pyproject.toml"  # edits outside [tool.cuvil] change nothing built
    pyproject.write_text(pyproject.read_text().replace('version = "0.1"', 'version = "0.2"  # x'))
    changed, new_stats = hook.changed_inputs(record)
    assert changed == [] and new_stats is not None
    assert [e[4] for e in new_stats["inputs"]] == [e[4] for e in record["inputs"]]
    finder(root, tree).check()  # nothing to do, and the record now has the new stats
    refreshed = hook.read_record(str(tree))
    assert refreshed is not None and hook.changed_inputs(refreshed) == ([], None)
    assert refreshed["inputs"][1][2] == 1

    write_model(root / "net.onnx", seed=1)
    pyproject.write_text(pyproject.read_text().replace("[2, 4]", '["batch", 4]'))
    changed, _ = hook.changed_inputs(refreshed)
    assert changed == [f"[tool.cuvil] ({pyproject})", f"model net ({root / 'net.onnx'})"]
    (root / "net.onnx").unlink()
    assert hook.changed_inputs(refreshed)[0][1] == f"model net ({root / 'net.onnx'}, now missing)"


def test_error_mode_names_the_changed_file_and_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tree = project_with_record(tmp_path / "p", mode="error")
    monkeypatch.setattr(backend, "rebuild_editable", lambda *a: pytest.fail("rebuilt"))
    f = finder(root, tree)
    f.check()  # unchanged
    write_model(root / "net.onnx", seed=1)
    for _ in range(2):  # a failed check fails every import, not just the first
        with pytest.raises(ImportError) as info:
            f.find_spec("dense")
        assert str(info.value) == (
            f"cuvil: the editable install of 'dense' is out of date: model net "
            f"({root / 'net.onnx'}) changed since it was built. Rebuild it with `cuvil develop "
            f"{root} -C opt-level=2` (or `pip install -e {root}`), or set "
            'editable-rebuild = "auto" in [tool.cuvil] to rebuild at import')
    monkeypatch.setenv("CUVIL_EDITABLE_REBUILD", "off")  # the variable overrides the install's
    f.check()
    monkeypatch.setenv("CUVIL_EDITABLE_REBUILD", "sometimes")
    with pytest.raises(ImportError, match="CUVIL_EDITABLE_REBUILD='sometimes' is not one of"):
        f.check()


def test_a_failed_rebuild_refuses_the_import_and_says_the_old_build_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tree = project_with_record(tmp_path / "p")
    calls = []

    def broken(project: str, settings: dict) -> str:
        calls.append((project, settings))
        raise ModelError(f"{root / 'net.onnx'}: not a readable ONNX model")

    monkeypatch.setattr(backend, "rebuild_editable", broken)
    write_model(root / "net.onnx", seed=1)
    f = finder(root, tree)
    for _ in range(2):
        with pytest.raises(ImportError) as info:
            f.find_spec("dense")
        message = str(info.value)
        assert message.startswith("cuvil: rebuilding the editable install of 'dense' failed")
        assert "net.onnx: not a readable ONNX model" in message
        assert f"The previous build in {tree} is kept but not imported" in message
        assert info.value.__cause__ is None  # cuvil's message is enough: no traceback of it
    assert calls == [(str(root), {"opt-level": "2"})] * 2


def test_without_cuvil_the_import_says_how_to_rebuild(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tree = project_with_record(tmp_path / "p")
    write_model(root / "net.onnx", seed=1)
    real = hook.importlib.import_module

    def without_cuvil(name: str) -> object:
        if name.startswith("cuvil"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name)

    monkeypatch.setattr(hook.importlib, "import_module", without_cuvil)
    with pytest.raises(ImportError, match=r"but cuvil, which rebuilds it, is not installed in "
                       r"this environment .*: install it here \(pip install cuvil\), or rebuild "
                       r"with `cuvil develop"):
        finder(root, tree).check()


def test_the_finder_module_is_the_hook_with_its_install_call(tmp_path: Path) -> None:
    from cuvil.build_backend._editable import render_finder

    source = render_finder("dense", tmp_path, tmp_path / "build", None, {"cpu": "native"})
    namespace: dict = {"__name__": "_cuvil_editable_dense"}
    meta_path = list(sys.meta_path)
    try:
        exec(compile(source, "finder", "exec"), namespace)
        installed = sys.meta_path[0]
        assert type(installed).__name__ == "CuvilEditableFinder"
        assert (installed.package, installed.tree, installed.config_settings) == (
            "dense", str(tmp_path / "build"), {"cpu": "native"})
        exec(compile(source, "finder", "exec"), dict(namespace))  # a second run adds none
        assert len(sys.meta_path) == len(meta_path) + 1
    finally:
        sys.meta_path[:] = meta_path


def test_the_setting_is_checked_and_develop_needs_an_installer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cuvil.config import EDITABLE_REBUILD_MODES, load_project

    assert hook.MODES == EDITABLE_REBUILD_MODES  # the hook cannot import config: kept in step
    root, _ = project_with_record(tmp_path / "p")
    assert load_project(root).settings.editable_rebuild == "auto"
    with pytest.raises(ConfigError, match="editable-rebuild"):
        load_project(root, {"editable-rebuild": "sometimes"})

    import importlib.util
    import shutil

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(backend, "rebuild_editable", lambda *a: pytest.fail("built"))
    with pytest.raises(CuvilError, match=r"cuvil develop installs with pip, which .* does not have, "
                       r"nor is uv on PATH: run `.* -m ensurepip`, or install uv"):
        cli.cmd_develop(cli._parser().parse_args(["develop", str(root)]))


# -- slow: `cuvil develop` into a venv, then edits and imports ---------------------------------

linux_x86 = pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine != "x86_64",
    reason="the wheel-building tests target x86_64 Linux",
)


def run(cmd: list[str], check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    # cuvil from this checkout; one copy of the code (no CPU variants): a quick compile
    full = {**os.environ, "PYTHONPATH": str(ROOT), "CUVIL_CPU": "x86-64", **env}
    proc = subprocess.run(cmd, env=full, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


# Calls the package on a fixed batch; prints its outputs as JSON, then whether cuvil was
# imported and how long the hook's check of an up-to-date build took.
CALL = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import dense
    x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
    print(json.dumps(dense.net(x).tolist()))
    print("cuvil" in sys.modules)
    finder = next(f for f in sys.meta_path if type(f).__name__ == "CuvilEditableFinder")
    start = time.perf_counter()
    finder.check()
    print(time.perf_counter() - start)
""")


def onnxruntime_outputs(model: Path) -> np.ndarray:
    import onnxruntime as ort

    x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(venv python, project): the project installed by `cuvil develop` run by the venv's
    python, which sees cuvil from this checkout (PYTHONPATH) and the test environment's
    packages."""
    root = tmp_path_factory.mktemp("editable") / "dense"
    root.mkdir()
    (root / "pyproject.toml").write_text(PYPROJECT)
    write_model(root / "net.onnx", seed=0)
    python = make_venv(tmp_path_factory.mktemp("venv") / "venv", system_site_packages=True)
    proc = run([python, "-m", "cuvil", "develop", str(root), "-C", "opt-level=2"])
    assert "cuvil: compiling model net" in proc.stderr
    assert f"installed {root} editable into" in proc.stdout
    return python, root


def import_and_call(python: str, check: bool = True, **env: str) -> tuple[np.ndarray, str, str]:
    """(outputs, stderr, the rest of stdout) of importing and calling the package."""
    proc = run([python, "-c", CALL], check=check, **env)
    if not check and proc.returncode != 0:
        return np.empty(0), proc.stderr, ""
    outputs, rest = proc.stdout.split("\n", 1)
    return np.array(json.loads(outputs), np.float32), proc.stderr, rest


def assert_matches(outputs: np.ndarray, model: Path) -> None:
    expected = onnxruntime_outputs(model)
    assert expected.any(), "a model whose outputs are all 0 would compare vacuously"
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@linux_x86
def test_develop_installs_the_project_editable(installed: tuple[str, Path]) -> None:
    python, root = installed
    script = "import importlib.metadata as m; print(m.distribution('dense').read_text('direct_url.json'))"
    direct_url = run([python, "-c", script])
    assert json.loads(direct_url.stdout)["dir_info"] == {"editable": True}
    outputs, stderr, _ = import_and_call(python)
    assert_matches(outputs, root / "net.onnx")
    assert "rebuilding" not in stderr


@pytest.mark.slow
@linux_x86
def test_an_unchanged_project_imports_without_cuvil_and_quickly(
    installed: tuple[str, Path],
) -> None:
    python, root = installed
    import_and_call(python)  # whatever an earlier test left is rebuilt here
    outputs, stderr, rest = import_and_call(python)
    assert "cuvil:" not in stderr
    imported_cuvil, seconds = rest.split()
    assert imported_cuvil == "False"  # the check stats the inputs; cuvil is not even imported
    assert float(seconds) < 0.05
    assert_matches(outputs, root / "net.onnx")


@pytest.mark.slow
@linux_x86
def test_a_changed_model_is_rebuilt_at_import(installed: tuple[str, Path]) -> None:
    python, root = installed
    before, _, _ = import_and_call(python)
    write_model(root / "net.onnx", seed=7)  # the same interface, other dense weights
    outputs, stderr, _ = import_and_call(python)
    assert (f"cuvil: model net ({root / 'net.onnx'}) changed since the editable install of "
            "'dense'; rebuilding") in stderr
    assert "cuvil: rebuilt 'dense' in" in stderr
    assert_matches(outputs, root / "net.onnx")
    assert not np.allclose(outputs, before)
    assert "rebuilding" not in import_and_call(python)[1]  # once


@pytest.mark.slow
@linux_x86
def test_a_changed_input_setting_is_rebuilt_at_import(installed: tuple[str, Path]) -> None:
    python, root = installed
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text()
    try:
        pyproject.write_text(text.replace("inputs = { x = [2, 4] }", 'inputs = { x = ["n", 4] }'))
        shape = run([python, "-c", "import dense; print(dense.net.inputs[0].shape)"])
        assert f"cuvil: [tool.cuvil] ({pyproject}) changed" in shape.stderr
        assert shape.stdout.strip() == "('n', 4)"
        assert_matches(import_and_call(python)[0], root / "net.onnx")
    finally:
        pyproject.write_text(text)


@pytest.mark.slow
@linux_x86
def test_error_mode_refuses_a_stale_build_until_it_is_rebuilt(installed: tuple[str, Path]) -> None:
    python, root = installed
    import_and_call(python)
    write_model(root / "net.onnx", seed=11)
    proc = run([python, "-c", "import dense"], check=False, CUVIL_EDITABLE_REBUILD="error")
    assert proc.returncode != 0
    assert (f"ImportError: cuvil: the editable install of 'dense' is out of date: model net "
            f"({root / 'net.onnx'}) changed since it was built. Rebuild it with `cuvil develop "
            f"{root} -C opt-level=2`") in proc.stderr
    outputs, stderr, _ = import_and_call(python)  # the default, "auto", rebuilds
    assert "rebuilding" in stderr
    assert_matches(outputs, root / "net.onnx")


@pytest.mark.slow
@linux_x86
def test_a_broken_model_fails_the_import_and_leaves_the_old_build(
    installed: tuple[str, Path],
) -> None:
    python, root = installed
    import_and_call(python)
    library = root / "build" / "cuvil" / "editable" / "dense" / "_net.so"
    built = library.read_bytes()
    model = root / "net.onnx"
    good = model.read_bytes()
    model.write_bytes(good[: len(good) // 2])  # truncated, as by an interrupted export
    try:
        for _ in range(2):  # each import tries again; none falls back to the old library
            proc = run([python, "-c", "import dense"], check=False)
            assert proc.returncode != 0
            assert f"{model}: not a readable ONNX model" in proc.stderr
            assert "is kept but not imported" in proc.stderr
        assert library.read_bytes() == built
        old = run([python, "-c", "import dense"], CUVIL_EDITABLE_REBUILD="off")
        assert old.returncode == 0  # off: the previous build, as the message says
    finally:
        model.write_bytes(good)
    assert_matches(import_and_call(python)[0], model)
