"""Targets, toolchain files, the zig driver and CMake toolchain files.

A target (x86_64-linux, universal2-macos, ...) is declared by a TOML toolchain file in
`toolchain-files/` (or a directory on $CUVIL_TOOLCHAIN_PATH). `cuvil.toolchains.llvm` turns
LLVM IR into object code for it (in a worker process), `cuvil.toolchains.zig` compiles, embeds
and links for it; `cuvil.toolchains.cmake` lets CMake builds use the same compiler.
"""

from __future__ import annotations

from cuvil.toolchains._targets import (
    AARCH64_CPU_FLAGS,
    ENV_VAR,
    X86_CPU_FLAGS,
    Arch,
    Target,
    Variant,
    bundled_toolchain_dir,
    cpu_flag_table,
    get_target,
    host_cpu,
    host_target_name,
    list_targets,
    load_toolchain_file,
    machine_options,
    target_machine,
    toolchain_search_path,
)

__all__ = [
    "AARCH64_CPU_FLAGS",
    "ENV_VAR",
    "X86_CPU_FLAGS",
    "Arch",
    "Target",
    "Variant",
    "bundled_toolchain_dir",
    "cpu_flag_table",
    "get_target",
    "host_cpu",
    "host_target_name",
    "list_targets",
    "load_toolchain_file",
    "machine_options",
    "target_machine",
    "toolchain_search_path",
]
