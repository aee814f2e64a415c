"""Seed models saved with their weights as ONNX external data, and the mutations of their
`external_data` entries and data files that the external-data fuzzer applies.

A seed is a folder, given as `{name: content}` relative to the model's folder: `model.onnx`,
its data files, and `../outside.bin` (a copy of a data file beside the folder, which nothing may
read). Content is bytes, or `("fifo",)`, `("dir",)`, `("symlink", target)`; a location may
start with `@ROOT@`, the folder holding the model's folder (unknown until the worker makes it),
or be `@BYTES@`, written as bytes that are not UTF-8. A mutation is `(kind, a, b)` as in
fuzz_seeds.py: `a` picks the tensor or the data file, `b` what it becomes, so a failing case
replays as an `@example`.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
from fuzz_seeds import SEEDS, _pick
from onnx import TensorProto, helper, numpy_helper

MODEL = "model.onnx"
OUTSIDE = "../outside.bin"
ROOT = "@ROOT@"
#: a location that becomes bytes that are not UTF-8 (protobuf's API sets no such string)
NOT_UTF8 = ("@BYTES@", b"w\xff\xfe.bin")
Files = dict[str, Any]


def constant() -> onnx.ModelProto:
    """Weights in a Constant node's tensor attribute (external too, with convert_attribute)."""
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32),
                                 "w_value")
    nodes = [helper.make_node("Constant", [], ["w"], value=w),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "seed", [helper.make_tensor_value_info("x", 1, ["N", 3])],
                              [helper.make_tensor_value_info("y", 1, ["N", 5])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


#: small models with dense random weights: float (conv, matmul, constant), scalars (elementwise)
#: and the int64 shape and indices the compiler reads at compile time (reshape_transpose)
MODELS: dict[str, Callable[[], onnx.ModelProto]] = {
    **{n: SEEDS[n] for n in ("conv", "matmul", "elementwise", "reshape_transpose")},
    "constant": constant}
LAYOUTS = {"one-file": True, "per-tensor": False}
SEED_NAMES = sorted(f"{m}/{layout}" for m in MODELS for layout in LAYOUTS)


@functools.cache
def _seed(name: str) -> tuple[tuple[str, bytes], ...]:
    model, layout = name.split("/")
    with tempfile.TemporaryDirectory() as tmp:
        one_file = LAYOUTS[layout]
        onnx.save_model(MODELS[model](), str(Path(tmp, MODEL)), save_as_external_data=True,
                        all_tensors_to_one_file=one_file, size_threshold=0, convert_attribute=True,
                        location="weights.bin" if one_file else None)
        files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}
    data = max((v for k, v in files.items() if k != MODEL), key=len)
    return (*files.items(), (OUTSIDE, data))


def tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The tensors with data (initializers, tensor attributes) of the graph and its subgraphs."""
    def walk(g: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                if attr.HasField("g"):
                    yield from walk(attr.g)
    return list(walk(model.graph))


# -- the values an entry can take ---------------------------------------------------------------

def _numbers(current: int, size: int) -> list[str | None]:
    """Offsets or lengths: negative, huge, past the file's end, off by one (unaligned), not
    numbers, numbers Python's int() reads but ONNX does not; None removes the entry."""
    values = [-1, -(2**63), 2**63, 2**64 + 1, size, size + 1, current + 1, current - 1,
              current + 4, 0, 1 << 40]
    return [*map(str, values), "x", "", " 4", "4_0", "1e3", "0x10", "\u0663", None]


def _locations(own: str, files: Files) -> list[str | None]:
    """A missing file, a folder, absolute paths (outside, and to its own file inside), `..`
    escapes, empty, NUL, control bytes and bytes not UTF-8, another tensor's file, the model
    itself, a name too long for the file system; None removes the entry."""
    others = sorted(k for k in files if k not in (MODEL, OUTSIDE, own)) or [own]
    return ["missing.bin", "sub", f"{ROOT}/outside.bin", f"{ROOT}/model/{own}", OUTSIDE,
            f"../model/{own}", f"sub/../{own}", f"./{own}", "", ".", "..", "w\0.bin",
            "\x01\x7f odd\n.bin", "\u00e9.bin", NOT_UTF8[0], *others, MODEL, "a" * 300, None]


def _set(t: onnx.TensorProto, key: str, value: str | None) -> None:
    """Set (or with None remove) the entry `key`; add it if missing."""
    entries = [e for e in t.external_data if e.key != key or value is not None]
    del t.external_data[:]
    t.external_data.extend(entries)
    if value is None:
        return
    for e in t.external_data:
        if e.key == key:
            e.value = value
            return
    t.external_data.add(key=key, value=value)


def _info(t: onnx.TensorProto, files: Files) -> tuple[str, int, int, int]:
    """The tensor's location, offset and length, and its file's size (0 when unreadable)."""
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location", "")
    data = files.get(location)
    size = len(data) if isinstance(data, bytes) else 0

    def number(key: str, default: int) -> int:
        try:
            return int(info.get(key, default))
        except ValueError:
            return default
    return location, number("offset", 0), number("length", size), size


def _bytes_of(t: onnx.TensorProto, files: Files) -> bytes:
    location, offset, length, _ = _info(t, files)
    data = files.get(location)
    return data[offset:offset + length] if isinstance(data, bytes) else b""


def _entry(model: onnx.ModelProto, files: Files, kind: str, a: int, b: int) -> None:
    t = _pick(tensors(model), a)
    if t is None:
        return
    location, offset, length, size = _info(t, files)
    if kind == "offset":
        _set(t, "offset", _pick(_numbers(offset, size), b))
    elif kind == "length":
        _set(t, "length", _pick(_numbers(length, size), b))
    elif kind == "location":
        value = _pick(_locations(location, files), b)
        if value == "sub" or (value or "").startswith("sub/"):
            files["sub"] = ("dir",)
        _set(t, "location", value)
    elif kind == "checksum":
        _set(t, "checksum", _pick(["0" * 40, "not hex", ""], b))
    elif kind == "duplicate_key":  # a second entry for a key ONNX expects once (or an unknown key)
        key = _pick(["location", "offset", "length", "checksum", "basepath", "bogus"], b)
        values = {"location": _locations(location, files), "offset": _numbers(offset, size),
                  "length": _numbers(length, size)}.get(key, ["0", "x"])
        t.external_data.add(key=key, value=_pick(values, b >> 3) or "")
    elif kind == "data_location":
        choice = b % 4
        if choice < 2:  # flipped to DEFAULT, its entries kept, with the right raw data or none
            raw = _bytes_of(t, files) if choice else b""
            t.data_location = TensorProto.DEFAULT
            t.raw_data = raw
        else:  # still EXTERNAL, with raw data too: the file's bytes or others of that length
            raw = _bytes_of(t, files)
            t.raw_data = raw if choice == 2 else bytes(255 - x for x in raw)
    else:
        raise AssertionError(f"unknown entry mutation {kind!r}")


def _file(files: Files, kind: str, a: int, b: int) -> None:
    names = sorted(k for k in files if k not in (MODEL, OUTSIDE))
    name = _pick(names, a)
    data = files.get(name)
    if not isinstance(data, bytes):
        return
    if kind == "truncate":
        files[name] = data[:b % max(len(data), 1)]
    elif kind == "extend":
        files[name] = data + bytes([b % 256]) * (1 + (b >> 8) % 64)
    elif kind == "flip" and data:
        flipped = bytearray(data)
        flipped[(b >> 3) % len(data)] ^= 1 << (b % 8)
        files[name] = bytes(flipped)
    elif kind == "replace":  # by a special file, a link outside or inside, a link loop, nothing
        other = _pick([n for n in names if n != name] or [name], b >> 3)
        files[name] = [("fifo",), ("dir",), ("symlink", OUTSIDE), ("symlink", other),
                       ("symlink", name), b"", None][b % 7]
        if files[name] is None:
            del files[name]
    elif kind != "flip":
        raise AssertionError(f"unknown file mutation {kind!r}")


ENTRY_MUTATIONS = ["offset", "length", "location", "checksum", "duplicate_key", "data_location"]
FILE_MUTATIONS = ["truncate", "extend", "flip", "replace"]
MUTATIONS = ENTRY_MUTATIONS + FILE_MUTATIONS


def mutated_folder(seed: str, mutations: list[tuple[str, int, int]]) -> Files:
    """The seed's files after the mutations, in order."""
    files: Files = dict(_seed(seed))
    for kind, a, b in mutations:
        if kind in ENTRY_MUTATIONS:
            model = onnx.load_model_from_string(files[MODEL])
            _entry(model, files, kind, a, b)
            files[MODEL] = model.SerializeToString()
        else:
            _file(files, kind, a, b)
    return files


def make_folder(root: Path, files: Files) -> Path:
    """Write the files into `root/model/` (and beside it); the model's path."""
    folder = root / "model"
    folder.mkdir()
    for name, content in sorted(files.items(), key=lambda item: not isinstance(item[1], bytes)):
        path = folder / name
        if name == MODEL:
            model = onnx.load_model_from_string(content)
            for t in tensors(model):
                for e in t.external_data:
                    e.value = e.value.replace(ROOT, str(root))
            content = model.SerializeToString().replace(NOT_UTF8[0].encode(), NOT_UTF8[1])
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content[0] == "fifo":
            os.mkfifo(path)
        elif content[0] == "dir":
            path.mkdir()
        else:
            path.symlink_to(content[1])
    return folder / MODEL
