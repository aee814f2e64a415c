"""cuvil as an ONNX backend (`onnx.backend.base.Backend`), for onnx's backend test suite and
for code written against that interface.

    from cuvil.onnx_backend import CuvilBackend
    rep = CuvilBackend.prepare(model)          # compiles once, in-process
    outputs = rep.run([x])                     # in the graph's output order
    outputs[0], outputs["y"]                   # by position or by output name

`prepare` compiles the model with `cuvil.compile`; a model using operators cuvil cannot
compile raises `UnsupportedOpError` (a `CuvilError`) there, before any code is generated.

cuvil compiles shapes ahead of time, so inputs that decide output shapes (Reshape's shape,
Slice's starts, TopK's k...) must be constants. A model that takes them as graph inputs can
still be prepared with `bind={name: value}`: each bound input becomes an initializer with
that value, exactly as an exporter would have written it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from cuvil.errors import ModelError, UnsupportedOpError

__all__ = [
    "CuvilBackend",
    "CuvilBackendRep",
    "bind_inputs",
    "prepare",
    "run_model",
    "run_node",
    "supports_device",
]

#: environment variable that overrides the LLVM optimization level (0-3) of `prepare`;
#: the conformance suite sets it to trade run time of the compiled code for compile time
OPT_LEVEL_ENV = "CUVIL_OPT_LEVEL"


class CuvilBackendRep(BackendRep):
    """A compiled model: `run(inputs)` returns the outputs in the graph's output order."""

    def __init__(self, compiled: Any, input_names: Sequence[str], output_names: Sequence[str]) -> None:
        self.compiled = compiled
        #: the graph inputs a caller passes, in graph order (initializers and bound inputs excluded)
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self._outputs_type = namedtupledict("Outputs", self.output_names)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        """`inputs`: one array, a list in graph-input order, or a dict name -> array."""
        if kwargs:
            raise TypeError(f"cuvil's BackendRep.run takes no options, got {sorted(kwargs)}")
        if isinstance(inputs, Mapping):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            if len(inputs) != len(self.input_names):
                raise ValueError(f"the model takes {len(self.input_names)} inputs "
                                 f"{list(self.input_names)}, got {len(inputs)}")
            feeds = dict(zip(self.input_names, inputs))
        unknown = set(feeds) - set(self.input_names)
        if unknown:
            raise ValueError(f"unknown inputs {sorted(unknown)}; the model's inputs are "
                             f"{list(self.input_names)}")
        # inputs the compiled code does not read (unused, or folded away) are not passed on
        wanted = {t.name for t in self.compiled.inputs}
        got = self.compiled.run({k: _as_array(v) for k, v in feeds.items() if k in wanted})
        return self._outputs_type(*[got[name] for name in self.output_names])


class CuvilBackend(Backend):
    """Compiles with cuvil for the host CPU."""

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            return Device(device).type == DeviceType.CPU
        except (AttributeError, ValueError):
            return False

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> CuvilBackendRep:
        """Compile `model` (ModelProto, serialized bytes or a path).

        Keyword options: `inputs` (pins or names of input dims, as in `cuvil.compile`),
        `bind` (graph inputs to turn into constants: name -> array), `opt_level` (0-3;
        default from $CUVIL_OPT_LEVEL, else cuvil's default).
        """
        if not cls.supports_device(device):
            raise ValueError(f"cuvil compiles for the CPU only, not for device {device!r}")
        pins = kwargs.pop("inputs", None)
        bind = kwargs.pop("bind", None)
        opt_level = kwargs.pop("opt_level", None)
        if kwargs:
            raise TypeError(f"unknown options {sorted(kwargs)}; cuvil's prepare takes inputs, "
                            "bind and opt_level")
        source: Any = _parse(bytes(model)) if isinstance(model, (bytes, bytearray)) else model
        if bind:
            if not isinstance(source, onnx.ModelProto):
                source = onnx.load(str(source))
            source = bind_inputs(source, bind)
        proto = source if isinstance(source, onnx.ModelProto) else None
        compiled = _compile(source, pins, _opt_level(opt_level))
        if proto is None:  # a path: its graph order of inputs and outputs, names only
            proto = onnx.load(str(source), load_external_data=False)
        inits = {i.name for i in proto.graph.initializer}
        input_names = [vi.name for vi in proto.graph.input if vi.name not in inits]
        output_names = [vi.name for vi in proto.graph.output]
        return CuvilBackendRep(compiled, input_names, output_names)

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls,
        node: onnx.NodeProto,
        inputs: Any,
        device: str = "CPU",
        outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """Compile a one-node model typed from `inputs` and run it (one compile per call)."""
        opset = kwargs.pop("opset_version", None) or onnx.defs.onnx_opset_version()
        names = [n for n in node.input if n]
        if isinstance(inputs, Mapping):
            arrays = {n: _as_array(inputs[n]) for n in names}
        else:
            if len(inputs) != len(names):
                raise ValueError(f"node {node.name or node.op_type!r} has {len(names)} inputs "
                                 f"{names}, got {len(inputs)} arrays")
            arrays = {n: _as_array(a) for n, a in zip(names, inputs)}
        graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype),
                                                      list(a.shape)) for n, a in arrays.items()]
        outs = [n for n in node.output if n]
        if outputs_info is not None:
            graph_outputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(
                np.dtype(dt)), list(shape)) for n, (dt, shape) in zip(outs, outputs_info)]
        else:
            graph_outputs = [helper.make_empty_tensor_value_info(n) for n in outs]
        domain = node.domain or ""
        opsets = [helper.make_opsetid("", opset)]
        if domain not in ("", "ai.onnx"):
            opsets.append(helper.make_opsetid(domain, kwargs.pop("domain_version", 1)))
        graph = helper.make_graph([node], f"run_node_{node.op_type}", graph_inputs, graph_outputs)
        model = helper.make_model(graph, opset_imports=opsets)
        if outputs_info is None:  # let onnx type the outputs, as an exporter would
            try:
                model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
            except Exception as exc:
                raise ModelError(f"node {node.name or node.op_type!r}: onnx's shape inference "
                                 f"rejects it with these inputs: {exc}") from None
        rep = cls.prepare(model, device, **kwargs)
        return rep.run(arrays)


def bind_inputs(model: onnx.ModelProto, bind: Mapping[str, Any]) -> onnx.ModelProto:
    """A copy of `model` where each bound graph input is an initializer with the given value."""
    inputs = {vi.name for vi in model.graph.input}
    missing = sorted(set(bind) - inputs)
    if missing:
        raise ModelError(f"cannot bind {missing}: not inputs of the model (its inputs are "
                         f"{sorted(inputs)})")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [vi for vi in out.graph.input if vi.name not in bind]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    taken = {i.name for i in out.graph.initializer}
    for name, value in bind.items():
        if name in taken:
            raise ModelError(f"cannot bind {name!r}: the model already has an initializer of "
                             "that name")
        out.graph.initializer.append(numpy_helper.from_array(_as_array(value), name))
    return out


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value)


def _parse(data: bytes) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError
        raise ModelError(f"<bytes>: not a serialized ONNX model ({type(exc).__name__}: {exc})"
                         ) from None
    return model


def _opt_level(value: Any) -> int | None:
    if value is None:
        value = os.environ.get(OPT_LEVEL_ENV) or None
        if value is None:
            return None
    try:
        level = int(value)
    except (TypeError, ValueError):
        level = -1
    if not 0 <= level <= 3:
        raise ValueError(f"opt_level (or ${OPT_LEVEL_ENV}) must be 0, 1, 2 or 3, got {value!r}")
    return level


def _compile(source: Any, pins: Any, opt_level: int | None) -> Any:
    """cuvil.compile, or the same steps with an explicit LLVM optimization level."""
    import cuvil

    try:
        if opt_level is None:
            return cuvil.compile(source, inputs=pins)
        from cuvil.compiler import driver
        from cuvil.config import CompileOptions
        from cuvil.runtime import Model

        name = _model_name(source)
        tmp = tempfile.TemporaryDirectory(prefix="cuvil-")
        try:
            options = CompileOptions(inputs={k: tuple(v) for k, v in (pins or {}).items()},
                                     opt_level=opt_level, cpu="native")
            built = driver.compile_model(source, name, Path(tmp.name), options)
        except BaseException:
            tmp.cleanup()
            raise
        return Model(built.library, built.signature, keep_alive=tmp)
    except NotImplementedError as exc:  # an op registered without a lowering for this case
        raise UnsupportedOpError(f"cuvil cannot compile this model: {exc}") from exc


def _model_name(source: Any) -> str:
    """The model name cuvil.compile would choose (it names the library's C symbols)."""
    import re

    stem = Path(source).stem if isinstance(source, (str, Path)) else (source.graph.name or "model")
    name = re.sub(r"\W", "_", stem) or "model"
    return "m_" + name if name[0].isdigit() else name


prepare = CuvilBackend.prepare
run_model = CuvilBackend.run_model
run_node = CuvilBackend.run_node
supports_device = CuvilBackend.supports_device
