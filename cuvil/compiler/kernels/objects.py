"""Kernels as objects of their own, compiled once and linked into every library that calls them.

A GEMM or matrix-vector kernel depends only on the CPU level and on its variant (epilogue,
operand layout), never on the model, and it is most of a module's code: 97% of the IR of a
one-Gemm model. Optimized inside each model's module, it made every model with a product
cost seconds of LLVM time per CPU level. Instead, a model's module declares the kernel under a
name that carries a digest of everything its code depends on (`KernelSet.tag`), and the driver
compiles the requested kernels as separate modules, each once per process (`KernelSet`
requests, `kernel_module_ir` builds their modules).

Without a `KernelSet` (`kernel_function`'s default: modules built by tests and tools) the
kernel is defined in the calling module, internal, as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from llvmlite import ir

from cuvil.compiler.kernels.emitter import guard_divisions
from cuvil.compiler.kernels.target import KernelTarget

#: writes the kernel's attributes and body for a target into `fn`, which `module` holds
Define = Callable[[ir.Module, ir.Function, KernelTarget], None]


@dataclass(frozen=True)
class KernelRequest:
    symbol: str
    fn_type: ir.FunctionType
    define: Define
    #: run LLVM's IR optimizer on the kernel's module (else only its code generator)
    optimize: bool = True


@dataclass
class KernelSet:
    """The kernels one model module calls. `tag` names the code they are compiled to (a digest
    of the target triple, data layout, CPU, features and optimization level): kernels of
    the same name and tag are the same object code."""

    tag: str
    requests: dict[str, KernelRequest] = field(default_factory=dict)


def kernel_function(module: ir.Module, target: KernelTarget, name: str,
                    fn_type: ir.FunctionType, define: Define, *,
                    optimize: bool = True) -> ir.Function:
    """The kernel `name` for a call from `module`, whose code is for `target`: a declaration
    of the separately compiled kernel when the module carries a KernelSet
    (`module.cuvil_kernels`), else an internal definition in `module` itself. `define` must
    read only the target it is given, so that both give the same code. `optimize=False`: the
    separate kernel skips LLVM's IR optimizer (for IR written as it should run)."""
    kernels: KernelSet | None = getattr(module, "cuvil_kernels", None)
    symbol = name if kernels is None else f"{name}.{kernels.tag}"
    try:
        return module.get_global(symbol)
    except KeyError:
        pass
    fn = ir.Function(module, fn_type, symbol)
    if kernels is None:
        fn.linkage = "internal"
        define(module, fn, target)
    else:
        kernels.requests.setdefault(symbol, KernelRequest(symbol, fn_type, define, optimize))
    return fn


_DEFINE_KERNEL = re.compile(r'^define (?!internal )(.*?)@"([^"]+)"', re.M)
_DECLARE_RUNTIME = re.compile(r'^declare (?!hidden )(.*?)@"(cuvil_[^"]+)"', re.M)


def kernel_module_ir(request: KernelRequest, triple: str, data_layout: str,
                     features: str) -> str:
    """The LLVM IR of a module defining the kernel of `request`, hidden (the library calls it;
    nothing outside does), for the target a model module of the same tag is built for."""
    module = ir.Module(name=request.symbol)
    module.triple = triple
    module.data_layout = data_layout
    request.define(module, ir.Function(module, request.fn_type, request.symbol),
                   KernelTarget(triple, features))
    guard_divisions(module)
    # llvmlite writes no visibility: the kernel and the runtime functions it calls (CPUID
    # queries in the thread pool's file) are the library's own
    text = _DEFINE_KERNEL.sub(r'define hidden \1@"\2"', str(module))
    return _DECLARE_RUNTIME.sub(r'declare hidden \1@"\2"', text)
