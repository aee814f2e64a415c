"""Calibration data for `quantize = "int8"`: read, checked against the model's inputs, batched.

A source is an .npz file (one array per model input, samples along the first axis), a Python
entry point "module:function" that returns or yields feed dicts, or such feed dicts directly
(`cuvil.compile(..., calibration=[{...}, ...])`). Every feed is checked against the model's
inputs (names, dtypes, fixed dims, pins) here, so that a mismatch is reported naming the file
and input instead of failing deep inside onnxruntime's calibration run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import sys
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx

from cuvil.errors import ConfigError, not_a_regular_file

__all__ = ["CalibrationSource", "Feeds", "InputSpec", "feeds_digest", "input_specs",
           "read_calibration"]

Feeds = dict[str, np.ndarray]
CalibrationSource = Union[str, Path, Iterable[Mapping[str, Any]]]

# Rows per feed when an .npz array's first axis is the model's free batch dim: enough to keep
# onnxruntime's calibration runs few, small enough to bound their memory.
_ROWS_PER_FEED = 64


@dataclass(frozen=True)
class InputSpec:
    """A model input as calibration data must match it: dims are ints (fixed), names (a
    symbolic dim: equal wherever it appears in one feed) or None (free)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int | str | None, ...]

    def text(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype.name}[{dims}]"


def input_specs(model: onnx.ModelProto, pins: Mapping[str, Sequence[int | str]] | None,
                label: str) -> dict[str, InputSpec]:
    """The model's inputs (not its initializers), with the project's pins applied."""
    initializers = {t.name for t in model.graph.initializer}
    specs = {}
    for vi in model.graph.input:
        if vi.name in initializers or not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        dims: list[int | str | None] = [
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or None)
            for d in tt.shape.dim]
        pinned = (pins or {}).get(vi.name)
        if pinned is not None and len(pinned) == len(dims):
            dims = [p if isinstance(p, int) or not isinstance(d, int) else d
                    for p, d in zip(pinned, dims)]
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{label}: input {vi.name!r} has an element type calibration data "
                              "cannot hold; quantize a model whose inputs are numpy dtypes") from None
        specs[vi.name] = InputSpec(vi.name, dtype, tuple(dims))
    return specs


def read_calibration(source: CalibrationSource, specs: Mapping[str, InputSpec], *,
                     search_path: Sequence[Path] = ()) -> list[Feeds]:
    """The feeds of `source`, each checked against `specs`; at least one."""
    if isinstance(source, Path) or (isinstance(source, str) and not _is_entry_point(source)):
        return _read_npz(Path(source), specs)
    if isinstance(source, str):
        label = f"calibration entry point {source!r}"
        feeds: Iterable[Mapping[str, Any]] = _entry_point_feeds(source, label, search_path)
    else:
        label = "calibration data"
        feeds = source
    checked = []
    try:
        for index, feed in enumerate(feeds):
            checked.append(_check_feed(feed, specs, f"{label}, feed {index}"))
    except ConfigError:
        raise
    except Exception as exc:  # the user's generator failed while running
        raise ConfigError(f"{label} raised {type(exc).__name__}: {exc}; fix the function (the "
                          "traceback above shows where)") from exc
    if not checked:
        raise ConfigError(f"{label} gave no feeds; it must return or yield at least one dict of "
                          f"input name -> array (inputs: {_inputs_text(specs)})")
    return checked


def feeds_digest(feeds: Iterable[Feeds]) -> str:
    """SHA-256 over the feeds' names, dtypes, shapes and bytes (the compile cache key's part)."""
    digest = hashlib.sha256()
    for feed in feeds:
        for name in sorted(feed):
            array = np.ascontiguousarray(feed[name])
            digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
            digest.update(array.tobytes())
        digest.update(b"\1")
    return digest.hexdigest()


def _is_entry_point(text: str) -> bool:
    from cuvil.config import ENTRY_POINT

    return bool(ENTRY_POINT.match(text))


def _inputs_text(specs: Mapping[str, InputSpec]) -> str:
    return ", ".join(spec.text() for spec in specs.values())


def _read_npz(path: Path, specs: Mapping[str, InputSpec]) -> list[Feeds]:
    label = str(path)
    fix = f"write it with np.savez({path.name!r}, {', '.join(f'{n}=...' for n in specs)})"
    kind = not_a_regular_file(path)
    if kind == "missing":
        raise ConfigError(f"{label}: no such calibration file; {fix}")
    if kind is not None:
        raise ConfigError(f"{label}: the calibration data is {kind}, not a file; {fix}")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{label}: not an .npz file ({exc}); {fix}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ConfigError(f"{label}: a single .npy array, not an .npz file of named arrays; {fix}")
    with loaded:
        try:
            arrays = {name: loaded[name] for name in loaded.files}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise ConfigError(f"{label}: cannot read its arrays ({exc}); {fix} with numeric "
                              "arrays (object arrays need pickle, which cuvil does not load)") from None
    _check_names(arrays, specs, label)
    for name, array in arrays.items():
        spec = specs[name]
        if array.ndim not in (len(spec.shape), len(spec.shape) + 1):
            raise ConfigError(
                f"{label}: input {name!r} has shape {list(array.shape)} (rank {array.ndim}), the "
                f"model's input is {spec.text()} (rank {len(spec.shape)}); save samples along the "
                f"first axis (rank {len(spec.shape)}) or whole feeds stacked on a new first axis "
                f"(rank {len(spec.shape) + 1})")
        _check_dtype(array, spec, label)
    rows = {name: len(a) if a.ndim else None for name, a in arrays.items()}
    if len(set(rows.values())) != 1 or None in rows.values():
        counts = ", ".join(f"{n}: {r if r is not None else 'a scalar'}" for n, r in rows.items())
        raise ConfigError(f"{label}: the arrays hold different numbers of samples along their "
                          f"first axis ({counts}); give every input the same samples, one per row")
    total = next(iter(rows.values()))
    if not total:
        raise ConfigError(f"{label}: the arrays hold no samples (their first axis is 0); save "
                          "representative inputs, a few hundred samples are typical")
    stacked = {name: arrays[name].ndim == len(specs[name].shape) + 1 for name in arrays}
    if len(set(stacked.values())) != 1:
        raise ConfigError(f"{label}: some arrays stack whole feeds (one rank more than their "
                          "input) and others do not; save all in one layout")
    if next(iter(stacked.values())):
        feeds = [{n: a[i] for n, a in arrays.items()} for i in range(total)]
    else:
        step = _rows_per_feed(specs, label, total)
        feeds = [{n: a[i:i + step] for n, a in arrays.items()} for i in range(0, total, step)]
    return [_check_feed(feed, specs, label) for feed in feeds]


def _rows_per_feed(specs: Mapping[str, InputSpec], label: str, total: int) -> int:
    """The model's fixed batch size, if an input fixes its first dim, else _ROWS_PER_FEED."""
    fixed = {s.shape[0] for s in specs.values() if s.shape and isinstance(s.shape[0], int)}
    if not fixed:
        return _ROWS_PER_FEED
    step = min(fixed)
    if total % step:
        raise ConfigError(f"{label}: {total} samples, but the model's inputs "
                          f"({_inputs_text(specs)}) take batches of {step}; give a multiple of "
                          f"{step} samples")
    return step


def _check_names(feed: Mapping[str, Any], specs: Mapping[str, InputSpec], label: str) -> None:
    missing = [n for n in specs if n not in feed]
    extra = [n for n in feed if n not in specs]
    if missing:
        raise ConfigError(f"{label}: no array for the model input {missing[0]!r} (it holds "
                          f"{sorted(feed) or 'none'}; the model's inputs are {_inputs_text(specs)}); "
                          "give one array per input, named as the input")
    if extra:
        raise ConfigError(f"{label}: {extra[0]!r} is not an input of the model (its inputs are "
                          f"{_inputs_text(specs)}); remove it or name it as the input it is for")


def _check_dtype(array: np.ndarray, spec: InputSpec, label: str) -> None:
    if array.dtype != spec.dtype:
        raise ConfigError(f"{label}: input {spec.name!r} is {array.dtype.name}, the model's input is "
                          f"{spec.text()}; convert it, e.g. x.astype(np.{spec.dtype.name})")


def _check_feed(feed: Any, specs: Mapping[str, InputSpec], label: str) -> Feeds:
    if not isinstance(feed, Mapping):
        raise ConfigError(f"{label}: {type(feed).__name__}, expected a dict of input name -> "
                          f"array (inputs: {_inputs_text(specs)})")
    _check_names(feed, specs, label)
    arrays = {name: np.asarray(value) for name, value in feed.items()}
    symbols: dict[str, tuple[int, str]] = {}
    for name, array in arrays.items():
        spec = specs[name]
        _check_dtype(array, spec, label)
        where = f"{label}: input {name!r} has shape {list(array.shape)}, the model's input is {spec.text()}"
        if array.ndim != len(spec.shape):
            raise ConfigError(f"{where} (rank {len(spec.shape)}); give arrays of that rank")
        for axis, (size, dim) in enumerate(zip(array.shape, spec.shape)):
            if isinstance(dim, int) and size != dim:
                raise ConfigError(f"{where}: dim {axis} must be {dim}; reshape or resize the data")
            if isinstance(dim, str):
                seen = symbols.setdefault(dim, (size, name))
                if seen[0] != size:
                    raise ConfigError(f"{where}: dim {axis} ({dim}) is {size} here but {seen[0]} in "
                                      f"input {seen[1]!r}; give equal sizes for one symbolic dim")
    return arrays


def _entry_point_feeds(spec: str, label: str, search_path: Sequence[Path]) -> Iterator[Mapping[str, Any]]:
    module_name, _, qualname = spec.partition(":")
    with _importable_from(search_path):
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError as exc:
            where = ", ".join(str(p) for p in search_path) or "sys.path"
            raise ConfigError(f"{label}: cannot import {module_name!r} ({exc}; searched {where} "
                              "first); put the module in the project's Python package, or fix the "
                              "name") from exc
        except Exception as exc:
            raise ConfigError(f"{label}: importing {module_name!r} raised {type(exc).__name__}: "
                              f"{exc}; fix the module") from exc
    for part in qualname.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{label}: {module_name!r} has no {qualname!r}; define it, or fix "
                              "the name after the colon")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{label}: {qualname!r} is a {type(target).__name__}, not a function; "
                          "name a function that returns or yields feed dicts")
    try:
        feeds = target()
    except Exception as exc:
        raise ConfigError(f"{label} raised {type(exc).__name__}: {exc}; fix the function (the "
                          "traceback above shows where)") from exc
    if isinstance(feeds, Mapping) or not isinstance(feeds, Iterable):
        raise ConfigError(f"{label} returned a {type(feeds).__name__}; it must return or yield "
                          "feed dicts (a list or generator of them), not one dict")
    yield from feeds


@contextlib.contextmanager
def _importable_from(folders: Sequence[Path]) -> Iterator[None]:
    """Put `folders` first on sys.path; afterwards forget them and the modules found there, so
    a later build (in this process) imports the user's edited files again."""
    added = [str(f) for f in folders]
    before = set(sys.modules)
    sys.path[:0] = added
    try:
        yield
    finally:
        for entry in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)
        roots = [Path(f).resolve() for f in folders]
        for name in set(sys.modules) - before:
            file = getattr(sys.modules[name], "__file__", None)
            if file and any(root in Path(file).resolve().parents for root in roots):
                del sys.modules[name]
