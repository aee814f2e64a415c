"""One model from ONNX to a linked library: frontend, passes, codegen, toolchain.

`compile_model` writes `<workdir>/_<name><suffix>` and returns it with the model's
signature (what the generated package and the C header describe); `compile_in_process`
does the same in a temporary directory and loads the result for calling.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cuvil.compiler.codegen.dispatch import render_dispatcher
from cuvil.compiler.codegen.module import build_module, symbol_names
from cuvil.compiler.frontend import import_model
from cuvil.compiler.frontend.calibration import CalibrationSource
from cuvil.compiler.frontend.quantize import QuantizeSettings, quantize_model
from cuvil.compiler.ir import MAX_TENSOR_BYTES, Graph, Node, Value, dim_str
from cuvil.compiler.kernels.objects import KernelSet
from cuvil.compiler.llvm_jobs import KernelCache, ObjectJobs, parallel_jobs
from cuvil.compiler.ops.flops import node_flops
from cuvil.compiler.ops.native import NativeKernel, native_ops, uses_native
from cuvil.compiler.passes import run_passes
from cuvil.compiler.passes.ir_text import node_label
from cuvil.compiler.passes.plan_memory import plan_memory
from cuvil.compiler.symbolic import relational_to_python, to_python
from cuvil.config import CompileOptions
from cuvil.errors import ConfigError, ModelError
from cuvil.runtime import CLOCK_SOURCE, THREADPOOL_SOURCE, Model, abi_checksum, exported_symbol

if TYPE_CHECKING:
    from cuvil.toolchains import Target

Log = Callable[[str], None]

#: the C runtime linked into every library (thread pool behind `Emitter.parallel_loop`)
RUNTIME_SOURCE = THREADPOOL_SOURCE

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class CompiledModel:
    name: str
    library: Path
    signature: dict[str, Any]


def signature_of(graph: Graph, name: str, library_file: str) -> dict[str, Any]:
    """What the package, the header and `cuvil check` know of the model (JSON-ready)."""
    sig: dict[str, Any] = {
        "name": name,
        "library": library_file,
        "symbols": [s.name for s in graph.symbols],
        "inputs": [{"name": v.name, "dtype": v.type.dtype.name,
                    "shape": [dim_str(d) for d in v.type.shape]} for v in graph.inputs],
        "outputs": [{"name": v.name, "dtype": v.type.dtype.name,
                     "shape": [dim_str(d) for d in v.type.shape],
                     "shape_expr": [to_python(d) for d in v.type.shape]} for v in graph.outputs],
        "constraints": [[relational_to_python(c.condition), c.message]
                        for c in graph.constraints],
        # by node index, for the runtime's error messages (see codegen.module: run's status)
        "nodes": [n.describe() for n in graph.nodes],
        # by node index, for the profiler (see cuvil.runtime's Profile)
        "node_profile": [_node_profile(n) for n in graph.nodes],
    }
    data_dims = graph.data_dims
    if data_dims:  # only then: the signatures (and checksums) of other models stay as they were
        # the dims the data decides, in their dim-array slots after the input dims, with the
        # bound each output buffer is sized by
        sig["data_dims"] = [{"name": d.symbol.name, "bound": dim_str(d.bound),
                             "bound_expr": to_python(graph.upper_bound(d.bound)), "node": d.node}
                            for d in data_dims]
        for t, v in zip(sig["outputs"], graph.outputs):
            bounded = [graph.upper_bound(d) for d in v.type.shape]
            t["max_shape"] = [dim_str(d) for d in bounded]
            t["max_shape_expr"] = [to_python(d) for d in bounded]
    if graph.metadata:  # a graph imported from ONNX (not one built in a test)
        sig["metadata"] = graph.metadata
        _add_onnx_shapes(graph, sig)
    return sig


def _add_onnx_shapes(graph: Graph, sig: dict[str, Any]) -> None:
    """Each input's and output's `onnx_shape`: its dims as onnxruntime reports them for the
    source model, which the package's onnxruntime-style session reports too. A size stays a
    size; otherwise the name the file declares for the dim, or the name of the input dim
    it equals; None for a dim nothing names (an unnamed input dim, one the data decides, a
    sum of dims)."""
    named: dict[str, str] = {}  # cuvil's symbol -> the file's name for that dim

    def onnx_shape(t: dict[str, Any], inputs: bool) -> list[int | str | None]:
        declared = graph.declared_shapes.get(t["name"])
        if declared is None or len(declared) != len(t["shape"]):
            declared = (None,) * len(t["shape"])
        dims: list[int | str | None] = []
        for dim, name in zip(t["shape"], declared):
            if isinstance(name, str) and inputs and isinstance(dim, str):
                named.setdefault(dim, name)
            dims.append(dim if isinstance(dim, int) else name if isinstance(name, str)
                        else named.get(dim))
        return dims

    for t in sig["inputs"]:
        t["onnx_shape"] = onnx_shape(t, inputs=True)
    for t in sig["outputs"]:
        t["onnx_shape"] = onnx_shape(t, inputs=False)


def _node_profile(node: Node) -> dict[str, Any]:
    """The node's name, what it runs (its path and fused steps: "Conv(winograd)+Add+Relu"), the
    shapes that tell nodes of one type apart and its FLOPs per call."""
    first = next((v for v in node.inputs if v is not None), None)

    def shape(v: Value) -> str:
        return "x".join(str(dim_str(d)) for d in v.type.shape) or "scalar"

    # the data input and the weights (constants of rank 2 or more: a conv's kernel size)
    ins = [v for v in node.inputs if v is not None and (v is first or (v.is_const and v.type.rank > 1))]
    outs = ", ".join(shape(v) for v in node.outputs)
    return {"name": node.name or (node.outputs[0].name if node.outputs else "?"),
            "op": node_label(node),
            "shapes": f"{', '.join(shape(v) for v in ins)} -> {outs}" if ins else outs,
            "flops": to_python(node_flops(node))}


def compile_model(
    source: Any,
    name: str,
    workdir: Path,
    options: CompileOptions | None = None,
    *,
    target: str | Target | None = None,
    log: Log | None = None,
    library_file: str | None = None,
    custom_ops: Sequence[NativeKernel] = (),
    native_objects: Callable[[], Mapping[str, Sequence[Path]]] | None = None,
    native_libs: Sequence[str] = (),
    kernel_cache: KernelCache | None = None,
) -> CompiledModel:
    """The model compiled as `options` say (config.CompileOptions; None: the defaults).
    With quantize = "int8" it first becomes a QDQ model calibrated on `options.calibration` (an
    .npz file, a "module:function" entry point or feed dicts; see frontend.quantize).
    `custom_ops` are the native kernels nodes may be matched to; `native_objects` gives, when
    first asked, their compiled files per arch name, linked into the library with the
    libraries `native_libs` ("c++" for C++ kernels). `kernel_cache` keeps kernel object code
    between processes (llvm_jobs.py)."""
    from cuvil.toolchains import get_target

    say = log or (lambda _msg: None)
    if not _NAME.match(name):
        raise ConfigError(f"model name {name!r} must be an identifier (it names C symbols)")
    options = options or CompileOptions()
    options.check(name)
    inputs = options.inputs or None
    if options.quantize == "int8":
        # an entry point's module may lie in the current folder, as for `python -m`
        settings = QuantizeSettings(options.calibration, options.calibration_method,
                                    tuple(options.keep_float), search_path=(Path.cwd(),))
        source = quantize_model(source, settings, inputs, say)
    # a Target object: one the build backend adjusted (e.g. to MACOSX_DEPLOYMENT_TARGET)
    tgt = target if not isinstance(target, (str, type(None))) else get_target(target)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    say(f"cuvil: importing {source if isinstance(source, (str, Path)) else 'model'} as {name}")
    with native_ops(custom_ops):
        return _compile(source, name, workdir, tgt, options, log=log, library_file=library_file,
                        native_objects=native_objects, native_libs=native_libs,
                        kernel_cache=kernel_cache, start=start)


def _compile(source: Any, name: str, workdir: Path, tgt: Target, options: CompileOptions, *,
             log: Log | None, library_file: str | None,
             native_objects: Callable[[], Mapping[str, Sequence[Path]]] | None,
             native_libs: Sequence[str], kernel_cache: KernelCache | None,
             start: float) -> CompiledModel:
    from cuvil.toolchains import zig

    say = log or (lambda _msg: None)
    graph = import_model(source, options.inputs or None, name)
    graph.precision = options.precision
    graph.transformed_weights = options.transformed_weights
    graph = run_passes(graph)
    plan = plan_memory(graph)
    # the file name is also the library's SONAME / install name (`cuvil compile -o` picks it)
    library_file = library_file or f"_{name}{tgt.library_suffix}"
    if "/" in library_file or "\\" in library_file:
        raise ConfigError(f"library file name {library_file!r} must be a bare file name")
    if isinstance(plan.workspace_size, int) and plan.workspace_size > MAX_TENSOR_BYTES:
        raise ModelError(f"model {name}: its intermediate tensors need {plan.workspace_size} bytes "
                         f"at once, more than any address space holds ({MAX_TENSOR_BYTES}); "
                         "fix the model's dims")
    sig = signature_of(graph, name, library_file)
    sig["workspace"] = to_python(plan.workspace_size)
    sig["checksum"] = abi_checksum(sig)
    say(f"cuvil: {name}: {len(graph.nodes)} nodes, {len(plan.weights)} bytes of weights, "
        f"workspace {plan.workspace_size} bytes (imported, optimized and planned in "
        f"{time.perf_counter() - start:.2f} s)")

    blob = workdir / f"{name}.weights.bin"
    blob.write_bytes(bytes(plan.weights))
    objects: dict[str, list[Path]] = {}
    jobs = ObjectJobs(kernel_cache)
    llvm_start = time.perf_counter()
    for arch in tgt.arches:
        objs = _compile_arch(graph, plan, sig, arch, workdir, jobs, cpu=options.cpu,
                             opt_level=options.opt_level, log=log)
        weights_obj = workdir / f"{name}.{arch.name}.weights.o"
        zig.embed_blob(blob, symbol_names(name)["weights"], weights_obj, arch, tgt.object_format,
                       log=log)
        runtime_objs = [_runtime_object(source, workdir / f"{source.stem}.{arch.name}.o", arch, log)
                        for source in (RUNTIME_SOURCE, CLOCK_SOURCE)]
        objects[arch.name] = [*objs, weights_obj, *runtime_objs]
    for arch_name, llvm_objects in jobs.wait().items():
        objects[arch_name][:0] = llvm_objects
    reused = [f"{n} kernels {where}" for n, where in ((jobs.cached, "from the kernel cache"),
                                                      (jobs.reused, "compiled earlier")) if n]
    say(f"cuvil: {name}: LLVM -O{options.opt_level} compiled {jobs.compiled} modules"
        f"{' (' + ', '.join(reused) + ')' if reused else ''} in "
        f"{time.perf_counter() - llvm_start:.2f} s, {parallel_jobs()} at a time")
    libs: tuple[str, ...] = ("m", "pthread")
    if native_objects is not None and uses_native(graph):
        natives = native_objects()
        for arch in tgt.arches:
            objects[arch.name] += natives[arch.name]
        libs += tuple(native_libs)
    extra: list[str] = []
    if "c++" in libs and tgt.object_format == "elf":
        # libc++abi's operator new/delete have default visibility (programs may replace them):
        # keep the library's exports to its C ABI all the same
        exports = workdir / f"{name}.exports.map"
        exports.write_text(f"{{ global: {exported_symbol(name, '*')}; local: *; }};\n")
        extra.append(f"-Wl,--version-script,{exports}")
    library = zig.link_library(tgt, objects, workdir / library_file, libs=libs, extra_args=extra,
                               strip=True, log=log)  # no debug info (zig's runtime carries ~1 MB)
    say(f"cuvil: {name}: built {library.name} in {time.perf_counter() - start:.1f} s")
    return CompiledModel(name, library, sig)


def baseline_features(arch: Any, cpu: str | None) -> tuple[str, tuple[str, ...]]:
    """The LLVM features the baseline copy's kernels are given, and the CPU flags it needs.
    Kernels size their tiles from the features, so what the cpu implies is spelled out
    (-C cpu=x86-64-v3 has AVX2, apple-m1 the dot product)."""
    from cuvil.toolchains import host_cpu, zig

    flags = zig.cpu_flags(replace(arch, cpu=cpu or arch.cpu))
    given = host_cpu()[1] if cpu == "native" else arch.features
    return ",".join(filter(None, [given, *(f"+{flag}" for flag in flags)])), flags


def _compile_arch(graph: Graph, plan: Any, sig: dict[str, Any], arch: Any, workdir: Path,
                  jobs: ObjectJobs, *, cpu: str | None, opt_level: int,
                  log: Log | None) -> list[Path]:
    """Start the LLVM jobs of the model's code for one arch (`jobs`, grouped by arch name):
    one copy for a named cpu, else the baseline plus each CPU variant of the toolchain file.
    Return the CPU check, with a dispatcher that runs the best copy the CPU supports,
    compiled for the plain arch."""
    from cuvil.toolchains import machine_options, target_machine, zig

    say = log or (lambda _msg: None)
    name = sig["name"]
    base_features, base_flags = baseline_features(arch, cpu)
    levels = [(cpu or arch.cpu, base_features, base_flags),
              *([] if cpu is not None else [(v.cpu, v.features, v.requires) for v in arch.variants])]
    # what the loader's and the header's CPU messages name, per slice of a universal2 library
    sig.setdefault("cpu", {})[arch.name] = {"baseline": cpu or arch.cpu,
                                            "requires": list(levels[0][2])}
    for index, (level_cpu, features, _) in enumerate(levels):
        # the baseline takes the toolchain's features (or the host's, for "native")
        machine = machine_options(arch, cpu=level_cpu, features=features if index else None,
                                  opt_level=opt_level)
        data_layout = str(target_machine(arch, cpu=level_cpu, features=features if index else None,
                                         opt_level=opt_level).target_data)
        kernels = KernelSet(kernel_tag(arch.llvm_triple, data_layout, features, machine))
        module = build_module(graph, plan, name, sig["checksum"], arch.llvm_triple, data_layout,
                              features=features, variant=index, kernels=kernels)
        jobs.model(arch.name, workdir / f"{name}.{arch.name}.{index}.o", module, machine)
        for request in kernels.requests.values():
            jobs.kernel(arch.name, workdir / f"{request.symbol}.o", request, arch.llvm_triple,
                        data_layout, features, machine)
        say(f"cuvil: {name}: generated code for {arch.llvm_triple} (cpu {level_cpu}), "
            f"calling {len(kernels.requests)} kernels")
    source = workdir / f"{name}.cpu_check.c"
    source.write_text(render_dispatcher(name, [requires for _, _, requires in levels], arch.is_x86))
    return [zig.compile_c(source, workdir / f"{name}.{arch.name}.cpu_check.o", arch.plain,
                          log=log)]


def kernel_tag(triple: str, data_layout: str, features: str, machine: Mapping[str, Any]) -> str:
    """What kernel symbols carry: a digest of everything their object code depends on beside
    their name (kernels/objects.py)."""
    text = repr((triple, data_layout, features, sorted(machine.items())))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


#: object code of the runtime's C files (thread pool, clock): (source text, arch) -> bytes.
#: The same for every model of an arch, so a process compiles each once (a zig run is
#: ~70 ms, a third of a small model's build).
_runtime_objects: dict[tuple[bytes, str], bytes] = {}


def _runtime_object(source: Path, output: Path, arch: Any, log: Log | None) -> Path:
    from cuvil.toolchains import zig

    key = (source.read_bytes(), repr(arch))
    code = _runtime_objects.get(key)
    if code is None:
        code = _runtime_objects[key] = zig.compile_c(source, output, arch, log=log).read_bytes()
    else:
        output.write_bytes(code)
    return output


def compile_in_process(
    model: Any,
    inputs: Mapping[str, Sequence[int | str]] | None = None,
    target: str | None = None,
    quantize: str | None = None,
    name: str | None = None,
    cpu: str | None = "native",
    calibration: CalibrationSource | None = None,
    calibration_method: str = "minmax",
    keep_float: Sequence[str] = (),
    precision: str = "float32",
    transformed_weights: str = "library",
) -> Model:
    from cuvil.toolchains import get_target

    tgt = get_target(target)
    if not tgt.is_host():
        raise ConfigError(
            f"cuvil.compile(target={target!r}): a {tgt.name} library cannot be loaded on this "
            "machine; use `cuvil compile --target` to write it to a file instead"
        )
    if name is None:
        stem = Path(model).stem if isinstance(model, (str, Path)) else (model.graph.name or "model")
        name = re.sub(r"\W", "_", stem) or "model"
        if name[0].isdigit():
            name = "m_" + name
    tmp = tempfile.TemporaryDirectory(prefix="cuvil-")
    try:
        options = CompileOptions(
            inputs={k: tuple(v) for k, v in (inputs or {}).items()}, cpu=cpu,
            quantize=quantize or "none", calibration=calibration,
            calibration_method=calibration_method, keep_float=tuple(keep_float),
            precision=precision, transformed_weights=transformed_weights)
        compiled = compile_model(model, name, Path(tmp.name), options, target=target)
    except BaseException:
        tmp.cleanup()
        raise
    return Model(compiled.library, compiled.signature, keep_alive=tmp)


__all__ = ["CompiledModel", "ModelError", "compile_in_process", "compile_model", "signature_of"]
