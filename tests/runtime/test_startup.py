"""What a fresh process pays before its first result (cuvil/runtime/_loader.py and the derived
weights' populate in cuvil/runtime/threadpool.c): a generated package's import loads neither
hashlib (OpenSSL) nor dataclasses, its ABI checksum is still the SHA-256 of the signature, and
the Winograd weights derived at the first run (transformed-weights = "first-run") land in pages
populated beforehand (huge ones where the system allows) with outputs equal to onnxruntime's at
1 and 2 threads."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil.build_backend._package import RUNTIME_MODULE, render_init
from cuvil.compiler.driver import compile_model
from cuvil.config import CompileOptions
from cuvil.runtime import ABI_VERSION, LOADER_SOURCE, abi_checksum

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits" / "models" / "classifier.onnx"
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _package(compiled: Any, root: Path, package: str = "startup_pkg") -> Path:
    """A generated package's files (as build_package_files lays them out) for one library."""
    pkg = root / package
    pkg.mkdir(parents=True)
    sig = compiled.signature
    shutil.copyfile(compiled.library, pkg / sig["library"])
    shutil.copyfile(LOADER_SOURCE, pkg / f"{RUNTIME_MODULE}.py")
    manifest = {"abi_version": ABI_VERSION, "package": package, "target": "host",
                "cuvil_version": "test", "models": [sig]}
    (pkg / "_models.json").write_text(json.dumps(manifest))
    (pkg / "__init__.py").write_text(render_init(package, [sig], "host"))
    return root


def _child(root: Path, script: str, threads: int | None = None, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUVIL_NUM_THREADS")}
    env["PYTHONPATH"] = str(root)  # the package alone, as a user's install: no cuvil
    if threads is not None:
        env["CUVIL_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return compile_model(str(DIGITS), "classifier", tmp_path_factory.mktemp("startup"),
                         CompileOptions(inputs={"image": ("batch", 1, 8, 8)}))


def test_the_checksum_is_the_sha256_of_the_canonical_signature(digits: Any) -> None:
    sig = digits.signature
    # the expressions the loader sizes memory by are covered too (a digits batch: "batch")
    canonical = {"abi": ABI_VERSION, "model": sig["name"], "symbols": list(sig["symbols"]),
                 "inputs": [[t["name"], t["dtype"], list(t["shape"])] for t in sig["inputs"]],
                 "outputs": [[t["name"], t["dtype"], list(t["shape"]), list(t["shape_expr"]), None]
                             for t in sig["outputs"]],
                 "workspace": sig["workspace"], "constraints": [], "data_dims": []}
    assert sig["outputs"][0]["shape_expr"][0] == "batch" and sig["workspace"]
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    want = hashlib.sha256(text.encode()).hexdigest()
    assert abi_checksum(sig) == want
    library = ctypes.CDLL(str(digits.library))
    embedded = (ctypes.c_char * 64).in_dll(library, "cuvil_classifier_abi_checksum").value
    assert embedded.decode() == want


@pytest.mark.skipif(all(importlib.util.find_spec(m) is None for m in ("_sha2", "_sha256")),
                    reason="this Python has no built-in SHA-256 module: the loader uses hashlib")
def test_importing_a_package_loads_neither_hashlib_nor_dataclasses(digits: Any,
                                                                   tmp_path: Path) -> None:
    root = _package(digits, tmp_path)
    out = _child(root, """
import sys
import numpy as np
x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)  # numpy.random: hashlib
before = set(sys.modules)
import startup_pkg
np.savez(sys.argv[1], x=x, y=startup_pkg.classifier(x))
print(" ".join(sorted(set(sys.modules) - before)))
""", None, str(tmp_path / "out.npz"))
    new = set(out.split())
    assert "startup_pkg._cuvil_runtime" in new
    assert not new & {"hashlib", "_hashlib", "dataclasses"}, sorted(new)
    got = np.load(tmp_path / "out.npz")
    want = ort.InferenceSession(str(DIGITS), providers=["CPUExecutionProvider"]).run(
        None, {"image": got["x"]})[0]
    np.testing.assert_allclose(got["y"], want, rtol=1e-4, atol=1e-6)


def _winograd_model() -> Any:
    """Two 3x3 convs of 128 channels at 28x28: Winograd, U = 2 x 36 x 128 x 128 floats
    (4.5 MiB, at least one whole 2 MiB page)."""
    rng = np.random.default_rng(7)
    consts = [numpy_helper.from_array((rng.standard_normal((128, 128, 3, 3)) * 0.05)
                                      .astype(np.float32), f"w{i}") for i in range(2)]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "w1"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128, 28, 28])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128, 28, 28])], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


#: in the child: two results, and the kB of huge pages in the anonymous mappings that continue
#: the library's (its .bss, where the derived weights live; advice splits it into several)
_FIRST_RUN = """
import os, sys
import numpy as np
import startup_pkg
x = np.random.default_rng(1).standard_normal((1, 128, 28, 28)).astype(np.float32)
first, second = startup_pkg.m(x), startup_pkg.m(x)
path = os.path.realpath(startup_pkg.m._path)
huge, in_bss, end = 0, False, None
for line in open("/proc/self/smaps"):
    fields = line.split()
    if not fields[0].endswith(":"):  # a mapping's first line: range, perms, offset, dev, inode[, path]
        lo, hi = (int(a, 16) for a in fields[0].split("-"))
        in_bss = len(fields) == 5 and lo == end and (in_bss or library)
        library = len(fields) == 6 and fields[5] == path
        end = hi
    elif fields[0] == "AnonHugePages:" and in_bss:
        huge += int(fields[1])
np.savez(sys.argv[1], first=first, second=second, huge=huge)
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_derived_weights_are_populated_and_right_at_the_first_run(tmp_path: Path,
                                                                  threads: int) -> None:
    model = _winograd_model()
    compiled = compile_model(model, "m", tmp_path / "build",
                             CompileOptions(transformed_weights="first-run"))
    assert [p["op"] for p in compiled.signature["node_profile"]] == [
        "Conv(winograd)+Relu", "Conv(winograd)"]
    root = _package(compiled, tmp_path / "site")
    _child(root, _FIRST_RUN, threads, str(tmp_path / "out.npz"))
    got = np.load(tmp_path / "out.npz")
    x = np.random.default_rng(1).standard_normal((1, 128, 28, 28)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got["first"], want, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(got["second"], got["first"])
    if "[never]" not in (THP.read_text() if THP.exists() else "[never]"):
        assert int(got["huge"]) >= 2048, "no huge page backs the derived weights"
