"""KernelTarget: what kernels read of the CPU a copy is for, handed to them explicitly (an
Emitter's `target`), and the SIMD levels it maps features to (`SIMD_LEVELS`)."""

from __future__ import annotations

import pytest

from cuvil.compiler.kernels.target import SIMD_LEVELS, KernelTarget

X86 = "x86_64-unknown-linux-gnu"


@pytest.mark.parametrize(("triple", "features", "registers", "lanes", "rows"), [
    (X86, "", 16, 4, 4),  # no features: the triple's baseline
    (X86, "+sse4.2", 16, 4, 4),
    (X86, "+avx", 16, 8, 6),
    (X86, "+avx,+avx2,+fma,-amx-tile", 16, 8, 6),
    (X86, "+avx2,+avx512f,+avx512bw", 32, 16, 12),
    (X86, "+avx2,-avx512f", 16, 8, 6),  # ruled out is not had
    ("aarch64-unknown-linux-gnu", "+neon", 32, 4, 12),
    ("riscv64-unknown-linux-gnu", "+v", 16, 4, 4),
])
def test_the_simd_level_follows_the_features(triple: str, features: str, registers: int,
                                             lanes: int, rows: int) -> None:
    target = KernelTarget(triple, features)
    assert target.vector_registers == registers
    assert target.isa.vector == target.simd.vector == lanes  # the float kernel's tiles
    assert target.isa.mr == rows


def test_every_architecture_has_a_level_for_any_copy() -> None:
    for arch, levels in SIMD_LEVELS.items():
        assert levels[-1].feature is None, arch  # the last level needs nothing
        # every tile fits the level's registers: MR x NV accumulators, and B's NV vectors
        for level in levels:
            assert level.gemm.mr * level.gemm.nv + level.gemm.nv <= level.registers, level


def test_has_and_excludes_read_the_sign_of_a_feature() -> None:
    target = KernelTarget(X86, "+avx2,-amx-tile,+fma")
    assert target.has("avx2") and target.has("fma") and not target.has("amx-tile")
    assert target.excludes("amx-tile") and not target.excludes("avx2")
    assert not target.has("avx") and not target.excludes("avx512f")  # neither: ask the CPU
    assert target.is_x86 and not target.is_aarch64
