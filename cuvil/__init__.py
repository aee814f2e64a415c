"""cuvil: ONNX models compiled ahead of time into native, pip-installable Python wheels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

from cuvil.errors import CuvilError

__version__ = "0.1.0"
__all__ = ["CuvilError", "__version__", "compile", "register_op"]

if TYPE_CHECKING:
    from cuvil.compiler.ops.registered import Decomposition
    from cuvil.runtime import Model


def compile(
    model: Any,
    inputs: dict[str, list[int | str]] | None = None,
    target: str | None = None,
    quantize: str | None = None,
    *,
    name: str | None = None,
    calibration: Any = None,
    calibration_method: str = "minmax",
    keep_float: Sequence[str] = (),
    precision: str = "float32",
    transformed_weights: str = "library",
) -> Model:
    """Compile an ONNX model (path or ModelProto) in-process and return a callable model.

    The object behaves like a model of a generated package: call it with arrays, or use
    `.run({...})`, `.inputs` and `.outputs`. Only host targets can be loaded and called.

    `quantize="int8"` quantizes the model first (docs/quantization.md; needs onnxruntime):
    `calibration` is an .npz file of representative inputs, a "module:function" entry point or
    an iterable of feed dicts; `calibration_method` is "minmax", "percentile" or "entropy";
    `keep_float` names nodes or op types to leave in float.

    `precision="bf16"` computes matrix products and convolutions in bfloat16 with float32
    sums (weights stored as bf16; AMX or AVX-512 BF16 where the CPU has them, float32 on the
    bf16 weights elsewhere): faster, within the error bound docs/precision.md gives.

    `transformed_weights="first-run"` derives Winograd convolutions' transformed weights at
    the first run instead of storing them in the library (smaller, a slower first run).
    """
    from cuvil.compiler.driver import compile_in_process

    return compile_in_process(model, inputs=inputs, target=target, quantize=quantize, name=name,
                              calibration=calibration, calibration_method=calibration_method,
                              keep_float=keep_float, precision=precision,
                              transformed_weights=transformed_weights)


def register_op(domain: str, op_type: str, *, since: int = 1,
                opset: int = 17) -> Callable[[Decomposition], Decomposition]:
    """Decorator: define the op `op_type` of `domain` (from version `since` of that domain on)
    as a decomposition into ONNX ops, for models using an op cuvil lacks.

    The decorated function gets a `cuvil.compiler.ops.registered.OpBuilder` for each node:
    `b.inputs` (the names to read the node's inputs by), `b.input_types` (dtype and shape of
    each), `b.attrs`; it adds ONNX nodes with `b.op("Mul", x, y)` / `b.const(...)` and returns
    the name of each output (or an onnx.FunctionProto). Its nodes use default-domain opset
    `opset`. cuvil compiles that body in the node's place, typed with its own shape rules::

        @cuvil.register_op("example.ops", "Softsign2")
        def softsign2(b):
            (x,) = b.inputs
            return b.op("Div", x, b.op("Add", b.const(1.0), b.op("Abs", x)))

    Installed packages declare modules holding registrations as entry points of the group
    `cuvil.ops`; a project names its own in `tool.cuvil.op-modules` (docs/custom-ops.md).
    """
    from cuvil.compiler.ops.registered import register_decomposition

    return register_decomposition(domain, op_type, since=since, opset=opset)
