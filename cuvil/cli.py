"""The `cuvil` command: compile, build, cache, check, publish, inspect, bench, init, targets.

Each subcommand is a thin function over the parts that do the work (compiler driver, build
backend, checks, toolchains). A `CuvilError` is printed as `cuvil: error: ...` on stderr with
exit code 2 and no traceback; `cuvil check` and `cuvil publish` exit 1 when a check fails.
Progress lines go to stderr with `--verbose` (`cuvil build` shows them always: on one status
line on a terminal, see progress.py); results go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional, Union

from cuvil.config import (
    CALIBRATION_METHODS,
    OPT_LEVELS,
    PRECISIONS,
    QUANTIZE_MODES,
    TRANSFORMED_WEIGHTS,
    CompileOptions,
)
from cuvil.errors import CheckError, ConfigError, CuvilError, not_a_regular_file

__all__ = ["main"]

Log = Optional[Callable[[str], None]]


# ----------------------------------------------------------------------------- helpers


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(args: argparse.Namespace) -> Log:
    """The log function the parts call: stderr lines with --verbose, else nothing."""
    if not getattr(args, "verbose", False):
        return None

    def log(message: str) -> None:
        _say(message if message.startswith("cuvil: ") else f"cuvil: {message}")

    return log


@contextlib.contextmanager
def _chdir(path: Path) -> Iterator[None]:
    # The PEP 517 hooks read the project from the current directory, as frontends call them.
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _model_name(path: Path) -> str:
    """A C identifier from a model file's name ("mnist-12.onnx" -> "mnist_12")."""
    name = re.sub(r"\W", "_", path.stem, flags=re.ASCII) or "model"
    return "m_" + name if name[0].isdigit() else name


def _parse_dims(text: str, option: str) -> tuple[str, list[int | str]]:
    """`name=dim,dim,...` (ints pin a dim, identifiers name a symbolic one)."""
    name, sep, dims_text = text.partition("=")
    example = f"{option} image=batch,1,8,8"
    if not sep or not name:
        raise ConfigError(f"{option} {text!r}: expected NAME=DIM,DIM,... (e.g. {example})")
    dims: list[int | str] = []
    for part in dims_text.split(","):
        part = part.strip()
        if re.fullmatch(r"[0-9]+", part) and int(part) >= 1:
            dims.append(int(part))
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            dims.append(part)
        else:
            raise ConfigError(
                f"{option} {text!r}: dim {part!r} is neither an integer >= 1 nor a symbol name "
                f"(e.g. {example})"
            )
    return name, dims


def _shape(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _signature_lines(sig: Mapping[str, Any], indent: str = "  ") -> list[str]:
    from cuvil.runtime import exported_symbol

    lines = []
    for kind in ("inputs", "outputs"):
        for t in sig.get(kind, []):
            bound = (f" (at most {_shape(t['max_shape'])})"
                     if t.get("max_shape", t["shape"]) != t["shape"] else "")
            lines.append(f"{indent}{kind[:-1]:<7}{t['name']}: {t['dtype']}{_shape(t['shape'])}"
                         f"{bound}")
    symbols = sig.get("symbols") or []
    lines.append(f"{indent}symbolic dims: {', '.join(symbols) if symbols else 'none'}")
    for d in sig.get("data_dims") or []:
        lines.append(f"{indent}data-dependent dim {d['name']}: at most {d['bound']}, decided by "
                     f"{d['node']}")
    for condition, message in sig.get("constraints") or []:
        lines.append(f"{indent}requires {condition}  ({message})")
    if "workspace" in sig:
        lines.append(f"{indent}workspace: {sig['workspace']} bytes")
    name = sig["name"]
    lines.append(f"{indent}C ABI: " + ", ".join(
        exported_symbol(name, part) for part in ("cpu_check", "run", "workspace_size", "abi_checksum")))
    lines.append(f"{indent}ABI checksum: {sig.get('checksum')}")
    return lines


# ----------------------------------------------------------------------------- compile


def compile_options(args: argparse.Namespace) -> CompileOptions:
    """`cuvil compile`'s flags as CompileOptions: each field from the flag of its name
    (--input for inputs, -O for opt_level), an unset one at the field's default."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(CompileOptions)
              if f.name != "inputs" and getattr(args, f.name, None) is not None}
    values["keep_float"] = tuple(values.get("keep_float", ()))
    values["inputs"] = {name: tuple(dims) for name, dims in
                        (_parse_dims(text, "--input") for text in args.input)}
    return CompileOptions(**values)


def cmd_compile(args: argparse.Namespace) -> int:
    from cuvil.build_backend.cache import file_key, open_cache
    from cuvil.compiler.codegen.header import render_header
    from cuvil.compiler.driver import compile_model
    from cuvil.config import load_settings
    from cuvil.toolchains import get_target

    source = Path(args.model)
    name = args.name or _model_name(source)
    target = get_target(args.target)
    output = Path(args.output) if args.output else Path(f"{name}{target.library_suffix}")
    if output.is_dir():
        output = output / f"{name}{target.library_suffix}"
    header = output.with_suffix(".h")
    if output.suffix != target.library_suffix:
        _say(
            f"cuvil: note: {output.name} does not end in {target.library_suffix}, the usual suffix "
            f"for {target.name} libraries"
        )
    log = _progress(args)
    start = time.perf_counter()
    options = compile_options(args)
    options.check(name)
    _need_file(source, "an .onnx model")
    cache = None if args.no_cache else open_cache(load_settings(Path.cwd()))
    key = file_key(source, name, options, target, output.name) if cache is not None else None
    # the cache's warnings (a damaged entry, a folder it cannot write) show without --verbose too
    found = cache.load(key, log or _say) if cache is not None and key is not None else None
    if found is not None:
        library, sig = found
    else:
        with tempfile.TemporaryDirectory(prefix="cuvil-compile-") as tmp:
            compiled = compile_model(source, name, Path(tmp), options, target=target.name, log=log,
                                     library_file=output.name)
            library, sig = compiled.library.read_bytes(), compiled.signature
        if cache is not None and key is not None:
            cache.store(key, library, sig, log or _say)
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.with_name(f".{output.name}.{os.getpid()}.part")
    staged.write_bytes(library)
    os.chmod(staged, 0o755)
    os.replace(staged, output)
    header.write_text(render_header(sig, output.name), encoding="utf-8")
    how = (f"from the compile cache {cache.folder}" if found is not None and cache is not None
           else f"compiled in {time.perf_counter() - start:.1f} s")
    print(f"{output}: model {name} for {target.name} ({output.stat().st_size} bytes), {how}")
    print(f"{header}: C header")
    for line in _signature_lines(sig):
        print(line)
    return 0


# ------------------------------------------------------------------------------- build


def _config_settings(pairs: Sequence[str]) -> dict[str, str]:
    settings: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"-C {pair!r}: expected KEY=VALUE, e.g. -C opt-level=2")
        settings[key] = value
    return settings


def cmd_build(args: argparse.Namespace) -> int:
    import cuvil.build_backend as backend
    from cuvil.config import load_project
    from cuvil.progress import build_progress

    root = Path(args.project_dir).resolve()
    if not (root / "pyproject.toml").is_file():
        raise ConfigError(
            f"{root}: no pyproject.toml; pass the model project's folder, or create one with "
            "`cuvil init --model model.onnx`"
        )
    settings = _config_settings(args.config_setting)
    project = load_project(root, settings)
    if args.all_targets:
        targets: list[str | None] = list(project.targets)
        if not targets:
            raise ConfigError(
                f"{project.pyproject}: tool.cuvil.targets is empty, so --all-targets has nothing to "
                'build; add e.g. targets = ["x86_64-linux", "aarch64-linux", "universal2-macos"]'
            )
    else:
        targets = [args.target]
    out_dir = Path(args.output).resolve() if args.output else root / "dist"
    built = []
    with _chdir(root):
        for target in targets:
            config = dict(settings)
            if args.verbose:  # the commands the toolchain runs and each step's duration too
                config.setdefault("verbose", "true")
            if target is not None:
                config["target"] = target
            start = time.perf_counter()
            with build_progress(args.verbose):
                name = backend.build_wheel(str(out_dir), config)
            built.append(out_dir / name)
            print(f"built {out_dir / name} ({time.perf_counter() - start:.1f} s)")
        if args.sdist:
            with build_progress(args.verbose):
                name = backend.build_sdist(str(out_dir), settings)
            built.append(out_dir / name)
            print(f"built {out_dir / name}")
    return 0


# ----------------------------------------------------------------------------- develop


def cmd_develop(args: argparse.Namespace) -> int:
    """Compile into the editable build folder here (with progress), then let pip (or uv)
    install the project editable into this interpreter's environment: its build finds the
    folder up to date, so it only writes the editable wheel."""
    import importlib.util

    from cuvil.build_backend import rebuild_editable
    from cuvil.progress import build_progress

    root = Path(args.project_dir).resolve()
    if not (root / "pyproject.toml").is_file():
        raise ConfigError(f"{root}: no pyproject.toml; pass the model project's folder")
    settings = _config_settings(args.config_setting)
    options = [f"--config-settings={key}={value}" for key, value in settings.items()]
    if importlib.util.find_spec("pip") is not None:
        install = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    elif shutil.which("uv"):
        install = ["uv", "pip", "install", "--python", sys.executable]
    else:
        raise CuvilError(
            f"cuvil develop installs with pip, which {sys.executable} does not have, nor is uv "
            f"on PATH: run `{sys.executable} -m ensurepip`, or install uv"
        )
    start = time.perf_counter()
    with build_progress(args.verbose):
        rebuild_editable(str(root), settings)
    # no build isolation: the build (and the rebuilds at import) use this environment's cuvil
    command = [*install, "--no-build-isolation", *options, "-e", str(root)]
    _say(f"cuvil: installing {root} editable into {sys.prefix}: {' '.join(command)}")
    if subprocess.run(command).returncode != 0:
        raise CuvilError(f"`{' '.join(command)}` failed (its output is above)")
    print(f"installed {root} editable into {sys.prefix} ({time.perf_counter() - start:.1f} s); "
          "a changed model or [tool.cuvil] is rebuilt at import (the editable-rebuild setting)")
    return 0


# ------------------------------------------------------------------------------- cache


def _size_text(size: int) -> str:
    if size < 1024:
        return f"{size} bytes"
    value, unit = size / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def cmd_cache(args: argparse.Namespace) -> int:
    from cuvil.build_backend.cache import CompileCache, cache_dir
    from cuvil.config import load_settings

    settings = load_settings(Path(args.project_dir), _config_settings(args.config_setting))
    cache = CompileCache(cache_dir(settings), settings.cache_max_size)
    if args.action == "clear":
        print(f"removed {_size_text(cache.clear())} of compiled models from {cache.folder}")
        return 0
    stats = cache.stats()
    print(f"compile cache: {stats.folder}")
    print(f"  state:   {'on' if settings.cache else 'off (the cache setting is false)'}")
    print(f"  entries: {stats.entries} ({_size_text(stats.size)})")
    print(f"  limit:   {_size_text(settings.cache_max_size)} (the cache-max-size setting)")
    return 0


# ------------------------------------------------------------------------------- check


def _check(paths: Sequence[str], auditwheel: bool, load: bool = False) -> tuple[bool, list[str]]:
    from cuvil.check import check_wheel

    ok = True
    texts = []
    for path in paths:
        report = check_wheel(path, auditwheel=auditwheel, load=load)
        ok = ok and report.ok
        texts.append(report.format())
    return ok, texts


def cmd_check(args: argparse.Namespace) -> int:
    ok, texts = _check(args.wheels, auditwheel=not args.no_auditwheel, load=args.load)
    print("\n".join(texts))
    return 0 if ok else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from cuvil.check.doctor import diagnose

    results = [diagnose(target) for target in args.targets]
    print("\n\n".join(r.text() for r in results))
    return 0 if all(r.ok for r in results) else 1


# ----------------------------------------------------------------------------- publish


def _twine_command() -> list[str] | None:
    import importlib.util

    if importlib.util.find_spec("twine") is not None:
        return [sys.executable, "-m", "twine"]
    found = shutil.which("twine")
    return [found] if found else None


def cmd_publish(args: argparse.Namespace) -> int:
    not_wheels = [p for p in args.wheels if not p.endswith(".whl")]
    if not_wheels:
        raise ConfigError(
            f"cuvil publish uploads checked wheels only; {', '.join(not_wheels)} "
            "is not a .whl file (upload sdists with twine directly)"
        )
    ok, texts = _check(args.wheels, auditwheel=True)
    print("\n".join(texts))
    if not ok:
        _say("cuvil: refusing to upload: the checks above failed; fix the build and run `cuvil check` again")
        return 1
    upload = ["upload"]
    if args.repository_url:
        upload += ["--repository-url", args.repository_url]
    upload += [str(Path(p)) for p in args.wheels]
    if args.dry_run:
        print(f"dry run: all checks passed; would run: twine {' '.join(upload)}")
        return 0
    twine = _twine_command()
    if twine is None:
        raise CuvilError(
            "the checks passed, but twine, which does the upload, is not installed; install it with "
            "`python -m pip install twine` and run cuvil publish again"
        )
    return subprocess.call([*twine, *upload])


# ----------------------------------------------------------------------------- inspect


def _inspect_wheel(path: Path) -> int:
    from cuvil.check import read_wheel
    from cuvil.errors import CheckError

    wheel = read_wheel(path)
    if wheel.manifest is None:
        raise CheckError(f"{path}: {wheel.manifest_error}")
    m = wheel.manifest
    print(
        f"{path.name}: package {m.get('package')}, target {m.get('target')}, built by cuvil "
        f"{m.get('cuvil_version')} (ABI {m.get('abi_version')})"
    )
    for sig in m["models"]:
        library = f"{wheel.package}/{sig.get('library')}"
        size = wheel.members[library].size if library in wheel.members else None
        print(
            f"model {sig.get('name')}: {library}" + (f" ({size} bytes)" if size is not None else " (missing)")
        )
        for line in _signature_lines(sig):
            print(line)
    return 0


def _dim_text(dim: Any) -> str:
    if dim.HasField("dim_value"):
        return str(dim.dim_value)
    return dim.dim_param or "?"


def _inspect_model(path: Path) -> int:
    import onnx

    from cuvil.compiler.frontend import load_onnx, unsupported_ops_advice
    from cuvil.compiler.ops import lookup

    model, _label = load_onnx(path)
    graph = model.graph
    opsets = {(imp.domain or ""): int(imp.version) for imp in model.opset_import}
    opsets.setdefault("", opsets.get("ai.onnx", 1))
    imports = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in sorted(opsets.items()))
    print(
        f"{path}: ONNX IR version {model.ir_version}, opsets {imports}, producer "
        f"{model.producer_name or '?'} {model.producer_version}".rstrip()
    )
    initializers = {t.name for t in graph.initializer}

    def tensor(vi: Any) -> str:
        if not vi.type.HasField("tensor_type"):
            return f"{vi.name}: (not a tensor)"
        tt = vi.type.tensor_type
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
        except (KeyError, ValueError, TypeError):
            dtype = onnx.TensorProto.DataType.Name(tt.elem_type).lower()
        shape = _shape([_dim_text(d) for d in tt.shape.dim]) if tt.HasField("shape") else "(no shape)"
        return f"{vi.name}: {dtype}{shape}"

    for vi in graph.input:
        if vi.name not in initializers:
            print(f"  input   {tensor(vi)}")
    for vi in graph.output:
        print(f"  output  {tensor(vi)}")
    weights = sum(int(getattr(onnx.numpy_helper.to_array(t), "nbytes", 0)) for t in graph.initializer)
    print(f"  {len(graph.node)} nodes, {len(graph.initializer)} initializers ({weights} bytes)")
    counts: dict[tuple[str, str], int] = {}
    for node in graph.node:
        key = (node.domain or "", node.op_type)
        counts[key] = counts.get(key, 0) + 1
    unsupported: list[tuple[str, str, int]] = []
    print("  operators:")
    for (domain, op_type), count in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        opset = opsets.get(domain, 0)
        supported = lookup(domain, op_type, opset) is not None
        label = f"{domain + '.' if domain else ''}{op_type}"
        if not supported:
            unsupported.append((domain or "ai.onnx", op_type, opset))
        print(f"    {label:<28} x{count:<5} opset {opset:<3} {'supported' if supported else 'NOT SUPPORTED'}")
    if unsupported:
        labels = [f"{d + '.' if d != 'ai.onnx' else ''}{op}" for d, op, _ in unsupported]
        print(
            f"  cuvil cannot compile {len(unsupported)} operator type(s): {', '.join(labels)} "
            "(unless they only compute constants, which are folded at compile time)"
        )
        print("  " + unsupported_ops_advice(unsupported).replace("\n", "\n  "))
    else:
        print(f"  all {len(counts)} operator types are supported")
    return 0


def _inspect_quantization(args: argparse.Namespace) -> int:
    """Quantize as a build would and print each layer's error against float (see
    frontend.quantize_report): a model file with --calibration, or a project's int8 models."""
    from cuvil.compiler.frontend.quantize import QuantizeSettings
    from cuvil.compiler.frontend.quantize_report import quantization_report
    from cuvil.config import load_project

    path = Path(args.path)
    method, keep = args.calibration_method, tuple(args.keep_float)
    jobs: list[tuple[Path, Mapping[str, Sequence[int | str]], QuantizeSettings, str]]
    if path.is_dir() or path.name == "pyproject.toml":
        if args.calibration or args.input:
            raise ConfigError(f"{path}: --calibration and --input are for a model file; a project "
                              "sets calibration and inputs in its [tool.cuvil.models.<name>] tables")
        project = load_project(path if path.is_dir() else path.parent)
        models = [m for m in project.models if m.quantize == "int8"]
        if not models:
            raise ConfigError(f"{project.pyproject}: no model sets quantize = \"int8\"; add it "
                              "(with calibration) to a [tool.cuvil.models.<name>] table")
        folders = (project.root, *([project.python_source] if project.python_source else []))
        jobs = [(m.source, m.inputs, QuantizeSettings(
            m.calibration if m.calibration is not None else "", method or m.calibration_method,
            keep or m.keep_float, folders), f"model {m.name} ({m.source.name})") for m in models]
    else:
        _need_file(path, "an .onnx model or a project folder")
        if not args.calibration:
            raise ConfigError(f"{path}: --quantization needs --calibration FILE.npz (or "
                              "module:function) for a model file")
        pins = dict(_parse_dims(text, "--input") for text in args.input)
        jobs = [(path, pins, QuantizeSettings(args.calibration, method or "minmax", keep,
                                                (Path.cwd(),)), str(path))]
    for index, (source, dims, settings, label) in enumerate(jobs):
        report = quantization_report(source, settings, dims or None, label=label)
        print(("\n" if index else "") + report.table())
    return 0


Pins = Optional[Mapping[str, Sequence[Union[int, str]]]]


def _inspect_types(path: Path, pins: Pins) -> int:
    """Every value's dtype and the places precision changes (passes/type_report.py); exit
    status 1 when typing stops at a node."""
    from cuvil.compiler.passes.type_report import type_report

    report = type_report(path, pins, label=str(path))
    print(report.text())
    return 1 if report.broken else 0


def _inspect_ir(path: Path, pins: Pins, after: str | None, name: str | None = None) -> int:
    """The compiler's graph as text after the stage `after` names, or after every pass with
    each value's memory placement (passes/ir_text.py)."""
    from cuvil.compiler.frontend import import_model
    from cuvil.compiler.passes import run_passes
    from cuvil.compiler.passes.ir_text import graph_text
    from cuvil.compiler.passes.plan_memory import plan_memory

    name = name or (re.sub(r"\W", "_", path.stem) if path.stem.isascii() else "model")
    graph = run_passes(import_model(str(path), pins, name), until=after)
    print(graph_text(graph, plan_memory(graph) if after is None else None))
    return 0


def _inspect_project(path: Path, args: argparse.Namespace) -> int:
    """Each model of a project (a folder with pyproject.toml, or that file), as `inspect` of
    its model file shows it, with --types and --ir typed by the model's `inputs` pins."""
    from cuvil.config import load_project

    if args.input:
        raise ConfigError(f"{path}: --input is for a model file; a project pins its models' inputs "
                          "with `inputs` in its [tool.cuvil.models.<name>] tables")
    if path.is_dir() and not (path / "pyproject.toml").is_file():
        raise ConfigError(f"{path}: a folder without pyproject.toml; pass an .onnx model, a .whl "
                          "wheel or a model project's folder (`cuvil init` creates one)")
    project = load_project(path if path.is_dir() else path.parent)
    print(f"{project.pyproject}: project {project.name}, package {project.package}, "
          f"{len(project.models)} model(s)")
    status = 0
    for model in project.models:
        pins = ", ".join(f"{k}={_shape(v)}" for k, v in model.inputs.items())
        print(f"\nmodel {model.name}: {model.source}" + (f" (inputs {pins})" if pins else ""))
        if args.ir or args.after:
            code = _inspect_ir(model.source, model.inputs or None, args.after, model.name)
        elif args.types:
            code = _inspect_types(model.source, model.inputs or None)
        else:
            code = _inspect_model(model.source)
        status = max(status, code)
    return status


def _need_file(path: Path, expected: str) -> None:
    kind = not_a_regular_file(path)
    if kind == "missing":
        raise ConfigError(f"{path}: no such file (expected {expected})")
    if kind is not None:
        raise ConfigError(f"{path}: is {kind}, not a file (expected {expected})")


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if args.quantization:
        return _inspect_quantization(args)
    if path.is_dir() or path.name == "pyproject.toml":
        return _inspect_project(path, args)
    pins = dict(_parse_dims(text, "--input") for text in args.input) or None
    if args.ir or args.after:
        _need_file(path, "an .onnx model or a project: --ir reads one")
        if path.suffix == ".whl":
            raise ConfigError(f"{path}: --ir needs an .onnx model file")
        return _inspect_ir(path, pins, args.after)
    if args.types:
        _need_file(path, "an .onnx model or a project: --types reads one")
        if path.suffix == ".whl":
            raise ConfigError(f"{path}: --types needs an .onnx model file")
        return _inspect_types(path, pins)
    _need_file(path, "an .onnx model, a .whl wheel or a project folder")
    if path.suffix == ".whl":
        return _inspect_wheel(path)
    return _inspect_model(path)


# ----------------------------------------------------------------------------- targets


def cmd_targets(args: argparse.Namespace) -> int:
    from cuvil.toolchains import list_targets

    targets = list_targets()
    width = max((len(t.name) for t in targets), default=0)
    tag_width = max((len(t.platform_tag) for t in targets), default=0)
    for t in targets:
        host = t.is_host()
        arches = " + ".join(a.name for a in t.arches)
        line = f"{'*' if host else ' '} {t.name:<{width}}  {t.platform_tag:<{tag_width}}  {arches}"
        if host:
            line += "  (host)"
        if args.verbose:
            line += f"\n    {t.description}  [{t.source}]"
            for a in t.arches:  # the CPU requirement: docs/targets.md
                faster = ", ".join(v.cpu for v in a.variants)
                line += (f"\n    {a.name}: cpu {a.cpu}"
                         + (f", faster copies for {faster}" if faster else ""))
        print(line)
    return 0


# -------------------------------------------------------------------------------- init


def _toml_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def _input_pins(model: Any) -> list[str]:
    """`name = [dims]` entries naming the model's dims, unnamed dynamic dims named for the user."""
    initializers = {t.name for t in model.graph.initializer}
    entries = []
    for vi in model.graph.input:
        if vi.name in initializers or not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        dims = []
        for axis, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value"):
                dims.append(str(d.dim_value))
            else:
                param = re.sub(r"\W", "_", d.dim_param, flags=re.ASCII) if d.dim_param else ""
                if not param or param[0].isdigit():
                    param = "batch" if axis == 0 else f"{_model_name(Path(vi.name))}_{axis}"
                dims.append(_toml_string(param))
        entries.append(f"{_toml_string(vi.name)} = [{', '.join(dims)}]")
    return entries


def cmd_init(args: argparse.Namespace) -> int:
    from cuvil.compiler.frontend.loader import load_onnx
    from cuvil.config import load_project, normalize_package_name, package_name_problem
    from cuvil.scaffold import WANTED_TARGETS, Project, render_files
    from cuvil.toolchains import list_targets

    root = Path(args.directory).resolve()
    source = Path(args.model)
    model, _label = load_onnx(source)  # a ModelError here says what is wrong with the file
    name = args.name or _model_name(source).lower()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ConfigError(f"--name {name!r}: a model name must be a C identifier (it names C symbols)")
    project_name = (
        args.project_name or f"{re.sub(r'[^A-Za-z0-9._-]+', '-', root.name).strip('-.') or 'model'}-cuvil"
    )
    try:
        package = args.package or normalize_package_name(project_name)
    except ConfigError as exc:
        raise ConfigError(f"{exc} With cuvil init, pass --package NAME.") from None
    problem = package_name_problem(package)
    if problem is not None:  # before any file is written
        raise ConfigError(f"package {package!r} {problem}; pass --package NAME to cuvil init.")

    model_rel = f"models/{name}.onnx"
    known = {t.name for t in list_targets()}
    targets = tuple(t for t in WANTED_TARGETS if t in known)
    files = render_files(Project(project_name, package, name, model_rel, tuple(_input_pins(model)),
                                 targets, args.ci))
    existing = [p for p in [*files, model_rel] if (root / p).exists()]
    if existing:
        raise ConfigError(
            f"{root}: refusing to overwrite {', '.join(existing)}; remove them or choose another directory"
        )
    (root / "models").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, root / model_rel)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    project = load_project(root)  # the scaffold must be a valid project
    print(f"created {project.pyproject} (project {project.name}, package {project.package}, model {name})")
    print(f"copied {source} to {root / model_rel}")
    print(f"wrote {', '.join(sorted(f for f in files if f != 'pyproject.toml'))}")
    print(f"next: cuvil build {args.directory}   then: cuvil check {args.directory}/dist/*.whl")
    return 0


# ------------------------------------------------------------------------------- bench


def _random_inputs(model: Any, dims: Mapping[str, int], seed: int = 0) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for info in model.inputs:
        shape = tuple(d if isinstance(d, int) else dims[d] for d in info.shape)
        if info.dtype.kind == "f":
            feeds[info.name] = rng.standard_normal(shape).astype(info.dtype)
        elif info.dtype.kind in "iu":
            feeds[info.name] = rng.integers(0, 10, size=shape).astype(info.dtype)
        elif info.dtype.kind == "b":
            feeds[info.name] = rng.random(shape) < 0.5
        else:
            raise ConfigError(f"bench cannot make random {info.dtype.name} data for input {info.name!r}")
    return feeds


def _time(fn: Callable[[], Any], runs: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - start) / runs


def cmd_bench(args: argparse.Namespace) -> int:
    import numpy as np

    from cuvil.compiler.driver import compile_in_process

    if args.runs < 1 or args.batch < 1 or (args.threads is not None and args.threads < 1):
        raise ConfigError("--runs, --batch and --threads must be at least 1")
    path = Path(args.model)
    log = _progress(args)
    if log:
        log(f"compiling {path} for this machine")
    start = time.perf_counter()
    model = compile_in_process(path, precision=args.precision,
                               transformed_weights=args.transformed_weights)
    model.num_threads = args.threads
    compile_time = time.perf_counter() - start
    dims: dict[str, int] = {}
    for info in model.inputs:
        for d in info.shape:
            if isinstance(d, str):
                dims.setdefault(d, args.batch)
    dims.update(dict(_parse_dim_value(text) for text in args.dim))
    feeds = _random_inputs(model, dims)
    shapes = ", ".join(f"{k}{_shape(v.shape)}" for k, v in feeds.items())
    print(f"{path}: compiled in {compile_time:.2f} s; inputs {shapes}")
    print(f"  {args.runs} timed runs after {args.warmup} warm-up runs")
    mine = _time(lambda: model.run(feeds), args.runs, args.warmup)
    print(f"  cuvil        {mine * 1e3:10.3f} ms per run")
    try:
        import onnxruntime
    except ImportError:
        print("  onnxruntime is not installed: no comparison (python -m pip install onnxruntime)")
        _print_profile(model, feeds, args.runs, args.profile)
        return 0
    options = onnxruntime.SessionOptions()
    if args.threads is not None:
        options.intra_op_num_threads = args.threads
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    theirs = _time(functools.partial(session.run, None, feeds), args.runs, args.warmup)
    print(f"  onnxruntime  {theirs * 1e3:10.3f} ms per run")
    ours = model.run(feeds)
    reference = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    diffs = []
    for name, value in ours.items():
        if name in reference and value.shape == reference[name].shape and value.size:
            diff = np.max(np.abs(value.astype(np.float64) - reference[name].astype(np.float64)))
            diffs.append(f"{name} {diff:.3g}")
    ratio = theirs / mine if mine > 0 else float("inf")
    verdict = "faster" if ratio >= 1 else "slower"
    print(f"  ratio        {ratio:10.2f}x (onnxruntime time / cuvil time: cuvil is {verdict})")
    if diffs:
        print(f"  max |cuvil - onnxruntime|: {', '.join(diffs)}")
    # onnxruntime's workers spin for ~50 ms after a run, taking a core from the profiled runs
    del session
    _print_profile(model, feeds, args.runs, args.profile)
    return 0


def _print_profile(model: Any, feeds: Mapping[str, Any], runs: int, wanted: bool) -> None:
    """--profile: after the plain timings, which reading the clock per node must not disturb."""
    if wanted:
        print()
        print(model.profile(feeds, runs=runs, warmup=0).table())


def _parse_dim_value(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < 1:
        raise ConfigError(f"--dim {text!r}: expected NAME=N with N >= 1, e.g. --dim batch=8")
    return name.strip(), int(value)


# ------------------------------------------------------------------------------ parser


def _quantization_options(p: argparse.ArgumentParser, command: str) -> None:
    """--calibration, --calibration-method, --keep-float (and --quantize for compile)."""
    when = "with --quantize int8" if command == "compile" else "for --quantization"
    if command == "compile":
        p.add_argument("--quantize", choices=QUANTIZE_MODES, default="none",
                       help="int8: post-training static quantization (docs/quantization.md)")
    p.add_argument("--calibration", metavar="FILE.npz|module:function",
                   help=f"representative inputs {when} (one array per model input)")
    p.add_argument("--calibration-method", choices=CALIBRATION_METHODS,
                   help=f"how activation ranges are read {when} (default: minmax"
                        + (")" if command == "compile" else ", or the project's)"))
    p.add_argument("--keep-float", action="append", default=[], metavar="NODE_OR_OP",
                   help=f"leave this node or op type in float {when} (repeatable)")


def _weights_options(p: argparse.ArgumentParser) -> None:
    """--precision and --transformed-weights: what the model settings of those names set."""
    p.add_argument("--precision", choices=PRECISIONS, default="float32",
                   help="bf16: matrix products and convolutions in bfloat16 with float32 sums, on "
                        "AMX or AVX-512 BF16 where the CPU has them, else in float32 on the bf16 "
                        "weights (docs/precision.md)")
    p.add_argument("--transformed-weights", choices=TRANSFORMED_WEIGHTS, default="library",
                   help="where Winograd convolutions' transformed weights come from: stored in "
                        "the library (default), or computed at the first run (a smaller library, "
                        "a slower first run)")


#: each subcommand's one-line help (in `cuvil --help`), description and examples (in its own --help)
_COMMANDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "compile": (
        "compile one model into a library and C header",
        ("Compile one ONNX model ahead of time into a shared library with a C ABI and its C header,\n"
         "for this machine or another target. The library is taken from the compile cache when it\n"
         "holds the same model compiled the same way (see `cuvil cache`)."),
        ("cuvil compile model.onnx -o build/model.so --input image=batch,3,224,224",
         "cuvil compile model.onnx --target aarch64-linux -O 2"),
    ),
    "build": (
        "build the wheel(s) of a model project",
        ("Build the wheels of a model project (a folder with pyproject.toml and [tool.cuvil]), as\n"
         "`pip wheel .` would, in this Python: no build environment and no package index needed."),
        ("cuvil build", "cuvil build my-project --all-targets --sdist -o dist",
         "cuvil build -C opt-level=2 --target aarch64-linux"),
    ),
    "develop": (
        "build a project and install it editable into this environment, in one step",
        ("Compile a model project's models and install it with `pip install --no-build-isolation -e`\n"
         "into the environment cuvil runs in (uv when pip is missing). Its Python files are read\n"
         "from the project, and a changed model or [tool.cuvil] table is rebuilt at the next\n"
         "import (the editable-rebuild setting)."),
        ("cuvil develop", "cuvil develop examples/digit-reader -C cpu=native"),
    ),
    "cache": (
        "show the compile cache's folder and size, or empty it",
        ("Show where the compile cache is and how much it holds, or empty it. The cache keeps each\n"
         "compiled model's library so that a rebuild of an unchanged model takes seconds."),
        ("cuvil cache info", "cuvil cache clear -C cache-dir=/tmp/cuvil-cache"),
    ),
    "check": (
        "validate built wheels (exit 1 on any failure)",
        ("Validate built wheels before publishing: tags, metadata, RECORD, the libraries' symbols,\n"
         "SONAME and ABI checksum, for any target, without loading them (docs/check.md)."),
        ("cuvil check dist/*.whl", "cuvil check --load --no-auditwheel dist/digits_cuvil-1.0.0-*.whl"),
    ),
    "doctor": (
        "say whether this machine can run a wheel or installed package, and if not why",
        ("Say whether this machine can run a wheel or an installed package and, if not, why and what\n"
         "to do: damaged files, another OS or architecture, a libc too old, missing CPU features."),
        ("cuvil doctor dist/digits_cuvil-1.0.0-py3-none-manylinux_2_17_x86_64.whl", "cuvil doctor digits"),
    ),
    "publish": (
        "check wheels, then upload them with twine",
        ("Run every check of `cuvil check` on the wheels, then upload them with twine; nothing is\n"
         "uploaded when a check fails."),
        ("cuvil publish --dry-run dist/*.whl",
         "cuvil publish --repository-url https://test.pypi.org/legacy/ dist/*.whl"),
    ),
    "inspect": (
        "show a model's tensors and operators, or a wheel's or project's models",
        ("Show a model file's inputs, outputs and operators (and whether cuvil supports each), a\n"
         "wheel's compiled models, or every model of a project; --types, --ir and --quantization\n"
         "look inside the compiler."),
        ("cuvil inspect model.onnx", "cuvil inspect dist/digits_cuvil-1.0.0-*.whl", "cuvil inspect .",
         "cuvil inspect model.onnx --ir --after fold_batchnorm"),
    ),
    "targets": (
        "list the known targets (* marks this machine)",
        ("List the targets cuvil builds wheels for from this machine, with each one's wheel platform\n"
         "tag and architectures; -v adds the CPU each needs."),
        ("cuvil targets", "cuvil targets -v"),
    ),
    "init": (
        "create a model project around an ONNX file",
        ("Create a model project around an ONNX file: pyproject.toml, README, a test against\n"
         "onnxruntime and a CI workflow that builds, tests and publishes every wheel."),
        ("cuvil init my-model --model model.onnx", "cuvil init . --model resnet.onnx --ci cibuildwheel"),
    ),
    "bench": (
        "time a model compiled by cuvil against onnxruntime",
        ("Compile a model for this machine and time it against onnxruntime on random inputs, with\n"
         "the largest difference between their outputs; --profile adds the time per op and node."),
        ("cuvil bench model.onnx --batch 8 --threads 1", "cuvil bench model.onnx --dim seq=128 --profile"),
    ),
}


def _command(sub: Any, common: argparse.ArgumentParser, name: str,
             func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    summary, description, examples = _COMMANDS[name]
    p: argparse.ArgumentParser = sub.add_parser(
        name, parents=[common], help=summary, description=description,
        epilog="examples:\n" + "\n".join(f"  {example}" for example in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func)
    return p


def _parser() -> argparse.ArgumentParser:
    from cuvil import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print progress lines on stderr",
    )
    parser = argparse.ArgumentParser(
        prog="cuvil",
        description="Compile ONNX models ahead of time into native, pip-installable Python wheels.",
        epilog="examples:\n  cuvil init my-model --model model.onnx\n  cuvil build my-model\n"
               "  cuvil check my-model/dist/*.whl\n\n`cuvil COMMAND --help` describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cuvil {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=False, help="print progress lines on stderr"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _command(sub, common, "compile", cmd_compile)
    p.add_argument("model", help="the ONNX model file")
    p.add_argument(
        "-o",
        "--output",
        help="library file to write (default: NAME + the target's suffix); "
        "the header goes next to it with suffix .h",
    )
    p.add_argument("--name", help="model name, used in the C symbols (default: from the file name)")
    p.add_argument("--target", help="target to build for (see `cuvil targets`; default: this machine)")
    p.add_argument(
        "--cpu", help='LLVM cpu to tune for ("native" for this machine; default: the target\'s baseline)'
    )
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=DIM,...",
        help="pin or name an input's dims, e.g. image=batch,1,8,8 (repeatable)",
    )
    p.add_argument(
        "-O", dest="opt_level", type=int, choices=OPT_LEVELS, default=3, help="optimization level"
    )
    _quantization_options(p, "compile")
    _weights_options(p)
    p.add_argument("--no-cache", action="store_true",
                   help="compile even when the compile cache holds this library, and store nothing "
                        "(CUVIL_CACHE=0 turns the cache off too; CUVIL_CACHE_DIR moves it)")

    p = _command(sub, common, "build", cmd_build)
    p.add_argument("project_dir", nargs="?", default=".", help="the project folder (default: .)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--target", help="target to build for (default: this machine)")
    group.add_argument(
        "--all-targets", action="store_true", help="build every target in [tool.cuvil].targets"
    )
    p.add_argument("-o", "--output", help="folder for the wheels (default: PROJECT_DIR/dist)")
    p.add_argument("--sdist", action="store_true", help="also build the source distribution")
    p.add_argument(
        "-C",
        "--config-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a build setting, as for pip -C (e.g. opt-level=2); repeatable",
    )

    p = _command(sub, common, "develop", cmd_develop)
    p.add_argument("project_dir", nargs="?", default=".", help="the project folder (default: .)")
    p.add_argument("-C", "--config-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a build setting, as for pip -C (e.g. opt-level=2); repeatable")

    p = _command(sub, common, "cache", cmd_cache)
    p.add_argument("action", choices=("info", "clear"))
    p.add_argument("--project", dest="project_dir", default=".",
                   help="read the cache settings of this project too (default: .)")
    p.add_argument("-C", "--config-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a build setting, e.g. cache-dir=/tmp/cache; repeatable")

    p = _command(sub, common, "check", cmd_check)
    p.add_argument("wheels", nargs="+", metavar="WHEEL")
    p.add_argument("--no-auditwheel", action="store_true", help="skip the auditwheel policy check")
    p.add_argument("--load", action="store_true",
                   help="also import each wheel this machine can run in a fresh interpreter and call "
                        "its models once (the build backend always does)")

    p = _command(sub, common, "doctor", cmd_doctor)
    p.add_argument("targets", nargs="+", metavar="WHEEL_OR_PACKAGE",
                   help="a .whl file, a generated package's folder, or an installed package's name")

    p = _command(sub, common, "publish", cmd_publish)
    p.add_argument("wheels", nargs="+", metavar="WHEEL")
    p.add_argument("--repository-url", help="upload to this package index instead of twine's default")
    p.add_argument("--dry-run", action="store_true", help="run the checks and show the upload command only")

    p = _command(sub, common, "inspect", cmd_inspect)
    p.add_argument("path", metavar="MODEL.onnx|WHEEL|PROJECT")
    p.add_argument("--quantization", action="store_true",
                   help="quantize to int8 and print each layer's error against float on the "
                        "calibration data (a model with --calibration, or a project's int8 models)")
    p.add_argument("--types", action="store_true",
                   help="print every value's dtype and shape, and flag each place where precision "
                        "changes (Casts, float16 computed in float32) or typing stops")
    p.add_argument("--ir", action="store_true",
                   help="print the compiler's graph after every pass, each node with what it "
                        "runs and each value with where it lives in memory")
    p.add_argument("--after", metavar="PASS",
                   help="with --ir: the graph after this stage instead (frontend, bodies, or a "
                        "pass of the pipeline, e.g. fold_batchnorm)")
    _quantization_options(p, "inspect")
    p.add_argument("--input", action="append", default=[], metavar="NAME=DIM,...",
                   help="pin or name an input's dims for --quantization, --types or --ir of a "
                        "model file")

    _command(sub, common, "targets", cmd_targets)

    p = _command(sub, common, "init", cmd_init)
    p.add_argument(
        "directory", nargs="?", default=".", help="project folder (created if missing; default: .)"
    )
    p.add_argument("--model", required=True, help="the ONNX model to copy into models/")
    p.add_argument("--name", help="model name (default: from the file name)")
    p.add_argument("--project-name", help="[project].name (default: FOLDER-cuvil)")
    p.add_argument("--package", help="import name (default: from the project name)")
    p.add_argument("--ci", choices=("cuvil", "cibuildwheel"), default="cuvil",
                   help="the wheels workflow: cross-build every target from one Linux job matrix "
                        "(cuvil, the default) or build on each platform with cibuildwheel")

    p = _command(sub, common, "bench", cmd_bench)
    p.add_argument("model", help="the ONNX model file")
    p.add_argument("--batch", type=int, default=1, help="value of every symbolic dim (default: 1)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=N", help="value of one symbolic dim")
    p.add_argument("--runs", type=int, default=100, help="timed runs (default: 100)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first (default: 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both engines (default: cuvil's pool size and onnxruntime's default)")
    p.add_argument("--profile", action="store_true",
                   help="also time every node (--runs more runs) and print time per op type and node")
    _weights_options(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except CheckError as exc:  # a wheel that fails validation, as `cuvil check` reports it: 1
        _say(f"cuvil: error: {exc}")
        return 1
    except CuvilError as exc:
        _say(f"cuvil: error: {exc}")
        return 2
    except KeyboardInterrupt:
        _say("cuvil: interrupted")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
