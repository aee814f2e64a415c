"""The CPU a module's code is for, as kernels see it: one typed value, passed explicitly (an
`Emitter` carries it as `k.target`; a kernel's `define` is handed it), instead of each kernel
reading the module's triple and feature string its own way.

Features are LLVM's: "+avx2" where the copy may use AVX2, "-amx-tile" where the CPU variant
rules AMX out, neither where a kernel must ask the CPU at run time.

The per-architecture choices that follow from the features are data here: `SIMD_LEVELS`
gives, per architecture, each level's vector width, register count and float32 GEMM tile.
The int8 and bf16 kernels choose among their instruction kinds in their own modules
(`int8_gemm.int8_isa`, `bf16_gemm.bf16_isas`), from the same target.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Isa:
    """The float32 GEMM tile of a SIMD level."""

    vector: int  # floats per vector register
    mr: int  # rows per tile
    nv: int  # vectors per tile row (NR = nv * vector)

    @property
    def nr(self) -> int:
        return self.vector * self.nv


@dataclass(frozen=True)
class SimdLevel:
    """What code for one SIMD level of an architecture works with."""

    feature: str | None  # the LLVM feature a copy needs for this level (None: every copy)
    registers: int  # vector registers
    gemm: Isa

    @property
    def vector(self) -> int:
        """float32 lanes per vector register."""
        return self.gemm.vector


#: per architecture, its levels best first: a copy works at the first level whose feature
#: it has. 32 registers hold AVX-512's and NEON's 12-row tiles; AVX2's 16 hold 6 rows.
SIMD_LEVELS: dict[str, tuple[SimdLevel, ...]] = {
    "x86": (SimdLevel("avx512f", 32, Isa(vector=16, mr=12, nv=2)),
            SimdLevel("avx2", 16, Isa(vector=8, mr=6, nv=2)),
            SimdLevel("avx", 16, Isa(vector=8, mr=6, nv=2)),
            SimdLevel(None, 16, Isa(vector=4, mr=4, nv=2))),
    "aarch64": (SimdLevel(None, 32, Isa(vector=4, mr=12, nv=2)),),
    # other architectures: LLVM's generic vectors
    "other": (SimdLevel(None, 16, Isa(vector=4, mr=4, nv=2)),),
}


@dataclass(frozen=True)
class KernelTarget:
    triple: str
    #: the LLVM features this copy is compiled with, as given ("+avx2,+fma,-amx-tile")
    features: str = ""
    #: tests on CPUs without AMX: the bf16 kernel's tile operations call functions with the
    #: same meaning (tests/harness/amx_emulation.c) instead of LLVM's intrinsics
    emulate_amx: bool = False

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(f for f in self.features.split(",") if f)

    @property
    def is_x86(self) -> bool:
        return self.triple.startswith(("x86_64", "i686", "i386"))

    @property
    def is_aarch64(self) -> bool:
        return self.triple.startswith(("aarch64", "arm64"))

    @property
    def arch(self) -> str:
        """The key of `SIMD_LEVELS`: "x86", "aarch64" or "other"."""
        return "x86" if self.is_x86 else "aarch64" if self.is_aarch64 else "other"

    def has(self, feature: str) -> bool:
        """Whether the copy may use `feature` ("avx512f") without asking the CPU."""
        return f"+{feature}" in self.flags

    def excludes(self, feature: str) -> bool:
        """Whether the CPU variant says its CPUs lack `feature`."""
        return f"-{feature}" in self.flags

    @cached_property
    def simd(self) -> SimdLevel:
        """The SIMD level of this copy (`SIMD_LEVELS`)."""
        return next(level for level in SIMD_LEVELS[self.arch]
                    if level.feature is None or self.has(level.feature))

    @property
    def isa(self) -> Isa:
        """The float32 GEMM tile."""
        return self.simd.gemm

    @property
    def vector_registers(self) -> int:
        """SIMD registers of the copy: 32 with NEON and AVX-512, 16 with AVX2 and SSE."""
        return self.simd.registers


__all__ = ["SIMD_LEVELS", "Isa", "KernelTarget", "SimdLevel"]
