"""Wheel-side fuzzing: the digits example's wheel with bytes changed where the dynamic loader
and the checks read its library (ELF header, program headers, the dynamic, symbol, string,
hash, version and relocation tables), or with its manifest edited, RECORD rewritten to match
each time (as a damaged download or a careless repack leaves it). Each mutant is either
refused by `cuvil check --load` (exit status 1, a FAIL line, no traceback) or imports in a
fresh interpreter and gives the original's outputs.

Left out: relocation addends, the code and the data, whose bytes no check can tell from the
real ones (a changed addend that still points inside the image may run and answer wrongly).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import budget
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wheel_files import read_entries, write_wheel

import cuvil.build_backend as backend
from cuvil.cli import main as cli_main

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"
LIBRARY = "digits/_classifier.so"
MANIFEST = "digits/_models.json"
#: the sections the loader's path reads (their bytes, relocation addends excepted)
LOADER_SECTIONS = (".dynamic", ".dynsym", ".dynstr", ".gnu.hash", ".hash", ".gnu.version",
                   ".gnu.version_r", ".rela.dyn", ".rela.plt")

# imports the package from a folder and writes its outputs for a fixed input
PROBE = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import digits
x = np.random.default_rng(0).standard_normal((3, 1, 8, 8)).astype(np.float32)
np.save(sys.argv[2], digits.classifier(x))
"""

pytestmark = pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                                reason="runs the x86_64 Linux wheel it mutates")


class Original:
    """The built wheel's files, the regions of its library a mutant may change, and the
    outputs of its package."""

    def __init__(self, root: Path) -> None:
        from elftools.elf.elffile import ELFFile

        cwd = os.getcwd()
        os.chdir(DIGITS)
        try:
            name = backend.build_wheel(str(root / "dist"), {"build-dir": str(root / "build")})
        finally:
            os.chdir(cwd)
        self.files = read_entries(root / "dist" / name)
        self.name = name
        lib = self.files[LIBRARY]
        elf = ELFFile(io.BytesIO(lib))
        self.regions = [(0, 64), (elf["e_phoff"], elf["e_phoff"] + elf["e_phnum"] * 56)]
        for section in elf.iter_sections():
            start, size = section["sh_offset"], section["sh_size"]
            if section.name.startswith(".rela"):  # offset and info of each entry, not its addend
                self.regions += [(at, at + 16) for at in range(start, start + size, 24)]
            elif section.name in LOADER_SECTIONS:
                self.regions.append((start, start + size))
        self.outputs = run_package(self.files, root / "original")
        assert self.outputs is not None


def run_package(files: dict[str, bytes], folder: Path) -> np.ndarray | None:
    """The package's outputs for the probe's input, run in a fresh interpreter (None if it
    did not run)."""
    for name, data in files.items():
        if name.startswith("digits/"):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(folder / "y.npy")],
                          env=env, capture_output=True, timeout=120)
    return np.load(folder / "y.npy") if done.returncode == 0 else None


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Original:
    return Original(tmp_path_factory.mktemp("wheel"))


def check_mutant(original: Original, files: dict[str, bytes], folder: Path,
                 capsys: pytest.CaptureFixture[str]) -> str:
    """Refused by cuvil check --load, or runs as the original: which of the two."""
    wheel = write_wheel(folder / original.name, files)
    status = cli_main(["check", "--load", "--no-auditwheel", str(wheel)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    if status == 1:
        assert "FAIL " in out, out
        return "refused"
    assert status == 0, (status, out, err)
    got = run_package(files, folder / "run")
    assert got is not None, f"passed cuvil check --load but does not run:\n{out}"
    assert np.array_equal(got, original.outputs), "passed cuvil check but answers differently"
    return "ran"


counter = iter(range(10**9))


def test_the_unchanged_wheel_passes_and_runs(original: Original, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """What every mutant is held to: the wheel as built passes and runs."""
    assert check_mutant(original, dict(original.files), tmp_path, capsys) == "ran"


@settings(max_examples=budget(25), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_library_is_refused_or_runs_as_built(original: Original, data: st.DataObject,
                                                        tmp_path_factory: pytest.TempPathFactory,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    lib = bytearray(original.files[LIBRARY])
    for _ in range(data.draw(st.integers(1, 3))):
        start, end = data.draw(st.sampled_from(original.regions))
        lib[data.draw(st.integers(start, end - 1))] = data.draw(st.integers(0, 255))
    folder = tmp_path_factory.mktemp(f"lib{next(counter)}")
    check_mutant(original, {**original.files, LIBRARY: bytes(lib)}, folder, capsys)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a JSON value."""
    found = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            found += _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _paths(v, (*path, i))
    return found


REPLACEMENTS = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), st.text(max_size=20),
                         st.just("batch + 1"), st.just("__import__('os')"), st.just([]), st.just({}),
                         st.just([[[[[[[[1]]]]]]]]))


@settings(max_examples=budget(25), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_edited_manifest_is_refused_or_runs_as_built(original: Original, data: st.DataObject,
                                                        tmp_path_factory: pytest.TempPathFactory,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads(original.files[MANIFEST])
    for _ in range(data.draw(st.integers(1, 2))):
        path = data.draw(st.sampled_from(_paths(manifest)[1:]))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(REPLACEMENTS)
    folder = tmp_path_factory.mktemp(f"manifest{next(counter)}")
    check_mutant(original, {**original.files, MANIFEST: json.dumps(manifest).encode()}, folder, capsys)
