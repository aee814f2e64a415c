"""The `[tool.cuvil]` settings model.

Every option is declared once, as a dataclass field whose metadata holds its kind, default,
help and an example. The same declarations fill the settings from pyproject.toml, from PEP 517
`-C key=value` config settings and from `CUVIL_*` environment variables (precedence:
-C > environment > pyproject.toml > default), and scripts/gen_config_docs.py renders them
into docs/config.md.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import keyword
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from cuvil.errors import ConfigError, not_a_regular_file

__all__ = [
    "CALIBRATION_METHODS",
    "CUSTOM_OP_ATTRIBUTE_TYPES",
    "CUSTOM_OP_DTYPES",
    "DEFAULT_VERSION_REGEX",
    "EDITABLE_REBUILD_MODES",
    "ENTRY_POINT",
    "OPT_LEVELS",
    "PRECISIONS",
    "QUANTIZE_MODES",
    "TRANSFORMED_WEIGHTS",
    "AttributeSpec",
    "BuildSettings",
    "CompileOptions",
    "CustomOpConfig",
    "ModelConfig",
    "Option",
    "ProjectConfig",
    "SdistConfig",
    "TensorSpec",
    "VersionConfig",
    "check_expression",
    "iter_options",
    "load_project",
    "load_settings",
    "normalize_package_name",
    "read_pyproject",
]

#: the quantize values: none, or post-training static int8
QUANTIZE_MODES = ("none", "int8")
#: the calibration-method values, in the order docs/config.md lists them
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
#: the precision values: float32, or bf16 matrix products with float32 sums
PRECISIONS = ("float32", "bf16")
#: the transformed-weights values: Winograd's weights stored, or computed at the first run
TRANSFORMED_WEIGHTS = ("library", "first-run")
#: what importing a stale editable install does (build_backend/_editable_hook.py)
EDITABLE_REBUILD_MODES = ("auto", "error", "off")
#: the optimization levels LLVM takes
OPT_LEVELS = (0, 1, 2, 3)
# A calibration entry point: "package.module:function" (dotted names of identifiers).
ENTRY_POINT = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\Z")
# ASCII only: model names become C symbols, package names become file names in the wheel.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# `__version__ = "1.2.3"` (optionally annotated `: str`) at the start of a line, as
# scikit-build-core's regex provider matches it; the version is the group named `value`.
DEFAULT_VERSION_REGEX = r"""(?m)^__version__\s*(?::\s*str\s*)?=\s*(['"])(?P<value>[^'"\n]+)\1"""
_IDENTIFIER_RULE = "ASCII letters, digits and _, not starting with a digit, not a Python keyword"
#: the longest package or model name: each becomes file names (`_<model>.so`, within the
#: 255 bytes most file systems allow with the suffixes and tags around it) and C symbols
MAX_NAME_LENGTH = 64
#: import names a generated package cannot take: Python finds these first (the standard
#: library's modules) or the package needs them (numpy, its one runtime dependency)
_TAKEN_IMPORT_NAMES = frozenset(sys.stdlib_module_names) | {"numpy", "cuvil"}
_BOOLS = {
    "true": True,
    "yes": True,
    "on": True,
    "1": True,
    "false": False,
    "no": False,
    "off": False,
    "0": False,
}
# The scalar kinds: what a value must be, for messages, and a check of a TOML value.
_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "string": ("a string", lambda v: isinstance(v, str)),
    "file": ("a path relative to the project root", lambda v: isinstance(v, str) and v != ""),
    "path": ("a path", lambda v: isinstance(v, str) and v != ""),
    "folder": ("a folder relative to the project root", lambda v: isinstance(v, str) and v != ""),
    "integer": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "boolean": ("a boolean", lambda v: isinstance(v, bool)),
    "size": (
        'a size: bytes as an integer >= 0, or a string such as "500 MB" or "2 GiB"',
        lambda v: _size(v) is not None,
    ),
    "array of strings": (
        "an array of strings",
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ),
}


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*", re.IGNORECASE)


def _size(value: Any) -> int | None:
    """Bytes for an integer or a text such as "2 GiB" (KB = 1000 bytes, KiB = 1024), else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return None
    number, unit = match.groups()
    power = "KMGT".index(unit[0].upper()) + 1 if unit else 0
    base = 1024 if unit and unit.lower().endswith("i") else 1000
    return int(float(number) * base**power)


def _help(text: str) -> dict[str, Any]:
    """Metadata of a field cuvil fills in itself."""
    return {"help": text}


def _option(
    kind: str,
    help: str,
    example: Any,
    *,
    default: Any = MISSING,
    default_doc: str = "",
    choices: tuple[Any, ...] = (),
    settable: bool = False,
) -> dict[str, Any]:
    """Metadata of a field users set; `settable` ones also come from -C and CUVIL_* variables."""
    return {
        "kind": kind,
        "help": help,
        "example": example,
        "default": default,
        "default_doc": default_doc,
        "choices": choices,
        "settable": settable,
    }


@dataclass(frozen=True)
class ModelConfig:
    """One `[tool.cuvil.models.<name>]` table."""

    name: str = field(metadata=_help("The table's key; exported symbols are cuvil_<name>_*."))
    source: Path = field(
        metadata=_option(
            "file",
            "ONNX model file, relative to the project root (not absolute) and inside it (the "
            "sdist carries it).",
            "models/classifier.onnx",
        )
    )
    inputs: dict[str, tuple[int | str, ...]] = field(
        metadata=_option(
            "inputs",
            "Pins or names input dims: input name -> list of dims, each an integer >= 1 or an "
            'identifier string (a symbolic dim such as "batch"). Dims the model leaves unknown '
            '(no size, "?", -1, as exporters write them) are free, each its own; a declared 0 is '
            "an empty dim unless pinned here.",
            {"image": ["batch", 1, 8, 8]},
            default={},
        )
    )
    quantize: str = field(
        metadata=_option(
            "string",
            '"int8": post-training static quantization (docs/quantization.md): onnxruntime\'s '
            "quantizer, needed at build time only (the build backend asks for it), folds "
            "Conv-BatchNormalization and writes a QDQ model with symmetric per-channel int8 "
            "weights and int8 activations whose ranges come from the calibration data; cuvil "
            "compiles that model.",
            "int8",
            default="none",
            choices=QUANTIZE_MODES,
        )
    )
    calibration: Path | str | None = field(
        metadata=_option(
            "calibration",
            'Representative inputs for quantize = "int8" (required by it): an .npz file with '
            "one array per model input, samples along the first axis (an array of one rank more "
            'than the input holds whole feeds, one per index), or a Python entry point "module:'
            'function" returning or yielding feed dicts (input name -> array), imported from the '
            "project root and the Python package's folder; keep its module in the Python package "
            "so that the sdist carries it.",
            "data/calibration.npz",
            default=None,
        )
    )
    calibration_method: str = field(
        default="minmax",
        metadata=_option(
            "string",
            "How activation ranges are read from the calibration data: \"minmax\" (the observed "
            'range), "percentile" (the 0.001st to 99.999th percentiles, clipping outliers) or '
            '"entropy" (the range that minimizes the KL divergence of the quantized histogram).',
            "percentile",
            default="minmax",
            choices=CALIBRATION_METHODS,
        ),
    )
    keep_float: tuple[str, ...] = field(
        default=(),
        metadata=_option(
            "array of strings",
            'Layers quantize = "int8" leaves in float: node names (as in the ONNX file) or op '
            "types (every node of that type); each must name a node or an op type of the model.",
            ["/fc2/Gemm", "Softmax"],
            default=[],
        ),
    )
    precision: str = field(
        default="float32",
        metadata=_option(
            "string",
            '"bf16": the float32 matrix products and convolutions (Gemm, MatMul with constant '
            "weights, and the convolutions that run as matrix products; not Winograd or "
            "depthwise ones) compute in bfloat16 with float32 sums, their weights stored as "
            "bf16 (half the size): on AMX or AVX-512 BF16 where the CPU has them (picked at "
            "run time); elsewhere in float32 on the bf16 weights, at float32's speed. Inputs "
            "and outputs stay float32; results differ from float32 by about 1% of an output's "
            "scale at most (docs/precision.md).",
            "bf16",
            default="float32",
            choices=PRECISIONS,
        ),
    )
    transformed_weights: str = field(
        default="library",
        metadata=_option(
            "string",
            'Where the weights of Winograd convolutions (3x3, stride 1), transformed for it, '
            'come from: "library" stores them in the library, 16/9 or 4 times the bytes of the '
            '3x3 kernels they replace, so that the first run has nothing to compute; '
            '"first-run" keeps the kernels and transforms them into fresh memory at the first '
            "run of a process: a smaller wheel, a slower first run (ResNet-50: 30 MB, some "
            "20 ms).",
            "first-run",
            default="library",
            choices=TRANSFORMED_WEIGHTS,
        ),
    )


@dataclass(frozen=True)
class CompileOptions:
    """Every choice besides the model and the target that shapes a compiled library: one value
    from `[tool.cuvil]` (`ProjectConfig.compile_options`), `cuvil compile`'s flags (one per
    field, of the field's name) or `cuvil.compile()`'s keywords to the driver, which takes it
    whole. The compile cache's key and the editable install's fingerprint take every field
    (`key_state`): a field added here is in both (tests/config/test_compile_options.py fails until it
    has a value that changes them). The meaning of each is documented on ModelConfig and
    BuildSettings, whose fields of the same names fill it from pyproject.toml."""

    inputs: Mapping[str, tuple[int | str, ...]] = field(default_factory=dict)
    cpu: str | None = None
    opt_level: int = 3
    quantize: str = "none"
    #: an .npz file, a "module:function" entry point, or (in process) feed dicts
    calibration: Any = None
    calibration_method: str = "minmax"
    keep_float: tuple[str, ...] = ()
    precision: str = "float32"
    transformed_weights: str = "library"

    def check(self, model: str) -> None:
        """A ConfigError naming `model` and the setting for a value the compiler cannot take."""
        for name, choices in (("quantize", QUANTIZE_MODES), ("opt_level", OPT_LEVELS),
                              ("calibration_method", CALIBRATION_METHODS),
                              ("precision", PRECISIONS),
                              ("transformed_weights", TRANSFORMED_WEIGHTS)):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"model {model}: {name.replace('_', '-')} = {value!r} is not "
                                  f"one of {', '.join(repr(c) for c in choices)}")
        if self.quantize == "int8" and self.calibration is None:
            raise ConfigError(
                f'model {model}: quantize = "int8" needs calibration data: pass calibration= an '
                '.npz file (one array per input), a "module:function" entry point or a list of '
                "feed dicts")
        if self.quantize == "none" and (self.calibration is not None or self.keep_float):
            raise ConfigError(f'model {model}: calibration data or keep-float given, but quantize '
                              'is "none"; pass quantize="int8" (--quantize int8), or leave them '
                              "out")

    def key_state(self) -> dict[str, Any]:
        """Every field as JSON data, for the digests that must change with them: the
        calibration by name when it is an entry point (the caller hashes its feeds, and an
        .npz file's bytes among the model's files)."""
        state: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "inputs":
                value = {k: list(v) for k, v in value.items()}
            elif f.name == "calibration":
                value = value if isinstance(value, str) else None
            elif isinstance(value, tuple):
                value = list(value)
            state[f.name] = value
        return state


#: the element types a custom op's tensors may have (numpy names)
CUSTOM_OP_DTYPES = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8",
                    "uint16", "uint32", "uint64", "bool")
#: attribute types of custom ops -> the TOML values a default may be
CUSTOM_OP_ATTRIBUTE_TYPES = ("int", "float", "string", "ints", "floats")
#: what a shape or workspace expression may use besides names: arithmetic on ints, indexing,
#: slicing, tuples and max/min (checked with `ast`, never run as arbitrary Python)
_EXPRESSION_NODES = (ast.Expression, ast.Name, ast.Load, ast.Constant, ast.Subscript, ast.Slice,
                     ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod,
                     ast.USub, ast.Tuple, ast.List, ast.Call)
EXPRESSION_FUNCTIONS = ("max", "min")


def check_expression(text: str, names: Any, where: str, hint: str) -> ast.Expression:
    """`text` parsed as a shape expression over `names`; a ConfigError naming `where` if it
    is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        _fail(where, f"{_toml(text)} is not an expression ({exc.msg})", hint)
    for node in ast.walk(tree):
        if not isinstance(node, _EXPRESSION_NODES):
            _fail(where, f"{_toml(text)} uses {type(node).__name__}, which shape expressions "
                  "do not allow (integers, + - * // %, x[i], x[i:j], tuples, max, min)", hint)
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name)
                                               and node.func.id in EXPRESSION_FUNCTIONS):
            _fail(where, f"{_toml(text)} calls something other than max or min", hint)
        if isinstance(node, ast.Name) and node.id not in names and node.id not in \
                EXPRESSION_FUNCTIONS:
            known = ", ".join(sorted(names)) or "none"
            _fail(where, f"{_toml(text)} names {node.id!r}, which is no input or attribute of "
                  f"the op (inputs and attributes: {known})", hint)
    return tree


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a custom op's signature."""

    name: str
    dtype: str
    rank: int | None  # None: any rank
    #: outputs: the shape expression (a str giving the whole shape, or one per dim)
    shape: str | tuple[str | int, ...] | None = None

    def describe(self) -> str:
        return f"{self.name}: {self.dtype}" + ("" if self.rank is None else f"[rank {self.rank}]")


@dataclass(frozen=True)
class AttributeSpec:
    name: str
    type: str  # one of CUSTOM_OP_ATTRIBUTE_TYPES
    default: Any  # None: required


@dataclass(frozen=True)
class CustomOpConfig:
    """One `[tool.cuvil.custom-ops.<name>]` table: a native kernel and its signature."""

    name: str = field(metadata=_help("The table's key."))
    domain: str = field(
        metadata=_option("string", "The op's domain, as the model's nodes name it.", "example.ops")
    )
    op_type: str = field(
        metadata=_option("string", "The op type, as the model's nodes name it.", "SoftClip")
    )
    since: int = field(
        metadata=_option(
            "integer",
            "The first version of the domain (the model's opset import of it) the kernel is for.",
            1,
            default=1,
        )
    )
    inputs: tuple[TensorSpec, ...] = field(
        metadata=_option(
            "tensors",
            "The inputs, in order: tables with name, dtype (float32, int64, ...: numpy names) "
            "and optionally rank (any rank when left out). A node is matched to the kernel "
            "whose signature (input count, dtypes, ranks, attributes) it fits.",
            [{"name": "x", "dtype": "float32", "rank": 2}],
        )
    )
    outputs: tuple[TensorSpec, ...] = field(
        metadata=_option(
            "tensors",
            "The outputs, in order: tables with name, dtype, optionally rank, and shape: the "
            "shape rule, an expression over the inputs' dims and the attributes, either one "
            'string per dim (["x[0]", "x[1] * 2"], x[i] being dim i of input x) or one string '
            'giving the whole shape ("x", "x[:-1] + (k,)"); + - * // %, slices, max and min '
            "are allowed. Required unless shape-function is set.",
            [{"name": "y", "dtype": "float32", "shape": "x"}],
        )
    )
    attributes: tuple[AttributeSpec, ...] = field(
        metadata=_option(
            "attributes",
            "The attributes: name -> table with type (int, float, string, ints, floats) and "
            "optionally default (else the node must set it). The kernel gets every one, in "
            "this order, with defaults filled in.",
            {"alpha": {"type": "float", "default": 1.0}},
            default={},
        )
    )
    sources: tuple[Path, ...] = field(
        metadata=_option(
            "files",
            "C or C++ source files of the kernel, relative to the project root (the sdist "
            "carries them); built for the target with CMake and zig. They include "
            "cuvil_op.h; the project root and each source's folder are on the include path.",
            ["ops/soft_clip.c"],
        )
    )
    function: str = field(
        metadata=_option(
            "string",
            "The C function cuvil calls: int function(const cuvil_op_context *ctx), returning "
            "0 on success (see docs/custom-ops.md).",
            "soft_clip",
            default=None,
            default_doc="the table's name",
        )
    )
    shape_function: str | None = field(
        metadata=_option(
            "string",
            'The shape rule as a Python function instead, "module:function": called with the '
            "input shapes (tuples of ints and sympy expressions) and the attributes (a dict), "
            "it returns one shape per output. The module is imported like op-modules.",
            "digits.ops:soft_clip_shape",
            default=None,
        )
    )
    workspace: str | int = field(
        metadata=_option(
            "string",
            "Bytes of scratch memory the kernel needs (ctx->workspace): an integer, or an "
            'expression like the shape rules\', e.g. "4 * x[1]".',
            "4 * x[1]",
            default=0,
        )
    )

    def describe(self) -> str:
        ins = ", ".join(t.describe() for t in self.inputs)
        outs = ", ".join(t.describe() for t in self.outputs)
        attrs = ", ".join(f"{a.name}: {a.type}" + ("" if a.default is None else f" = {a.default!r}")
                          for a in self.attributes)
        version = f" (since {self.since})" if self.since != 1 else ""
        return (f"{self.domain} {self.op_type}{version}({ins}" + (f"; {attrs}" if attrs else "")
                + f") -> {outs}")


@dataclass(frozen=True)
class BuildSettings:
    """How to build; each is also settable with -C key=value and CUVIL_* variables."""

    target: str | None = field(
        metadata=_option(
            "string",
            "Target to build for, e.g. aarch64-linux (see `cuvil targets`). Unset, the build "
            "follows cibuildwheel's platform variables (_PYTHON_HOST_PLATFORM, ARCHFLAGS, "
            "AUDITWHEEL_PLAT, VSCMD_ARG_TGT_ARCH; docs/cibuildwheel.md), else the host.",
            "aarch64-linux",
            default=None,
            default_doc="the host, or the platform cibuildwheel names",
            settable=True,
        )
    )
    cpu: str | None = field(
        metadata=_option(
            "string",
            'CPU to tune for and take features from; "native" (this machine\'s CPU) only when '
            "target is unset. A named cpu gives one copy of the code (no run-time dispatch), "
            "and the package refuses at import a CPU without its features; x86-64 runs on "
            "every x86-64 CPU (docs/targets.md).",
            "native",
            default=None,
            default_doc="the target's baseline",
            settable=True,
        )
    )
    opt_level: int = field(
        metadata=_option(
            "integer", "Optimization level.", 2, default=3, choices=OPT_LEVELS, settable=True
        )
    )
    verbose: bool = field(
        metadata=_option(
            "boolean",
            "Print each build step with its duration and the exact commands it runs (zig "
            'invocations, as "cuvil: $ ..." lines); pip shows them with -v: '
            "`pip wheel -v -C verbose=true .`.",
            True,
            default=False,
            settable=True,
        )
    )
    editable_rebuild: str = field(
        metadata=_option(
            "string",
            "What importing an editable install (`pip install -e .`, `cuvil develop`) does when "
            "a model file, a file it reads or the [tool.cuvil] table changed since it was built: "
            '"auto" rebuilds it at import (cuvil must be installed where the package is '
            'imported) with a message on stderr; "error" fails the import with an ImportError '
            'naming the changed file and the command that rebuilds it; "off" does not look. '
            "CUVIL_EDITABLE_REBUILD set when importing overrides it.",
            "error",
            default="auto",
            choices=EDITABLE_REBUILD_MODES,
            settable=True,
        )
    )
    build_dir: Path = field(
        metadata=_option(
            "path",
            "Directory for intermediate files, relative to the project root.",
            "build/cuvil",
            default="build/cuvil",
            settable=True,
        )
    )
    cache: bool = field(
        metadata=_option(
            "boolean",
            "Reuse compiled model libraries from the compile cache (cache-dir): a model whose "
            "bytes, settings, target and compiler (cuvil with a digest of its sources, llvmlite, "
            "zig) are unchanged is not compiled again, in any folder or Python. false neither "
            "reads nor writes the cache. `cuvil cache info` / `cuvil cache clear` show and empty "
            "it.",
            False,
            default=True,
            settable=True,
        )
    )
    cache_dir: Path | None = field(
        metadata=_option(
            "path",
            "Folder of the compile cache, shared by every project and build on the machine "
            "(relative paths are relative to the project root; ~ is expanded).",
            "~/.cache/cuvil",
            default=None,
            default_doc="the user cache folder: $XDG_CACHE_HOME/cuvil or ~/.cache/cuvil on Linux, "
            "~/Library/Caches/cuvil on macOS, %LOCALAPPDATA%\\cuvil\\Cache on Windows",
            settable=True,
        )
    )
    cache_max_size: int = field(
        metadata=_option(
            "size",
            "Size limit of the compile cache: bytes as an integer, or a string with a unit "
            '("500 MB", "2 GiB"). When an entry is added beyond it, the entries used least '
            "recently are removed.",
            "4GiB",
            default=2 << 30,
            default_doc='"2 GiB"',
            settable=True,
        )
    )


@dataclass(frozen=True)
class SdistConfig:
    """The `[tool.cuvil.sdist]` table: files the sdist carries besides the ones a rebuild needs."""

    include: tuple[str, ...] = field(
        metadata=_option(
            "array of strings",
            "Globs (relative to the project root, ** for any folders; a folder means every file "
            "in it) of extra files the sdist carries: scripts, data, docs. Each must match a "
            "file. The sdist always carries what a rebuild needs: pyproject.toml, the readme and "
            "license files, the models with their external data and calibration files, the "
            "Python package and the version file.",
            ["scripts/*.py", "docs"],
            default=[],
        )
    )
    exclude: tuple[str, ...] = field(
        metadata=_option(
            "array of strings",
            "Globs of files to leave out of what include names (and of the Python package's "
            "__pycache__ and .pyc files, always left out); a file a rebuild needs cannot be "
            "excluded.",
            ["docs/drafts/**"],
            default=[],
        )
    )


@dataclass(frozen=True)
class VersionConfig:
    """The `[tool.cuvil.metadata.version]` table: where `dynamic = ["version"]` reads it."""

    provider: str = field(
        metadata=_option(
            "string",
            "How the version is read: \"regex\" searches the input file with regex (the file is "
            "read as text, never imported).",
            "regex",
            default="regex",
            choices=("regex",),
        )
    )
    input: Path | None = field(
        metadata=_option(
            "file",
            "The file holding the version, relative to the project root.",
            "src/digits/__init__.py",
            default=None,
            default_doc="the Python package's __init__.py",
        )
    )
    regex: str = field(
        metadata=_option(
            "string",
            "Python regular expression whose group named value (else its first group) is the "
            "version; checked as a PEP 440 version and normalized. The default matches a line "
            "`__version__ = \"1.2.3\"`.",
            r"(?m)^VERSION = '(?P<value>[^']+)'",
            default=DEFAULT_VERSION_REGEX,
            default_doc="`__version__ = \"...\"`",
        )
    )


@dataclass(frozen=True)
class ProjectConfig:
    """A model project: pyproject.toml's `[project]` and `[tool.cuvil]`, plus the build settings."""

    root: Path = field(metadata=_help("Absolute project directory."))
    pyproject: Path = field(metadata=_help("Absolute path of pyproject.toml."))
    project: dict[str, Any] = field(metadata=_help("The raw [project] table."))
    name: str = field(metadata=_help("[project].name as written."))
    package: str = field(
        metadata=_option(
            "string",
            "Import name of the generated package. The default is [project].name lowercased, each "
            'run of other characters than letters, digits and "_" replaced by "_", and a '
            'trailing "_cuvil" dropped: digits-cuvil gives digits. At most 64 characters, and not '
            "the name of a standard-library module, numpy or cuvil (Python would import those "
            "instead).",
            "digits",
            default=None,
            default_doc="from [project].name",
        )
    )
    targets: tuple[str, ...] = field(
        metadata=_option(
            "array of strings",
            "Targets that `cuvil build --all-targets` builds.",
            ["x86_64-linux", "aarch64-linux"],
            default=[],
        )
    )
    check_warnings: tuple[str, ...] = field(
        metadata=_option(
            "array of strings",
            "Checks of `cuvil check` that only warn, instead of failing the build, when the build "
            "backend runs them on each wheel it writes: names such as \"auditwheel\" or \"glibc "
            "versions\" (every name is in docs/check.md; \"archive\" cannot be one).",
            ["auditwheel"],
            default=[],
        )
    )
    python_source: Path | None = field(
        metadata=_option(
            "folder",
            "The folder holding the project's own Python package <package>/ (pre- and "
            "post-processing, a command line), which the wheel ships with the compiled models. "
            'Write "." for the project root.',
            "src",
            default=None,
            default_doc="src if src/<package>/ exists, else the root if <package>/ does, else none",
        )
    )
    op_modules: tuple[str, ...] = field(
        metadata=_option(
            "array of strings",
            "Python modules to import before compiling, whose cuvil.register_op decorators "
            "define ops the models use as decompositions into ONNX ops (docs/custom-ops.md). "
            "They are looked up in the python-source folder, then the project root, then the "
            "installed packages; packages can also declare them as entry points of the group "
            "cuvil.ops, which every build loads. An edit of such a module recompiles the models.",
            ["digits.ops"],
            default=[],
        )
    )
    models: tuple[ModelConfig, ...] = field(
        metadata=_option(
            "models", "One [tool.cuvil.models.<name>] table per model; at least one.", None
        )
    )
    custom_ops: tuple[CustomOpConfig, ...] = field(
        metadata=_option(
            "custom-ops",
            "One [tool.cuvil.custom-ops.<name>] table per native kernel of an op the models use "
            "(docs/custom-ops.md).",
            None,
            default={},
        )
    )
    settings: BuildSettings = field(metadata=_help("The build settings."))
    sdist: SdistConfig = field(
        default=SdistConfig((), ()), metadata=_help("The [tool.cuvil.sdist] table.")
    )
    version: str | None = field(
        default=None,
        metadata=_help("The normalized version read for dynamic = [\"version\"], else None."),
    )
    version_file: Path | None = field(
        default=None, metadata=_help("The file the dynamic version was read from.")
    )

    @property
    def python_package(self) -> Path | None:
        """The folder of the project's own Python package, if it has one."""
        return None if self.python_source is None else self.python_source / self.package

    def compile_options(self, model: ModelConfig) -> CompileOptions:
        """How `model` compiles: its table's settings and the build settings."""
        return CompileOptions(
            inputs=model.inputs, cpu=self.settings.cpu, opt_level=self.settings.opt_level,
            quantize=model.quantize, calibration=model.calibration,
            calibration_method=model.calibration_method, keep_float=model.keep_float,
            precision=model.precision, transformed_weights=model.transformed_weights)


@dataclass(frozen=True)
class Option:
    """One user-facing option, as declared in the dataclasses above."""

    table: str  # the TOML table holding it
    key: str  # its key there; also the -C key of settable options
    attr: str  # the dataclass field
    kind: str
    help: str
    example: Any
    default: Any
    default_doc: str
    choices: tuple[Any, ...]
    settable: bool

    @property
    def env(self) -> str:
        return "CUVIL_" + self.attr.upper()

    @property
    def type_text(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(_toml, self.choices))
        names = {
            "file": "path to a file",
            "folder": "path to a folder",
            "inputs": "table of arrays",
            "calibration": 'path to an .npz file, or "module:function"',
            "models": "tables",
            "custom-ops": "tables",
            "tensors": "array of tables",
            "attributes": "table of tables",
            "files": "array of paths to files",
            "size": "integer or string (a size)",
        }
        return names.get(self.kind, self.kind)

    @property
    def default_text(self) -> str:
        if self.default_doc:
            return self.default_doc
        if self.default is MISSING:
            return "required"
        return "unset" if self.default is None else _toml(self.default)


def _options(cls: type, table: str) -> tuple[Option, ...]:
    return tuple(
        Option(table=table, key=f.name.replace("_", "-"), attr=f.name, **f.metadata)
        for f in dataclasses.fields(cls)
        if "kind" in f.metadata
    )


_PROJECT_OPTIONS = _options(ProjectConfig, "tool.cuvil")
_MODEL_OPTIONS = _options(ModelConfig, "tool.cuvil.models.<name>")
_SETTINGS_OPTIONS = _options(BuildSettings, "tool.cuvil")
_SDIST_OPTIONS = _options(SdistConfig, "tool.cuvil.sdist")
_VERSION_OPTIONS = _options(VersionConfig, "tool.cuvil.metadata.version")
_CUSTOM_OP_OPTIONS = _options(CustomOpConfig, "tool.cuvil.custom-ops.<name>")
# tables inside [tool.cuvil] besides the models
_SUBTABLES = ("sdist", "metadata")


def iter_options() -> tuple[Option, ...]:
    """Every option, in documentation order."""
    return (
        _PROJECT_OPTIONS + _MODEL_OPTIONS + _CUSTOM_OP_OPTIONS + _SDIST_OPTIONS + _VERSION_OPTIONS
        + _SETTINGS_OPTIONS
    )


@dataclass(frozen=True)
class _Source:
    """Where a value came from (`where`), and a `hint` that shows a valid setting."""

    where: str
    hint: str


@dataclass(frozen=True)
class _Context:
    file: str  # pyproject.toml as the caller named it, for messages
    root: Path  # resolved


def _fail(where: str, problem: str, fix: str) -> NoReturn:
    raise ConfigError(f"{where}: {problem}. {fix}")


def _toml(value: Any) -> str:
    """`value` written as TOML, for messages and docs."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    if isinstance(value, dict) and value:
        return "{ " + ", ".join(f"{_bare(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    return "{}" if value == {} else str(value)


def _got(value: Any) -> str:
    kinds = {
        bool: "a boolean",
        int: "an integer",
        float: "a float",
        str: "a string",
        list: "an array",
        dict: "a table",
    }
    return f"got {_toml(value)} ({kinds.get(type(value), 'a date/time')})"


def _bare(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _reject_unknown(keys: Any, known: list[str], where: str, prefix: str) -> None:
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            guess = f"; did you mean {close[0]!r}?" if close else "."
            raise ConfigError(
                f"{where}: unknown key {prefix}{_bare(key)}{guess} "
                f"Valid keys there: {', '.join(known)}."
            )


def _is_identifier(name: str) -> bool:
    return bool(_IDENTIFIER.match(name)) and not keyword.iskeyword(name)


def read_pyproject(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed TOML file; a ConfigError names the file (and line and column) on failure."""
    kind = not_a_regular_file(path)
    if kind not in (None, "missing"):
        _fail(str(path), f"is {kind}, not a file", "Give pyproject.toml as a regular file.")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        _fail(
            str(path),
            "not found",
            "Run cuvil in the project directory, or create the file with `cuvil init`.",
        )
    except OSError as exc:
        _fail(str(path), f"cannot be read ({exc.strerror})", "Check the file's permissions.")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        _fail(
            str(path),
            f"invalid TOML: {exc}",
            "Fix the syntax there; note that a key or a table such as "
            "[tool.cuvil.models.<name>] may appear only once.",
        )


def package_name_problem(package: str) -> str | None:
    """Why a valid identifier cannot name a generated package (too long, or an import name
    Python resolves elsewhere), or None."""
    if len(package) > MAX_NAME_LENGTH:
        return f"has {len(package)} characters, more than the {MAX_NAME_LENGTH} a package name may have"
    if package in _TAKEN_IMPORT_NAMES:
        reason = ("numpy, which every generated package imports" if package == "numpy" else
                  "cuvil's own package" if package == "cuvil" else
                  "a module of Python's standard library, which Python imports instead")
        return f"is the import name of {reason}: the package could never be imported"
    return None


def _check_package_name(package: str, ctx: _Context, derived_from: str | None) -> None:
    problem = package_name_problem(package)
    if problem is not None:
        origin = (f" (made from project.name {_toml(derived_from)})" if derived_from is not None
                  else "")
        _fail(f"{ctx.file}: tool.cuvil.package", f"{_toml(package)}{origin} {problem}",
              f'Set another name, e.g. package = "{package[:MAX_NAME_LENGTH - 6]}_model".')


def normalize_package_name(project_name: str) -> str:
    """The default import name for a project name: "digits-cuvil" -> "digits"."""
    name = re.sub(r"[^a-z0-9_]+", "_", project_name.lower())
    if name.endswith("_cuvil") and len(name) > len("_cuvil"):
        name = name[: -len("_cuvil")]
    if not _is_identifier(name):
        raise ConfigError(
            f"project.name {_toml(project_name)} gives no valid import name ({_toml(name)}; "
            f'expected {_IDENTIFIER_RULE}). Set tool.cuvil.package, e.g. package = "digits".'
        )
    return name


def load_project(
    root: str | os.PathLike[str],
    config_settings: Mapping[str, str | list[str]] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    backend: str | None = None,
) -> ProjectConfig:
    """Read and check the project in `root`, with -C `config_settings` and `environ` on top.

    `backend` names another build backend whose plugin compiles the models (hatchling,
    setuptools): that backend writes the metadata and the sdist, so [tool.cuvil.metadata]
    and [tool.cuvil.sdist] are refused and a dynamic version is left to it.
    """
    ctx = _Context(file=str(Path(root) / "pyproject.toml"), root=Path(root).resolve())
    data = read_pyproject(ctx.file)
    name, project = _check_project(data.get("project"), ctx)
    tool = data.get("tool")
    tool = tool.get("cuvil") if isinstance(tool, dict) else None
    if not isinstance(tool, dict):
        _fail(
            ctx.file,
            "no [tool.cuvil] table",
            "Add [tool.cuvil] and one [tool.cuvil.models.<name>] table per model, with "
            'source = "models/<name>.onnx".',
        )
    known = [o.key for o in _PROJECT_OPTIONS + _SETTINGS_OPTIONS] + list(_SUBTABLES)
    _reject_unknown(tool, known, ctx.file, "tool.cuvil.")
    if not tool.get("models"):
        _fail(
            f"{ctx.file}: tool.cuvil.models",
            "no models",
            "Add one [tool.cuvil.models.<name>] table per model, e.g. "
            '[tool.cuvil.models.classifier] with source = "models/classifier.onnx".',
        )
    values = _read(_PROJECT_OPTIONS, tool, "tool.cuvil", ctx)

    if values["package"] is None:
        try:
            values["package"] = normalize_package_name(name)
        except ConfigError as exc:
            raise ConfigError(f"{ctx.file}: {exc}") from None
    elif not _is_identifier(values["package"]):
        _fail(
            f"{ctx.file}: tool.cuvil.package",
            f"{_toml(values['package'])} is not a valid import name (expected {_IDENTIFIER_RULE})",
            'Write e.g. package = "digits".',
        )

    _check_package_name(values["package"], ctx, derived_from=name if tool.get("package") is None else None)
    values["python_source"] = _python_source(values["python_source"], values["package"], ctx)
    for module in values["op_modules"]:
        if not all(_is_identifier(part) for part in module.split(".")):
            _fail(
                f"{ctx.file}: tool.cuvil.op-modules",
                f"{_toml(module)} is not a module name",
                'Write dotted module names, e.g. op-modules = ["digits.ops"].',
            )
    if backend is not None:
        for key in ("metadata", "sdist"):
            if key in tool:
                _fail(f"{ctx.file}: tool.cuvil.{key}",
                      f"is read by cuvil's own build backend only, but {backend} builds this project "
                      f"and writes its {'metadata' if key == 'metadata' else 'sdist'}",
                      f"Remove the table and configure it for {backend}.")
    sdist = SdistConfig(**_read(_SDIST_OPTIONS, _table(tool, "sdist", ctx), "tool.cuvil.sdist", ctx))
    version, version_file = (None, None) if backend is not None else \
        _dynamic_version(project, tool, values, ctx)
    settings = _settings(
        tool, config_settings or {}, os.environ if environ is None else environ, ctx
    )
    return ProjectConfig(
        root=ctx.root,
        pyproject=ctx.root / "pyproject.toml",
        project=project,
        name=name,
        settings=settings,
        sdist=sdist,
        version=version,
        version_file=version_file,
        **values,
    )


def load_settings(
    root: str | os.PathLike[str],
    config_settings: Mapping[str, str | list[str]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> BuildSettings:
    """The build settings alone, for commands that need no models (`cuvil cache`): from -C,
    the environment and `root`/pyproject.toml's [tool.cuvil] if there is one."""
    ctx = _Context(file=str(Path(root) / "pyproject.toml"), root=Path(root).resolve())
    tool: Any = read_pyproject(ctx.file).get("tool", {}) if Path(ctx.file).is_file() else {}
    tool = tool.get("cuvil") if isinstance(tool, dict) else None
    return _settings(tool if isinstance(tool, dict) else {}, config_settings or {},
                     os.environ if environ is None else environ, ctx)


def _table(parent: dict[str, Any], key: str, ctx: _Context, dotted: str = "tool.cuvil") -> dict[str, Any]:
    """The sub-table `key` of `parent` ({} when absent), with its unknown keys refused."""
    value = parent.get(key, {})
    if not isinstance(value, dict):
        _fail(f"{ctx.file}: {dotted}.{key}", f"{_got(value)}, expected a table", f"Write [{dotted}.{key}].")
    options = {"sdist": _SDIST_OPTIONS, "version": _VERSION_OPTIONS}.get(key)
    known = [o.key for o in options] if options is not None else ["version"]
    _reject_unknown(value, known, ctx.file, f"{dotted}.{key}.")
    return value


def _python_source(value: Path | None, package: str, ctx: _Context) -> Path | None:
    """The folder holding the project's Python package: as set, else src/ or the root."""
    if value is not None:
        if not (value / package).is_dir():
            _fail(
                f"{ctx.file}: tool.cuvil.python-source",
                f"{value} holds no folder {package}/ (the package tool.cuvil.package names)",
                f"Create {value / package}, or point python-source at the folder that holds it.",
            )
        return value
    found = [folder for folder in (ctx.root / "src", ctx.root) if (folder / package).is_dir()]
    if len(found) > 1:
        _fail(
            f"{ctx.file}: tool.cuvil.python-source",
            f"both src/{package}/ and {package}/ exist, so the Python package is ambiguous",
            'Set python-source = "src" (or "." for the root), or remove one of them.',
        )
    return found[0] if found else None


def _dynamic_version(
    project: dict[str, Any], tool: dict[str, Any], values: dict[str, Any], ctx: _Context
) -> tuple[str | None, Path | None]:
    """The version `dynamic = ["version"]` reads, and its file; (None, None) if not dynamic."""
    from packaging.version import InvalidVersion, Version

    table = _table(_table(tool, "metadata", ctx), "version", ctx, "tool.cuvil.metadata")
    dynamic = "version" in project.get("dynamic", [])
    where = f"{ctx.file}: tool.cuvil.metadata.version"
    if not dynamic:
        if table:
            _fail(
                where,
                'is set, but project.dynamic does not list "version"',
                'Add dynamic = ["version"] to [project] (and remove project.version), or remove '
                "the table.",
            )
        return None, None
    if "version" in project:
        _fail(
            f"{ctx.file}: project.version",
            'is set, but project.dynamic lists "version" too',
            'Remove one of them: version = "..." or dynamic = ["version"].',
        )
    config = VersionConfig(**_read(_VERSION_OPTIONS, table, "tool.cuvil.metadata.version", ctx))
    path = config.input
    if path is None:
        package = values["python_source"] and values["python_source"] / values["package"]
        if package is None or not (package / "__init__.py").is_file():
            _fail(
                where,
                'project.dynamic lists "version", but there is no input file to read it from '
                f"(the default, {values['package']}/__init__.py of the Python package, does not "
                "exist)",
                'Add [tool.cuvil.metadata.version] with input = "VERSION.txt" (the file holding '
                "the version) and a regex, or set project.version.",
            )
        path = package / "__init__.py"
    try:
        pattern = re.compile(config.regex)
    except re.error as exc:
        _fail(f"{where}.regex", f"{config.regex!r} is not a regular expression ({exc})", "Fix it.")
    if "value" not in pattern.groupindex and pattern.groups == 0:
        _fail(
            f"{where}.regex",
            f"{config.regex!r} has no group to take the version from",
            'Put the version in a group named value: (?P<value>...).',
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"{where}.input", f"cannot read {path} as UTF-8 text ({exc})", "Fix the file.")
    match = pattern.search(text)
    if match is None:
        _fail(
            f"{where}.regex",
            f"{config.regex!r} matches nothing in {path}",
            'Write e.g. __version__ = "1.0.0" there, or fix the regex.',
        )
    found = match.group("value" if "value" in pattern.groupindex else 1)
    try:
        return str(Version(found.strip())), path
    except InvalidVersion:
        _fail(
            f"{where}",
            f"{found!r}, read from {path}, is not a valid version (PEP 440)",
            'Write a version such as "1.0.0" or "2.1rc1" there.',
        )


def _check_project(project: Any, ctx: _Context) -> tuple[str, dict[str, Any]]:
    if not isinstance(project, dict):
        _fail(
            ctx.file,
            "no [project] table",
            'Add [project] with name = "digits-cuvil" and version = "1.0.0".',
        )
    name = project.get("name")
    if not isinstance(name, str) or not name:
        _fail(
            f"{ctx.file}: project.name",
            "missing" if name is None else _got(name),
            'Add name = "digits-cuvil" to [project].',
        )
    if "version" not in project and "version" not in project.get("dynamic", []):
        _fail(
            f"{ctx.file}: project.version",
            "missing and not listed in project.dynamic",
            'Add version = "1.0.0" to [project], or dynamic = ["version"] if the build sets it.',
        )
    return name, project


def _read(
    options: tuple[Option, ...], table: dict[str, Any], dotted: str, ctx: _Context
) -> dict[str, Any]:
    """Values of the pyproject-only `options` in `table`, with defaults filled in."""
    values = {}
    for opt in options:
        src = _Source(
            f"{ctx.file}: {dotted}.{opt.key}", f"Write e.g. {opt.key} = {_toml(opt.example)}."
        )
        if opt.key not in table and opt.default is MISSING:
            _fail(src.where, "missing", src.hint.replace("Write", "Add", 1))
        values[opt.attr] = _convert(opt, table.get(opt.key, opt.default), src, ctx)
    return values


def _settings(
    tool: dict[str, Any],
    config_settings: Mapping[str, str | list[str]],
    environ: Mapping[str, str],
    ctx: _Context,
) -> BuildSettings:
    """The build settings, from -C, then the environment, then [tool.cuvil], then defaults."""
    _reject_unknown(config_settings, [o.key for o in _SETTINGS_OPTIONS], "-C config settings", "")
    values, sources = {}, {}
    for opt in _SETTINGS_OPTIONS:
        # An empty -C value or variable counts as not given, so a blank CI variable is harmless.
        text = config_settings.get(opt.key)
        if isinstance(text, list):
            if len(text) != 1:
                _fail(f"-C {opt.key}", f"given {len(text)} times", "Pass it once.")
            text = text[0]
        example = _toml(opt.example).strip('"')
        if text:
            src = _Source(f"-C {opt.key}={text}", f"Pass e.g. -C {opt.key}={example}.")
        elif environ.get(opt.env):
            text = environ[opt.env]
            src = _Source(
                f"environment variable {opt.env}={text}", f"Set e.g. {opt.env}={example}."
            )
        else:
            src = _Source(
                f"{ctx.file}: tool.cuvil.{opt.key}", f"Write e.g. {opt.key} = {_toml(opt.example)}."
            )
        raw = _from_text(opt, text, src) if text else tool.get(opt.key, opt.default)
        values[opt.attr], sources[opt.attr] = _convert(opt, raw, src, ctx), src
    if values["cpu"] == "native" and values["target"] is not None:
        _fail(
            sources["cpu"].where,
            f'"native" means this machine\'s CPU, but the build is for target '
            f"{_toml(values['target'])} ({sources['target'].where})",
            "Unset target for a host build, or name a CPU of that target.",
        )
    return BuildSettings(**values)


def _from_text(opt: Option, text: str, src: _Source) -> Any:
    """A -C or environment string as a value of the option's kind."""
    if opt.kind == "integer":
        try:
            return int(text)
        except ValueError:
            _fail(src.where, f"{text!r} is not an integer", src.hint)
    if opt.kind == "boolean":
        if text.strip().lower() not in _BOOLS:
            _fail(
                src.where, f"{text!r} is not a boolean (true/false, yes/no, on/off, 1/0)", src.hint
            )
        return _BOOLS[text.strip().lower()]
    return text


def _convert(opt: Option, value: Any, src: _Source, ctx: _Context) -> Any:
    """`value` checked against the option and turned into the field's type."""
    if value is None:  # only defaults are None: TOML and -C have no null
        return None
    if opt.kind == "models":
        return _models(value, ctx)
    if opt.kind == "custom-ops":
        return _custom_ops(value, ctx)
    if opt.kind == "inputs":
        return _inputs(value, src)
    if opt.kind == "calibration":
        if isinstance(value, str) and ENTRY_POINT.match(value):
            return value  # imported at build time, not now: reading the config runs no user code
        opt = dataclasses.replace(opt, kind="file")
    expected, check = _KINDS[opt.kind]
    if not check(value) or (opt.choices and value not in opt.choices):
        expected = opt.type_text if opt.choices else expected
        _fail(src.where, f"{_got(value)}, expected {expected}", src.hint)
    if opt.kind == "array of strings":
        return tuple(value)
    if opt.kind == "path":
        return ctx.root / Path(value).expanduser()
    if opt.kind == "size":
        return _size(value)
    if opt.kind == "folder":
        return _project_folder(value, src, ctx)
    if opt.kind == "file":
        return _project_file(value, src, ctx)
    return value


def _project_file(value: str, src: _Source, ctx: _Context) -> Path:
    if Path(value).is_absolute():
        # pyproject.toml travels in the sdist: an absolute path would point outside its copy
        _fail(
            src.where,
            f"{_toml(value)} is an absolute path",
            "Give the path relative to the project root (e.g. \"models/classifier.onnx\"), so "
            "that a build from the sdist finds the file too.",
        )
    path = (ctx.root / value).resolve()
    if ctx.root not in path.parents:
        _fail(
            src.where,
            f"{_toml(value)} is {path}, outside the project root {ctx.root}",
            "Move the file into the project, so that the sdist can carry it, and give its path "
            "relative to the project root.",
        )
    # opened only once it is known to be a file: opening a FIFO would wait for a writer
    kind = not_a_regular_file(path)
    if kind not in (None, "missing"):
        _fail(src.where, f"{_toml(value)} is {kind}, not a file; the path is relative to the "
              f"project root {ctx.root}", "Give the path of the file itself.")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        _fail(
            src.where,
            f"cannot read {path} ({exc.strerror}); the path is relative to the project root "
            f"{ctx.root}",
            "Fix the path or add the file.",
        )
    return path


def _project_folder(value: str, src: _Source, ctx: _Context) -> Path:
    path = (ctx.root / value).resolve()
    if Path(value).is_absolute() or (path != ctx.root and ctx.root not in path.parents):
        _fail(
            src.where,
            f"{_toml(value)} is not a folder inside the project root {ctx.root}",
            'Give a path relative to the project root, e.g. "src" (the sdist carries the folder).',
        )
    if not path.is_dir():
        _fail(src.where, f"{path} is not a folder", "Fix the path or create the folder.")
    return path


def _inputs(value: Any, src: _Source) -> dict[str, tuple[int | str, ...]]:
    if not isinstance(value, dict):
        _fail(src.where, f"{_got(value)}, expected a table of input name -> list of dims", src.hint)
    inputs = {}
    for name, dims in value.items():
        where = f"{src.where}.{_bare(name)}"
        if not isinstance(dims, list):
            _fail(where, f"{_got(dims)}, expected an array of dims", src.hint)
        for i, dim in enumerate(dims):
            fixed = isinstance(dim, int) and not isinstance(dim, bool) and dim >= 1
            if not fixed and not (isinstance(dim, str) and _IDENTIFIER.match(dim)):
                _fail(
                    f"{where}[{i}]",
                    f"{_got(dim)}, expected an integer >= 1 (a fixed size) "
                    'or an identifier string (a symbolic dim such as "batch")',
                    src.hint,
                )
        inputs[name] = tuple(dims)
    return inputs


def _models(value: Any, ctx: _Context) -> tuple[ModelConfig, ...]:
    if not isinstance(value, dict):
        _fail(
            f"{ctx.file}: tool.cuvil.models",
            f"{_got(value)}, expected a table of tables",
            "Write one table per model, e.g. [tool.cuvil.models.classifier] with source = "
            '"models/classifier.onnx".',
        )
    models: list[ModelConfig] = []
    for name, table in value.items():
        dotted = f"tool.cuvil.models.{_bare(name)}"
        where = f"{ctx.file}: {dotted}"
        if not _is_identifier(name):
            _fail(
                where,
                f"the model name {_toml(name)} is not valid (expected {_IDENTIFIER_RULE})",
                "Rename the table, e.g. [tool.cuvil.models.classifier]; the name becomes the C "
                "symbols cuvil_<name>_* and an attribute of the package.",
            )
        if len(name) > MAX_NAME_LENGTH:
            _fail(
                where,
                f"the model name has {len(name)} characters, more than the {MAX_NAME_LENGTH} a "
                "model name may have (it names the model's library file and C symbols)",
                "Rename the table, e.g. [tool.cuvil.models.classifier].",
            )
        clash = next((m.name for m in models if m.name.lower() == name.lower()), None)
        if clash is not None:
            _fail(
                where,
                f"differs from tool.cuvil.models.{clash} only in case, so their files "
                "would clash on case-insensitive file systems",
                "Rename one of them.",
            )
        if not isinstance(table, dict):
            _fail(
                where,
                f"{_got(table)}, expected a table",
                f'Write [{dotted}] with source = "models/{name}.onnx".',
            )
        _reject_unknown(table, [o.key for o in _MODEL_OPTIONS], ctx.file, dotted + ".")
        model = ModelConfig(name=name, **_read(_MODEL_OPTIONS, table, dotted, ctx))
        if model.quantize == "int8" and model.calibration is None:
            _fail(
                f"{where}.calibration",
                'missing; quantize = "int8" needs calibration data',
                'Add calibration = "data/calibration.npz" (one array per model input) or '
                'calibration = "package.module:function" (yielding feed dicts), or set '
                'quantize = "none".',
            )
        unused = [key for key in ("calibration", "calibration-method", "keep-float") if key in table]
        if model.quantize == "none" and unused:
            _fail(
                f"{where}.{unused[0]}",
                f'is set, but the model is not quantized (quantize = {_toml(model.quantize)})',
                f'Add quantize = "int8", or remove {", ".join(unused)}.',
            )
        models.append(model)
    return tuple(models)


_TENSOR_KEYS = ("name", "dtype", "rank", "shape")
_ATTRIBUTE_VALUE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "ints": lambda v: isinstance(v, list) and all(_ATTRIBUTE_VALUE_CHECKS["int"](x) for x in v),
    "floats": lambda v: isinstance(v, list) and all(_ATTRIBUTE_VALUE_CHECKS["float"](x) for x in v),
}


def _custom_ops(value: Any, ctx: _Context) -> tuple[CustomOpConfig, ...]:
    if not isinstance(value, dict):
        _fail(f"{ctx.file}: tool.cuvil.custom-ops", f"{_got(value)}, expected a table of tables",
              "Write one [tool.cuvil.custom-ops.<name>] table per kernel.")
    ops = []
    for name, table in value.items():
        dotted = f"tool.cuvil.custom-ops.{_bare(name)}"
        where = f"{ctx.file}: {dotted}"
        if not _is_identifier(name):
            _fail(where, f"the name {_toml(name)} is not valid (expected {_IDENTIFIER_RULE})",
                  "Rename the table, e.g. [tool.cuvil.custom-ops.soft_clip].")
        if not isinstance(table, dict):
            _fail(where, f"{_got(table)}, expected a table",
                  f'Write [{dotted}] with domain, op-type, inputs, outputs and sources.')
        _reject_unknown(table, [o.key for o in _CUSTOM_OP_OPTIONS], ctx.file, dotted + ".")
        options = {o.attr: o for o in _CUSTOM_OP_OPTIONS}
        plain = [o for o in _CUSTOM_OP_OPTIONS if o.kind in ("string", "integer") and o.key != "workspace"]
        values = _read(tuple(plain), table, dotted, ctx)
        for key in ("domain", "op_type", "function"):
            text = values[key]
            if text is None:
                continue
            ok = _is_identifier(text) if key != "domain" else \
                all(_is_identifier(part) for part in text.split("."))
            if not ok:
                _fail(f"{where}.{options[key].key}", f"{_toml(text)} is not a valid "
                      f"{'domain' if key == 'domain' else 'identifier'}",
                      f"Write e.g. {options[key].key} = {_toml(options[key].example)}.")
        if values["since"] < 1:
            _fail(f"{where}.since", f"{values['since']} is not an opset version", "Write since = 1.")
        inputs = _tensors(table, "inputs", dotted, ctx, output=False)
        attributes = _attributes(table.get("attributes", {}), f"{where}.attributes")
        names = [t.name for t in inputs] + [a.name for a in attributes]
        clash = next((n for n in names if names.count(n) > 1), None)
        if clash is not None:
            _fail(where, f"{clash!r} names two inputs or attributes", "Rename one of them.")
        outputs = _tensors(table, "outputs", dotted, ctx, output=True,
                           names=names, need_shape=values["shape_function"] is None)
        sources = table.get("sources")
        src = _Source(f"{where}.sources", 'Write e.g. sources = ["ops/soft_clip.c"].')
        if not isinstance(sources, list) or not sources or not all(isinstance(x, str) for x in sources):
            _fail(src.where, "missing" if sources is None else f"{_got(sources)}, expected a "
                  "non-empty array of paths", src.hint)
        paths = []
        for i, text in enumerate(sources):
            path = _project_file(text, _Source(f"{src.where}[{i}] ({text})", src.hint), ctx)
            if path.suffix not in (".c", ".cc", ".cpp", ".cxx", ".C"):
                _fail(f"{src.where}[{i}]", f"{_toml(text)} is not a C or C++ source (.c, .cc, "
                      ".cpp, .cxx)", "List the sources to compile; headers are found through "
                      "#include.")
            paths.append(path)
        workspace = table.get("workspace", 0)
        if isinstance(workspace, str):
            check_expression(workspace, names, f"{where}.workspace", 'Write e.g. workspace = "4 * x[1]".')
        elif not (isinstance(workspace, int) and not isinstance(workspace, bool) and workspace >= 0):
            _fail(f"{where}.workspace", f"{_got(workspace)}, expected bytes (an integer or an "
                  "expression)", 'Write e.g. workspace = "4 * x[1]".')
        shape_function = values["shape_function"]
        if shape_function is not None and not re.fullmatch(r"[\w.]+:[\w.]+", shape_function):
            _fail(f"{where}.shape-function", f"{_toml(shape_function)} is not \"module:function\"",
                  'Write e.g. shape-function = "digits.ops:soft_clip_shape".')
        ops.append(CustomOpConfig(
            name=name, domain=values["domain"], op_type=values["op_type"], since=values["since"],
            inputs=inputs, outputs=outputs, attributes=attributes, sources=tuple(paths),
            function=values["function"] or name, shape_function=shape_function,
            workspace=workspace))
    return tuple(ops)


def _tensors(table: dict[str, Any], key: str, dotted: str, ctx: _Context, *, output: bool,
             names: Any = (), need_shape: bool = False) -> tuple[TensorSpec, ...]:
    where = f"{ctx.file}: {dotted}.{key}"
    hint = (f'Write e.g. {key} = [{{ name = "y", dtype = "float32", shape = "x" }}].' if output
            else f'Write e.g. {key} = [{{ name = "x", dtype = "float32", rank = 2 }}].')
    value = table.get(key)
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value) or \
            (output and not value):
        _fail(where, "missing" if value is None else f"{_got(value)}, expected an array of tables",
              hint)
    specs = []
    for i, t in enumerate(value):
        at = f"{where}[{i}]"
        _reject_unknown(t, list(_TENSOR_KEYS if output else _TENSOR_KEYS[:3]), ctx.file,
                        f"{dotted}.{key}[{i}].")
        name, dtype, rank = t.get("name"), t.get("dtype"), t.get("rank")
        if not isinstance(name, str) or not _is_identifier(name):
            _fail(f"{at}.name", "missing" if name is None else f"{_got(name)}, expected an "
                  "identifier", hint)
        if dtype not in CUSTOM_OP_DTYPES:
            _fail(f"{at}.dtype", "missing" if dtype is None else f"{_got(dtype)}, expected one of "
                  + ", ".join(CUSTOM_OP_DTYPES), hint)
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            _fail(f"{at}.rank", f"{_got(rank)}, expected an integer >= 0", hint)
        shape = t.get("shape")
        if output:
            if shape is None and need_shape:
                _fail(f"{at}.shape", "missing (the output's shape rule)", hint + " Or set "
                      "shape-function.")
            dims = [shape] if isinstance(shape, str) else shape
            if shape is not None and not isinstance(dims, list):
                _fail(f"{at}.shape", f"{_got(shape)}, expected an expression or an array of them",
                      hint)
            for d in dims or []:
                if isinstance(d, str):
                    check_expression(d, names, f"{at}.shape", hint)
                elif not (isinstance(d, int) and not isinstance(d, bool) and d >= 0):
                    _fail(f"{at}.shape", f"{_got(d)}, expected a dim expression", hint)
            if isinstance(shape, list):
                if rank is not None and len(shape) != rank:
                    _fail(f"{at}.shape", f"has {len(shape)} dims but rank is {rank}", hint)
                shape = tuple(shape)
        specs.append(TensorSpec(name, dtype, rank, shape))
    return tuple(specs)


def _attributes(value: Any, where: str) -> tuple[AttributeSpec, ...]:
    hint = 'Write e.g. attributes = { alpha = { type = "float", default = 1.0 } }.'
    if not isinstance(value, dict):
        _fail(where, f"{_got(value)}, expected a table of attribute tables", hint)
    specs = []
    for name, spec in value.items():
        at = f"{where}.{_bare(name)}"
        if not _is_identifier(name):
            _fail(at, f"{_toml(name)} is not an identifier", hint)
        if not isinstance(spec, dict):
            _fail(at, f"{_got(spec)}, expected a table with type and default", hint)
        _reject_unknown(spec, ["type", "default"], where, f"{_bare(name)}.")
        kind = spec.get("type")
        if kind not in CUSTOM_OP_ATTRIBUTE_TYPES:
            _fail(f"{at}.type", "missing" if kind is None else f"{_got(kind)}, expected one of "
                  + ", ".join(CUSTOM_OP_ATTRIBUTE_TYPES), hint)
        default = spec.get("default")
        if default is not None and not _ATTRIBUTE_VALUE_CHECKS[kind](default):
            _fail(f"{at}.default", f"{_got(default)}, which is not a value of type {kind}", hint)
        if kind == "float" and default is not None:
            default = float(default)
        if kind == "floats" and default is not None:
            default = [float(x) for x in default]
        specs.append(AttributeSpec(name, kind, default))
    return tuple(specs)
