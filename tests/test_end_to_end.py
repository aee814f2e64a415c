"""The whole path a user takes: cuvil's own wheel -> `pip wheel` of a model project (with and
without build isolation) -> install into a fresh venv that has neither cuvil nor onnx ->
import and call, compared with onnxruntime on the held-out digits.

These tests build real wheels and virtual environments; they are slow and run in CI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "digits"
WHEEL_NAME = "digits_cuvil-1.0.0-py3-none-manylinux_2_17_x86_64.whl"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                       reason="the end-to-end wheel tests target x86_64 Linux"),
]


def run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def pip(*args: str, python: str = sys.executable, **kw) -> subprocess.CompletedProcess[str]:
    return run([python, "-m", "pip", "--disable-pip-version-check", *args], **kw)


def copy_project(dest: Path) -> Path:
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("build", "dist", "__pycache__"))
    return dest


def make_venv(path: Path, system_site_packages: bool = False) -> str:
    """A fresh venv; with `system_site_packages` it sees the packages of the environment the
    tests run in, even when that is itself a venv (which --system-site-packages alone skips:
    it reaches the base interpreter's packages only)."""
    args = [sys.executable, "-m", "venv", str(path)]
    if system_site_packages:
        args.insert(3, "--system-site-packages")
    run(args)
    python = str(path / "bin" / "python")
    if system_site_packages and sys.prefix != sys.base_prefix:
        purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
        # addsitedir, unlike a plain path line, also runs the outer .pth files (editable installs)
        lines = [f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()]
        Path(purelib.stdout.strip(), "_outer_environment.pth").write_text("".join(lines))
    return python


@pytest.fixture(scope="module")
def cuvil_dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cuvil's own wheel, built from this checkout."""
    out = tmp_path_factory.mktemp("cuvil-dist")
    pip("wheel", "--no-deps", "-w", str(out), str(ROOT))
    assert len(list(out.glob("cuvil-*.whl"))) == 1
    return out


@pytest.fixture(scope="module")
def held_out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The held-out digits and onnxruntime's probabilities for them (the oracle)."""
    import onnxruntime as ort

    sys.path.insert(0, str(EXAMPLE))
    try:
        from train import load_split
    finally:
        sys.path.remove(str(EXAMPLE))
    _, x_test, _, y_test = load_split()
    sess = ort.InferenceSession(str(EXAMPLE / "models" / "classifier.onnx"),
                                providers=["CPUExecutionProvider"])
    (probs,) = sess.run(None, {"image": x_test})
    return {"x": x_test, "y": y_test, "ort": probs}


@pytest.fixture(scope="module")
def isolated_wheel(tmp_path_factory: pytest.TempPathFactory, cuvil_dist: Path) -> Path:
    """`pip wheel` of the example with build isolation: cuvil comes from --find-links."""
    project = copy_project(tmp_path_factory.mktemp("iso") / "digits")
    out = tmp_path_factory.mktemp("iso-out")
    proc = pip("wheel", "--no-deps", "-v", "--find-links", str(cuvil_dist), "-w", str(out),
               str(project))
    assert "cuvil: linking" in proc.stdout + proc.stderr  # progress is shown with -v
    wheel = out / WHEEL_NAME
    assert wheel.is_file(), list(out.iterdir())
    return wheel


def predict_in_fresh_venv(venv_python: str, workdir: Path, x: np.ndarray) -> np.ndarray:
    """Call digits.classifier in another interpreter; return its outputs."""
    np.save(workdir / "x.npy", x)
    script = textwrap.dedent("""
        import importlib.util, json, sys
        import numpy as np
        absent = [m for m in ("cuvil", "onnx", "onnxruntime", "llvmlite", "torch")
                  if importlib.util.find_spec(m) is not None]
        assert not absent, f"the venv should not have {absent}"
        import digits
        x = np.load(sys.argv[1])
        out = digits.classifier(x)
        # the same batch: batches of up to 4 rows take the matrix-vector kernel, whose sums
        # may differ from the tiled kernel's in the last bit
        run = digits.classifier.run({"image": x})["probabilities"]
        np.testing.assert_array_equal(run, out)
        # the onnxruntime-style session, from the package's own copy of the session module
        session = digits.classifier.session()
        np.testing.assert_array_equal(session.run(None, {"image": x})[0], out)
        info = [(t.name, t.dtype.name, list(t.shape)) for t in digits.classifier.inputs]
        info += [(t.name, t.dtype.name, list(t.shape)) for t in digits.classifier.outputs]
        nodes = [(a.name, a.type, a.shape) for a in session.get_inputs() + session.get_outputs()]
        np.save(sys.argv[2], out)
        print(json.dumps(nodes))
        print(json.dumps(info))
    """)
    (workdir / "predict.py").write_text(script)
    proc = run([venv_python, str(workdir / "predict.py"), str(workdir / "x.npy"),
                str(workdir / "y.npy")], cwd=workdir)
    lines = proc.stdout.strip().splitlines()
    info = json.loads(lines[-1])
    assert info == [["image", "float32", ["batch", 1, 8, 8]],
                    ["probabilities", "float32", ["batch", 10]]]
    import onnxruntime as ort

    oracle = ort.InferenceSession(str(EXAMPLE / "models" / "classifier.onnx"),
                                  providers=["CPUExecutionProvider"])
    assert json.loads(lines[-2]) == [[a.name, a.type, a.shape]
                                     for a in oracle.get_inputs() + oracle.get_outputs()]
    return np.load(workdir / "y.npy")


def test_isolated_build_installs_and_matches_onnxruntime(
    isolated_wheel: Path, held_out: dict[str, np.ndarray], tmp_path: Path
) -> None:
    venv = make_venv(tmp_path / "venv")
    pip("install", str(isolated_wheel), python=venv)  # numpy comes from the registry
    probs = predict_in_fresh_venv(venv, tmp_path, held_out["x"])
    np.testing.assert_allclose(probs, held_out["ort"], rtol=1e-4, atol=1e-6)
    accuracy = float((probs.argmax(1) == held_out["y"]).mean())
    onnx_accuracy = float((held_out["ort"].argmax(1) == held_out["y"]).mean())
    assert accuracy == onnx_accuracy
    assert accuracy > 0.9


def _readme_command(readme: str, pattern: str) -> str:
    found = re.search(pattern, readme)
    assert found, f"the README cuvil init writes has no command matching {pattern!r}:\n{readme}"
    return found.group(1)


def test_a_cuvil_init_project_builds_as_its_readme_says(
    tmp_path: Path, cuvil_dist: Path, held_out: dict[str, np.ndarray]
) -> None:
    """In a fresh venv holding cuvil's wheel (cuvil on no index): `cuvil init`, then the three
    builds its README gives: `cuvil build` and pip without isolation, with no index at all,
    and pip's isolated build finding cuvil through PIP_FIND_LINKS. Each gives the same wheel."""
    venv = make_venv(tmp_path / "venv")
    (cuvil_wheel,) = cuvil_dist.glob("cuvil-*.whl")
    pip("install", str(cuvil_wheel), python=venv)  # its dependencies come from the registry
    env = {**os.environ, "PATH": f"{Path(venv).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # the venv's cuvil, not this checkout
    run(["cuvil", "init", "proj", "--model", str(EXAMPLE / "models" / "classifier.onnx")],
        cwd=tmp_path, env=env)
    project = tmp_path / "proj"
    readme = (project / "README.md").read_text()
    no_index = {**env, "PIP_NO_INDEX": "1"}
    commands = {
        "cuvil": (_readme_command(readme, r"\n(cuvil build) +#"), no_index),
        "no isolation": (_readme_command(readme, r"`(python -m pip wheel [^`]*--no-build-isolation[^`]*)`"),
                         no_index),
        "isolated": (_readme_command(readme, r"\n(PIP_FIND_LINKS=\S+ python -m pip wheel [^#\n]*?) +#")
                     .replace("path/to/wheels", str(cuvil_dist)), env),
    }
    wheels = {}
    for how, (command, command_env) in commands.items():
        run(["sh", "-c", command], cwd=project, env=command_env)
        (wheel,) = (project / "dist").glob("*.whl")
        (tmp_path / how).mkdir()
        wheels[how] = wheel.rename(tmp_path / how / wheel.name)
    assert len({w.read_bytes() for w in wheels.values()}) == 1, wheels

    pip("install", "--no-deps", str(wheels["isolated"]), python=venv)
    work = tmp_path / "work"  # not beside the project's folder, which is named like the package
    work.mkdir()
    np.save(work / "x.npy", held_out["x"])
    code = "import sys, numpy as np, proj; np.save(sys.argv[2], proj.classifier(np.load(sys.argv[1])))"
    run([venv, "-c", code, "x.npy", "y.npy"], cwd=work, env=env)
    np.testing.assert_allclose(np.load(work / "y.npy"), held_out["ort"], rtol=1e-4, atol=1e-6)


def test_wheel_contents_and_manylinux_policy(isolated_wheel: Path) -> None:
    with zipfile.ZipFile(isolated_wheel) as zf:
        names = zf.namelist()
        manifest = json.loads(zf.read("digits/_models.json"))
    for expected in ("digits/__init__.py", "digits/__init__.pyi", "digits/py.typed",
                     "digits/_classifier.so", "digits/classifier.h", "digits/_cuvil_runtime.py",
                     "digits/_cuvil_session.py"):
        assert expected in names
    assert names[-1].endswith(".dist-info/RECORD")
    assert manifest["target"] == "x86_64-linux"
    auditwheel = shutil.which("auditwheel") or str(Path(sys.executable).parent / "auditwheel")
    proc = run([auditwheel, "show", str(isolated_wheel)])
    # auditwheel names the most compatible policy the library satisfies; 2_17 must be within it
    text = proc.stdout.replace("\n", " ")
    assert "is consistent with the following platform tag" in text
    tag = text.split('platform tag: "')[1].split('"')[0]
    glibc = tuple(int(p) for p in tag.split("_")[1:3])
    assert glibc <= (2, 17), tag


def test_build_without_isolation_is_reproducible(tmp_path: Path, isolated_wheel: Path) -> None:
    project = copy_project(tmp_path / "digits")
    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000"}
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out1), str(project), env=env)
    shutil.rmtree(project / "build")
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out2), str(project), env=env)
    assert (out1 / WHEEL_NAME).read_bytes() == (out2 / WHEEL_NAME).read_bytes()


def test_sdist_rebuilds_into_a_wheel(tmp_path: Path, held_out: dict[str, np.ndarray]) -> None:
    project = copy_project(tmp_path / "digits")
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(tmp_path / "sd"),
         str(project)])
    (sdist,) = (tmp_path / "sd").glob("digits_cuvil-1.0.0.tar.gz")
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"), str(sdist))
    assert (tmp_path / "whl" / WHEEL_NAME).is_file()


def test_editable_install_imports_and_runs(tmp_path: Path, held_out: dict[str, np.ndarray]) -> None:
    project = copy_project(tmp_path / "digits")
    venv = make_venv(tmp_path / "venv", system_site_packages=True)  # sees this cuvil
    import cuvil

    where = run([venv, "-c", "import cuvil; print(cuvil.__file__)"]).stdout.strip()
    assert where == cuvil.__file__, "the venv would build with another cuvil than the one under test"
    pip("install", "--no-deps", "--no-build-isolation", "-e", str(project), python=venv)
    code = ("import sys, numpy as np, digits; x = np.load(sys.argv[1]); "
            "np.save(sys.argv[2], digits.classifier(x)); print(digits.__file__)")
    np.save(tmp_path / "x.npy", held_out["x"][:50])
    proc = run([venv, "-c", code, str(tmp_path / "x.npy"), str(tmp_path / "y.npy")], cwd=tmp_path)
    assert str(project) in proc.stdout  # imported from the project's build folder
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), held_out["ort"][:50], rtol=1e-4,
                               atol=1e-6)


def test_the_editable_test_venv_sees_the_packages_of_an_outer_venv(tmp_path: Path) -> None:
    # the README's test command run inside a venv: the test's own venv must see that venv's
    # packages (cuvil installed there), not only the base interpreter's
    outer = tmp_path / "outer"
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(outer)])
    outer_python = str(outer / "bin" / "python")
    purelib = run([outer_python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    Path(purelib.stdout.strip(), "only_in_outer.py").write_text("WHERE = 'outer'\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_end_to_end as t; "
            "from pathlib import Path; print(t.make_venv(Path(sys.argv[2]), "
            "system_site_packages=True))")
    inner = run([outer_python, "-c", code, str(Path(__file__).parent), str(tmp_path / "inner")])
    found = run([inner.stdout.strip(), "-c", "import only_in_outer; print(only_in_outer.WHERE)"])
    assert found.stdout.strip() == "outer"


def test_failed_build_names_the_problem_and_leaves_no_wheel(tmp_path: Path) -> None:
    import onnx
    from onnx import helper

    project = copy_project(tmp_path / "digits")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="fine"),
         helper.make_node("Mystery", ["r"], ["y"], name="uniq", domain="com.example")],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n"])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.example", 1)]),
              project / "models" / "classifier.onnx")
    (project / "pyproject.toml").write_text(
        (project / "pyproject.toml").read_text().replace('inputs = { image = ["batch", 1, 8, 8] }', ""))
    out = tmp_path / "out"
    out.mkdir()
    proc = pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(project),
               check=False)
    assert proc.returncode != 0
    assert "Mystery" in proc.stderr + proc.stdout and "uniq" in proc.stderr + proc.stdout
    assert list(out.iterdir()) == []


def test_built_package_writes_into_out_arrays(tmp_path: Path, held_out: dict[str, np.ndarray],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # the package's own runtime copy and stub: out= fills the caller's arrays and type-checks
    import cuvil.build_backend as backend

    project = copy_project(tmp_path / "digits")
    monkeypatch.chdir(project)
    wheel = project / "dist" / backend.build_wheel(str(project / "dist"))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        import digits
        x = np.load(sys.argv[1])
        buf = np.empty((len(x), 10), np.float32)
        assert digits.classifier(x, out=buf) is buf
        assert digits.classifier.run({"image": x}, out={"probabilities": buf})["probabilities"] is buf
        try:
            digits.classifier(x, out=buf[:1])
        except ValueError as exc:
            assert "'probabilities'" in str(exc) and "shape" in str(exc), exc
        else:
            raise AssertionError("a wrong-shaped out= was accepted")
        assert digits.__file__.startswith(sys.argv[3]), digits.__file__
        probs = digits.classifier.session().run(["probabilities"], {"image": x})[0]
        np.testing.assert_array_equal(probs, buf)
        np.save(sys.argv[2], buf)
    """))
    np.save(tmp_path / "x.npy", held_out["x"][:40])
    env = {**os.environ, "PYTHONPATH": str(site)}
    run([sys.executable, str(user), str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), str(site)],
        cwd=tmp_path, env=env)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), held_out["ort"][:40], rtol=1e-4,
                               atol=1e-6)
    typed = run([sys.executable, "-m", "mypy", "--no-incremental", "--strict", str(user)],
                cwd=tmp_path, env={**env, "MYPYPATH": str(site)}, check=False)
    assert typed.returncode == 0, typed.stdout
