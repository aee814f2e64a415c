"""The C header shipped next to each model library."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cuvil.runtime import exported_symbol

_C_TYPES = {
    "float32": "float", "float64": "double", "float16": "uint16_t /* IEEE half */",
    "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "bool": "uint8_t /* 0 or 1 */",
}


def _thread_lines(name: str) -> list[str]:
    return [
        "/* Threads. Each library starts its own pool (CUVIL_NUM_THREADS threads, else one per",
        " * CPU; idle workers exit after a second). A program loading several cuvil libraries",
        " * shares one pool: pass cuvil_<first>_thread_pool() to every other library's",
        " * use_thread_pool(), which returns 0, or -1 for a pool of an incompatible version",
        " * (the library then keeps its own); NULL goes back to its own. The first library",
        " * must stay loaded while the others use its pool. */",
        "struct cuvil_pool;",
        f"const struct cuvil_pool *{exported_symbol(name, 'thread_pool')}(void);",
        f"int32_t {exported_symbol(name, 'use_thread_pool')}(const struct cuvil_pool *pool);",
        "",
        "/* at most `threads` threads (the caller's included) run the calling thread's later",
        " * calls of this library's run(); 0: as many as the pool has */",
        f"void {exported_symbol(name, 'set_thread_limit')}(int32_t threads);",
    ]


def _cpu_lines(name: str, cpus: Mapping[str, Any]) -> list[str]:
    needs = [f" *   {arch}: cpu {c['baseline']}, needing "
             f"{', '.join(c['requires']) or 'nothing beyond the architecture'}"
             for arch, c in cpus.items()]
    return [
        "/* CPU. The library's lowest copy of the model code is built for",
        *needs,
        " * Call cpu_check() first (it runs on any CPU of the architecture): it returns the copy",
        " * run() uses (0: the baseline, 1...: the toolchain's faster variants), or -1 when the",
        " * CPU lacks a needed flag, and writes the missing flags' names, space-separated and",
        " * NUL-terminated, into missing[0 .. size) (\"\" when none; missing may be NULL). */",
        f"#define CUVIL_{name.upper()}_CPU_UNSUPPORTED (-1)",
        f"int32_t {exported_symbol(name, 'cpu_check')}(char *missing, int64_t size);",
    ]


def render_header(signature: Mapping[str, Any], library_file: str) -> str:
    name = signature["name"]
    guard = f"CUVIL_{name.upper()}_H"
    symbols = signature["symbols"]
    nodes = signature.get("nodes", ())

    data_dims = signature.get("data_dims", ())

    def tensor_lines(kind: str, tensors: list[dict[str, Any]]) -> list[str]:
        lines = []
        for i, t in enumerate(tensors):
            dims = " x ".join(str(d) for d in t["shape"]) or "scalar"
            line = f" *   {kind}[{i}]  {t['name']}: {_C_TYPES[t['dtype']]}, {dims}"
            if t.get("max_shape", t["shape"]) != t["shape"]:
                line += f" (buffer for {' x '.join(str(d) for d in t['max_shape'])})"
            lines.append(line)
        return lines

    dims_doc = (", ".join(f"dims[{i}] = {s}" for i, s in enumerate(symbols))
                if symbols or data_dims else "unused (the model has no symbolic dims); pass NULL")
    data_doc = [
        " * Data-dependent dims: run() writes them into dims[] after the input dims, so dims",
        (f" * holds CUVIL_{name.upper()}_NUM_DIMS + CUVIL_{name.upper()}_NUM_DATA_DIMS values "
         "(the caller sets the first ones):"),
        *(f" *   dims[{len(symbols) + j}] = {d['name']}: at most {d['bound']}, decided by "
          f"{d['node']}" for j, d in enumerate(data_dims)),
        " * The caller sizes each output buffer by its dims' bounds (\"buffer for\"); run()",
        " * writes the output densely, row-major in its actual shape, from the buffer's start.",
    ] if data_dims else []
    dims_type = "int64_t" if data_dims else "const int64_t"  # run() writes data-dependent dims
    doc = [
        "/*",
        f" * Model {name!r}, compiled by cuvil into {library_file}.",
        " *",
        " * Tensors are dense, row-major (C order) buffers owned by the caller:",
        *tensor_lines("inputs", signature["inputs"]),
        *tensor_lines("outputs", signature["outputs"]),
        f" * Symbolic dims: {dims_doc}.",
        *data_doc,
        " *",
        " * Call cuvil_" + name + "_workspace_size(dims) for the scratch buffer's size in bytes,",
        " * allocate it 64-byte aligned, then cuvil_" + name + "_run(). The function keeps no",
        " * state between calls (but weights it may derive from the model's on the first call,",
        " * once per process, which makes that call slower): threads may run it at once, each",
        " * with its own workspace.",
        f" * ABI checksum: {signature['checksum']}",
        " */",
    ]
    return "\n".join([
        *doc,
        f"#ifndef {guard}",
        f"#define {guard}",
        "",
        "#include <stdint.h>",
        "",
        "#ifdef __cplusplus",
        'extern "C" {',
        "#endif",
        "",
        f"#define CUVIL_{name.upper()}_ABI_CHECKSUM \"{signature['checksum']}\"",
        f"#define CUVIL_{name.upper()}_NUM_INPUTS {len(signature['inputs'])}",
        f"#define CUVIL_{name.upper()}_NUM_OUTPUTS {len(signature['outputs'])}",
        f"#define CUVIL_{name.upper()}_NUM_DIMS {len(symbols)}",
        *([f"#define CUVIL_{name.upper()}_NUM_DATA_DIMS {len(data_dims)}"] if data_dims else []),
        "",
        "/* hex sha256 of the model's signature, NUL-terminated; compare with the macro above */",
        f"extern const char {exported_symbol(name, 'abi_checksum')}[65];",
        "",
        *_cpu_lines(name, signature.get("cpu", {})),
        "",
        "/* bytes of scratch memory one call needs, for the given symbolic dims */",
        f"int64_t {exported_symbol(name, 'workspace_size')}(const int64_t *dims);",
        "",
        f"/* run the model; returns 0 on success, CUVIL_{name.upper()}_CPU_UNSUPPORTED (running",
        " * nothing) on a CPU that lacks what cpu_check() names, else (node index << 8) | code */",
        f"int32_t {exported_symbol(name, 'run')}(const void *const *inputs, void *const *outputs,",
        f"{' ' * (len(name) + 20)}{dims_type} *dims, void *workspace);",
        "",
        "/* run() that also stores a monotonic clock in nanoseconds: timestamps_ns[0] before the",
        f"   first node, [i + 1] after node i, [{len(nodes) + 1}] at the end (nodes: see _models.json) */",
        f"int32_t {exported_symbol(name, 'run_profiled')}(const void *const *inputs, void *const *outputs,",
        f"{' ' * (len(name) + 29)}{dims_type} *dims, void *workspace,",
        f"{' ' * (len(name) + 29)}uint64_t timestamps_ns[{len(nodes) + 2}]);",
        *_thread_lines(name),
        "",
        "#ifdef __cplusplus",
        "}",
        "#endif",
        "",
        f"#endif /* {guard} */",
        "",
    ])
