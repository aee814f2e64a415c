"""The files `cuvil init` writes: a complete model project ready for CI and publishing.

- `pyproject.toml` with `[tool.cuvil]` (and `[tool.cibuildwheel]` with `--ci cibuildwheel`)
- `README.md`, `LICENSE` (a placeholder to replace), `.gitignore`
- `tests/test_<model>.py`: the installed package against onnxruntime on the same inputs
- `.github/workflows/wheels.yml`: builds every target, tests each wheel on its platform, and
  publishes to the package index on a `v*` tag with trusted publishing.

The default workflow cross-builds every target from one Linux job matrix (`cuvil build
--target`); `--ci cibuildwheel` builds on each platform's own runner with cibuildwheel
instead. Only targets this cuvil has are listed (`cuvil targets`), so a project made by a
newer cuvil gets the newer targets.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CI_CHOICES", "WANTED_TARGETS", "Project", "render_files"]

CI_CHOICES = ("cuvil", "cibuildwheel")
#: what a published model project builds, when this cuvil has the target
WANTED_TARGETS = (
    "x86_64-linux", "aarch64-linux", "x86_64-linux-musl", "aarch64-linux-musl",
    "universal2-macos", "x86_64-windows", "aarch64-windows",
)
# GitHub-hosted runners that test each target's wheel on its own platform (universal2 twice:
# its arm64 slice on Apple silicon, its x86_64 slice on an Intel Mac)
_TEST_RUNNERS = {
    "x86_64-linux": ("ubuntu-latest",),
    "aarch64-linux": ("ubuntu-24.04-arm",),
    "x86_64-linux-musl": ("ubuntu-latest",),
    "aarch64-linux-musl": ("ubuntu-24.04-arm",),
    "universal2-macos": ("macos-latest", "macos-15-intel"),
    "x86_64-windows": ("windows-latest",),
    "aarch64-windows": ("windows-11-arm",),
}


@dataclass(frozen=True)
class Project:
    name: str  # [project].name
    package: str  # import name
    model: str  # model name
    source: str  # model file, relative to the project root
    pins: tuple[str, ...]  # `name = [dims]` TOML entries of the model's inputs
    targets: tuple[str, ...]  # the targets this cuvil has, in WANTED_TARGETS order
    ci: str = "cuvil"


def _s(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a valid TOML and YAML string


def render_files(project: Project) -> dict[str, str]:
    """Relative path -> text of every file of the scaffold (the model file aside)."""
    workflow = _cibuildwheel_workflow(project) if project.ci == "cibuildwheel" else _cuvil_workflow(project)
    return {
        "pyproject.toml": _pyproject(project),
        "README.md": _readme(project),
        "LICENSE": _LICENSE,
        ".gitignore": "build/\ndist/\nwheelhouse/\n__pycache__/\n",
        f"tests/test_{project.model}.py": _TEST.replace("PACKAGE", project.package)
        .replace("MODEL_FILE", project.source).replace("MODEL", project.model),
        ".github/workflows/wheels.yml": workflow,
    }


# ----------------------------------------------------------------------------- pyproject


def _pyproject(p: Project) -> str:
    lines = [
        "[build-system]",
        'requires = ["cuvil"]',
        'build-backend = "cuvil.build_backend"',
        "",
        "[project]",
        f"name = {_s(p.name)}",
        'version = "0.1.0"',
        f"description = {_s(f'The {p.model} model, compiled by cuvil')}",
        'readme = "README.md"',
        'license-files = ["LICENSE"]',
        'requires-python = ">=3.9"',
        "",
        "[tool.cuvil]",
        f"package = {_s(p.package)}",
        f"targets = [{', '.join(map(_s, p.targets))}]   # built by `cuvil build --all-targets`",
        "",
        f"[tool.cuvil.models.{p.model}]",
        f"source = {_s(p.source)}",
    ]
    if p.pins:
        lines.append(f"inputs = {{ {', '.join(p.pins)} }}   # ints pin dims, strings name symbolic ones")
    if p.ci == "cibuildwheel":
        lines += ["", *_cibuildwheel_config(p)]
    return "\n".join(lines) + "\n"


def _cibuildwheel_config(p: Project) -> list[str]:
    # cibuildwheel's builds that this cuvil has no target for
    missing = {"x86_64-linux-musl": "*-musllinux_x86_64", "aarch64-linux-musl": "*-musllinux_aarch64",
               "x86_64-windows": "*-win_amd64", "aarch64-windows": "*-win_arm64"}
    skip = [pattern for target, pattern in missing.items() if target not in p.targets]
    return [
        "# The wheel is py3-none (it does not depend on the Python version): cibuildwheel builds it",
        "# for the first Python it selects and reuses it for the others, testing it on each.",
        "[tool.cibuildwheel]",
        'build = ["cp39-*", "cp313-*"]',
        f"skip = [{', '.join(map(_s, skip))}]",
        'test-requires = ["pytest", "numpy", "onnxruntime"]',
        'test-command = "python -m pytest {project}/tests"',
        "",
        "[tool.cibuildwheel.linux]",
        'archs = ["x86_64", "aarch64"]',
        "",
        "[tool.cibuildwheel.macos]",
        'archs = ["universal2"]',
        "# the oldest macOS the x86_64 code runs on; cibuildwheel's default for CPython < 3.12 is",
        "# 10.9, which cuvil refuses (delocate-wheel would refuse the library after it)",
        'environment = { MACOSX_DEPLOYMENT_TARGET = "10.13" }',
        "",
        "[tool.cibuildwheel.windows]",
        'archs = ["AMD64", "ARM64"]',
        "",
        "# onnxruntime has no musllinux wheels: the test compares with tests/reference.npz there",
        "[[tool.cibuildwheel.overrides]]",
        'select = "*-musllinux_*"',
        'test-requires = ["pytest", "numpy"]',
    ]


# -------------------------------------------------------------------------------- README


def _readme(p: Project) -> str:
    targets = "\n".join(f"- `{t}`" for t in p.targets)
    return f"""# {p.name}

The `{p.model}` model ({p.source}), compiled ahead of time by cuvil into a native library
with a Python package around it. numpy is its only dependency.

```python
import {p.package}
outputs = {p.package}.{p.model}.run({{...}})   # a dict of numpy arrays, one per output
print({p.package}.{p.model}.inputs, {p.package}.{p.model}.outputs)
```

## Build and test

```sh
python -m pip install cuvil      # or a cuvil wheel: python -m pip install path/to/cuvil-*.whl
cuvil build                      # a wheel for this machine, in dist/
cuvil build --all-targets        # every target below
cuvil check dist/*.whl
python -m pip install dist/*.whl pytest onnxruntime && python -m pytest tests
```

`cuvil build` builds in the Python where cuvil is installed: it needs no package index.

`pip wheel .`, `pip install .` and `python -m build` build in an isolated environment, into
which they install the build requirement, `cuvil` (with its dependencies), from the package
index. Where cuvil is not on your index, point them at a folder holding its wheel; the other
requirements still come from the index:

```sh
PIP_FIND_LINKS=path/to/wheels python -m pip wheel . --no-deps -w dist   # pip; python -m build too
UV_FIND_LINKS=path/to/wheels uv build --wheel                           # uv
```

or build in the current environment, where cuvil is installed, with no index at all:
`python -m pip wheel . --no-deps --no-build-isolation -w dist` (`python -m build --no-isolation`,
`uv build --no-build-isolation`).

`tests/test_{p.model}.py` compares the installed package with onnxruntime on the same inputs.
Where onnxruntime has no wheel (musllinux), it compares with `tests/reference.npz`, which
`python tests/test_{p.model}.py` writes on a machine that has onnxruntime.

Targets (`[tool.cuvil].targets`):

{targets}

## Publishing

`.github/workflows/wheels.yml` builds every wheel, tests each on its own platform, and on a
tag `v*` uploads them with the sdist using trusted publishing: on the package index, add this
repository and the workflow `wheels.yml` with the environment `pypi` as a trusted publisher
of the project first.

## Licence

Replace `LICENSE` with the licence of the model and of this project before publishing.
"""


_LICENSE = """\
TODO: replace this file with the licence of this project before publishing.

The model file in models/ may carry a licence of its own (see where it came from); the
wheels that cuvil builds contain the model's weights, so that licence applies to them too.
"""


# -------------------------------------------------------------------------------- the test

_TEST = '''"""The installed PACKAGE package against onnxruntime, on the same seeded inputs.

`python tests/test_MODEL.py` writes tests/reference.npz (the inputs and onnxruntime's outputs),
against which platforms without onnxruntime wheels (musllinux) compare instead.
"""

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest

import PACKAGE

ROOT = Path(__file__).resolve().parent.parent
MODEL_PATH = ROOT / "MODEL_FILE"
REFERENCE = Path(__file__).resolve().parent / "reference.npz"
SYMBOLIC_DIM = 2  # the value of every symbolic dim in the test


def make_inputs():
    rng = np.random.default_rng(0)
    feeds = {}
    for tensor in PACKAGE.MODEL.inputs:
        shape = [d if isinstance(d, int) else SYMBOLIC_DIM for d in tensor.shape]
        dtype = np.dtype(tensor.dtype)
        if dtype.kind == "f":
            feeds[tensor.name] = rng.standard_normal(shape).astype(dtype)
        else:  # integers and booleans: small values, valid as indices too
            feeds[tensor.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def model_digest():
    return hashlib.sha256(MODEL_PATH.read_bytes()).hexdigest()


def onnxruntime_outputs(feeds):
    import onnxruntime

    session = onnxruntime.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def inputs_and_expected():
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        if not REFERENCE.is_file():
            pytest.fail("onnxruntime is not installed and there is no tests/reference.npz: install "
                        "onnxruntime, or run python tests/test_MODEL.py where it is installed")
        data = np.load(REFERENCE)
        if str(data["model_sha256"]) != model_digest():
            pytest.fail("tests/reference.npz was made for another model file: run "
                        "python tests/test_MODEL.py again where onnxruntime is installed")
        feeds = {k[len("input:"):]: data[k] for k in data.files if k.startswith("input:")}
        expected = {k[len("output:"):]: data[k] for k in data.files if k.startswith("output:")}
        return feeds, expected
    feeds = make_inputs()
    return feeds, onnxruntime_outputs(feeds)


def test_MODEL_matches_onnxruntime():
    feeds, expected = inputs_and_expected()
    outputs = PACKAGE.MODEL.run(feeds)
    assert sorted(outputs) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(outputs[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


if __name__ == "__main__":
    feeds = make_inputs()
    arrays = {f"input:{k}": v for k, v in feeds.items()}
    arrays.update({f"output:{k}": v for k, v in onnxruntime_outputs(feeds).items()})
    np.savez(REFERENCE, model_sha256=np.array(model_digest()), **arrays)
    print(f"wrote {REFERENCE}", file=sys.stderr)
'''


# ---------------------------------------------------------------------------- workflows

_HEADER = """\
name: wheels

on:
  push:
    branches: [main]
    tags: ["v*"]
  pull_request:
  workflow_dispatch:

permissions:
  contents: read

defaults:
  run:
    shell: bash

jobs:
"""

# the steps of a test job that fetch its target's wheel and the reference outputs
_DOWNLOAD_WHEEL_AND_REFERENCE = """      - uses: actions/download-artifact@v4
        with:
          name: wheel-${{ matrix.target }}
          path: dist
      - uses: actions/download-artifact@v4
        with:
          name: reference
          path: tests
"""


_SETUP = """\
      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.12"
"""

_SDIST_AND_PUBLISH = """\
  sdist:
    runs-on: ubuntu-latest
    steps:
{setup}      - run: python -m pip install build && python -m build --sdist --outdir dist
      - uses: actions/upload-artifact@v4
        with:
          name: sdist
          path: dist/*.tar.gz

  # on a tag v*: upload every wheel and the sdist with trusted publishing (no token: the index
  # trusts this repository's workflow wheels.yml in the environment pypi)
  publish:
    needs: [{needs}]
    if: github.event_name == 'push' && startsWith(github.ref, 'refs/tags/v')
    runs-on: ubuntu-latest
    environment: pypi
    permissions:
      id-token: write
    steps:
      - uses: actions/download-artifact@v4
        with:
          pattern: "{pattern}"
          path: dist
          merge-multiple: true
      - uses: actions/download-artifact@v4
        with:
          name: sdist
          path: dist
      - uses: pypa/gh-action-pypi-publish@release/v1
"""


def _matrix_rows(rows: Sequence[dict[str, str]], indent: str) -> str:
    return "".join(indent + "- {" + ", ".join(f"{k}: {v}" for k, v in row.items()) + "}\n" for row in rows)


def _cuvil_workflow(p: Project) -> str:
    glibc_macos_windows = [t for t in p.targets if not t.endswith("-musl")]
    musl = [t for t in p.targets if t.endswith("-musl")]
    native = [{"target": t, "runner": r} for t in glibc_macos_windows for r in _TEST_RUNNERS.get(t, ())]
    musl_rows = [{"target": t, "runner": r} for t in musl for r in _TEST_RUNNERS[t]]
    reference_wheel = "x86_64-linux" if "x86_64-linux" in p.targets else p.targets[0]
    text = _HEADER + f"""\
  # every target from one Linux job matrix: cuvil cross-compiles and links with zig
  build:
    name: build ${{{{ matrix.target }}}}
    runs-on: ubuntu-latest
    strategy:
      fail-fast: false
      matrix:
        target: [{', '.join(p.targets)}]
    steps:
{_SETUP}      - run: python -m pip install cuvil
      - run: cuvil build --target "${{{{ matrix.target }}}}" -o dist
      - run: cuvil check dist/*.whl
      - uses: actions/upload-artifact@v4
        with:
          name: wheel-${{{{ matrix.target }}}}
          path: dist/*.whl

  # onnxruntime's outputs on the test's inputs, for test platforms without onnxruntime wheels
  reference:
    needs: build
    runs-on: ubuntu-latest
    steps:
{_SETUP}      - uses: actions/download-artifact@v4
        with:
          name: wheel-{reference_wheel}
          path: dist
      - run: python -m pip install dist/*.whl pytest onnxruntime
      - run: python tests/test_{p.model}.py
      - uses: actions/upload-artifact@v4
        with:
          name: reference
          path: tests/reference.npz

  # each wheel installed and tested on its own platform
  test:
    needs: [build, reference]
    name: test ${{{{ matrix.target }}}} on ${{{{ matrix.runner }}}}
    runs-on: ${{{{ matrix.runner }}}}
    strategy:
      fail-fast: false
      matrix:
        include:
{_matrix_rows(native, "          ")}    steps:
{_SETUP}{_DOWNLOAD_WHEEL_AND_REFERENCE}      - run: python -m pip install dist/*.whl pytest
      - run: python -m pip install onnxruntime || echo "no onnxruntime wheel, tests use reference.npz"
      - run: python -m pytest tests
"""
    needs = ["test", "sdist"]
    if musl_rows:
        text += f"""
  # musllinux wheels in an Alpine container (musl libc), on a runner of their architecture
  test-musl:
    needs: [build, reference]
    name: test ${{{{ matrix.target }}}} on Alpine
    runs-on: ${{{{ matrix.runner }}}}
    strategy:
      fail-fast: false
      matrix:
        include:
{_matrix_rows(musl_rows, "          ")}    steps:
      - uses: actions/checkout@v4
{_DOWNLOAD_WHEEL_AND_REFERENCE}      - run: >-
          docker run --rm -v "$PWD:/project" -w /project python:3.12-alpine
          sh -c "python -m pip install dist/*.whl pytest && python -m pytest tests"
"""
        needs.insert(1, "test-musl")
    return text + "\n" + _SDIST_AND_PUBLISH.format(setup=_SETUP, needs=", ".join(needs), pattern="wheel-*")


def _cibuildwheel_workflow(p: Project) -> str:
    runners = ["ubuntu-latest", "ubuntu-24.04-arm", "macos-latest"]
    if "x86_64-windows" in p.targets:
        runners.append("windows-latest")
    if "aarch64-windows" in p.targets:
        runners.append("windows-11-arm")
    text = _HEADER + f"""\
  # cibuildwheel on each platform's own runner ([tool.cibuildwheel] in pyproject.toml): it
  # builds the py3-none wheel once, repairs it (nothing to change) and tests it on each Python
  wheels:
    name: wheels on ${{{{ matrix.os }}}}
    runs-on: ${{{{ matrix.os }}}}
    strategy:
      fail-fast: false
      matrix:
        os: [{', '.join(runners)}]
    steps:
{_SETUP}      # onnxruntime's outputs for the musllinux tests, which cannot install onnxruntime
      - if: runner.os == 'Linux'
        run: |
          python -m pip install cuvil onnxruntime pytest
          cuvil build -o reference-wheel
          python -m pip install reference-wheel/*.whl
          python tests/test_{p.model}.py
      - uses: pypa/cibuildwheel@v3.2
      - uses: actions/upload-artifact@v4
        with:
          name: wheels-${{{{ matrix.os }}}}
          path: wheelhouse/*.whl
"""
    return text + "\n" + _SDIST_AND_PUBLISH.format(setup=_SETUP, needs="wheels, sdist", pattern="wheels-*")
