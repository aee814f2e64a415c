"""Kernel tests' scaffolding: an llvmlite module for the host's arch at one x86 instruction set,
linked with the runtime into a library the test calls through ctypes (tests/kernels)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
from llvmlite import ir

from cuvil.compiler.codegen.module import hide_declarations
from cuvil.compiler.driver import RUNTIME_SOURCE
from cuvil.compiler.kernels.target import KernelTarget
from cuvil.toolchains import get_target, target_machine, zig
from cuvil.toolchains.llvm import emit_object

#: the instruction sets the kernels have tiles for, as LLVM feature strings
FEATURES = {"sse": "", "avx2": "+avx,+avx2,+fma",
            "avx512": "+avx,+avx2,+fma,+avx512f,+avx512bw,+avx512cd,+avx512dq,+avx512vl"}


def cpu_of(features: str) -> str:
    return ("x86-64-v4" if "+avx512f" in features else "x86-64-v3" if features
            else "x86-64-v2")


def host_module(features: str) -> tuple[ir.Module, Any, KernelTarget]:
    """An empty module for the host's arch with `features`, its target machine and the
    kernels' target."""
    arch = get_target(None).arches[0]
    tm = target_machine(arch, cpu=cpu_of(features), features=features)
    module = ir.Module("g")
    module.triple = arch.llvm_triple
    module.data_layout = str(tm.target_data)
    return module, tm, KernelTarget(module.triple, features)


def link(tmp: Path, module: ir.Module, tm: Any) -> ctypes.CDLL:
    """`module` compiled and linked with the runtime (thread pool) into a loaded library."""
    return link_modules(tmp, [(module, tm)])


def link_modules(tmp: Path, modules: list[tuple[ir.Module, Any]],
                 c_sources: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """Several modules (each for its own instruction set: exported names must differ), the
    runtime and `c_sources` in one loaded library: one link instead of one per instruction
    set."""
    target = get_target(None)
    objects = []
    for i, (module, tm) in enumerate(modules):
        objects.append(tmp / f"g{i}.o")
        objects[-1].write_bytes(emit_object(hide_declarations(str(module), "-"), tm))
    for i, source in enumerate((RUNTIME_SOURCE, *c_sources)):
        objects.append(zig.compile_c(source, tmp / f"c{i}.o", target.arches[0]))
    return ctypes.CDLL(str(zig.link_library(target, objects, tmp / "_g.so",
                                            libs=("m", "pthread"))))


def skip_unless_host_has(isa: str) -> None:
    if isa != "sse":
        import llvmlite.binding as llvm

        flag = "+avx512f" if isa == "avx512" else "+avx2"
        if flag not in llvm.get_host_cpu_features().flatten().split(","):
            pytest.skip(f"this CPU has no {isa.upper()}")
