"""The call boundary's fuzz cases: two small models and the calls a spec describes.

A spec is plain data (dicts, tuples, strings, ints) so it pickles to the worker child, reads
back as an `@example`, and builds the same arrays every time: the child builds them itself,
because views, strides, alignment and byte order would not survive pickling.

spec = {"form": "positional" | "keywords" | "run",
        "inputs": {name: (container, dtype, shape, layout, values) or "missing"},
        "extra": bool,                 # an input name the model does not have
        "out": None or {output name: kind},
        "seed": int}
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:  # onnx is imported by the model builders only: runs under valgrind load less
    import onnx

EXTRA = "bogus"
CONTAINERS = ["array", "list", "scalar", "none"]
LAYOUTS = ["c", "fortran", "reversed", "strided", "misaligned", "readonly", "byteswapped",
           "broadcast"]
VALUES = ["normal", "nonfinite", "large"]
OUT_KINDS = ["alloc", "none", "wrong_shape", "wrong_dtype", "alias", "readonly", "strided", "list",
             "same_for_two"]


def _graph_model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
                 outputs: Sequence[onnx.ValueInfoProto], inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    import onnx
    from onnx import helper, numpy_helper

    graph = helper.make_graph(list(nodes), "call", list(inputs), list(outputs),
                              [numpy_helper.from_array(a, n) for n, a in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def static_model() -> onnx.ModelProto:
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    F = TensorProto.FLOAT
    return _graph_model(
        [helper.make_node("Mul", ["pixels", "scale"], ["t"]),
         helper.make_node("Add", ["t", "pixels"], ["scaled"]),
         helper.make_node("ReduceSum", ["pixels", "last"], ["total"], keepdims=0)],
        [vi("pixels", F, [2, 3, 4]), vi("scale", F, [4])],
        [vi("scaled", F, [2, 3, 4]), vi("total", F, [2, 3])],
        {"last": np.array([2], np.int64)})


def symbolic_model() -> onnx.ModelProto:
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    F = TensorProto.FLOAT
    rng = np.random.default_rng(1)
    return _graph_model(
        [helper.make_node("MatMul", ["features", "w"], ["m"]),
         helper.make_node("Add", ["m", "b"], ["a"]),
         helper.make_node("Softmax", ["a"], ["scores"], axis=-1),
         helper.make_node("Cast", ["counts"], ["c"], to=F),
         helper.make_node("ReduceSum", ["features", "one"], ["s"], keepdims=0),
         helper.make_node("Add", ["c", "s"], ["totals"])],
        [vi("features", F, ["N", 3]), vi("counts", TensorProto.INT64, ["N"])],
        [vi("scores", F, ["N", 4]), vi("totals", F, ["N"])],
        {"w": rng.standard_normal((3, 4)).astype(np.float32),
         "b": rng.standard_normal(4).astype(np.float32), "one": np.array([1], np.int64)})


MODELS: dict[str, Callable[[], onnx.ModelProto]] = {"static": static_model, "symbolic": symbolic_model}


def _values(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if dtype.kind == "f":
        a = rng.standard_normal(shape) * (1e30 if kind == "large" else 1)
        if kind == "nonfinite" and a.size:
            flat = a.reshape(-1)
            flat[rng.integers(0, a.size, max(1, a.size // 3))] = rng.choice(
                [np.nan, np.inf, -np.inf], max(1, a.size // 3))
        with np.errstate(over="ignore", invalid="ignore"):
            return a.astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    big = kind == "large" and dtype.itemsize >= 4
    info = np.iinfo(dtype)
    return rng.integers(info.min if big else 0, info.max if big else 10, shape, dtype=dtype,
                        endpoint=True)


def _laid_out(a: np.ndarray, layout: str) -> np.ndarray:
    """An array with `a`'s shape and values (broadcast: its first row) in another layout."""
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout == "reversed" and a.ndim:
        return a[::-1].copy()[::-1]
    if layout == "strided" and a.ndim:
        wide = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)
        wide[..., ::2] = a
        return wide[..., ::2]
    if layout == "misaligned" and a.dtype.itemsize > 1:
        raw = np.zeros(a.nbytes + 1, np.uint8)
        view = raw[1:].view(a.dtype).reshape(a.shape)
        view[...] = a
        return view
    if layout == "readonly":
        a = a.copy()
        a.setflags(write=False)
        return a
    if layout == "byteswapped":
        swapped = a.dtype.newbyteorder("S")
        return a.astype(swapped)
    if layout == "broadcast" and a.ndim and a.shape[0]:
        return np.broadcast_to(a[:1], a.shape)
    return a


def _symbols(model: Any, spec: dict[str, Any]) -> dict[str, int]:
    """The symbolic dims' values as the spec's correctly shaped inputs give them."""
    dims: dict[str, int] = {}
    for info in model.inputs:
        given = spec["inputs"].get(info.name)
        if isinstance(given, tuple) and len(given[2]) == len(info.shape):
            for want, got in zip(info.shape, given[2]):
                if isinstance(want, str):
                    dims.setdefault(want, got)
    return dims


def _output_shape(info: Any, dims: dict[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else dims.get(d, 1) for d in info.shape)


@dataclass
class Call:
    """One call to make: its arguments, the inputs as onnxruntime gets them, and whether the
    model must accept it."""

    form: str
    args: dict[str, Any]  # input name -> value, in the model's order; EXTRA too
    out: dict[str, Any] | None
    converted: dict[str, np.ndarray]
    valid: bool
    names: list[str]  # what an error message may name
    out_given: dict[str, np.ndarray] = field(default_factory=dict)

    def invoke(self, model: Any) -> dict[str, np.ndarray]:
        """The outputs by name."""
        names = [o.name for o in model.outputs]
        if self.form == "run":
            return dict(model.run(self.args, out=self.out))
        out = {} if self.out is None else {
            "out": self.out[names[0]] if len(names) == 1 else tuple(self.out.get(n) for n in names)}
        result = (model(*self.args.values(), **out) if self.form == "positional"
                  else model(**self.args, **out))
        result = result if isinstance(result, tuple) else (result,)
        return dict(zip(names, result))


def build_call(model: Any, spec: dict[str, Any]) -> Call:
    rng = np.random.default_rng(spec["seed"])
    valid = not spec["extra"]
    args: dict[str, Any] = {}
    converted = {}
    dims = _symbols(model, spec)
    for info in model.inputs:
        given = spec["inputs"][info.name]
        if given == "missing":
            valid = False
            continue
        container, dtype_name, shape, layout, values = given
        dtype = np.dtype(dtype_name)
        a = _values(rng, dtype, tuple(shape), values)
        if container == "array":
            value: Any = _laid_out(a, layout)
        elif container == "list":
            value = a.tolist()
        elif container == "scalar":
            value = a.reshape(-1)[0].item() if a.size else 0.0
        else:
            value = None
        args[info.name] = value
        right_shape = len(shape) == len(info.shape) and all(
            g == (w if isinstance(w, int) else dims[w]) for w, g in zip(info.shape, shape))
        valid &= container == "array" and dtype == info.dtype and right_shape
        with contextlib.suppress(TypeError, ValueError):  # not convertible: never run by onnxruntime
            converted[info.name] = np.ascontiguousarray(np.asarray(value).astype(info.dtype))
    if spec["extra"]:
        args[EXTRA] = np.zeros(1, np.float32)
    out: dict[str, Any] | None = None
    out_given = {}
    if spec["out"] is not None:
        out = {}
        arrays = [v for v in args.values() if isinstance(v, np.ndarray)]
        for info in model.outputs:
            kind = spec["out"][info.name]
            shape = _output_shape(info, dims)
            fresh = np.empty(shape, info.dtype)
            if kind == "alloc":
                out[info.name] = fresh
            elif kind == "none":
                out[info.name] = None
            elif kind == "wrong_shape":
                out[info.name] = np.empty((*shape, 2), info.dtype)
            elif kind == "wrong_dtype":
                out[info.name] = fresh.astype(np.float64 if info.dtype != np.float64 else np.float32)
            elif kind == "alias":
                same = [a for a in arrays if a.shape == shape and a.dtype == info.dtype]
                out[info.name] = same[0] if same else (arrays[0] if arrays else fresh)
            elif kind == "readonly":
                fresh.setflags(write=False)
                out[info.name] = fresh
            elif kind == "strided":
                out[info.name] = np.empty((*shape, 2), info.dtype)[..., 0]
            elif kind == "list":
                out[info.name] = fresh.tolist()
            else:  # same_for_two: the first output's array again
                out[info.name] = next((a for a in out.values() if a is not None), fresh)
            given = out[info.name]
            # an empty array holds no element to alias, and is dense however it was sliced
            empty_fit = (isinstance(given, np.ndarray) and given.size == 0 and given.shape == shape
                         and given.dtype == info.dtype and given.flags.carray)
            valid &= kind in ("alloc", "none") or empty_fit
            if kind == "alloc":
                out_given[info.name] = fresh
    names = [t.name for t in (*model.inputs, *model.outputs)] + [EXTRA]
    if spec["form"] == "positional" and spec["extra"]:
        names.append(f"takes {len(model.inputs)} inputs")  # an extra positional has no name
    return Call(spec["form"], args, out, converted, valid, names, out_given)
