"""KernelTarget: what a module's kernels read of its CPU, given once with `set_target`."""

from __future__ import annotations

import pytest
from llvmlite import ir

from cuvil.compiler.kernels.gemm import isa_of
from cuvil.compiler.kernels.target import KernelTarget, set_target, target_of

X86 = "x86_64-unknown-linux-gnu"


def module_for(triple: str, features: str | None) -> ir.Module:
    module = ir.Module()
    module.triple = triple
    if features is not None:
        set_target(module, KernelTarget(triple, features))
    return module


@pytest.mark.parametrize(("triple", "features", "registers", "lanes"), [
    (X86, None, 16, 4),  # nothing given: the triple's baseline
    (X86, "+sse4.2", 16, 4),
    (X86, "+avx,+avx2,+fma,-amx-tile", 16, 8),
    (X86, "+avx2,+avx512f,+avx512bw", 32, 16),
    ("aarch64-unknown-linux-gnu", "+neon", 32, 4),
])
def test_the_target_is_what_the_module_was_given(triple: str, features: str | None,
                                                 registers: int, lanes: int) -> None:
    target = target_of(module_for(triple, features))
    assert target == KernelTarget(triple, features or "")
    assert target.vector_registers == registers
    assert isa_of(module_for(triple, features)).vector == lanes  # the float kernel's tiles


def test_has_and_excludes_read_the_sign_of_a_feature() -> None:
    target = KernelTarget(X86, "+avx2,-amx-tile,+fma")
    assert target.has("avx2") and target.has("fma") and not target.has("amx-tile")
    assert target.excludes("amx-tile") and not target.excludes("avx2")
    assert not target.has("avx") and not target.excludes("avx512f")  # neither: ask the CPU
    assert target.is_x86 and not target.is_aarch64
