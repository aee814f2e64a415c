"""Ops a project defines itself: Python decompositions (`cuvil.register_op`, found through
`tool.cuvil.op-modules` and the `cuvil.ops` entry points) and native kernels in C
(`[tool.cuvil.custom-ops.<name>]`, built with CMake and zig for the target, called through
cuvil_op.h). Results are compared with numpy formulas of the ops; the native example's
aarch64 build runs under qemu."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cuvil
from cuvil.build_backend.cache import model_key
from cuvil.compiler.ops import registered
from cuvil.config import load_project
from cuvil.errors import ConfigError, ModelError
from cuvil.toolchains import get_target

ROOT = Path(__file__).resolve().parent.parent
F = TensorProto.FLOAT


def one_op_model(domain: str, op_type: str, shape: list, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op_type, ["x"], ["y"], domain=domain, name="custom", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F, shape)],
                              [helper.make_tensor_value_info("y", F, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(domain, 1)])


# -- Python decompositions ---------------------------------------------------------------------


def test_a_registered_decomposition_compiles_with_its_attributes() -> None:
    @cuvil.register_op("test.decomposed", "ScaledSoftsign")
    def scaled_softsign(b):
        (x,) = b.inputs
        assert b.input_types[0].shape[1] == 3 and b.input_types[0].dtype == np.float32
        scale = b.op("Mul", b.const(b.attr("alpha", 1.0)), b.op("Abs", x))
        return b.op("Div", x, b.op("Add", b.const(1.0), scale))

    model = cuvil.compile(one_op_model("test.decomposed", "ScaledSoftsign", ["n", 3], alpha=2.5))
    x = np.linspace(-4, 4, 15, dtype=np.float32).reshape(5, 3)
    np.testing.assert_allclose(model(x), x / (1 + 2.5 * np.abs(x)), rtol=1e-6)


def test_the_newest_registration_for_the_models_opset_is_used() -> None:
    @cuvil.register_op("test.versions", "Twice", since=1)
    def v1(b):
        return b.op("Add", b.inputs[0], b.inputs[0])

    @cuvil.register_op("test.versions", "Twice", since=3)
    def v3(b):
        return b.op("Mul", b.inputs[0], b.const(3.0))  # version 3 changed the meaning

    x = np.arange(4, dtype=np.float32)
    for opset, factor in [(2, 2.0), (3, 3.0)]:
        model = one_op_model("test.versions", "Twice", [4])
        model.opset_import[1].version = opset
        np.testing.assert_array_equal(cuvil.compile(model)(x), x * factor)


def test_a_failing_decomposition_names_the_node_and_the_function() -> None:
    @cuvil.register_op("test.broken", "Broken")
    def broken(b):
        raise KeyError("no such thing")

    with pytest.raises(ModelError, match=r"'custom'.*the decomposition .*broken .*KeyError"):
        cuvil.compile(one_op_model("test.broken", "Broken", [4]))


def test_an_op_cuvil_implements_cannot_be_replaced() -> None:
    with pytest.raises(ConfigError, match=r"ai\.onnx Relu is implemented by cuvil itself"):
        cuvil.register_op("", "Relu")(lambda b: b.inputs[0])


def test_entry_points_of_installed_packages_register_ops(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution declaring `[cuvil.ops]` in its entry points: its module is imported by
    the first compile, without the user importing it."""
    (tmp_path / "negate_ops.py").write_text(textwrap.dedent("""
        import cuvil

        @cuvil.register_op("test.installed", "Negate")
        def negate(b):
            return b.op("Neg", b.inputs[0])
        """))
    info = tmp_path / "negate_ops-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: negate-ops\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[cuvil.ops]\nnegate = negate_ops\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registered.load_entry_points.cache_clear()
    try:
        x = np.arange(3, dtype=np.float32)
        np.testing.assert_array_equal(cuvil.compile(one_op_model("test.installed", "Negate", [3]))(x), -x)
        assert "negate" in registered.load_entry_points()
    finally:
        registered.load_entry_points.cache_clear()


PROJECT = """\
[project]
name = "halve"
version = "1.0"

[tool.cuvil]
op-modules = ["halve_ops"]

[tool.cuvil.models.net]
source = "net.onnx"
"""


def test_op_modules_join_the_compile_cache_key(tmp_path: Path) -> None:
    """An edit of the module defining a decomposition gives another key: the model compiles again."""
    (tmp_path / "pyproject.toml").write_text(PROJECT)
    onnx.save(one_op_model("test.project", "Halve", [4]), tmp_path / "net.onnx")
    ops = tmp_path / "halve_ops.py"
    ops.write_text("import cuvil\n\n@cuvil.register_op('test.project', 'Halve')\n"
                   "def halve(b):\n    return b.op('Mul', b.inputs[0], b.const(0.5))\n")
    sys.modules.pop("halve_ops", None)
    project = load_project(tmp_path, environ={})
    target = get_target(None)
    before = model_key(project, project.models[0], target)
    assert "halve_ops" in sys.modules  # the key imported the project's op module
    assert model_key(project, project.models[0], target) == before
    ops.write_text(ops.read_text().replace("0.5", "0.25"))
    assert model_key(project, project.models[0], target) != before
    sys.modules.pop("halve_ops", None)


def test_an_op_module_that_does_not_import_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(PROJECT.replace("halve_ops", "no_such_ops"))
    onnx.save(one_op_model("test.project", "Halve", [4]), tmp_path / "net.onnx")
    project = load_project(tmp_path, environ={})
    with pytest.raises(ConfigError, match=r"tool.cuvil.op-modules: module 'no_such_ops' cannot"):
        model_key(project, project.models[0], get_target(None))
    importlib.invalidate_caches()
