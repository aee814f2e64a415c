"""A compiled model as an onnxruntime InferenceSession (`Model.session()`).

Copied into every generated package beside the loader, under this same name (so the loader
imports it alike in cuvil and in a package); numpy and the standard library only. Code written
against onnxruntime runs unchanged on the object `session()` returns: `run`, `get_inputs`,
`get_outputs`, `get_modelmeta`, `get_providers`, `get_provider_options`, and, for a bad feed,
the exception onnxruntime raises, by class name and message text, followed by what to fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Fail", "InvalidArgument", "ModelMetadata", "NodeArg", "Session"]


class Fail(RuntimeError):
    """onnxruntime's Fail (status 1): the model cannot run on these inputs (sizes that do not
    fit together, an index out of range). onnxruntime's exceptions derive from Exception
    only; these also derive from the built-in exception that fits."""


class InvalidArgument(ValueError):
    """onnxruntime's InvalidArgument (status 2): a wrong input or output name, dtype or shape."""


def _error(kind: type[Exception], text: str, fix: str = "") -> Exception:
    """onnxruntime's exception and text, then cuvil's word on what to fix."""
    code = "1 : FAIL" if kind is Fail else "2 : INVALID_ARGUMENT"
    return kind(f"[ONNXRuntimeError] : {code} : {text}" + (f" ({fix})" if fix else ""))


#: ONNX's names of the tensor types, as onnxruntime writes them ("tensor(float)"), by numpy's
_ONNX_TYPES = {"float32": "float", "float64": "double", "float16": "float16", "int8": "int8",
               "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8",
               "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool"}
#: ModelMetadata.version of a model that sets none: what onnxruntime reports (INT64_MAX)
_NO_VERSION = 2**63 - 1


def _type(dtype: np.dtype) -> str:
    name = _ONNX_TYPES.get(dtype.name) or ("string" if dtype.kind in "OSU" else dtype.name)
    return f"tensor({name})"


class NodeArg:
    """An input or output as onnxruntime's NodeArg: `name`, `shape` (a list: sizes, dim
    names, None for a dim nothing names) and `type` ("tensor(float)")."""

    __slots__ = ("_shape", "name", "type")

    def __init__(self, name: str, shape: Sequence[int | str | None], type: str) -> None:
        self.name = name
        self._shape = tuple(shape)
        self.type = type

    @property
    def shape(self) -> list[int | str | None]:
        return list(self._shape)

    def __repr__(self) -> str:  # onnxruntime's str() of a NodeArg (its repr is the default)
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"


class ModelMetadata:
    """The ONNX model's metadata, as onnxruntime's ModelMetadata gives it."""

    __slots__ = ("_custom", "description", "domain", "graph_description", "graph_name",
                 "producer_name", "version")

    def __init__(self, meta: Mapping[str, Any], graph_name: str) -> None:
        self.producer_name: str = meta.get("producer_name", "")
        self.graph_name: str = meta.get("graph_name", graph_name)
        self.domain: str = meta.get("domain", "")
        self.description: str = meta.get("description", "")
        self.graph_description: str = meta.get("graph_description", "")
        self.version: int = meta.get("version", _NO_VERSION)
        self._custom: dict[str, str] = dict(meta.get("custom_metadata_map", {}))

    @property
    def custom_metadata_map(self) -> dict[str, str]:
        return dict(self._custom)

    def __repr__(self) -> str:
        return (f"ModelMetadata(producer_name={self.producer_name!r}, graph_name="
                f"{self.graph_name!r}, version={self.version!r})")


class Session:
    """The methods of onnxruntime's InferenceSession that a compiled model has.

    It runs on the CPU, so `get_providers()` is ["CPUExecutionProvider"]: code that picks a
    path by the providers takes its CPU path. What it lacks: IO binding, OrtValues, profiling,
    run_async, changing providers. Calls share nothing but the model, so threads may call
    one session at once."""

    # `model` is the loader's Model, typed Any: the loader's module has one name in cuvil and
    # another in a package, and a type checker must resolve this file in both
    def __init__(self, model: Any, num_threads: int | None = None) -> None:
        self._model = model
        self._num_threads = num_threads
        sig = model.signature
        symbols = frozenset(sig.symbols)

        def node_arg(t: Any) -> NodeArg:
            shape = t.onnx_shape
            if shape is None:  # a manifest that does not record it: cuvil's own names
                shape = [d if isinstance(d, int) or d in symbols else None for d in t.shape]
            return NodeArg(t.name, shape, _type(np.dtype(t.dtype)))

        self._inputs = [node_arg(t) for t in sig.inputs]
        self._input_args = {a.name: a for a in self._inputs}
        self._outputs = [node_arg(t) for t in sig.outputs]
        self._output_index = {t.name: i for i, t in enumerate(model.outputs)}

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_modelmeta(self) -> ModelMetadata:
        return ModelMetadata(self._model.signature.metadata, self._model.name)

    def get_providers(self) -> list[str]:
        return ["CPUExecutionProvider"]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {"CPUExecutionProvider": {}}

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """The outputs named in `output_names` (None or empty: all, in the model's order), as
        a list of arrays, for the inputs of `input_feed` (input name -> numpy array; a list
        is converted to the input's dtype, as onnxruntime does). `run_options` is accepted and
        ignored: a RunOptions' settings (log levels, tags, terminate) have nothing to act on
        here. Every output is computed whichever are asked for."""
        indices = self._output_indices(output_names)
        values = self._feeds(input_feed)
        model = self._model
        try:
            outs = model._execute(values, num_threads=self._num_threads)
        except (ValueError, RuntimeError) as exc:  # checked by the model: sizes, the run's status
            raise _error(Fail, str(exc)) from None  # its text says what to fix
        return [outs[i] for i in indices]

    def _output_indices(self, output_names: Any) -> list[int]:
        if not output_names:
            return list(range(len(self._outputs)))
        if isinstance(output_names, str) or not isinstance(output_names, Sequence):
            raise TypeError(f"{self._model.name}: run's output_names must be a list of output "
                            f"names or None, got {type(output_names).__name__}")
        indices = []
        for name in output_names:
            if name not in self._output_index:
                raise _error(InvalidArgument, f"Invalid output name:{name}",
                             f"model {self._model.name!r} has outputs {list(self._output_index)}")
            indices.append(self._output_index[name])
        return indices

    def _feeds(self, input_feed: Any) -> list[np.ndarray]:
        model = self._model
        names = [t.name for t in model.inputs]
        if not isinstance(input_feed, Mapping):
            raise TypeError(f"{model.name}: run's input_feed must be a dict of input name -> "
                            f"numpy array, got {type(input_feed).__name__}")
        missing = [n for n in names if n not in input_feed]
        if missing:  # onnxruntime's text, and its class
            raise ValueError(f"Required inputs ({missing}) are missing from input feed "
                             f"({list(input_feed)}). (model {model.name!r} has inputs {names})")
        for key in input_feed:
            if key not in self._input_args:
                raise _error(InvalidArgument, f"Invalid input name: {key}",
                             f"model {model.name!r} has inputs {names}")
        return [self._array(info, input_feed[info.name]) for info in model.inputs]

    def _array(self, info: Any, value: Any) -> np.ndarray:
        """`value` checked as onnxruntime checks a feed: a numpy array of the input's dtype
        (byte order aside: the model converts it), rank and fixed sizes; or a list."""
        dims = ", ".join(str(d) for d in self._input_args[info.name].shape)
        where = f"model {self._model.name!r} takes {info.name!r} as {info.dtype.name}[{dims}]"
        if isinstance(value, list):
            try:
                a = np.asarray(value, dtype=info.dtype)  # as onnxruntime converts a list
            except (ValueError, TypeError, OverflowError) as exc:
                raise RuntimeError(f"input {info.name!r}: the list cannot be converted to "
                                   f"{info.dtype.name} ({exc}); {where}") from None
        elif isinstance(value, np.ndarray):
            a = value
        else:  # onnxruntime refuses scalars, tuples and the like, with these texts
            text = (f"Unable to handle object of type {type(value)}"
                    if isinstance(value, (int, float, complex, np.generic)) else
                    f"Input must be a list of dictionaries or a single numpy array for input "
                    f"'{info.name}'.")
            raise RuntimeError(f"{text} (pass np.asarray(value, dtype=np.{info.dtype.name}) for "
                               f"input {info.name!r}: {where})")
        if a.dtype.newbyteorder("=") != info.dtype:
            raise _error(InvalidArgument, f"Unexpected input data type. Actual: ({_type(a.dtype)})"
                         f" , expected: ({_type(info.dtype)})",
                         f"{where}: convert it with .astype(np.{info.dtype.name})")
        got = f"got shape {list(a.shape)}"
        if a.ndim != len(info.shape):
            raise _error(InvalidArgument, f"Invalid rank for input: {info.name} Got: {a.ndim} "
                         f"Expected: {len(info.shape)} Please fix either the inputs/outputs or "
                         "the model.", f"{where}, {got}")
        bad = [f" index: {axis} Got: {n} Expected: {want}\n"
               for axis, (n, want) in enumerate(zip(a.shape, info.shape))
               if isinstance(want, int) and n != want]
        if bad:
            raise _error(InvalidArgument, f"Got invalid dimensions for input: {info.name} for the "
                         f"following indices\n{''.join(bad)} Please fix either the "
                         "inputs/outputs or the model.", f"{where}, {got}")
        return a

    def __repr__(self) -> str:
        return f"<cuvil session of model {self._model.name}>"
