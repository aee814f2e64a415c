"""Calls a cuvil-compiled model library from Python with numpy arrays.

This file is copied verbatim into every generated package (as `_cuvil_runtime.py`), so it
depends on numpy and the standard library only. cuvil itself uses it for `cuvil.compile`.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import operator
import os
import platform
import sys
import threading
import time
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ._cuvil_session import Session

ABI_VERSION = 4  # 2: run_profiled and the thread-pool exports (thread_pool, use_thread_pool,
#    set_thread_limit); 3: cpu_check, and run's STATUS_CPU_UNSUPPORTED; 4: the checksum covers
#    the expressions the loader sizes memory by (output shapes, workspace, constraints)

__all__ = ["ABI_DTYPES", "ABI_VERSION", "Manifest", "ManifestError", "Model", "ModelSignature",
           "NodeTime", "OpTime", "Profile", "TensorInfo", "TensorSignature", "abi_checksum",
           "load_models"]


def abi_checksum(signature: Mapping[str, Any] | ModelSignature) -> str:
    """sha256 over what caller and library must agree on: ABI version, names, dtypes, shapes,
    and the expressions the caller sizes the library's memory by (each output's shape and
    bound, the workspace, the constraints): a manifest edited there would have the library
    write past the buffers it is given."""
    if isinstance(signature, ModelSignature):
        s: Any = signature
        name, symbols = s.name, s.symbols
        data_dims = [[d.name, d.bound, d.bound_expr] for d in s.data_dims]
        inputs = [[t.name, t.dtype, list(t.shape)] for t in s.inputs]
        outputs = [[t.name, t.dtype, list(t.shape), _listed(t.shape_expr), _listed(t.max_shape_expr)]
                   for t in s.outputs]
        workspace, constraints = s.workspace, [list(c) for c in s.constraints]
    else:  # the compiler's dict, before the manifest is written
        s = signature
        name, symbols = s["name"], s["symbols"]
        data_dims = [[d["name"], d["bound"], d.get("bound_expr")] for d in s.get("data_dims", ())]
        inputs = [[t["name"], t["dtype"], list(t["shape"])] for t in s["inputs"]]
        outputs = [[t["name"], t["dtype"], list(t["shape"]), _listed(t.get("shape_expr")),
                    _listed(t.get("max_shape_expr"))] for t in s["outputs"]]
        workspace, constraints = s.get("workspace"), s.get("constraints", [])
    canonical = {"abi": ABI_VERSION, "model": name, "symbols": list(symbols), "inputs": inputs,
                 "outputs": outputs, "workspace": workspace, "constraints": constraints,
                 "data_dims": data_dims}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return str(_sha256(text.encode()).hexdigest())


def _listed(dims: Any) -> list[Any] | None:
    return None if dims is None else list(dims)


def _sha256(data: bytes) -> Any:
    """hashlib.sha256, without importing hashlib where CPython's own SHA-256 module exists:
    hashlib loads OpenSSL first, which cost a model's import some milliseconds."""
    try:
        from _sha2 import sha256  # type: ignore[import-not-found]  # CPython 3.12 and later
    except ImportError:
        try:
            from _sha256 import sha256  # type: ignore[import-not-found]  # CPython <= 3.11
        except ImportError:  # another interpreter, or a Python built without them
            from hashlib import sha256
    return sha256(data)


class TensorInfo:
    """Name, numpy dtype and shape (ints, or str for symbolic dims) of an input or output.

    `max_shape` is the largest shape the output can have: `shape` with each dim that depends
    on the data (NonZero's count, the boxes NonMaxSuppression keeps) replaced by its upper
    bound over the input dims; `data_dependent` lists those axes (empty for most tensors,
    whose `max_shape` is their `shape`)."""

    __slots__ = ("dtype", "max_shape", "name", "shape")

    def __init__(self, name: str, dtype: np.dtype, shape: tuple[int | str, ...],
                 max_shape: tuple[int | str, ...] | None = None) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.max_shape = shape if max_shape is None else max_shape

    @property
    def data_dependent(self) -> tuple[int, ...]:
        return tuple(i for i, (d, m) in enumerate(zip(self.shape, self.max_shape)) if d != m)

    def __repr__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        bound = (f", max_shape=[{', '.join(str(d) for d in self.max_shape)}]"
                 if self.data_dependent else "")
        return f"TensorInfo(name={self.name!r}, dtype={self.dtype.name}, shape=[{dims}]{bound})"


#: what every model library exports: `exported_symbol(model, part)` for each of these parts
#: (the C header declares them; `cuvil check` requires exactly them)
EXPORTED_PARTS = ("abi_checksum", "cpu_check", "workspace_size", "run", "run_profiled",
                  "thread_pool", "use_thread_pool", "set_thread_limit")


def exported_symbol(model: str, part: str) -> str:
    """The C name of `part` (one of EXPORTED_PARTS) of `model`'s library."""
    return f"cuvil_{model}_{part}"


#: the status codes of the C ABI, defined here once (the compiler's code returns them): a node
#: function returns 0 or a code; `cuvil_<m>_run` stops at the first failing node and returns
#: ``(node_index << 8) | code``
STATUS_OK = 0
STATUS_INDEX_OUT_OF_RANGE = 1
#: a custom op's kernel returned non-zero (cuvil_op.h)
STATUS_CUSTOM_OP_FAILED = 2
#: what `run` returns, running nothing, on a CPU without the flags of the library's lowest
#: copy (negative: no node's status); `cuvil_<m>_cpu_check` names them, and the loader's CPU
#: check refuses such a library before any call
STATUS_CPU_UNSUPPORTED = -1
#: what a node's status means, for the error a call raises
_STATUS_MESSAGES = {
    STATUS_INDEX_OUT_OF_RANGE: "index out of range (an index input holds a value outside the "
                               "dim it indexes; check the values fed to the model)",
    STATUS_CUSTOM_OP_FAILED: "the custom op's kernel reported an error (it returned non-zero)",
}


# -- the manifest (`_models.json`): its schema --------------------------------------------
# What a package's manifest holds, as typed records. The loader reads a package through
# them, and `cuvil check` and `cuvil doctor` judge a wheel by them, so a manifest that one
# accepts the others accept too. Expressions (dims, workspace, constraints, FLOPs) are
# Python text the loader evaluates: only integers, dim names, + - * // %, max/min and, in
# constraints, comparisons joined by `and` are allowed.


class ManifestError(ValueError):
    """The manifest breaks its schema; the message names the key (`models[0].workspace`)."""


#: the dtypes cuvil compiles, by numpy name (the compiler's IR takes them from here)
ABI_DTYPES = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8",
              "uint16", "uint32", "uint64", "bool")
#: longest expression text accepted (the compiler writes a few hundred characters at most)
_MAX_EXPRESSION = 20_000


class _Record:
    """A plain record with a readable repr (not a dataclass: importing dataclasses and
    decorating classes cost the import of every model package milliseconds)."""

    __slots__: tuple[str, ...] = ()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k.lstrip('_'))!r}" for k in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:  # a private field by its public property
        return type(other) is type(self) and all(
            getattr(self, k.lstrip("_")) == getattr(other, k.lstrip("_")) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  # mutable, like a dataclass


class _Frozen(_Record):
    """A record whose fields are given by name once and never change."""

    __slots__: tuple[str, ...] = ()

    def __init__(self, **fields: Any) -> None:
        for key in self.__slots__:
            object.__setattr__(self, key, fields[key])

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")


class TensorSignature(_Frozen):
    """An input or output: name, dtype name and shape (ints; dim names or expressions as
    text). Outputs also give `shape_expr` (how to compute each dim from the input dims) and,
    where the data decides a dim, `max_shape` / `max_shape_expr` (its bound). `onnx_shape`,
    where the compiler knew the ONNX model, is the shape onnxruntime reports for it (None for
    a dim nothing names), which `Model.session()` reports."""

    __slots__ = ("dtype", "max_shape", "max_shape_expr", "name", "onnx_shape", "shape",
                 "shape_expr")
    name: str
    dtype: str
    shape: tuple[int | str, ...]
    shape_expr: tuple[int | str, ...] | None
    max_shape: tuple[int | str, ...] | None
    max_shape_expr: tuple[int | str, ...] | None
    onnx_shape: tuple[int | str | None, ...] | None


class DataDimSignature(_Frozen):
    """A dim the data decides: its name, bound (text and expression) and producing node."""

    __slots__ = ("bound", "bound_expr", "name", "node")
    name: str
    bound: int | str
    bound_expr: int | str
    node: str


class NodeProfileEntry(_Frozen):
    """A node as the profiler reports it: name, what runs, shapes and FLOPs per call."""

    __slots__ = ("flops", "name", "op", "shapes")
    name: str
    op: str
    shapes: str
    flops: int | str


class CpuBaseline(_Frozen):
    """The CPU one architecture's slice of a library needs: its name and the flags."""

    __slots__ = ("baseline", "requires")
    baseline: str
    requires: tuple[str, ...]


class ModelSignature(_Frozen):
    """Everything the package knows of one model's library (a `models` entry)."""

    __slots__ = ("_node_profile", "checksum", "constraints", "cpu", "data_dims", "inputs",
                 "library", "metadata", "name", "nodes", "outputs", "symbols", "workspace")
    name: str
    library: str
    checksum: str
    symbols: tuple[str, ...]
    inputs: tuple[TensorSignature, ...]
    outputs: tuple[TensorSignature, ...]
    constraints: tuple[tuple[str, str], ...]
    nodes: tuple[str, ...]
    data_dims: tuple[DataDimSignature, ...]
    workspace: int | str
    cpu: dict[str, CpuBaseline]
    #: the ONNX model's metadata by onnxruntime's ModelMetadata names ({}: not recorded)
    metadata: dict[str, Any]
    _node_profile: _Reader | tuple[NodeProfileEntry, ...]

    @classmethod
    def from_json(cls, raw: Any, where: str = "model") -> ModelSignature:
        """The signature `raw` (a dict as in `_models.json`) holds; ManifestError naming the
        key where it breaks the schema. Expressions are checked as they are compiled (the
        loader compiles those a call needs), or all at once by `check_expressions`."""
        r = _Reader(raw, where)
        symbols = tuple(r.items("symbols", lambda x: x.identifier()))
        if len(set(symbols)) != len(symbols):
            raise ManifestError(f"{where}.symbols: a name repeats")
        inputs = tuple(r.items("inputs", lambda x: _tensor(x, output=False)))
        for i, t in enumerate(inputs):
            for axis, d in enumerate(t.shape):
                if isinstance(d, str) and d not in symbols:
                    raise ManifestError(f"{where}.inputs[{i}].shape[{axis}]: {d!r} is not one "
                                        "of the model's symbols")
        return cls(
            name=r.identifier("name"), library=r.file_name("library"),
            checksum=r.hex_digest("checksum"), symbols=symbols, inputs=inputs,
            outputs=tuple(r.items("outputs", lambda x: _tensor(x, output=True))),
            constraints=tuple(r.items("constraints", _constraint, optional=True)),
            nodes=r.texts("nodes", optional=True),
            # read when first asked for (a profiled call, `cuvil check`): read at import, its
            # entries cost about 8 us each
            _node_profile=_Reader(*r._get("node_profile", True, []), list),
            data_dims=tuple(r.items("data_dims", _data_dim, optional=True)),
            workspace=r.expression_text("workspace"),
            cpu={arch: _cpu_baseline(x) for arch, x in r.mapping("cpu", optional=True)},
            metadata=_metadata(_Reader(*r._get("metadata", True, {}))))

    @property
    def node_profile(self) -> tuple[NodeProfileEntry, ...]:
        """Each node as the profiler reports it (ManifestError where an entry is malformed)."""
        entries = self._node_profile
        if isinstance(entries, _Reader):  # not read yet
            entries = tuple(entries.items(None, _node_profile))
            object.__setattr__(self, "_node_profile", entries)
        return entries

    @property
    def dim_names(self) -> frozenset[str]:
        """The names expressions may use: the symbols, and the dims the data decides."""
        return frozenset(self.symbols) | {d.name for d in self.data_dims}

    def check_expressions(self, where: str = "model") -> None:
        """ManifestError unless every expression is well formed (what `cuvil check` asks;
        the loader checks each as it compiles it)."""
        symbols, every = frozenset(self.symbols), self.dim_names
        for i, d in enumerate(self.data_dims):
            _expression(d.bound_expr, symbols, f"{where}.data_dims[{i}].bound_expr")
        for i, t in enumerate(self.outputs):
            for key in ("shape_expr", "max_shape_expr"):
                for axis, e in enumerate(getattr(t, key) or ()):
                    _expression(e, every, f"{where}.outputs[{i}].{key}[{axis}]")
        for i, (condition, _) in enumerate(self.constraints):
            _expression(condition, symbols, f"{where}.constraints[{i}][0]", condition=True)
        _expression(self.workspace, symbols, f"{where}.workspace")
        for i, p in enumerate(self.node_profile):
            _expression(p.flops, every, f"{where}.node_profile[{i}].flops")


class Manifest(_Frozen):
    """A generated package's `_models.json`."""

    __slots__ = ("abi_version", "cuvil_version", "models", "package", "target")
    abi_version: int
    package: str
    target: str
    cuvil_version: str
    models: tuple[ModelSignature, ...]

    @classmethod
    def from_json(cls, raw: Any) -> Manifest:
        """The manifest `raw` (the parsed JSON) holds. ManifestError where it breaks the
        schema; an ABI version other than this runtime's is reported before anything else."""
        r = _Reader(raw, "")
        version = r.raw.get("abi_version")
        if version != ABI_VERSION:
            raise ManifestError(f"built for cuvil ABI {version!r}, this runtime speaks ABI "
                                f"{ABI_VERSION}")
        models = tuple(r.items("models", lambda x: ModelSignature.from_json(x.raw, x.where)))
        names = [m.name for m in models]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ManifestError(f"models: model names repeat: {', '.join(repeated)}")
        return cls(abi_version=version, package=r.identifier("package", dotted=True),
                   target=r.text("target"), cuvil_version=r.text("cuvil_version"), models=models)


class _Reader:
    """Reads typed fields of one JSON object, naming the key in every error."""

    __slots__ = ("raw", "where")

    def __init__(self, raw: Any, where: str, kind: type | None = dict) -> None:
        if kind is not None and not isinstance(raw, kind):
            want = "an object" if kind is dict else "a list"
            raise ManifestError(f"{where or 'the manifest'}: expected {want}, got {_json_kind(raw)}")
        self.raw = raw
        self.where = where

    def _path(self, key: str | None) -> str:
        """Where the value at `key` (None: this value) is, as errors name it."""
        if key is None:
            return self.where
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str | None, optional: bool = False, default: Any = None) -> tuple[Any, str]:
        if key is None:  # the value itself (a list item)
            return self.raw, self.where
        where = self._path(key)
        if key not in self.raw:
            if optional:
                return default, where
            raise ManifestError(f"{self.where or 'the manifest'}: lacks {key!r}")
        return self.raw[key], where

    def text(self, key: str | None = None, optional: bool = False) -> str:
        value, where = self._get(key, optional, "")
        if not isinstance(value, str):
            raise ManifestError(f"{where}: expected a string, got {_json_kind(value)}")
        return value

    def identifier(self, key: str | None = None, dotted: bool = False) -> str:
        value = self.text(key)
        parts = value.split(".") if dotted else [value]
        if not all(p.isidentifier() and p.isascii() for p in parts):
            raise ManifestError(f"{self._path(key)}: {value!r} is not "
                                f"{'a dotted name' if dotted else 'an identifier'}")
        return value

    def file_name(self, key: str) -> str:
        value = self.text(key)
        if not value or value in (".", "..") or any(c in value for c in "/\\\0:"):
            raise ManifestError(f"{self._path(key)}: {value!r} is not a bare file name")
        return value

    def hex_digest(self, key: str) -> str:
        value = self.text(key)
        if len(value) != 64 or value.strip("0123456789abcdef"):
            raise ManifestError(f"{self._path(key)}: {value!r} is not a sha256 hex digest")
        return value

    def expression_text(self, key: str | None = None) -> int | str:
        value, where = self._get(key)
        if type(value) is not int and not isinstance(value, str):
            raise ManifestError(f"{where}: expected an integer or an expression (a string), "
                                f"got {_json_kind(value)}")
        return value

    def dims(self, key: str, optional: bool = False) -> tuple[int | str, ...] | None:
        if optional and key not in self.raw:
            return None
        return tuple(self.items(key, lambda x: x.expression_text()))

    def texts(self, key: str, optional: bool = False) -> tuple[str, ...]:
        value = self._get(key, optional, [])[0]
        if isinstance(value, list) and all(type(x) is str for x in value):
            return tuple(value)
        return tuple(self.items(key, lambda x: x.text(), optional))  # names the bad item

    def items(self, key: str | None, item: Any, optional: bool = False) -> list[Any]:
        value, where = self._get(key, optional, [])
        if not isinstance(value, list):
            raise ManifestError(f"{where}: expected a list, got {_json_kind(value)}")
        return [item(_Reader(v, f"{where}[{i}]", None)) for i, v in enumerate(value)]

    def mapping(self, key: str, optional: bool = False) -> list[tuple[str, _Reader]]:
        value, where = self._get(key, optional, {})
        if not isinstance(value, dict):
            raise ManifestError(f"{where}: expected an object, got {_json_kind(value)}")
        return [(k, _Reader(v, f"{where}.{k}")) for k, v in value.items()]


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an "
            "integer", float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _tensor(item: _Reader, output: bool) -> TensorSignature:
    r = _Reader(item.raw, item.where)
    dtype = r.text("dtype")
    if dtype not in ABI_DTYPES:
        raise ManifestError(f"{item.where}.dtype: {dtype!r} is not one of "
                            f"{', '.join(ABI_DTYPES)}")
    shape = r.dims("shape")
    assert shape is not None
    for axis, d in enumerate(shape):
        if isinstance(d, int) and d < 0:
            raise ManifestError(f"{item.where}.shape[{axis}]: a dim cannot be negative ({d})")
    fields: dict[str, Any] = {"name": r.text("name"), "dtype": dtype, "shape": shape,
                              "shape_expr": None, "max_shape": None, "max_shape_expr": None,
                              "onnx_shape": None}
    if "onnx_shape" in r.raw:
        fields["onnx_shape"] = tuple(r.items("onnx_shape", _onnx_dim))
        if len(fields["onnx_shape"]) != len(shape):
            raise ManifestError(f"{item.where}.onnx_shape: {len(fields['onnx_shape'])} dims, but "
                                f"shape has {len(shape)}")
    if output:
        fields.update(shape_expr=r.dims("shape_expr"), max_shape=r.dims("max_shape", True),
                      max_shape_expr=r.dims("max_shape_expr", True))
        for key in ("shape_expr", "max_shape", "max_shape_expr"):
            if fields[key] is not None and len(fields[key]) != len(shape):
                raise ManifestError(f"{item.where}.{key}: {len(fields[key])} dims, but shape "
                                    f"has {len(shape)}")
        if (fields["max_shape"] is None) != (fields["max_shape_expr"] is None):
            raise ManifestError(f"{item.where}: max_shape and max_shape_expr come together")
    return TensorSignature(**fields)


def _onnx_dim(item: _Reader) -> int | str | None:
    value = item.raw
    if value is None or isinstance(value, str) or (type(value) is int and value >= 0):
        return value
    raise ManifestError(f"{item.where}: expected a size, a name or null, got {_json_kind(value)}")


#: the text fields of a model's `metadata` (all optional), besides `version` (an integer) and
#: `custom_metadata_map` (an object of strings)
_METADATA_TEXTS = ("producer_name", "graph_name", "domain", "description", "graph_description")


def _metadata(r: _Reader) -> dict[str, Any]:
    meta: dict[str, Any] = {key: r.text(key) for key in _METADATA_TEXTS if key in r.raw}
    version, where = r._get("version", True)
    if version is not None:
        if type(version) is not int:
            raise ManifestError(f"{where}: expected an integer, got {_json_kind(version)}")
        meta["version"] = version
    if "custom_metadata_map" in r.raw:
        entries, where = r._get("custom_metadata_map")
        if not isinstance(entries, dict):
            raise ManifestError(f"{where}: expected an object, got {_json_kind(entries)}")
        meta["custom_metadata_map"] = {k: _Reader(v, f"{where}.{k}", None).text()
                                       for k, v in entries.items()}
    return meta


def _data_dim(item: _Reader) -> DataDimSignature:
    r = _Reader(item.raw, item.where)
    return DataDimSignature(name=r.identifier("name"), bound=r.expression_text("bound"),
                            bound_expr=r.expression_text("bound_expr"), node=r.text("node"))


def _constraint(item: _Reader) -> tuple[str, str]:
    r = _Reader(item.raw, item.where, list)
    if len(r.raw) != 2:
        raise ManifestError(f"{item.where}: expected [condition, message]")
    return (_Reader(r.raw[0], f"{item.where}[0]", None).text(),
            _Reader(r.raw[1], f"{item.where}[1]", None).text())


def _node_profile(item: _Reader) -> NodeProfileEntry:
    r = _Reader(item.raw, item.where)
    return NodeProfileEntry(name=r.text("name"), op=r.text("op"),
                            shapes=r.text("shapes", optional=True),
                            flops=r.expression_text("flops"))


def _cpu_baseline(r: _Reader) -> CpuBaseline:
    return CpuBaseline(baseline=r.text("baseline"),
                       requires=r.texts("requires"))


#: the syntax allowed in a manifest's expressions (class names of Python's AST): a dim
#: expression, and what a constraint adds
_DIM_SYNTAX = frozenset({"Expression", "BinOp", "UnaryOp", "Call", "Name", "Constant", "Load",
                         "Add", "Sub", "Mult", "FloorDiv", "Mod", "USub", "UAdd"})
_CONDITION_SYNTAX = _DIM_SYNTAX | {"Compare", "BoolOp", "And", "Eq", "NotEq", "Lt", "LtE", "Gt",
                                   "GtE"}
_ONLY_AST = 0x400  # ast.PyCF_ONLY_AST, without importing ast (about a millisecond at start-up)


def _expression(text: int | str, names: frozenset[str], where: str,
                condition: bool = False) -> Any:
    """`text` as a program for `_run` (an int stays an int), after checking that it uses only
    the allowed syntax and `names` (and max, min); ManifestError otherwise. Nothing read from
    a manifest is ever executed as Python: the checked syntax tree becomes a list of steps."""
    if isinstance(text, int):
        return text
    if len(text) > _MAX_EXPRESSION:
        raise ManifestError(f"{where}: an expression of {len(text)} characters (at most "
                            f"{_MAX_EXPRESSION})")
    try:
        tree = compile(text, where, "eval", _ONLY_AST)
        allowed = _CONDITION_SYNTAX if condition else _DIM_SYNTAX
        todo = [tree]
        while todo:  # no recursion: a deep tree must not overflow the stack
            node = todo.pop()
            kind = type(node).__name__
            bad = None
            if kind not in allowed:
                bad = f"{kind.lower()} syntax"
            elif kind == "Name" and node.id not in names:
                bad = f"the unknown name {node.id!r}"
            elif kind == "Constant" and type(node.value) is not int:
                bad = f"the constant {node.value!r}"
            elif kind == "Call" and (type(node.func).__name__ != "Name"
                                     or node.func.id not in ("max", "min")
                                     or node.keywords or len(node.args) < 2):
                bad = "a call other than max(a, b, ...) or min(a, b, ...)"
            elif kind == "BinOp" and type(node.op).__name__ in ("FloorDiv", "Mod") and (
                    type(node.right).__name__ == "Constant" and node.right.value == 0):
                bad = "a division by zero"
            if bad:
                raise ManifestError(f"{where}: {text[:80]!r} uses {bad}")
            if kind == "Call":  # its function is max or min, checked above
                todo.extend(node.args)
                continue
            for field in node._fields:
                value = getattr(node, field, None)
                todo.extend(value if isinstance(value, list) else
                            [value] if hasattr(value, "_fields") else [])
        return _program(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"{where}: {text[:80]!r} is not a valid expression "
                            f"({type(exc).__name__})") from None


_BINARY = {"Add": operator.add, "Sub": operator.sub, "Mult": operator.mul,
           "FloorDiv": operator.floordiv, "Mod": operator.mod, "Eq": operator.eq,
           "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le, "Gt": operator.gt,
           "GtE": operator.ge}


def _program(tree: Any) -> tuple[tuple[str, Any], ...]:
    """A checked expression tree (`_expression`) as steps in postfix order, made without
    recursion: ("int", value), ("dim", name), ("binary", op), ("negate", None),
    ("call", (max or min, count)), ("compare", ops), ("and", count)."""
    steps: list[tuple[str, Any]] = []
    todo: list[tuple[Any, bool]] = [(tree.body, False)]
    while todo:
        node, ready = todo.pop()
        kind = type(node).__name__
        if ready:  # its operands are on the stack
            if kind == "BinOp":
                steps.append(("binary", _BINARY[type(node.op).__name__]))
            elif kind == "UnaryOp":
                if type(node.op).__name__ == "USub":
                    steps.append(("negate", None))
            elif kind == "Call":
                steps.append(("call", (max if node.func.id == "max" else min, len(node.args))))
            elif kind == "Compare":
                steps.append(("compare", [_BINARY[type(op).__name__] for op in node.ops]))
            else:  # BoolOp: And, the only one allowed
                steps.append(("and", len(node.values)))
        elif kind == "Constant":
            steps.append(("int", node.value))
        elif kind == "Name":
            steps.append(("dim", node.id))
        else:
            operands = ([node.left, node.right] if kind == "BinOp" else
                        [node.operand] if kind == "UnaryOp" else
                        [node.left, *node.comparators] if kind == "Compare" else
                        node.args if kind == "Call" else node.values)  # BoolOp
            todo.append((node, True))
            todo.extend((child, False) for child in reversed(operands))
    return tuple(steps)


def _run(program: Any, env: Mapping[str, int]) -> Any:
    """The value of an `_expression` for the dims in `env` (an int program is itself);
    KeyError for a dim `env` lacks."""
    if isinstance(program, int):
        return program
    stack: list[Any] = []
    for step, arg in program:
        if step == "int":
            stack.append(arg)
        elif step == "dim":
            stack.append(env[arg])
        elif step == "binary":
            right = stack.pop()
            stack.append(arg(stack.pop(), right))
        elif step == "negate":
            stack.append(-stack.pop())
        else:
            count = arg[1] if step == "call" else len(arg) + 1 if step == "compare" else arg
            values = stack[len(stack) - count:]
            del stack[len(stack) - count:]
            if step == "call":
                stack.append(arg[0](values))
            elif step == "compare":
                stack.append(all(op(a, b) for op, a, b in zip(arg, values, values[1:])))
            else:
                stack.append(all(values))
    return stack[0]


#: input shapes whose checked dims, output shapes and workspace size a model remembers
_PLAN_CACHE_SIZE = 64


class _Plan:
    """A model's call for one set of input shapes: symbolic dims, output shapes, workspace
    bytes, and the dims as the library reads them."""

    __slots__ = ("dim_values", "dims", "empty", "out_shapes", "workspace")

    def __init__(self, dims: dict[str, int], out_shapes: tuple[tuple[int, ...], ...],
                 workspace: int, dim_values: Any, empty: bool) -> None:
        self.dims = dims
        self.out_shapes = out_shapes
        self.workspace = workspace
        self.dim_values = dim_values
        self.empty = empty  # every output is empty: the library is not called


def _evaluated(shape: Sequence[Any], env: dict[str, Any]) -> tuple[int, ...]:
    """A shape's dims (`_expression`s): integers as they are, programs run in `env`."""
    return tuple(int(_run(d, env)) for d in shape)


class _Scratch:
    """One thread's memory for calling one model: the workspace, grown to the largest call
    so far and reused, and the arrays of input and output pointers."""

    __slots__ = ("address", "buffer", "capacity", "inputs", "outputs")

    def __init__(self, n_inputs: int, n_outputs: int) -> None:
        self.buffer: np.ndarray | None = None
        self.address = 0
        self.capacity = 0
        self.inputs = (ctypes.c_void_p * max(n_inputs, 1))()
        self.outputs = (ctypes.c_void_p * max(n_outputs, 1))()

    def grow(self, size: int) -> None:
        self.buffer = None  # free the old buffer first: lower peak memory
        self.buffer = np.empty(size + 64, dtype=np.uint8)
        address = self.buffer.ctypes.data
        self.address = address + (-address) % 64  # 64-byte aligned like the planner assumes
        self.capacity = size


def _address(a: np.ndarray) -> int:
    """The address of an array's data; through the buffer protocol, several times faster than
    `a.ctypes.data`, for writeable non-empty arrays."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
    except (TypeError, ValueError):  # read-only or empty
        return int(a.ctypes.data)


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


class Model:
    """A compiled model: call it with arrays (positional or by input name) or use `.run`.

    `num_threads` (also settable later, `model.num_threads = 1`) caps the threads one call
    uses, the calling thread included; None uses the process's pool, whose size is
    CUVIL_NUM_THREADS or the CPUs the process may run on. Every model in a process shares
    that one pool.
    """

    def __init__(self, library_path: str | os.PathLike[str],
                 signature: Mapping[str, Any] | ModelSignature, keep_alive: Any = None,
                 num_threads: int | None = None) -> None:
        if not isinstance(signature, ModelSignature):
            signature = ModelSignature.from_json(signature)
        self.signature = signature
        self.name: str = signature.name
        self._path = os.fspath(library_path)
        self._keep_alive = keep_alive  # e.g. the temporary directory of cuvil.compile
        self.inputs = tuple(TensorInfo(t.name, np.dtype(t.dtype), t.shape)
                            for t in signature.inputs)
        self.outputs = tuple(TensorInfo(t.name, np.dtype(t.dtype), t.shape, t.max_shape)
                             for t in signature.outputs)
        self._symbols = signature.symbols
        self._node_labels = signature.nodes
        # buffers are allocated for the largest shape; the run writes the dims the data decides
        # into the dim array after the input dims, which give the outputs' actual shapes
        self._data_dims = tuple(d.name for d in signature.data_dims)
        names = signature.dim_names
        where = f"model {self.name!r}: "
        self._out_shapes = [[_expression(d, names, f"{where}outputs[{i}].shape_expr")
                             for d in t.max_shape_expr or t.shape_expr or ()]
                            for i, t in enumerate(signature.outputs)]
        self._actual_shapes = [None if t.max_shape_expr is None or t.shape == t.max_shape
                               else [_expression(d, names, f"{where}outputs[{i}].shape_expr")
                                     for d in t.shape_expr or ()]
                               for i, t in enumerate(signature.outputs)]
        self._data_bounds = [_expression(d.bound_expr, names, f"{where}data_dims[{i}].bound_expr")
                             for i, d in enumerate(signature.data_dims)]
        self._workspace = _expression(signature.workspace, names, f"{where}workspace")
        self._constraints = [(_expression(c, names, f"{where}constraints[{i}]", condition=True),
                              msg) for i, (c, msg) in enumerate(signature.constraints)]
        self._lib = self._load(signature)
        self._run = _function(self._lib, self.name, "run")
        self._run.restype = ctypes.c_int32
        self._run.argtypes = [ctypes.c_void_p] * 4
        self._run_profiled = _function(self._lib, self.name, "run_profiled")
        self._run_profiled.restype = ctypes.c_int32
        self._run_profiled.argtypes = [ctypes.c_void_p] * 5
        self._node_flops: list[Any] | None = None
        self._lock = threading.Lock()
        self._plans: dict[tuple[tuple[int, ...], ...], _Plan] = {}  # by the inputs' shapes
        self._scratch = threading.local()  # .current: this thread's _Scratch
        self._out_is_input = any(t.name == "out" for t in self.inputs)
        # CUVIL_PROFILE=1: every call is profiled and the sum printed when the process exits
        self._process_profile: Profile | None = None
        if os.environ.get("CUVIL_PROFILE", "0") not in ("", "0"):
            self._process_profile = self._new_profile()
            atexit.register(self._print_session)
        self._set_thread_limit = _function(self._lib, self.name, "set_thread_limit")
        self._set_thread_limit.argtypes = [ctypes.c_int32]
        self._set_thread_limit.restype = None
        if not _share_thread_pool(self._lib, self.name):
            _unload_when_dropped(self, self._lib)
        self.num_threads = num_threads

    @property
    def num_threads(self) -> int | None:
        """The most threads one call uses (None: as many as the process's pool has)."""
        return self._num_threads

    @num_threads.setter
    def num_threads(self, value: int | None) -> None:
        self._num_threads = self._checked_threads(value, f"{self.name}.num_threads")

    def _checked_threads(self, value: int | None, what: str) -> int | None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{what} must be None or an int >= 1, got {value!r}")
        return value

    def session(self, num_threads: int | None = None) -> Session:
        """The model as an onnxruntime InferenceSession: `run(output_names, input_feed)`,
        `get_inputs()`, `get_outputs()`, `get_modelmeta()`, `get_providers()`, raising the
        errors onnxruntime raises (docs/migrating.md). `num_threads` caps the threads of its
        calls (None: the model's `num_threads`), as SessionOptions.intra_op_num_threads does."""
        from ._cuvil_session import Session  # shipped beside this file; most callers never need it

        return Session(self, self._checked_threads(num_threads, f"{self.name}.session(num_threads)"))

    def _load(self, signature: ModelSignature) -> ctypes.CDLL:
        try:
            lib = _open_library(self._path)
        except (OSError, UnicodeDecodeError) as exc:  # ctypes decodes dlerror()'s text as UTF-8
            raise ImportError(f"cannot load model library {self._path}: {exc}"
                              f"{_why_not_loadable(self._path, str(exc))}") from None
        symbol = exported_symbol(self.name, "abi_checksum")
        try:
            found = (ctypes.c_char * 64).in_dll(lib, symbol).value.decode("ascii", "replace")
        except ValueError:
            raise ImportError(f"{self._path} has no {symbol}: it is not a cuvil library for "
                              f"model {self.name!r}") from None
        expected = abi_checksum(signature)
        if found != expected:
            raise ImportError(
                f"{self._path}: ABI checksum mismatch for model {self.name!r}: the library was "
                f"built for a different signature (library {found[:16]}..., package expects "
                f"{expected[:16]}...; expected inputs "
                + ", ".join(f"{t.name}: {t.dtype.name}{list(t.shape)}" for t in self.inputs)
                + "). Reinstall the package so its files come from one build."
            )
        self._check_cpu(lib, signature)
        return lib

    def _check_cpu(self, lib: ctypes.CDLL, signature: ModelSignature) -> None:
        """Refuse, before any of the library's code for its baseline runs, a CPU without the
        flags it needs: the library's check is compiled for the plain architecture."""
        check = _function(lib, self.name, "cpu_check")
        check.restype = ctypes.c_int32
        check.argtypes = [ctypes.c_char_p, ctypes.c_int64]
        missing = ctypes.create_string_buffer(1024)
        if check(missing, len(missing)) >= 0:
            return
        names = missing.value.decode("ascii", "replace").split()
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                              platform.machine().lower())
        cpu = signature.cpu[machine].baseline if machine in signature.cpu else "?"
        raise ImportError(
            f"model {self.name!r} ({self._path}) needs CPU features this machine lacks: "
            f"{', '.join(names)}. The library was built for CPU baseline {cpu!r}. Rebuild the "
            "package for a lower CPU (e.g. `pip wheel . -C cpu=x86-64`, or tool.cuvil.cpu in "
            "pyproject.toml), or use a machine with these features."
        )

    # -- calling ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Outputs for the inputs (positional or by name): one array, or a tuple of them.

        `out=` (keyword only) writes the outputs into caller arrays and returns them, like
        numpy's ufuncs: one array for a one-output model, else a tuple or list with an array
        or None (allocate that one) per output. A model with an input named `out` takes that
        input by this keyword instead; use `run(feeds, out=...)` there.
        """
        out = None
        if "out" in kwargs and not self._out_is_input:
            out = self._out_list(kwargs.pop("out"))
        feeds = args if not kwargs and len(args) == len(self.inputs) else self._bind(args, kwargs)
        outs = self._execute(feeds, out=out)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def run(self, feeds: Mapping[str, Any],
            out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Run with a dict of input name -> array; returns a dict of output name -> array.

        `out=`, a dict of output name -> array (any subset of the outputs), writes those
        outputs into the given arrays; the returned dict holds the same arrays.
        """
        if not isinstance(feeds, Mapping):
            raise TypeError(f"{self.name}.run expects a dict of input name -> array")
        unknown = set(feeds) - {t.name for t in self.inputs}
        if unknown:
            raise ValueError(f"{self.name}: unknown inputs {sorted(unknown)}; the inputs are "
                             f"{[t.name for t in self.inputs]}")
        out_list = None
        if out is not None:
            if not isinstance(out, Mapping):
                raise TypeError(f"{self.name}.run: out must be a dict of output name -> array, "
                                f"got {type(out).__name__}")
            names = [t.name for t in self.outputs]
            unknown = set(out) - set(names)
            if unknown:
                raise ValueError(f"{self.name}: out names unknown outputs {sorted(unknown)}; the "
                                 f"outputs are {names}")
            out_list = [out.get(n) for n in names]
        outs = self._execute([self._get(feeds, t.name) for t in self.inputs], out=out_list)
        return {t.name: a for t, a in zip(self.outputs, outs)}

    def _get(self, feeds: Mapping[str, Any], name: str) -> Any:
        if name not in feeds:
            raise ValueError(f"{self.name}: missing input {name!r}")
        return feeds[name]

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        n = len(self.inputs)
        if len(args) > n:
            raise TypeError(f"{self.name}() takes {n} inputs but {len(args)} were given")
        bound = list(args) + [None] * (n - len(args))
        names = [t.name for t in self.inputs]
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"{self.name}() got an unknown input {key!r}; inputs: {names}")
            i = names.index(key)
            if i < len(args):
                raise TypeError(f"{self.name}() got input {key!r} twice")
            bound[i] = value
        missing = [names[i] for i, v in enumerate(bound) if v is None]
        if missing:
            raise TypeError(f"{self.name}() is missing inputs {missing}")
        return bound

    def _out_list(self, out: Any) -> list[Any] | None:
        """`out=` of a call as one entry (array or None) per output."""
        if out is None:
            return None
        if isinstance(out, np.ndarray) and len(self.outputs) == 1:
            return [out]
        if isinstance(out, (tuple, list)) and len(out) == len(self.outputs):
            return list(out)
        count = len(self.outputs)
        want = ("an array or a tuple of one array" if count == 1
                else f"a tuple or list of {count} arrays (None for any to allocate)")
        raise TypeError(f"{self.name}(): out must be {want}, got {_kind(out)}")

    def _arrays(self, values: Sequence[Any]) -> tuple[list[np.ndarray], tuple[Any, ...]]:
        """The inputs as arrays of the right dtype, dense and aligned (copied if not), and
        their shapes."""
        arrays = []
        shapes = []
        for info, value in zip(self.inputs, values):
            a = value if type(value) is np.ndarray else np.asarray(value)
            if a.dtype != info.dtype:
                a = self._in_native_order(info, value, a)
            flags = a.flags
            # the library reads dense row-major data
            arrays.append(a if flags.c_contiguous and flags.aligned else np.ascontiguousarray(a))
            shapes.append(a.shape)
        return arrays, tuple(shapes)

    def _in_native_order(self, info: TensorInfo, value: Any, a: np.ndarray) -> np.ndarray:
        """`a` converted to this machine's byte order if only that differs from the input's
        dtype (the same values, so no loss; onnxruntime would misread the bytes instead);
        otherwise a ValueError that says how to convert."""
        if a.dtype.newbyteorder("=") == info.dtype:
            return a.astype(info.dtype)
        got = a.dtype.name
        if not a.dtype.isnative:
            got += f" ({'big' if a.dtype.byteorder == '>' else 'little'}-endian)"
        if isinstance(value, np.ndarray):
            fix = f"convert it with .astype(np.{info.dtype.name})"
        else:  # a list, a scalar...: np.asarray picked the dtype
            got = f"{_kind(value)}, which np.asarray makes {got}"
            fix = f"pass np.asarray(value, dtype=np.{info.dtype.name})"
        raise ValueError(f"{self.name}: input {info.name!r} must have dtype {info.dtype.name}, "
                         f"got {got}; {fix}")

    def _plan(self, arrays: Sequence[np.ndarray], shapes: tuple[Any, ...]) -> _Plan:
        """What depends on the input shapes only, checked and worked out once per shape."""
        dims: dict[str, int] = {}
        for info, a in zip(self.inputs, arrays):
            if a.ndim != len(info.shape):
                raise ValueError(f"{self.name}: input {info.name!r} must have shape "
                                 f"{_shape_text(info.shape)} (rank {len(info.shape)}), got "
                                 f"{list(a.shape)}")
            for axis, (want, got) in enumerate(zip(info.shape, a.shape)):
                if isinstance(want, int):
                    if want != got:
                        raise ValueError(f"{self.name}: input {info.name!r} dim {axis} must be "
                                         f"{want}, got {got} (expected shape "
                                         f"{_shape_text(info.shape)}, got {list(a.shape)})")
                elif want in dims and dims[want] != got:
                    raise ValueError(f"{self.name}: input {info.name!r} dim {axis} ({want!r}) is "
                                     f"{got}, but {want!r} is {dims[want]} in another dim")
                else:
                    dims[want] = got
        env: dict[str, Any] = dict(dims)
        try:
            for code, message in self._constraints:
                if not _run(code, env):
                    raise ValueError(f"{self.name}: the input sizes break a constraint of the "
                                     f"model: {message} (with {self._dims_text(dims)}); feed "
                                     "inputs whose dims satisfy it")
            out_shapes = tuple(_evaluated(shape, env) for shape in self._out_shapes)
            # a dim is 0 and so is some dim of every output: nothing to compute
            empty = all(0 in shape for shape in out_shapes)
            if empty:
                out_shapes = self._empty_shapes(dims, env)
            ws = (1 if empty else self._workspace if isinstance(self._workspace, int)
                  else _run(self._workspace, env))
        except ZeroDivisionError:  # a size divided by a dim that is 0 here
            if 0 not in dims.values():  # not the empty-input case this message is for
                raise
            raise self._not_empty(dims, "its output sizes divide by that dim") from None
        dim_values = (ctypes.c_int64 * max(len(self._symbols) + len(self._data_dims), 1))(
            *[dims[s] for s in self._symbols])
        plan = _Plan(dims, out_shapes, max(int(ws), 1), dim_values, empty)
        if len(self._plans) >= _PLAN_CACHE_SIZE:
            self._plans.clear()  # many distinct shapes: start over rather than grow unbounded
        self._plans[shapes] = plan
        return plan

    def _empty_shapes(self, dims: dict[str, int], env: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
        """The outputs' shapes when every output is empty, as onnxruntime gives them. Refused
        where the data would decide an output's shape."""
        # a dim the data decides is known only where its bound is 0
        known = {**env, **{name: 0 for name, bound in zip(self._data_dims, self._data_bounds)
                           if _evaluated([bound], env) == (0,)}}
        shapes = []
        for info, max_code, code in zip(self.outputs, self._out_shapes, self._actual_shapes):
            shape = _evaluated(max_code, env)
            if code is not None:
                try:
                    shape = _evaluated(code, known)
                except KeyError:
                    raise self._not_empty(dims, f"the data decides output {info.name!r}'s "
                                                "shape") from None
            shapes.append(shape)
        return tuple(shapes)

    def _not_empty(self, dims: dict[str, int], why: str) -> ValueError:
        zero = {k: v for k, v in dims.items() if v == 0}
        return ValueError(
            f"{self.name}: {self._dims_text(zero)}, and {why}; feed at least one element "
            "along that dim")

    def _outputs(self, plan: _Plan, arrays: Sequence[np.ndarray], in_addresses: Sequence[int],
                 out: Sequence[Any] | None) -> tuple[list[np.ndarray], list[int]]:
        """The output arrays and their addresses: the caller's (checked) where `out` gives
        one, else new ones."""
        outs: list[np.ndarray] = []
        addresses: list[int] = []
        for i, (info, shape) in enumerate(zip(self.outputs, plan.out_shapes)):
            given = None if out is None else out[i]
            if given is None:
                outs.append(np.empty(shape, info.dtype))
                addresses.append(_address(outs[-1]))
                continue
            what = f"{self.name}: out for output {info.name!r}"
            if not isinstance(given, np.ndarray):
                raise TypeError(f"{what} must be a numpy array, got {_kind(given)}")
            if given.dtype != info.dtype:
                raise ValueError(f"{what} must have dtype {info.dtype.name}, got "
                                 f"{given.dtype.name}; allocate it with dtype=np.{info.dtype.name}")
            if given.shape != shape:
                raise ValueError(f"{what} must have shape {list(shape)} for these inputs, got "
                                 f"{list(given.shape)}")
            flags = given.flags
            if not flags.carray:  # C-contiguous, aligned and writeable
                if not flags.writeable:
                    raise ValueError(f"{what} is read-only; pass a writeable array")
                raise ValueError(f"{what} must be C-contiguous and aligned; pass a fresh "
                                 f"np.empty({tuple(shape)}, np.{info.dtype.name}) or a "
                                 "contiguous slice")
            address, size = _address(given), given.nbytes
            # every array here is dense, so overlapping byte ranges mean shared elements
            for other, a, start in zip(self.inputs, arrays, in_addresses):
                if start < address + size and address < start + a.nbytes:
                    raise ValueError(f"{what} shares memory with input {other.name!r}; the model "
                                     "reads its inputs while it writes outputs, so pass a "
                                     "separate array")
            for other, o, start in zip(self.outputs, outs, addresses):
                if start < address + size and address < start + o.nbytes:
                    raise ValueError(f"{what} shares memory with out for output "
                                     f"{other.name!r}; pass a separate array for each output")
            outs.append(given)
            addresses.append(address)
        return outs, addresses

    def _dims_text(self, dims: Mapping[str, int]) -> str:
        """Each symbolic dim's value and the first input dim it was read from."""
        where: dict[str, str] = {}
        for info in self.inputs:
            for axis, d in enumerate(info.shape):
                if isinstance(d, str) and d not in where:
                    where[d] = f"input {info.name!r} dim {axis}"
        return ", ".join(f"{s} = {v} ({where.get(s, '?')})" for s, v in dims.items())

    # -- profiling ----------------------------------------------------------------------
    def profile(self, feeds: Mapping[str, Any], runs: int = 10, warmup: int = 1) -> Profile:
        """Run `runs` times (after `warmup` untimed runs) timing every node; `str()` of the
        result is a table by op type and by node."""
        if runs < 1 or warmup < 0:
            raise ValueError(f"{self.name}.profile: runs must be at least 1 and warmup at least 0")
        for _ in range(warmup):
            self.run(feeds)  # also checks the feeds
        values = [self._get(feeds, t.name) for t in self.inputs]
        result = self._new_profile()
        for _ in range(runs):
            self._execute(values, profile=result)
        return result

    def _new_profile(self) -> Profile:
        return Profile(self.name, [NodeTime(i, p.name, p.op, p.shapes)
                                   for i, p in enumerate(self.signature.node_profile)])

    def _print_session(self) -> None:
        if self._process_profile is not None and self._process_profile.runs:
            sys.stderr.write(f"{self._process_profile}\n")

    def _execute(self, values: Sequence[Any], profile: Profile | None = None,
                 out: Sequence[Any] | None = None,
                 num_threads: int | None = None) -> list[np.ndarray]:
        profile = profile or self._process_profile
        start = time.perf_counter_ns() if profile is not None else 0
        arrays, shapes = self._arrays(values)
        plan = self._plans.get(shapes) or self._plan(arrays, shapes)
        in_addresses = [_address(a) for a in arrays]
        outs, out_addresses = self._outputs(plan, arrays, in_addresses, out)
        if plan.empty:
            return outs
        # this thread's scratch, taken out of the thread-local while in use so that a call
        # re-entering on this thread (a signal handler) builds its own instead of sharing it
        scratch = self._scratch.__dict__.pop("current", None) or _Scratch(len(arrays),
                                                                           len(outs))
        if plan.workspace > scratch.capacity:
            scratch.grow(plan.workspace)
        in_ptrs, out_ptrs = scratch.inputs, scratch.outputs
        in_ptrs[:len(arrays)] = in_addresses
        out_ptrs[:len(outs)] = out_addresses
        # per calling thread, in the library
        self._set_thread_limit(num_threads or self._num_threads or 0)
        # the run writes the data-dependent dims into its dim array: one per call
        dims = (plan.dim_values if not self._data_dims
                else type(plan.dim_values).from_buffer_copy(plan.dim_values))
        if profile is None:
            status = self._run(in_ptrs, out_ptrs, dims, scratch.address)
        else:
            stamps = (ctypes.c_uint64 * (len(self.signature.node_profile) + 2))()
            status = self._run_profiled(in_ptrs, out_ptrs, dims, scratch.address, stamps)
            if status == 0:
                if self._node_flops is None:  # not at load: most processes never profile
                    names = self.signature.dim_names
                    self._node_flops = [_expression(p.flops, names, f"model {self.name!r}: "
                                                    f"node_profile[{i}].flops")
                                        for i, p in enumerate(self.signature.node_profile)]
                env = {**plan.dims, **self._data_dim_values(dims)}
                flops = [int(_run(f, env)) for f in self._node_flops]
                with self._lock:
                    profile.add(list(stamps), flops, time.perf_counter_ns() - start)
        self._scratch.current = scratch
        if status != 0:
            raise self._status_error(status)
        if self._data_dims:
            outs = self._trimmed(outs, out, {**plan.dims,
                                             **self._data_dim_values(dims)})
        return outs

    def _data_dim_values(self, dims: Any) -> dict[str, int]:
        base = len(self._symbols)
        return {name: int(dims[base + j]) for j, name in enumerate(self._data_dims)}

    def _trimmed(self, outs: list[np.ndarray], out: Sequence[Any] | None,
                 env: dict[str, Any]) -> list[np.ndarray]:
        """Outputs whose size the data decides, cut to their actual shape: the run wrote them
        densely at the start of buffers of the largest shape. A view of the caller's `out=`
        array; of a buffer allocated here, a view, or a copy when it would keep less than
        half of the buffer alive."""
        result = []
        for i, (a, shape_code) in enumerate(zip(outs, self._actual_shapes)):
            if shape_code is None:
                result.append(a)
                continue
            shape = _evaluated(shape_code, env)
            count = 1
            for d in shape:
                count *= d
            part = a.reshape(-1)[:count].reshape(shape)
            given = out is not None and out[i] is not None
            result.append(part if given or 2 * count >= a.size else part.copy())
        return result

    def _status_error(self, status: int) -> Exception:
        if status == STATUS_CPU_UNSUPPORTED:
            return RuntimeError(f"{self.name}: the compiled model cannot run on this CPU (it "
                                "lacks features of the library's baseline)")
        code, index = status & 0xFF, status >> 8
        message = _STATUS_MESSAGES.get(code)
        if message is None or index < 0:
            return RuntimeError(f"{self.name}: the compiled model failed with status {status}")
        node = (self._node_labels[index] if index < len(self._node_labels)
                else f"node #{index}")
        return ValueError(f"model {self.name}: {node}: {message}")

    def __repr__(self) -> str:
        ins = ", ".join(f"{t.name}: {t.dtype.name}{_shape_text(t.shape)}" for t in self.inputs)
        outs = ", ".join(f"{t.name}: {t.dtype.name}{_shape_text(t.shape)}" for t in self.outputs)
        return f"<cuvil model {self.name}({ins}) -> ({outs})>"


class NodeTime(_Record):
    """One node of the compiled graph: its time and FLOPs summed over the profiled runs.

    `op` is the op type, with a fused activation ("Conv+Relu"); `shapes` the first input's and
    the outputs' shapes ("1x64x56x56 -> 1x256x56x56"); `flops` 2 x multiply-adds, 0 for ops
    whose FLOPs are not counted."""

    __slots__ = ("flops", "index", "name", "op", "shapes", "time_ns")

    def __init__(self, index: int, name: str, op: str, shapes: str = "", time_ns: int = 0,
                 flops: int = 0) -> None:
        self.index, self.name, self.op, self.shapes = index, name, op, shapes
        self.time_ns, self.flops = time_ns, flops

    @property
    def gflops(self) -> float | None:
        """Achieved GFLOP/s, None when the op's FLOPs are not counted."""
        return self.flops / self.time_ns if self.flops and self.time_ns else None


class OpTime(_Record):
    """The nodes of one op type together (`count` of them)."""

    __slots__ = ("count", "flops", "op", "time_ns")

    def __init__(self, op: str, count: int, time_ns: int, flops: int) -> None:
        self.op, self.count, self.time_ns, self.flops = op, count, time_ns, flops

    @property
    def gflops(self) -> float | None:
        return self.flops / self.time_ns if self.flops and self.time_ns else None


class Profile(_Record):
    """Where a model's time goes, summed over `runs` calls (`Model.profile`, CUVIL_PROFILE=1).

    Clock readings (monotonic, ns) bracket every node, so node times and the output copies
    add up to `time_ns` exactly; the Python side of each call (checks, allocation) is outside.
    `time_ns` runs from before the first node to after the output copies, `copies_ns` is the
    copying of results into outputs after the last node, `wall_ns` the same calls timed in
    Python, checks and allocations included.
    """

    __slots__ = ("copies_ns", "model", "nodes", "runs", "time_ns", "wall_ns")

    def __init__(self, model: str, nodes: list[NodeTime], runs: int = 0, time_ns: int = 0,
                 copies_ns: int = 0, wall_ns: int = 0) -> None:
        self.model, self.nodes, self.runs = model, nodes, runs
        self.time_ns, self.copies_ns, self.wall_ns = time_ns, copies_ns, wall_ns

    def add(self, stamps: Sequence[int], flops: Sequence[int], wall_ns: int) -> None:
        """Add one run: its timestamps (len(nodes) + 2), per-node FLOPs and time in Python."""
        for node, start, end, f in zip(self.nodes, stamps, stamps[1:], flops):
            node.time_ns += end - start
            node.flops += f
        self.copies_ns += stamps[-1] - stamps[-2]
        self.time_ns += stamps[-1] - stamps[0]
        self.wall_ns += wall_ns
        self.runs += 1

    @property
    def ops(self) -> list[OpTime]:
        """One entry per op type, slowest first."""
        by_op: dict[str, OpTime] = {}
        for n in self.nodes:
            t = by_op.setdefault(n.op, OpTime(n.op, 0, 0, 0))
            t.count += 1
            t.time_ns += n.time_ns
            t.flops += n.flops
        return sorted(by_op.values(), key=lambda t: -t.time_ns)

    @property
    def flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def table(self, top: int | None = 25) -> str:
        """The profile as text: totals, then op types and the `top` nodes (all: None), slowest
        first, each with its total time, time per run, share of the total and GFLOP/s."""
        runs = max(self.runs, 1)
        rate = f", {self.flops / self.time_ns:.1f} GFLOP/s" if self.flops and self.time_ns else ""
        lines = [(f"cuvil profile of model {self.model}: {self.runs} runs, "
                 f"{self.time_ns / runs / 1e6:.3f} ms per run in compiled code "
                 f"({self.wall_ns / runs / 1e6:.3f} ms with the Python call), "
                 f"{self.flops / runs / 1e9:.3f} GFLOP per run{rate}")]

        def row(label: str, count: int, ns: int, gflops: float | None, shapes: str = "") -> str:
            share = 100 * ns / self.time_ns if self.time_ns else 0.0
            g = f"{gflops:9.1f}" if gflops is not None else f"{'-':>9}"
            return (f"  {label:<40.40} {count:>5} {ns / 1e6:>10.3f} {ns / runs / 1e6:>9.3f} "
                    f"{share:>6.1f}% {g}  {shapes}").rstrip()

        header = f"  {{:<40}} {{:>5}} {'total ms':>10} {'ms/run':>9} {'share':>7} {'GFLOP/s':>9}"
        lines += ["", "by op type:", header.format("op", "nodes")]
        lines += [row(t.op, t.count, t.time_ns, t.gflops) for t in self.ops]
        nodes = sorted(self.nodes, key=lambda n: -n.time_ns)
        shown = nodes if top is None else nodes[:top]
        lines += ["", f"by node ({len(shown)} slowest of {len(nodes)}):" if len(shown) < len(nodes)
                  else "by node:", header.format("#  node (op)", "runs") + "  shapes"]
        lines += [row(f"{n.index:<3}{n.name} ({n.op})", self.runs, n.time_ns, n.gflops, n.shapes)
                  for n in shown]
        lines.append(row("(copies into outputs)", self.runs, self.copies_ns, None))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _thread_pool_registry() -> Any:
    """The process's record of the shared thread pool. A module in sys.modules, because each
    generated package carries its own copy of this file and all of them must find one pool."""
    fresh = types.ModuleType("_cuvil_thread_pool")
    # pool: address of the first library's `struct cuvil_pool`; owner: that library, kept
    # loaded as long as others use its pool
    fresh.__dict__.update(lock=threading.Lock(), pool=None, owner=None)
    return sys.modules.setdefault("_cuvil_thread_pool", fresh)


#: ELF e_machine, Mach-O cputype and PE Machine values of the architectures cuvil builds for
_ELF_MACHINES = {62: "x86_64", 183: "aarch64", 3: "x86", 40: "arm"}
_MACHO_CPUS = {0x01000007: "x86_64", 0x0100000C: "aarch64"}
_PE_MACHINES = {0x8664: "x86_64", 0xAA64: "aarch64", 0x014C: "x86", 0x01C4: "arm"}


#: LoadLibraryEx flags: look for the DLL's imports in its own folder and in System32 only (a
#: cuvil DLL imports KERNEL32 and the Universal C Runtime alone), never in PATH or the current
#: directory, which could supply another DLL of the same name; they need an absolute path
_LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR = 0x100
_LOAD_LIBRARY_SEARCH_SYSTEM32 = 0x800


def _open_library(path: str) -> ctypes.CDLL:
    """Load a model library: dlopen with every symbol bound now and none shared with later
    libraries; on Windows, LoadLibraryEx with the search limited as above."""
    if sys.platform == "win32":
        return ctypes.CDLL(os.path.abspath(path),
                           winmode=_LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR | _LOAD_LIBRARY_SEARCH_SYSTEM32)
    return ctypes.CDLL(path, mode=getattr(os, "RTLD_NOW", 2) | getattr(os, "RTLD_LOCAL", 0))


def _why_not_loadable(path: str, error: str) -> str:
    """A sentence on why the dynamic loader refused the library, and what to do ("" when it
    is not one of the known causes). `cuvil doctor` says more."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return "; the file is missing: reinstall the package"
    host = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                      platform.machine().lower())
    built = None
    if head[:4] == b"\x7fELF" and len(head) >= 20:
        built = _ELF_MACHINES.get(int.from_bytes(head[18:20], "little" if head[5] == 1 else "big"))
        if sys.platform == "darwin":
            return "; it is a Linux library: install the macOS wheel of the package"
    elif head[:4] in (b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe"):
        if head[:4] == b"\xcf\xfa\xed\xfe":
            built = _MACHO_CPUS.get(int.from_bytes(head[4:8], "little"))
        if sys.platform != "darwin":
            return "; it is a macOS library: install the wheel built for this system"
    elif head[:2] == b"MZ":
        if sys.platform != "win32":
            return "; it is a Windows library: install the wheel built for this system"
        pe_offset = int.from_bytes(head[60:64], "little")
        try:
            with open(path, "rb") as f:
                f.seek(pe_offset)
                signature = f.read(6)
        except OSError:
            signature = b""
        if signature[:4] == b"PE\0\0":
            built = _PE_MACHINES.get(int.from_bytes(signature[4:6], "little"))
    if built is not None and built != host:
        return (f"; it is built for {built} and this machine is {host}: install the wheel built "
                "for this machine (pip picks it by its tag)")
    if "GLIBC_" in error:
        return "; this system's glibc is older than the one the wheel was built for"
    if "libc.so" in error:  # a musl library on glibc ("libc.so: cannot open") or the reverse
        return ("; it is built for another C library than this system's: install the manylinux "
                "wheel on glibc systems, the musllinux one on musl systems (Alpine)")
    if len(head) < 64:
        return "; the file is truncated: reinstall the package"
    return "; run `cuvil doctor` on the package for a diagnosis"


def _function(lib: ctypes.CDLL, model: str, part: str) -> Any:
    """The library's exported function `part` of `model`; ImportError when it is missing (a
    damaged library, or one built for another model)."""
    symbol = exported_symbol(model, part)
    try:
        return getattr(lib, symbol)
    except AttributeError:
        raise ImportError(f"{getattr(lib, '_name', 'the model library')} does not export {symbol}: "
                          f"it is damaged or not built for model {model!r}; reinstall the "
                          "package (`cuvil doctor` diagnoses it)") from None


def _share_thread_pool(lib: ctypes.CDLL, name: str) -> bool:
    """Make the library run its parallel loops on the process's pool: the first library's.
    True when this library is that first one (it then stays loaded: others use its pool)."""
    registry = _thread_pool_registry()
    with registry.lock:
        if registry.pool is None:
            get_pool = _function(lib, name, "thread_pool")
            get_pool.restype = ctypes.c_void_p
            get_pool.argtypes = []
            registry.pool, registry.owner = get_pool(), lib
            return True
        use_pool = _function(lib, name, "use_thread_pool")
        use_pool.restype = ctypes.c_int32
        use_pool.argtypes = [ctypes.c_void_p]
        use_pool(registry.pool)  # -1: a pool of another version; the library keeps its own
        return False


def _unload_when_dropped(model: Model, lib: ctypes.CDLL) -> None:
    """Unload the library once the model is garbage. ctypes never unloads one, so each
    `cuvil.compile` or reload would keep its code and weights mapped until the process exits.
    Only the model holds the library's functions, and no call can run once it is gone; its
    worker threads, if it started any, are joined by the library's own destructor. Not at
    exit: the OS unmaps everything then, while other threads may still be running."""
    try:
        import _ctypes
    except ImportError:
        return
    close = getattr(_ctypes, "dlclose", None) or getattr(_ctypes, "FreeLibrary", None)
    if close is not None:
        weakref.finalize(model, close, lib._handle).atexit = False


def _shape_text(shape: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def load_models(package_dir: str | os.PathLike[str]) -> dict[str, Model]:
    """Load every model listed in a generated package's `_models.json`."""
    path = os.path.join(package_dir, "_models.json")
    fix = "; reinstall the package (`cuvil check` on its wheel says more)"
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (ValueError, RecursionError):  # bad bytes, bad JSON, nesting deeper than the stack
        raise ImportError(f"{path}: not valid JSON{fix}") from None
    try:
        manifest = Manifest.from_json(raw)
        return {m.name: Model(os.path.join(package_dir, m.library), m) for m in manifest.models}
    except ManifestError as exc:
        raise ImportError(f"{path}: {exc}{fix}") from None
