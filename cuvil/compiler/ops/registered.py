"""Ops that users define in Python as decompositions into ONNX ops (`cuvil.register_op`).

A decomposition is a function that gets an `OpBuilder` (the node's inputs, their types, its
attributes) and builds the op's body from ONNX ops; the importer compiles that body in the
node's place before typing it (`Op.expand`, as for ai.onnx.ml and ONNX functions), so a model
using an op cuvil lacks compiles without changing cuvil. Registrations come from modules that
call the decorator: imported by the user, named by `tool.cuvil.op-modules`, or declared by
installed packages as entry points of the group `cuvil.ops` (`load_entry_points`).

`registrations()` describes every registration with a digest of the source of the module
defining it: the compile cache keys on it, so an edited decomposition is compiled again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, NamedTuple, Union

import numpy as np
import onnx

from cuvil.compiler.ir import Node, TensorType, dim_str
from cuvil.compiler.ops import InferContext, Op, lookup, register
from cuvil.compiler.ops._ml_graph import Body
from cuvil.errors import ConfigError, CuvilError, ModelError

__all__ = ["ENTRY_POINT_GROUP", "OpBuilder", "TensorInfo", "import_op_modules",
           "load_entry_points", "register_decomposition", "registrations"]

#: the entry-point group installed packages declare their op modules in
ENTRY_POINT_GROUP = "cuvil.ops"
#: the default-domain opset a decomposition's nodes are written for, unless it says otherwise
DEFAULT_OPSET = 17
#: domains whose ops cuvil implements itself: a registration there may only add missing ops
_OWN_DOMAINS = ("", "ai.onnx.ml", "cuvil")

Decomposition = Callable[["OpBuilder"], Union[str, Sequence[str], onnx.FunctionProto]]


class TensorInfo(NamedTuple):
    """An input's numpy dtype and shape (ints, or str for symbolic dims)."""

    dtype: np.dtype
    shape: tuple[int | str, ...]


class OpBuilder(Body):
    """What a decomposition gets. `inputs` are the names its nodes read the node's inputs by
    (in the op's order), `input_types` their `TensorInfo` (None for an omitted optional input),
    `attrs` the node's attributes (str, int, float, lists, numpy arrays). `op(...)` adds an
    ONNX node and returns its output name (a list for `outputs=n`), `const(value, dtype)` a
    constant; `add(node_proto)` takes a node written with onnx.helper. Return the names of the
    op's outputs, in order."""

    def __init__(self, node: Node) -> None:
        super().__init__(node)
        self.attrs: dict[str, Any] = dict(node.attrs)
        self.input_types: list[TensorInfo | None] = [
            None if v is None else TensorInfo(v.type.dtype, tuple(_dim(d) for d in v.type.shape))
            for v in node.inputs]

    def attr(self, name: str, default: Any = None) -> Any:
        """The attribute `name`, else `default`."""
        return self.attrs.get(name, default)

    def add(self, node: onnx.NodeProto) -> None:
        self.nodes.append(node)


def _dim(d: Any) -> int | str:
    text = dim_str(d)
    return text if isinstance(text, str) else int(text)


@dataclass(frozen=True)
class _Registration:
    domain: str
    op_type: str
    since: int
    opset: int
    function: Decomposition

    def describe(self) -> dict[str, Any]:
        module = getattr(self.function, "__module__", "?")
        return {"domain": self.domain, "op_type": self.op_type, "since": self.since,
                "opset": self.opset, "module": module,
                "function": getattr(self.function, "__qualname__", repr(self.function)),
                "source": _source_digest(self.function)}


#: (domain, op type, since) -> the registration; the newest one for a key wins
_REGISTRATIONS: dict[tuple[str, str, int], _Registration] = {}


class _Decomposed(Op):
    """An op a user registered; the importer compiles its body in its place."""

    registration: _Registration

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        raise AssertionError("expanded by the importer")

    def expand(self, node: Node) -> onnx.FunctionProto:
        reg = self.registration
        where = f"{node.describe()}: the decomposition {_name(reg.function)} (cuvil.register_op)"
        builder = OpBuilder(node)
        try:
            result = reg.function(builder)
        except CuvilError:
            raise
        except Exception as exc:
            raise ModelError(f"{where} raised {type(exc).__name__}: {exc}") from None
        if isinstance(result, onnx.FunctionProto):
            return result
        outputs = [result] if isinstance(result, str) else list(result or [])
        if not outputs or not all(isinstance(o, str) for o in outputs):
            raise ModelError(f"{where} returned {result!r}; return the name of each output "
                             "(what builder.op(...) returns), or an onnx.FunctionProto")
        imports = [onnx.helper.make_opsetid("", reg.opset)]
        domains = {n.domain for n in builder.nodes if n.domain not in ("", "ai.onnx")}
        imports += [onnx.helper.make_opsetid(d, node.opset if d == node.domain else 1)
                    for d in sorted(domains)]
        return onnx.helper.make_function(node.domain or "ai.onnx", node.op_type, builder.inputs,
                                         outputs, builder.nodes, imports)


def _name(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"


def register_decomposition(domain: str, op_type: str, *, since: int = 1,
                           opset: int = DEFAULT_OPSET) -> Callable[[Decomposition], Decomposition]:
    """The decorator behind `cuvil.register_op`."""
    domain = "" if domain == "ai.onnx" else domain
    if not isinstance(op_type, str) or not op_type.isidentifier():
        raise ConfigError(f"cuvil.register_op: op type {op_type!r} is not an identifier")
    if not isinstance(since, int) or since < 1:
        raise ConfigError(f"cuvil.register_op({domain!r}, {op_type!r}): since={since!r} must be "
                          "an opset version >= 1 (the first version of the domain the op is in)")

    def decorate(function: Decomposition) -> Decomposition:
        key = (domain, op_type, since)
        builtin = lookup(domain, op_type, 10**6)
        if domain in _OWN_DOMAINS and builtin is not None and key not in _REGISTRATIONS \
                and not isinstance(builtin, _Decomposed):
            raise ConfigError(
                f"cuvil.register_op: {domain or 'ai.onnx'} {op_type} is implemented by cuvil "
                f"itself; {_name(function)} cannot replace it. Register the op in a domain of "
                "your own")
        reg = _Registration(domain, op_type, since, opset, function)
        if key in _REGISTRATIONS:  # a module imported again: its new function replaces the old
            existing = lookup(domain, op_type, since)
            assert isinstance(existing, _Decomposed)
            existing.registration = reg
        else:
            cls = type(f"Decomposed_{op_type}", (_Decomposed,),
                       {"op_type": op_type, "domain": domain, "since": since, "registration": reg,
                        "dtypes": ()})
            register(cls)
        _REGISTRATIONS[key] = reg
        return function

    return decorate


def registrations() -> list[dict[str, Any]]:
    """Every registration, with the digest of its module's source (the compile cache's key)."""
    return [r.describe() for _, r in sorted(_REGISTRATIONS.items())]


def _source_digest(function: Any) -> str:
    """SHA-256 of the file defining `function` (its whole module: helpers it calls count), else
    of its own source or code (a function typed into a notebook)."""
    try:
        path = inspect.getsourcefile(function)
        if path is not None and Path(path).is_file():
            return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except TypeError:
        pass
    try:
        text = inspect.getsource(function).encode()
    except (OSError, TypeError):
        code = getattr(function, "__code__", None)
        text = repr((code.co_code, code.co_consts)).encode() if code is not None else b""
    return hashlib.sha256(text).hexdigest()


@functools.cache
def load_entry_points() -> tuple[str, ...]:
    """Import what the entry points of the group `cuvil.ops` name (once per process); returns
    their names. A failing one is an error naming it and its distribution."""
    every: Any = metadata.entry_points()
    found = list(every.select(group=ENTRY_POINT_GROUP) if hasattr(every, "select")
                 else every.get(ENTRY_POINT_GROUP, []))  # Python 3.9: a dict
    for ep in found:
        try:
            ep.load()
        except CuvilError:
            raise
        except Exception as exc:
            dist = getattr(getattr(ep, "dist", None), "name", "an installed package")
            raise ConfigError(
                f"entry point {ep.name} = {ep.value!r} of group {ENTRY_POINT_GROUP!r} (from "
                f"{dist}) cannot be loaded: {type(exc).__name__}: {exc}. Fix or uninstall "
                "that package") from None
    return tuple(sorted(ep.name for ep in found))


def import_op_modules(modules: Sequence[str], search_path: Sequence[Path], where: str) -> None:
    """Import `modules` (whose `cuvil.register_op` decorators register ops), looked up in
    `search_path` first; `where` names the setting, for errors."""
    added = [str(p) for p in search_path if str(p) not in sys.path]
    sys.path[:0] = added
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except CuvilError:
                raise
            except Exception as exc:
                raise ConfigError(
                    f"{where}: module {name!r} cannot be imported ({type(exc).__name__}: {exc}). "
                    "Name a module of the project's Python package or of an installed package") \
                    from None
    finally:
        for p in added:
            if p in sys.path:
                sys.path.remove(p)
