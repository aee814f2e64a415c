"""Reading model files: broken files, external data (missing, outside the folder, short) and
unsupported ops give one clear ModelError naming the file; external weights compile and
match onnxruntime."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from oracle import make_model, run_ort

import cuvil
from cuvil.errors import CuvilError, ModelError, UnsupportedOpError

RNG = np.random.default_rng(7)
W1 = RNG.standard_normal((8, 16)).astype(np.float32)
B1 = RNG.standard_normal(16).astype(np.float32)
W2 = RNG.standard_normal((16, 4)).astype(np.float32)


def _mlp() -> onnx.ModelProto:
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    return make_model(nodes, {"x": (np.float32, [3, 8])}, {"y": np.float32},
                      initializers={"w1": W1, "b1": B1, "w2": W2})


def _save_external(folder: Path, one_file: bool = True, name: str = "model.onnx") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    onnx.save_model(_mlp(), str(path), save_as_external_data=True,
                    all_tensors_to_one_file=one_file,
                    location="weights.bin" if one_file else None, size_threshold=0)
    return path


def _compile_error(source, cls=ModelError) -> str:
    with pytest.raises(cls) as info:
        cuvil.compile(source)
    exc = info.value
    # a clear message of our own, not a chained protobuf or OS traceback
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)
    return str(exc)


def _set_entry(path: Path, tensor: str, key: str, value: str | None) -> None:
    """Set an initializer's external-data entry `key` (added if missing; None removes it)."""
    model = onnx.load(str(path), load_external_data=False)
    t = next(t for t in model.graph.initializer if t.name == tensor)
    entries = [e for e in t.external_data if e.key != key]
    del t.external_data[:]
    t.external_data.extend(entries)
    if value is not None:
        t.external_data.add(key=key, value=value)
    path.write_bytes(model.SerializeToString())


def _set_location(path: Path, tensor: str, location: str) -> None:
    _set_entry(path, tensor, "location", location)


@pytest.fixture()
def no_reads_outside(monkeypatch, tmp_path):
    """Fail the test if cuvil opens a file outside `tmp_path/model/`."""
    import builtins
    import io

    allowed = (tmp_path / "model").resolve()
    real_open = builtins.open
    real_io_open = io.open
    opened = []

    def guard(opener):
        def checked(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and "r" in mode:
                p = Path(file).resolve()
                if str(p).startswith(str(tmp_path)) and allowed not in p.parents:
                    opened.append(p)
            return opener(file, mode, *args, **kwargs)
        return checked

    monkeypatch.setattr(builtins, "open", guard(real_open))
    monkeypatch.setattr(io, "open", guard(real_io_open))
    yield
    assert not opened, f"read outside the model's folder: {opened}"


# -- broken files ----------------------------------------------------------------------------


def test_truncated_model_file(tmp_path):
    data = _mlp().SerializeToString()
    for cut in (len(data) // 2, len(data) - 3, 5):
        path = tmp_path / f"cut{cut}.onnx"
        path.write_bytes(data[:cut])
        msg = _compile_error(path)
        assert str(path) in msg
        assert "truncated" in msg or "checker" in msg


@pytest.mark.parametrize("name", ["x", "batch"])  # an input's name, a dim's name
def test_names_that_are_not_utf8_are_refused(tmp_path, name):
    # found by tests/fuzz: protobuf returns such strings as bytes (a TypeError deep inside)
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], {"x": (np.float32, ["batch", 4])},
                       {"y": np.float32})
    data = model.SerializeToString()
    field = bytes([len(name)]) + name.encode()
    assert field in data
    path = tmp_path / "bad_text.onnx"
    path.write_bytes(data.replace(field, bytes([len(name)]) + b"\xff" * len(name)))
    msg = _compile_error(path)
    assert str(path) in msg and "not valid UTF-8" in msg and "re-export" in msg


def test_non_onnx_files(tmp_path):
    for name, content in [("notes.onnx", b"hello, this is not a model\n"),
                          ("image.onnx", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4),
                          ("empty.onnx", b""),
                          ("varint.onnx", b"\x08\x07")]:  # parses: ir_version=7, no graph
        path = tmp_path / name
        path.write_bytes(content)
        msg = _compile_error(path)
        assert str(path) in msg, msg
        assert "DecodeError" not in msg.split(";")[-1]


def test_missing_model_file(tmp_path):
    msg = _compile_error(tmp_path / "nope.onnx")
    assert "nope.onnx" in msg and "no such model file" in msg


# -- external data ---------------------------------------------------------------------------


@pytest.mark.parametrize("one_file", [True, False], ids=["one-file", "file-per-tensor"])
def test_external_weights_compile_and_match_onnxruntime(tmp_path, one_file, no_reads_outside):
    path = _save_external(tmp_path / "model", one_file=one_file)
    stored = onnx.load(str(path), load_external_data=False)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in stored.graph.initializer)
    compiled = cuvil.compile(path)
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    import onnxruntime as ort

    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(compiled(x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(compiled(x), run_ort(_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_missing_external_data_file(tmp_path):
    path = _save_external(tmp_path / "model")
    (tmp_path / "model" / "weights.bin").unlink()
    msg = _compile_error(path)
    assert str(path) in msg and "weights.bin" in msg and "missing" in msg


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_external_data_outside_the_folder_is_refused(tmp_path, where, no_reads_outside):
    path = _save_external(tmp_path / "model")
    weights = tmp_path / "model" / "weights.bin"
    outside = tmp_path / "x.bin"
    outside.write_bytes(weights.read_bytes())  # a file that exists, and must not be read
    if where == "parent":
        location = "../x.bin"
    elif where == "absolute":
        location = str(outside)
    else:
        (tmp_path / "model" / "link.bin").symlink_to(outside)
        location = "link.bin"
    _set_location(path, "w1", location)
    msg = _compile_error(path)
    assert str(path) in msg and "'w1'" in msg and "outside the model's folder" in msg


def test_external_data_shorter_than_declared(tmp_path):
    path = _save_external(tmp_path / "model")
    weights = tmp_path / "model" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:-100])
    msg = _compile_error(path)
    assert str(path) in msg and "weights.bin" in msg and "truncated" in msg


@pytest.mark.parametrize(("location", "why"), [
    ("loop.bin", "cannot be followed"),  # a symlink to itself: was a raw RuntimeError
    ("w\0.bin", "holds a NUL byte"),  # was a raw ValueError
    ("a" * 300, "cannot read external data"),  # too long for the file system: a raw OSError
    (".", "is a directory, not a file"),  # the folder itself: was called outside it
    ("@folder/weights.bin", ("is an absolute path; ONNX reads locations relative to the model's "
     "folder (onnxruntime refuses absolute ones): re-save the model with location 'weights.bin'")),
], ids=["symlink-loop", "nul", "too-long", "dot", "absolute-inside"])
def test_odd_external_data_locations_are_refused_naming_the_tensor(tmp_path, location, why, no_reads_outside):
    path = _save_external(tmp_path / "model")
    (tmp_path / "model" / "loop.bin").symlink_to("loop.bin")
    _set_location(path, "w1", location.replace("@folder", str(path.parent)))
    msg = _compile_error(path)
    assert str(path) in msg and "'w1'" in msg and why in msg


@pytest.mark.parametrize("value", ["-4", "4_0", " +48", "0x10", "1e3", "\u0663", ""])
@pytest.mark.parametrize("key", ["offset", "length"])
def test_external_data_offsets_and_lengths_are_digits_only(tmp_path, key, value):
    """As onnxruntime reads them: Python's int() takes '4_0', ' +48' and Arabic digits."""
    path = _save_external(tmp_path / "model")
    _set_entry(path, "b1", key, value)
    msg = _compile_error(path)
    assert f"tensor 'b1': its external data {key} {value!r} is not a number of bytes" in msg


def test_an_external_data_key_given_twice_is_refused(tmp_path):
    path = _save_external(tmp_path / "model")
    model = onnx.load(str(path), load_external_data=False)
    model.graph.initializer[0].external_data.add(key="offset", value="16")
    path.write_bytes(model.SerializeToString())
    msg = _compile_error(path)
    assert "tensor 'w1': its external data gives 'offset' twice ('0' and '16')" in msg


def test_an_external_data_length_that_disagrees_with_the_dims_names_both(tmp_path):
    path = _save_external(tmp_path / "model")
    _set_entry(path, "w1", "length", "513")  # within the file: it used to fail in numpy
    msg = _compile_error(path)
    assert ("tensor 'w1': its external data length is 513 bytes, but its dims [8, 16] of FLOAT "
            "take 512") in msg


def test_external_data_without_a_length_is_the_tensors_size(tmp_path):
    """As in onnxruntime: a shared file without lengths holds each tensor at its offset (it
    used to read to the file's end)."""
    path = _save_external(tmp_path / "model")
    for name in ("w1", "b1", "w2"):
        _set_entry(path, name, "length", None)
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(cuvil.compile(path)(x), run_ort(_mlp(), {"x": x})[0],
                               rtol=1e-5, atol=1e-5)


def test_external_data_in_a_model_proto_is_not_read_from_the_working_directory(tmp_path,
                                                                               monkeypatch):
    path = _save_external(tmp_path / "model")
    monkeypatch.chdir(tmp_path / "model")  # where a naive reader would find weights.bin
    proto = onnx.load(str(path), load_external_data=False)
    msg = _compile_error(proto)
    assert "external" in msg and "path" in msg


# -- unsupported ops -------------------------------------------------------------------------


def test_every_unsupported_op_is_reported_at_once_before_code_generation(monkeypatch):
    import cuvil.compiler.driver as driver

    def no_codegen(*args, **kwargs):
        raise AssertionError("code generation ran for a model with unsupported ops")

    monkeypatch.setattr(driver, "build_module", no_codegen)
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Frobnicate", ["a"], ["b"], name="frob_1", domain="com.example"),
        helper.make_node("Frobnicate", ["b"], ["c"], name="frob_2", domain="com.example"),
        helper.make_node("Twiddle", ["c"], ["d"], name="twiddle", domain="com.example"),
        helper.make_node("ImageDecoder", ["jpeg"], ["image"], name="decode"),
        helper.make_node("Add", ["d", "x"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "unsupported",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("jpeg", onnx.TensorProto.UINT8, [100])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("image", onnx.TensorProto.UINT8, ["h", "w", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                    helper.make_opsetid("com.example", 3)])
    msg = _compile_error(model, UnsupportedOpError)
    assert "3 operator(s)" in msg
    for expected in ("com.example Frobnicate (opset 3)", "'frob_1'", "'frob_2'",
                     "com.example Twiddle (opset 3)", "'twiddle'",
                     "ai.onnx ImageDecoder (opset 20)", "'decode'"):
        assert expected in msg, (expected, msg)
    assert "'relu'" not in msg and "'add'" not in msg
    # the standard op: another export opset; the custom-domain ones: how to define them
    assert "docs/ops.md" in msg and "export opset" in msg
    assert "com.example Frobnicate, com.example Twiddle: custom-domain op(s)" in msg
    assert '@cuvil.register_op("com.example", "Frobnicate")' in msg
    assert "[tool.cuvil.custom-ops.<name>]" in msg and "docs/custom-ops.md" in msg
    assert issubclass(UnsupportedOpError, CuvilError)


def test_a_model_whose_only_unsupported_op_is_custom_is_pointed_to_custom_ops_not_opsets():
    graph = helper.make_graph(
        [helper.make_node("Frobnicate", ["x"], ["y"], name="frob", domain="com.example")], "custom",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.example", 1)])
    msg = _compile_error(model, UnsupportedOpError)
    assert "docs/custom-ops.md" in msg and "tool.cuvil.op-modules" in msg
    assert "export opset" not in msg  # no exporter setting removes an op of one's own domain


def test_external_data_round_trip_keeps_the_weights(tmp_path):
    """The loader's result holds the same initializer values as the in-memory model."""
    from cuvil.compiler.frontend.loader import load_onnx

    path = _save_external(tmp_path / "model", one_file=False)
    model, label = load_onnx(path)
    assert label == str(path)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(values["w1"], W1)
    np.testing.assert_array_equal(values["b1"], B1)
    np.testing.assert_array_equal(values["w2"], W2)


def test_opset_6_prelu_slopes_are_per_channel_and_the_callers_model_is_kept():
    # before opset 7 a PRelu slope of C values applied along axis 1 (old PyTorch exports rely
    # on it); numpy-style broadcasting of [C] against [N, C, H, W] would be wrong or fail
    slope = np.array([0.1, -0.5, 2.0], dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("PRelu", ["x", "slope"], ["y"])], "old",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4, 5]),
         helper.make_tensor_value_info("slope", onnx.TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 4, 5])],
        [numpy_helper.from_array(slope, "slope")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)])
    model.ir_version = 3
    before = model.SerializeToString()
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    got = cuvil.compile(model)(x)
    np.testing.assert_allclose(got, np.where(x >= 0, x, x * slope[:, None, None]), rtol=1e-6)
    assert model.SerializeToString() == before


def test_a_model_file_or_external_data_that_is_a_fifo_is_refused_without_opening_it(tmp_path, fifo):
    path = fifo(tmp_path / "pipe.onnx")
    msg = _compile_error(path)
    assert str(path) in msg and "a FIFO (named pipe), not a model file" in msg
    path = _save_external(tmp_path / "model")
    (tmp_path / "model" / "weights.bin").unlink()
    fifo(tmp_path / "model" / "weights.bin")
    msg = _compile_error(path)
    assert "'weights.bin' is a FIFO (named pipe), not a file" in msg


@pytest.mark.parametrize("op", ["Constant", "ConstantOfShape"])
def test_a_tensor_attribute_whose_raw_data_disagrees_with_its_dims_names_the_node(op):
    """16 bytes of raw data for 3 floats: onnx's checker passes it, numpy_helper cannot
    reshape it (an initializer with the same fault has its own error)."""
    t = helper.make_tensor("c", onnx.TensorProto.FLOAT, [4], np.ones(4, np.float32).tobytes(), raw=True)
    t.dims[0] = 3 if op == "Constant" else 1
    nodes = ([helper.make_node("Constant", [], ["c"], value=t, name="bad_node")] if op == "Constant"
             else [helper.make_node("Constant", [], ["shape"], value_ints=[3]),
                   helper.make_node("ConstantOfShape", ["shape"], ["c"], value=t, name="bad_node")])
    graph = helper.make_graph(
        [*nodes, helper.make_node("Add", ["x", "c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])])
    msg = _compile_error(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert f"node 'bad_node' ({op}): attribute 'value' cannot be read" in msg and "re-export" in msg
