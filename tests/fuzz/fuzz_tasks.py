"""What the fuzz worker child runs (see fuzz_worker.py): compile mutated models, make calls.

Each task returns `(outcome, detail)`: outcome "bug" means the property failed (detail says
how); the other outcomes are allowed and only counted: "refused" (a CuvilError at compile time
or a ValueError/TypeError naming the input at call time), "match" (cuvil and onnxruntime agree),
"bytes-match" (onnxruntime refuses a model's external data that cuvil reads, and cuvil agrees
with onnxruntime running the model with the bytes onnx's own reader finds there),
"ort-refuses" (cuvil compiles and runs a model onnxruntime will not load or run: a finding to
report), "too-big" (compiled, but its inputs are too large to run here).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from fuzz_calls import MODELS, build_call

import cuvil
from cuvil.errors import CuvilError

Outcome = tuple[str, str]
#: inputs with more elements than this are not run (the model still had to compile)
MAX_ELEMENTS = 1 << 20
SYMBOL_SIZE = 2


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _session(data: bytes | str) -> Any:
    """onnxruntime's session of a model file's bytes, or of the model at a path."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 4
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


def _random_feeds(model: Any, seed: int) -> dict[str, np.ndarray] | None:
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in model.inputs:
        shape = tuple(d if isinstance(d, int) else SYMBOL_SIZE for d in info.shape)
        if int(np.prod(shape, dtype=object)) > MAX_ELEMENTS:
            return None
        if info.dtype.kind == "f":
            a = rng.standard_normal(shape)
        elif info.dtype.kind == "b":
            a = rng.integers(0, 2, shape)
        else:  # small values: valid indices and trip counts for most models
            a = rng.integers(0, 3, shape)
        feeds[info.name] = np.asarray(a).astype(info.dtype)
    return feeds


#: Loops with more iterations than this are not run
MAX_TRIPS = 10_000


def _loop_trips(data: bytes) -> int:
    """The largest constant trip count of the model's top-level Loops (0: none)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load_model_from_string(data)
    consts = {t.name: t for t in model.graph.initializer}
    trips = [0]
    for node in model.graph.node:
        if node.op_type == "Loop" and node.input and node.input[0] in consts:
            with contextlib.suppress(Exception):  # a broken tensor: cuvil dealt with it
                trips.append(abs(int(numpy_helper.to_array(consts[node.input[0]]).reshape(-1)[0])))
    return max(trips)


def _compare(names: Sequence[str], want: Sequence[np.ndarray], got: Mapping[str, np.ndarray]
             ) -> str | None:
    """What differs between onnxruntime's outputs and cuvil's, or None."""
    if sorted(got) != sorted(set(names)):
        return f"cuvil gives outputs {sorted(got)}, onnxruntime {list(names)}"
    for name, expected in zip(names, want):
        have = got[name]
        if have.shape != expected.shape or have.dtype != expected.dtype:
            return (f"output {name!r}: cuvil {have.dtype}{list(have.shape)}, onnxruntime "
                    f"{expected.dtype}{list(expected.shape)}")
        if expected.dtype.kind in "fc":
            if not np.allclose(have, expected, rtol=1e-3, atol=1e-4, equal_nan=True):
                return f"output {name!r} differs: cuvil {have!r}, onnxruntime {expected!r}"
        elif not np.array_equal(have, expected):
            return f"output {name!r} differs: cuvil {have!r}, onnxruntime {expected!r}"
    return None


def compile_and_compare(data: bytes) -> Outcome:
    """Compile the model file `data`; if cuvil compiles it, run it and onnxruntime on random
    inputs and compare."""
    with tempfile.TemporaryDirectory(prefix="cuvil-fuzz-") as tmp:
        path = Path(tmp, "fuzz.onnx")
        path.write_bytes(data)
        try:
            model = cuvil.compile(path)
        except CuvilError as exc:
            return "refused", _first_line(exc)
        except Exception:
            return "bug", f"cuvil.compile raised a non-CuvilError:\n{traceback.format_exc()}"
    try:
        session = _session(data)
    except Exception as exc:
        return "ort-refuses", f"load: {_first_line(exc)}"
    return _run_and_compare(model, session, data)


def _run_and_compare(model: Any, session: Any, data: bytes, agreed: str = "match") -> Outcome:
    """Run the compiled model and onnxruntime's session of the model file `data` on random
    inputs; `agreed` is the outcome when their outputs are the same."""
    feeds = _random_feeds(model, seed=len(data))
    if feeds is None:
        return "too-big", ""
    trips = _loop_trips(data)
    if trips > MAX_TRIPS:  # a long time in both, not a defect (a flipped bit in a trip count)
        return "too-big", f"a Loop of {trips} iterations"
    try:
        want = session.run(None, feeds)
    except MemoryError:
        return "too-big", "onnxruntime ran out of memory"
    except Exception as exc:
        # onnxruntime refuses these inputs: cuvil may refuse them too, but must not crash
        with contextlib.suppress(ValueError, TypeError, MemoryError):
            model.run(feeds)
        return "ort-refuses", f"run: {_first_line(exc)}"
    try:
        got = model.run(feeds)
    except MemoryError:
        return "too-big", "cuvil ran out of memory"
    except Exception:
        return "bug", f"cuvil's call failed where onnxruntime ran:\n{traceback.format_exc()}"
    names = [o.name for o in session.get_outputs()]
    diff = _compare(names, want, got)
    return ("bug", diff) if diff else (agreed, "")


# -- models with external data ----------------------------------------------------------------

#: the paths opened while a compile is watched (see _audit), None when none is
_opened: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def _names(path: Path) -> set[str]:
    """The model file's name and its tensors' and nodes' names and outputs, quoted as cuvil's
    messages quote them."""
    import onnx
    from fuzz_external import tensors

    model = onnx.load(str(path), load_external_data=False)
    names = {t.name for t in tensors(model)}
    for node in model.graph.node:
        names.update([node.name, *node.output])
    return {path.name} | {repr(n) for n in names if n}


def _reference(path: Path) -> bytes:
    """The model with the bytes its tensors' entries point to, read by onnx's reader (not
    cuvil's) after dropping the keys the ONNX spec does not define, which cuvil ignores
    (onnx's reader takes `basepath` as a folder, onnxruntime refuses any of them), and with
    `..` taken out of locations (onnx's reader refuses any; cuvil and onnxruntime follow
    `../model/w` back into the model's folder)."""
    import onnx
    from fuzz_external import tensors

    folder = str(path.parent)
    model = onnx.load(str(path), load_external_data=False)
    for t in tensors(model):
        spec = [e for e in t.external_data if e.key in ("location", "offset", "length", "checksum")]
        for e in spec:
            if e.key == "location":
                e.value = os.path.relpath(os.path.normpath(os.path.join(folder, e.value)), folder)
        del t.external_data[:]
        t.external_data.extend(spec)
    onnx.external_data_helper.load_external_data_for_model(model, folder)
    return model.SerializeToString()


def compile_folder_and_compare(files: dict[str, Any]) -> Outcome:
    """Compile the model of a folder (see fuzz_external.py) and compare it with onnxruntime
    reading the same folder; where onnxruntime refuses the folder, with onnxruntime running
    the model with the bytes onnx's own reader finds there. A refusal must name the model's
    file, a tensor or a node, and cuvil must open nothing beside the model's folder."""
    from fuzz_external import make_folder

    global _opened
    with tempfile.TemporaryDirectory(prefix="cuvil-fuzz-") as tmp:
        root = Path(tmp).resolve()
        path = make_folder(root, files)
        _opened = []
        try:
            model = cuvil.compile(path)
        except CuvilError as exc:
            model, refusal = None, _first_line(exc)
        except Exception:
            return "bug", f"cuvil.compile raised a non-CuvilError:\n{traceback.format_exc()}"
        finally:
            opened, _opened = _opened, None
        outside = [p for p in map(os.path.realpath, opened)
                   if Path(p).is_relative_to(root) and not Path(p).is_relative_to(path.parent)]
        if outside:
            return "bug", f"cuvil opened {outside}, outside the model's folder"
        if model is None:
            if not any(name in refusal for name in _names(path)):
                return "bug", f"the refusal names no file, tensor or node: {refusal}"
            return "refused", refusal
        try:
            session, agreed = _session(str(path)), "match"
        except Exception as exc:
            refused = _first_line(exc)
            try:
                session, agreed = _session(_reference(path)), "bytes-match"
            except Exception as err:
                return "ort-refuses", f"load: {refused}; onnx.load: {_first_line(err)}"
        return _run_and_compare(model, session, path.read_bytes(), agreed)


# -- the call boundary ------------------------------------------------------------------------

_compiled: dict[str, Any] = {}


def _model(key: str, library: str | None) -> Any:
    """The model `key` of fuzz_calls.MODELS: compiled here once, or loaded from `library`
    (a file compiled by another process, e.g. for a run under valgrind)."""
    if key not in _compiled:
        if library is None:
            _compiled[key] = cuvil.compile(MODELS[key](), name=key)
        else:
            import json

            from cuvil.runtime import Model

            sig = json.loads(Path(library).with_suffix(".json").read_text())
            _compiled[key] = Model(library, sig)
    return _compiled[key]


def call(key: str, spec: Any, library: str | None = None, oracle: bool = True) -> Any:
    """Make the call `spec` describes (see fuzz_calls.build_call) on model `key`; compare with
    onnxruntime on the converted inputs (or, with `oracle` False, return cuvil's outputs for
    the parent to compare)."""
    model = _model(key, library)
    call = build_call(model, spec)
    try:
        result = call.invoke(model)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if not any(repr(n) in message or n in message for n in call.names):
            return "bug", f"{_first_line(exc)}: the message names no input or output {call.names}"
        if call.valid:
            return "bug", f"a valid call was refused: {_first_line(exc)}"
        return "refused", _first_line(exc)
    except Exception:
        return "bug", f"the call raised an unexpected exception:\n{traceback.format_exc()}"
    if call.out_given and any(result[n] is not a for n, a in call.out_given.items()):
        return "bug", "the result does not hold the out= arrays given"
    if not oracle:
        # which outputs hold a NaN: a test that branches on every element, so valgrind reports
        # any element the model left unwritten
        nans = {n: bool(np.isnan(a).any()) for n, a in result.items()}
        return "ran", ({n: np.array(a) for n, a in result.items()}, nans)
    session = _session(MODELS[key]().SerializeToString())
    want = session.run(None, call.converted)
    diff = _compare([o.name for o in session.get_outputs()], want, result)
    return ("bug", diff) if diff else ("match", "")
