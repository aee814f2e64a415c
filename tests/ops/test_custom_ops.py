"""Ops a project defines itself: Python decompositions (`cuvil.register_op`, found through
`tool.cuvil.op-modules` and the `cuvil.ops` entry points) and native kernels in C
(`[tool.cuvil.custom-ops.<name>]`, built with CMake and zig for the target, called through
cuvil_op.h). Results are compared with numpy formulas of the ops; the native example's
aarch64 build runs under qemu."""

from __future__ import annotations

import importlib
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from host_tools import AARCH64_LOADER, AARCH64_SYSROOT, QEMU_AARCH64, needs, tool
from onnx import TensorProto, helper

import cuvil
import cuvil.build_backend as backend
from cuvil.build_backend.cache import model_key
from cuvil.compiler.frontend import import_model
from cuvil.compiler.ops import registered
from cuvil.compiler.ops.native import NativeKernel, native_ops
from cuvil.config import CompileOptions, load_project
from cuvil.errors import BuildError, ConfigError, ModelError
from cuvil.toolchains import custom_ops, get_target

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom-op"
F = TensorProto.FLOAT
linux_x86 = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="builds and cross-runs from an x86-64 Linux host (as CI is)")


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


# -- native kernels: the declaration ----------------------------------------------------------

NATIVE = """\
[project]
name = "clip"
version = "1.0"

[tool.cuvil.models.net]
source = "net.onnx"

[tool.cuvil.custom-ops.soft_clip]
domain = "example.ops"
op-type = "SoftClip"
inputs = [{ name = "x", dtype = "float32", rank = 2 }]
outputs = [{ name = "y", dtype = "float32", shape = "x" }]
attributes = { alpha = { type = "float", default = 1.0 } }
sources = ["ops/soft_clip.c"]
"""


def native_project(root: Path, pyproject: str = NATIVE, source: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(pyproject)
    shutil.copy(EXAMPLE / "models" / "net.onnx", root / "net.onnx")
    (root / "ops").mkdir(exist_ok=True)
    (root / "ops" / "soft_clip.c").write_text(
        source if source is not None else (EXAMPLE / "ops" / "soft_clip.c").read_text())
    return root


@pytest.mark.parametrize(("old", "new", "message"), [
    ('dtype = "float32", rank', 'dtype = "float33", rank',
     r"custom-ops\.soft_clip\.inputs\[0\]\.dtype: got \"float33\".*expected one of float32"),
    ('shape = "x"', 'shape = "x[0] * k"',
     (r"outputs\[0\]\.shape: \"x\[0\] \* k\" names 'k', which is no input or attribute of the op "
      r"\(inputs and attributes: alpha, x\)")),
    ('shape = "x"', 'shape = "__import__(\'os\')"', r"outputs\[0\]\.shape: .* calls something other"),
    ('type = "float", default = 1.0', 'type = "double"', r"attributes\.alpha\.type: got \"double\""),
    ('type = "float", default = 1.0', 'type = "int", default = 1.5',
     r"attributes\.alpha\.default: got 1\.5 \(a float\), which is not a value of type int"),
    ('op-type = "SoftClip"', 'op-type = "Soft Clip"', r"op-type: \"Soft Clip\" is not a valid identifier"),
    ('outputs = [{ name = "y", dtype = "float32", shape = "x" }]\n', '',
     r"custom-ops\.soft_clip\.outputs: missing"),
])
def test_a_bad_signature_names_the_key(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in NATIVE
    root = native_project(tmp_path, NATIVE.replace(old, new))
    with pytest.raises(ConfigError, match=message):
        load_project(root, environ={})


def test_a_missing_source_names_the_key(tmp_path: Path) -> None:
    root = native_project(tmp_path, NATIVE.replace("ops/soft_clip.c", "ops/soft_clp.c"))
    with pytest.raises(ConfigError, match=r"custom-ops\.soft_clip\.sources\[0\] \(ops/soft_clp\.c\): "
                                          r"cannot read .*soft_clp\.c"):
        load_project(root, environ={})


def _kernels(root: Path) -> list[NativeKernel]:
    return [NativeKernel(op) for op in load_project(root, environ={}).custom_ops]


def test_nodes_are_typed_by_the_declared_shape_rule(tmp_path: Path) -> None:
    root = native_project(tmp_path, NATIVE.replace('shape = "x"', 'shape = ["x[0]", "2 * x[1] - 1"]'))
    with native_ops(_kernels(root)):
        graph = import_model(root / "net.onnx", {"x": ["batch", 8]})
    (node,) = [n for n in graph.nodes if n.op_type == "SoftClip"]
    assert [str(d) for d in node.outputs[0].type.shape] == ["batch", "7"]


@pytest.mark.parametrize(("edit", "differs"), [
    (lambda n: n.attribute.append(helper.make_attribute("beta", 1.0)),
     "attribute 'beta' is not one the kernel takes (alpha)"),
    (lambda n: n.attribute[0].CopyFrom(helper.make_attribute("alpha", 2)),
     "attribute 'alpha' is int, the kernel takes float"),
    (lambda n: n.input.append("h"), "the node has 2 inputs, the kernel takes 1"),
])
def test_a_node_that_fits_no_kernel_names_the_closest_signature(tmp_path: Path, edit, differs) -> None:
    root = native_project(tmp_path)
    model = onnx.load(root / "net.onnx")
    edit(model.graph.node[1])
    with native_ops(_kernels(root)), pytest.raises(ModelError) as info:
        import_model(model, {"x": ["batch", 8]})
    text = str(info.value)
    assert "node 'clip' (SoftClip): no custom-op kernel matches" in text
    assert ("closest is tool.cuvil.custom-ops.soft_clip: example.ops SoftClip(x: float32[rank 2]; "
            "alpha: float = 1.0) -> y: float32") in text
    assert differs in text


def test_a_node_of_another_dtype_names_what_differs(tmp_path: Path) -> None:
    root = native_project(tmp_path)
    node = helper.make_node("SoftClip", ["x"], ["y"], domain="example.ops", name="clip64")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("example.ops", 1)])
    differs = r"input 0 \(x\) is float64, the kernel takes float32"
    with native_ops(_kernels(root)), pytest.raises(ModelError, match=differs):
        import_model(model)


@pytest.mark.parametrize("cmake", [True, False], ids=["cmake", "zig-cc"])
def test_a_compile_error_gives_the_compilers_message_and_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cmake: bool) -> None:
    if not cmake:  # as on a machine without CMake, or for Windows
        monkeypatch.setattr(custom_ops, "find_cmake", lambda: None)
    broken = ('#include "cuvil_op.h"\nint soft_clip(const cuvil_op_context *ctx) {\n'
              "  return ctx->nothing;\n}\n")
    root = native_project(tmp_path, source=broken)
    project = load_project(root, environ={})
    with pytest.raises(BuildError) as info:
        custom_ops.build_custom_ops(project.custom_ops, get_target(None), tmp_path / "build")
    text = str(info.value)
    source = root / "ops" / "soft_clip.c"
    assert text.startswith(f"tool.cuvil.custom-ops.soft_clip.sources: compiling {source} for "), text
    assert re.search(r"soft_clip\.c:3:\d+: error: no member named 'nothing'", text), text


def test_the_kernel_sources_join_the_compile_cache_key(tmp_path: Path) -> None:
    root = native_project(tmp_path)
    (root / "ops" / "helpers.h").write_text("#define TWO 2\n")
    project = load_project(root, environ={})
    target = get_target(None)
    before = model_key(project, project.models[0], target)
    (root / "ops" / "helpers.h").write_text("#define TWO 3\n")  # a header beside the sources
    after_header = model_key(project, project.models[0], target)
    (root / "ops" / "soft_clip.c").write_text((root / "ops" / "soft_clip.c").read_text() + "\n")
    assert len({before, after_header, model_key(project, project.models[0], target)}) == 3


def test_cmake_is_asked_for_when_the_machine_has_none(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(native_project(tmp_path))
    monkeypatch.setattr(custom_ops, "find_cmake", lambda: None)
    monkeypatch.setattr(custom_ops, "find_build_tool", lambda: None)
    assert backend.get_requires_for_build_wheel() == ["cmake>=3.15", "ninja"]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert backend.get_requires_for_build_wheel() == []  # no custom ops: nothing more
    monkeypatch.chdir(native_project(tmp_path / "again"))
    assert backend.get_requires_for_build_wheel() == []  # the test extras install cmake and ninja


# -- native kernels: the example, built ------------------------------------------------------------


def _build(root: Path, settings: dict[str, str]) -> Path:
    """The wheel of the project in `root`, built in-process without the compile cache, unpacked."""
    cwd = os.getcwd()
    os.chdir(root)
    try:
        wheel = root / "dist" / backend.build_wheel(str(root / "dist"), {**settings, "cache": "false"})
    finally:
        os.chdir(cwd)
    site = root / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


@pytest.fixture(scope="module")
def host_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("host") / "custom-op"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("build", "dist", "__pycache__"))
    return _build(root, {"cpu": "x86-64"})  # one copy of the code: a short compile


@linux_x86
def test_the_example_builds_and_check_py_passes(host_build: Path) -> None:
    assert sorted(p.name for p in (host_build / "softclip").glob("_net.*")) == ["_net.so"]
    proc = subprocess.run([sys.executable, str(host_build.parent / "check.py")], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(host_build)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matches numpy" in proc.stdout
    exported = subprocess.run(["nm", "-D", "--defined-only", str(host_build / "softclip" / "_net.so")],
                              capture_output=True, text=True).stdout if shutil.which("nm") else ""
    assert "soft_clip" not in exported  # the kernel stays inside the library


@linux_x86
@needs(*QEMU_AARCH64)
def test_the_aarch64_build_runs_under_qemu(tmp_path: Path) -> None:
    from test_harness import compile_harness

    qemu = tool("qemu-aarch64-static")
    tool(str(AARCH64_LOADER))
    root = tmp_path / "custom-op"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("build", "dist", "__pycache__"))
    pyproject = root / "pyproject.toml"  # the harness runs models without symbolic dims
    pyproject.write_text(pyproject.read_text().replace('["batch", 8]', "[3, 8]"))
    site = _build(root, {"target": "aarch64-linux"})
    arch = get_target("aarch64-linux").arches[0]
    harness = compile_harness(arch, site / "softclip", tmp_path / "run_model")
    x = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
    feeds = tmp_path / "inputs.bin"
    feeds.write_bytes(len(x.tobytes()).to_bytes(8, "little") + x.tobytes())
    proc = subprocess.run([qemu, "-L", str(AARCH64_SYSROOT), str(harness),
                           str(site / "softclip" / "_net.so"), str(feeds), "12"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    got = np.array([float(v) for v in lines[2:14]], np.float32).reshape(3, 4)
    reference = np.load(EXAMPLE / "data" / "reference.npz")
    alpha = float(reference["alpha"])
    np.testing.assert_allclose(got, alpha * np.tanh((x @ reference["w"]) / alpha), rtol=1e-5, atol=1e-6)


@linux_x86
def test_a_kernel_returning_an_error_fails_the_call_naming_the_node(tmp_path: Path) -> None:
    """The example's kernel refuses alpha <= 0 (returns 2): the call raises, naming the node."""
    from cuvil.compiler.driver import compile_model
    from cuvil.runtime import Model

    root = native_project(tmp_path / "p")
    model = onnx.load(root / "net.onnx")
    model.graph.node[1].attribute[0].f = -1.0
    project = load_project(root, environ={})
    target = get_target(None)
    compiled = compile_model(
        model, "net", tmp_path / "work", CompileOptions(inputs={"x": ("batch", 8)}, cpu="x86-64"),
        target=target, custom_ops=[NativeKernel(op) for op in project.custom_ops],
        native_objects=lambda: custom_ops.build_custom_ops(project.custom_ops, target,
                                                           tmp_path / "kernels"))
    net = Model(compiled.library, compiled.signature)
    with pytest.raises(ValueError, match=r"node 'clip' \(SoftClip\): the custom op's kernel reported"):
        net(np.ones((2, 8), np.float32))


def test_a_shape_function_gives_the_output_shapes(tmp_path: Path) -> None:
    from cuvil.build_backend._custom_ops import native_kernels

    pyproject = NATIVE.replace(', shape = "x" }]', ' }]\nshape-function = "clip_shapes:rule"')
    root = native_project(tmp_path, pyproject)
    (root / "clip_shapes.py").write_text(
        "def rule(shapes, attrs):\n    (batch, width), = shapes\n"
        "    return [(batch, width + int(attrs['alpha']))]\n")
    project = load_project(root, environ={})
    with native_ops(native_kernels(project)):
        graph = import_model(root / "net.onnx", {"x": ["batch", 8]})
    assert [str(d) for d in graph.outputs[0].type.shape] == ["batch", "6"]  # 4 + alpha (2)
    sys.modules.pop("clip_shapes", None)


CXX_KERNEL = """\
#include <cmath>
#include <vector>
#include "cuvil_op.h"

extern "C" int soft_clip(const cuvil_op_context *ctx) {
    const cuvil_tensor *x = &ctx->inputs[0], *y = &ctx->outputs[0];
    const float alpha = (float)cuvil_op_attr(ctx, "alpha")->f;
    std::vector<float> rows((size_t)cuvil_op_size(x));  // the C++ library, linked in
    for (size_t i = 0; i < rows.size(); i++)
        rows[i] = alpha * std::tanh(((const float *)x->data)[i] / alpha);
    std::copy(rows.begin(), rows.end(), (float *)y->data);
    return 0;
}
"""


@linux_x86
def test_a_cxx_kernel_links_the_cxx_library_and_exports_nothing_more(tmp_path: Path) -> None:
    from cuvil.compiler.driver import compile_model
    from cuvil.runtime import Model

    root = native_project(tmp_path / "p", NATIVE.replace("soft_clip.c", "soft_clip.cpp"))
    (root / "ops" / "soft_clip.cpp").write_text(CXX_KERNEL)
    project = load_project(root, environ={})
    target = get_target(None)
    compiled = compile_model(
        root / "net.onnx", "net", tmp_path / "work",
        CompileOptions(inputs={"x": ("batch", 8)}, cpu="x86-64"), target=target,
        custom_ops=[NativeKernel(op) for op in project.custom_ops],
        native_objects=lambda: custom_ops.build_custom_ops(project.custom_ops, target,
                                                           tmp_path / "kernels"),
        native_libs=custom_ops.link_libraries(project.custom_ops))
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    reference = np.load(EXAMPLE / "data" / "reference.npz")
    alpha = float(reference["alpha"])
    got = Model(compiled.library, compiled.signature)(x)
    np.testing.assert_allclose(got, alpha * np.tanh((x @ reference["w"]) / alpha), rtol=1e-5, atol=1e-6)
    from elftools.elf.elffile import ELFFile

    with open(compiled.library, "rb") as f:  # libc++abi's operator new is exported by default
        exported = [s.name for s in ELFFile(f).get_section_by_name(".dynsym").iter_symbols()
                    if s["st_shndx"] != "SHN_UNDEF" and s["st_info"]["bind"] != "STB_LOCAL"]
    assert exported and all(name.startswith("cuvil_net_") for name in exported), exported
