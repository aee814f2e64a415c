"""The CPU a module's code is for, as kernels see it: one typed value instead of each kernel
reading the module's triple and feature string its own way.

A module is given its target once (`set_target`: the model modules by codegen/module.py, the
kernel modules by kernels/objects.py); kernels read it back with `target_of`. Features are
LLVM's: "+avx2" where the copy may use AVX2, "-amx-tile" where the CPU variant rules AMX out,
neither where a kernel must ask the CPU at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir


@dataclass(frozen=True)
class KernelTarget:
    triple: str
    #: the LLVM features this copy is compiled with, as given ("+avx2,+fma,-amx-tile")
    features: str = ""

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(f for f in self.features.split(",") if f)

    @property
    def is_x86(self) -> bool:
        return self.triple.startswith(("x86_64", "i686", "i386"))

    @property
    def is_aarch64(self) -> bool:
        return self.triple.startswith(("aarch64", "arm64"))

    def has(self, feature: str) -> bool:
        """Whether the copy may use `feature` ("avx512f") without asking the CPU."""
        return f"+{feature}" in self.flags

    def excludes(self, feature: str) -> bool:
        """Whether the CPU variant says its CPUs lack `feature`."""
        return f"-{feature}" in self.flags

    @property
    def vector_registers(self) -> int:
        """SIMD registers of the copy: 32 with NEON and AVX-512, 16 with AVX2 and SSE."""
        return 32 if self.is_aarch64 or self.has("avx512f") else 16


def set_target(module: ir.Module, target: KernelTarget) -> None:
    """Give `module` its target (an llvmlite module has no field for it: an attribute holds
    it, read only through `target_of`)."""
    module.cuvil_target = target


def target_of(module: ir.Module) -> KernelTarget:
    """The target `set_target` gave `module`; a module given none (hand-built in a test)
    is its triple with no features."""
    target = getattr(module, "cuvil_target", None)
    return target if target is not None else KernelTarget(module.triple)


__all__ = ["KernelTarget", "set_target", "target_of"]
