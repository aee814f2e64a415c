"""Kernels compiled as objects of their own (kernels/objects.py): each once per process,
linked into every library that calls them, hidden, and the libraries the same bytes as when
nothing was reused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from llvmlite import ir
from onnx import TensorProto, helper, numpy_helper
from oracle import run_ort

import cuvil.compiler.driver as driver
import cuvil.compiler.llvm_jobs as jobs_module
import cuvil.toolchains.llvm as llvm
from cuvil.check._elf import read_elf
from cuvil.compiler.kernels.gemm import PLAIN, gemm_function
from cuvil.compiler.kernels.objects import KernelSet, kernel_module_ir
from cuvil.compiler.kernels.target import KernelTarget
from cuvil.runtime import Model


def product_model(seed: int, n: int) -> onnx.ModelProto:
    """MatMul + bias + Relu (one GEMM and one matrix-vector kernel per CPU level)."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((24, n)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 24])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def llvm_jobs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The first line of each module LLVM compiles (its ModuleID: the model or the kernel)."""
    jobs: list[str] = []
    real = llvm.emit_object_isolated

    def counting(ir_text: str, machine: dict, optimize: bool = True) -> bytes:
        jobs.append(ir_text.split("\n", 1)[0])
        return real(ir_text, machine, optimize)

    monkeypatch.setattr(llvm, "emit_object_isolated", counting)
    monkeypatch.setattr(jobs_module, "_kernels", {})
    return jobs


def test_a_kernel_compiles_once_and_every_library_that_calls_it_links_it(
        tmp_path: Path, llvm_jobs: list[str]) -> None:
    first = driver.compile_model(product_model(0, 40), "first", tmp_path / "a")
    levels = sum('"first"' in job for job in llvm_jobs)  # one module per CPU level
    kernels = [job for job in llvm_jobs if '"first"' not in job]
    assert kernels and all("cuvil.gem" in job for job in kernels), llvm_jobs
    llvm_jobs.clear()
    # other weights and sizes, the same kinds of kernel: only the model's own code compiles
    second = driver.compile_model(product_model(1, 72), "second", tmp_path / "b")
    assert llvm_jobs == [llvm_jobs[0]] * levels and '"second"' in llvm_jobs[0]

    for seed, n, compiled in ((0, 40, first), (1, 72, second)):
        model = product_model(seed, n)
        for rows in (1, 3, 50):  # the matrix-vector kernel, then the GEMM
            x = np.random.default_rng(rows).standard_normal((rows, 24)).astype(np.float32)
            (want,) = run_ort(model, {"x": x})
            got = Model(compiled.library, compiled.signature).run({"x": x})["y"]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    # the kernels are the library's own: nothing beyond the model's C ABI is exported
    exported = read_elf(first.library.read_bytes()).exported
    assert exported and all(name.startswith("cuvil_first_") for name in exported), sorted(exported)


def test_a_library_is_the_same_whether_its_kernels_were_compiled_for_it_or_reused(
        tmp_path: Path, llvm_jobs: list[str]) -> None:
    fresh = driver.compile_model(product_model(0, 40), "net", tmp_path / "fresh").library.read_bytes()
    driver.compile_model(product_model(2, 16), "other", tmp_path / "other")
    llvm_jobs.clear()
    reused = driver.compile_model(product_model(0, 40), "net", tmp_path / "reused")
    assert all('"net"' in job for job in llvm_jobs)
    assert reused.library.read_bytes() == fresh


def test_the_kernel_symbol_names_what_its_code_depends_on() -> None:
    def declared(triple: str, features: str) -> str:
        module = ir.Module()
        module.triple = triple
        module.cuvil_kernels = KernelSet(driver.kernel_tag(triple, "", features, {"cpu": "x"}))
        return gemm_function(module, KernelTarget(triple, features), PLAIN).name

    avx2 = declared("x86_64-unknown-linux-gnu", "+avx2,+fma")
    assert avx2 == declared("x86_64-unknown-linux-gnu", "+avx2,+fma")
    assert avx2 != declared("x86_64-unknown-linux-gnu", "+avx512f,+avx2,+fma")
    assert avx2 != declared("x86_64-apple-macosx", "+avx2,+fma")
    assert avx2.startswith("cuvil.gemm.none.")


def test_the_kernel_module_defines_the_kernel_hidden_and_its_helpers_internal() -> None:
    module = ir.Module()
    module.triple = "aarch64-unknown-linux-gnu"
    kernels = module.cuvil_kernels = KernelSet("t")
    fn = gemm_function(module, KernelTarget(module.triple, "+neon"), PLAIN)
    assert fn.is_declaration and list(kernels.requests) == [fn.name]
    text = kernel_module_ir(kernels.requests[fn.name], module.triple, "", "+neon")
    defines = [line for line in text.splitlines() if line.startswith("define ")]
    assert defines[0].startswith(f'define hidden void @"{fn.name}"'), defines[0]
    assert all(" internal " in line or "hidden" in line for line in defines), defines
