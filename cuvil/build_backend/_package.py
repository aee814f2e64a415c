"""Generate the files of a model package: libraries, Python wrapper, header, stubs.

Layout inside the wheel, for package `digits` with model `classifier`:

    digits/__init__.py          loads every model; `digits.classifier(x)`
    digits/__init__.pyi, py.typed
    digits/_cuvil_runtime.py    the ctypes/numpy caller (a copy of cuvil/runtime/_loader.py)
    digits/_cuvil_session.py    `classifier.session()`, as onnxruntime's (cuvil/runtime's copy)
    digits/_models.json         signatures: names, dtypes, shapes, ABI checksums
    digits/_classifier.so       the compiled model (C ABI)
    digits/classifier.h         its C header

In a mixed project whose Python package has its own `__init__.py`, the models load in
`digits/_cuvil_models.py` (with `_cuvil_models.pyi`) instead, and the user's files are not
among the files generated here (the backend adds them; see `_python.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import keyword
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import cuvil
from cuvil.build_backend import SUMMARY_PREFIX
from cuvil.build_backend._custom_ops import load_op_modules, native_kernels
from cuvil.build_backend._python import (
    MODELS_MODULE,
    RUNTIME_MODULE,
    SESSION_MODULE,
    check_no_clash,
    models_module,
    python_files,
)
from cuvil.build_backend.cache import CompileCache, model_key, open_cache
from cuvil.compiler.codegen.header import render_header
from cuvil.config import ModelConfig, ProjectConfig
from cuvil.runtime import ABI_VERSION, LOADER_SOURCE, SESSION_SOURCE, Manifest
from cuvil.toolchains import Target


def build_package_files(
    project: ProjectConfig, workdir: Path, log: Callable[[str], None], target: Target
) -> dict[str, bytes]:
    """Compile every model of `project` for `target`; return the generated
    files as wheel paths -> bytes (the project's own Python files are not among them)."""
    settings = project.settings
    pkg = project.package
    user_files = python_files(project)
    loader = models_module(pkg, user_files).replace(".", "/")
    generated = [f"{pkg}/{n}" for n in (RUNTIME_MODULE + ".py", SESSION_MODULE + ".py",
                                        "_models.json")]
    generated += [f"{loader}.py", f"{loader}.pyi" if loader != pkg else f"{pkg}/__init__.pyi"]
    for model in project.models:
        generated += [f"{pkg}/_{model.name}{target.library_suffix}", f"{pkg}/{model.name}.h"]
    check_no_clash(project, user_files, generated)  # before compiling: it fails fast
    if project.op_modules:  # their registrations must exist before the models are imported
        load_op_modules(project)
    files: dict[str, bytes] = {}
    signatures = []
    cache = open_cache(settings)
    natives = _natives(project, target, Path(workdir) / "custom-ops", log)
    summaries = []
    for number, model in enumerate(project.models, 1):
        log(f"cuvil: model {number} of {len(project.models)}: {model.name}")
        start = time.perf_counter()
        library, sig, cached = _compile(project, model, target, Path(workdir) / model.name, log,
                                        cache, natives)
        summaries.append(model_summary(sig, len(library),
                                       "from the compile cache" if cached else
                                       f"compiled in {time.perf_counter() - start:.1f} s"))
        signatures.append(sig)
        files[f"{pkg}/{sig['library']}"] = library
        files[f"{pkg}/{model.name}.h"] = render_header(sig, sig["library"]).encode()
    for line in summaries:
        log(line)
    manifest = {
        "abi_version": ABI_VERSION,
        "package": pkg,
        "target": target.name,
        "cuvil_version": cuvil.__version__,
        "models": signatures,
    }
    # read back as the package's loader and `cuvil check` will (a ManifestError is a cuvil bug)
    for i, signature in enumerate(Manifest.from_json(manifest).models):
        signature.check_expressions(f"models[{i}]")
    files[f"{pkg}/_models.json"] = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    files[f"{pkg}/{RUNTIME_MODULE}.py"] = LOADER_SOURCE.read_bytes()
    files[f"{pkg}/{SESSION_MODULE}.py"] = SESSION_SOURCE.read_bytes()
    if loader == pkg:
        files[f"{pkg}/__init__.py"] = render_init(pkg, signatures, target.name).encode()
        files[f"{pkg}/__init__.pyi"] = render_stub(signatures).encode()
    else:
        files[f"{loader}.py"] = render_init(pkg, signatures, target.name, submodule=True).encode()
        files[f"{loader}.pyi"] = render_stub(signatures).encode()
    if f"{pkg}/py.typed" not in user_files:
        files[f"{pkg}/py.typed"] = b""
    return files


def model_summary(signature: Mapping[str, Any], library_size: int, how: str) -> str:
    """One line: the model's nodes by op (the commonest first), its library's size and how it
    was made ("compiled in 3.2 s")."""
    ops = Counter(profile["op"].split("(")[0].split("+")[0]
                  for profile in signature["node_profile"])
    shown = ", ".join(f"{count} {op}" for op, count in ops.most_common(4))
    more = f" and {len(ops) - 4} more ops" if len(ops) > 4 else ""
    return (f"{SUMMARY_PREFIX}{signature['name']}: {len(signature['node_profile'])} nodes "
            f"({shown}{more}), {signature['library']} {library_size / 1024:.0f} KiB, {how}")


def _natives(project: ProjectConfig, target: Target, workdir: Path,
             log: Callable[[str], None]) -> Callable[[], Mapping[str, Sequence[Path]]]:
    """The project's custom-op kernels compiled for `target`: built when a model first needs
    them (never when every model comes from the compile cache), once per build."""

    @functools.cache
    def build() -> Mapping[str, Sequence[Path]]:
        from cuvil.toolchains.custom_ops import build_custom_ops

        return build_custom_ops(project.custom_ops, target, workdir, [project.root], log)

    return build


def _compile(project: ProjectConfig, model: ModelConfig, target: Target, workdir: Path,
             log: Callable[[str], None], cache: CompileCache | None,
             natives: Callable[[], Mapping[str, Sequence[Path]]]
             ) -> tuple[bytes, dict[str, Any], bool]:
    """The model's library and signature, and whether they came from the compile cache (else
    they are compiled, and stored)."""

    options = project.compile_options(model)
    feeds_digest = None
    if options.quantize == "int8" and isinstance(options.calibration, str):
        # an entry point: its feeds are what the build depends on, so they are read once, here,
        # and both hashed into the cache key and handed to the compiler
        feeds, feeds_digest = _entry_point_feeds(project, model)
        options = dataclasses.replace(options, calibration=feeds)
    key = ""
    if cache is not None:
        key = model_key(project, model, target, feeds_digest=feeds_digest)
        hit = cache.load(key, log)
        if hit is not None:
            log(f"cuvil: {model.name}: {hit[1]['library']} taken from the compile cache "
                f"(entry {key[:16]} in {cache.folder})")
            return (*hit, True)
    # only now: a hit needs neither the compiler nor onnx (a second of imports)
    from cuvil.compiler.driver import compile_model
    from cuvil.toolchains.custom_ops import link_libraries

    compiled = compile_model(
        model.source, model.name, workdir, options,
        target=target, log=log, custom_ops=native_kernels(project) if project.custom_ops else (),
        native_objects=natives if project.custom_ops else None,
        native_libs=link_libraries(project.custom_ops),
        kernel_cache=cache.kernels(log) if cache is not None else None,
    )
    library = compiled.library.read_bytes()
    if cache is not None:
        cache.store(key, library, compiled.signature, log)
    return library, compiled.signature, False


def _entry_point_feeds(project: ProjectConfig, model: ModelConfig) -> tuple[list[Any], str]:
    """The feeds of the model's calibration entry point (imported from the project root and
    the Python package's folder first), checked against the model, and their digest."""
    from cuvil.compiler.frontend import load_onnx
    from cuvil.compiler.frontend.calibration import feeds_digest, input_specs, read_calibration

    onnx_model, label = load_onnx(model.source)
    folders = [project.root, *([project.python_source] if project.python_source else [])]
    feeds = read_calibration(str(model.calibration), input_specs(onnx_model, model.inputs, label),
                             search_path=folders)
    return feeds, feeds_digest(feeds)


def _describe(sig: dict[str, Any]) -> str:
    def t(x: dict[str, Any]) -> str:
        return f"{x['name']}: {x['dtype']}[{', '.join(str(d) for d in x['shape'])}]"

    ins = ", ".join(t(x) for x in sig["inputs"])
    outs = ", ".join(t(x) for x in sig["outputs"])
    return f"{sig['name']}({ins}) -> {outs}"


def render_init(
    package: str, signatures: list[dict[str, Any]], target: str, submodule: bool = False
) -> str:
    """The module that loads the models: `package/__init__.py`, or with `submodule` the one the
    user's own `__init__.py` re-exports them from."""
    names = [s["name"] for s in signatures]
    usage = f"from .{MODELS_MODULE} import {', '.join(names)}"
    reexport = ["", f"The package's own __init__.py re-exports them: `{usage}`."]
    lines = [
        f'"""{package}: models compiled by cuvil {cuvil.__version__} for {target}.',
        "",
        *[f"    {_describe(s)}" for s in signatures],
        "",
        "Call a model with numpy arrays (`model(x)`), or with a dict (`model.run({...})`);",
        "`.inputs` and `.outputs` describe its tensors.",
        *(reexport if submodule else []),
        '"""',
        "",
        "import os as _os",
        "",
        f"from .{RUNTIME_MODULE} import load_models as _load_models",
        "",
        "_models = _load_models(_os.path.dirname(_os.path.abspath(__file__)))",
        *[f"{n} = _models[{n!r}]" for n in names],
        "",
        f"__all__ = {names!r}",
        "",
    ]
    return "\n".join(lines)


def _param(name: str, i: int) -> str:
    return name if name.isidentifier() and not keyword.iskeyword(name) else f"input_{i}"


def render_stub(signatures: list[dict[str, Any]]) -> str:
    lines = [
        "from typing import Any, Mapping",
        "",
        "import numpy as np",
        "from numpy.typing import ArrayLike, NDArray",
        "",
        f"from .{RUNTIME_MODULE} import Model",
        "",
    ]
    for sig in signatures:
        cls = "_" + "".join(p.capitalize() for p in sig["name"].split("_")) + "Model"
        params = ", ".join(f"{_param(t['name'], i)}: ArrayLike" for i, t in enumerate(sig["inputs"]))
        if any(_param(t["name"], i) != t["name"] for i, t in enumerate(sig["inputs"])):
            params += ", /"  # some input names are not identifiers: positional only
        outs = [f"NDArray[np.{t['dtype'] if t['dtype'] != 'bool' else 'bool_'}]"
                for t in sig["outputs"]]
        ret = outs[0] if len(outs) == 1 else f"tuple[{', '.join(outs)}]"
        if all(t["name"] != "out" for t in sig["inputs"]):  # else `out=` names that input
            out = (outs[0] if len(outs) == 1
                   else f"tuple[{', '.join(o + ' | None' for o in outs)}]")
            params = ", ".join(p for p in (params, f"*, out: {out} | None = None") if p)
        lines += [
            "",
            f"class {cls}(Model):",
            f'    """{_describe(sig)}"""',
            f"    def __call__(self, {params}) -> {ret}: ...",
            "    def run(self, feeds: Mapping[str, ArrayLike],",
            "            out: Mapping[str, NDArray[Any]] | None = None) -> dict[str, NDArray[Any]]: ...",
            "",
            f"{sig['name']}: {cls}",
        ]
    lines += ["", f"__all__ = {[s['name'] for s in signatures]!r}", ""]
    return "\n".join(lines)
