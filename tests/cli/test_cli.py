"""The `cuvil` command, called through `cuvil.cli.main(argv)` as the console script does.

Fast tests cover argument handling, errors (message on stderr, exit code 2, no traceback),
`targets`, `inspect` of a model, `init`, and the refusal paths of `check` and `publish`. The slow
ones compile the digits model and call the library through its C header's ABI (compared with
onnxruntime), build a scaffolded project for two targets and check, inspect and dry-run publish
its wheels, and run `bench`. Nothing is ever uploaded.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import shlex
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from cuvil import cli

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"
DIGITS_MODEL = DIGITS / "models" / "classifier.onnx"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert err.startswith("cuvil: error: ") and "Traceback" not in err
    for word in words:
        assert word in err, err


# --------------------------------------------------------------------------- basics


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys)
    assert code == 2 and "compile" in err and "publish" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import cuvil

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert cuvil.__version__ in capsys.readouterr().out


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_subcommand_has_a_description_and_examples_that_parse(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # after the usage lines
    assert not description.startswith(("positional arguments:", "options:")), out
    assert len(description.split()) >= 8, description
    examples = out.split("\nexamples:\n", 1)[1].splitlines()
    assert examples and all(line.startswith(f"  cuvil {command}") for line in examples), out
    for example in examples:  # each example is a valid command line for this subcommand
        args = cli._parser().parse_args(shlex.split(example)[1:])
        assert args.func.__name__ == f"cmd_{command}", example


def test_targets_lists_every_toolchain_file_and_marks_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "targets")
    assert code == 0 and err == ""  # results on stdout only
    lines = {
        line.split()[0] if not line.startswith("*") else line.split()[1]: line
        for line in out.splitlines()
        if line.strip()
    }
    host = {
        ("Linux", "x86_64"): "x86_64-linux",
        ("Linux", "aarch64"): "aarch64-linux",
        ("Darwin", "arm64"): "arm64-macos",
        ("Darwin", "x86_64"): "x86_64-macos",
    }.get((platform.system(), platform.machine()))
    files = sorted((ROOT / "toolchain-files").glob("*.toml"))
    assert files
    for path in files:
        data = tomllib.loads(path.read_text())
        line = lines[data["name"]]
        assert data["platform-tag"] in line
        assert line.startswith("*") == (data["name"] == host), line
        if data["name"] == host:
            assert "(host)" in line


def _model_with_an_unknown_op(path: Path) -> Path:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Frobnicate", ["r"], ["y"], domain="com.example"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    onnx.save(model, str(path))
    return path


def test_inspect_model_lists_tensors_and_operator_support(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _model_with_an_unknown_op(tmp_path / "m.onnx")
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0
    assert "input   x: float32[batch, 4]" in out and "output  y: float32[batch, 4]" in out
    relu = next(line for line in out.splitlines() if line.strip().startswith("Relu"))
    frob = next(line for line in out.splitlines() if "Frobnicate" in line)
    assert relu.rstrip().endswith("supported") and "NOT" not in relu
    assert "com.example.Frobnicate" in frob and frob.rstrip().endswith("NOT SUPPORTED")
    assert "cannot compile 1 operator type(s): com.example.Frobnicate" in out
    assert '@cuvil.register_op("com.example", "Frobnicate")' in out and "docs/custom-ops.md" in out


def test_inspect_types_of_a_mixed_float16_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A float32 MLP converted to float16 with float32 I/O: every value is listed with its
    dtype, the converter's Casts are named with the direction they change precision, and the
    float16 MatMul and Softmax are flagged as computed in float32."""
    float16 = pytest.importorskip("onnxconverter_common.float16")
    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
         helper.make_node("Softmax", ["h"], ["y"], axis=-1, name="probs")],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    mixed = float16.convert_float_to_float16(model, keep_io_types=True)
    onnx.save(mixed, str(tmp_path / "mixed.onnx"))
    casts = {n.name: n for n in mixed.graph.node if n.op_type == "Cast"}
    assert len(casts) == 2

    code, out, _ = run(capsys, "inspect", "--types", str(tmp_path / "mixed.onnx"))
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert rows["x"][1:] == ["float32", "[batch,", "16]", "input"]
    assert rows["w"][1] == "float16" and rows["h"][1] == "float16" and rows["y"][1] == "float32"
    flags = [line for line in out.splitlines() if line.startswith(("  cast ", "  float32 compute"))]
    for name, node in casts.items():
        to = "float16" if node.attribute[0].i == TensorProto.FLOAT16 else "float32"
        assert any(f"{name} (Cast)" in f and f"-> {to}" in f for f in flags), (name, out)
    assert any("fc (MatMul): computes float16 in float32" in f for f in flags), out
    assert any("probs (Softmax): computes float16 in float32" in f for f in flags), out


def test_inspect_types_names_the_node_where_typing_stops(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    graph = helper.make_graph(
        [helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT, name="mask_cast"),
         helper.make_node("Sub", ["x", "mf"], ["y"], name="mask_sub")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 4]),
              helper.make_tensor_value_info("m", TensorProto.INT64, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4])])
    path = tmp_path / "broken.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    code, out, _ = run(capsys, "inspect", "--types", str(path))
    assert code == 1
    assert "inference stops  mask_sub (Sub)" in out and "insert a Cast" in out
    assert any(line.split()[:2] == ["x", "float16"] for line in out.splitlines() if line.strip())


def test_inspect_digits_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", str(DIGITS_MODEL))
    assert code == 0
    model = onnx.load(str(DIGITS_MODEL))
    for op in {n.op_type for n in model.graph.node}:
        assert op in out
    assert "image: float32[" in out


def test_inspect_a_project_shows_each_of_its_models(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    project = tmp_path / "two-models"
    (project / "models").mkdir(parents=True)
    (project / "models" / "digits.onnx").write_bytes(DIGITS_MODEL.read_bytes())
    _model_with_an_unknown_op(project / "models" / "odd.onnx")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["cuvil"]\nbuild-backend = "cuvil.build_backend"\n'
        '[project]\nname = "two-models"\nversion = "1.0"\n'
        '[tool.cuvil.models.digits]\nsource = "models/digits.onnx"\ninputs = { image = [3, 1, 8, 8] }\n'
        '[tool.cuvil.models.odd]\nsource = "models/odd.onnx"\n')
    for path in (project, project / "pyproject.toml"):
        code, out, _ = run(capsys, "inspect", str(path))
        assert code == 0, out
        assert "project two-models, package two_models, 2 model(s)" in out
        digits, odd = out.split("\nmodel odd: ")
        assert "model digits: " in digits and "(inputs image=[3, 1, 8, 8])" in digits
        for op in {n.op_type for n in onnx.load(str(DIGITS_MODEL)).graph.node}:
            assert op in digits
        assert "Conv" not in odd
        assert "com.example.Frobnicate" in odd and "NOT SUPPORTED" in odd and "NOT" not in digits
    # --types types each model with its pins from the project: the pinned batch of 3
    code, out, _ = run(capsys, "inspect", str(project), "--types")
    digits, odd = out.split("\nmodel odd: ")
    assert any(line.split()[:3] == ["image", "float32", "[3,"] for line in digits.splitlines())
    assert code == 1 and "Frobnicate" in odd  # typing stops at the op cuvil lacks
    assert_user_error(*run(capsys, "inspect", str(project), "--input", "image=1,1,8,8")[::2],
                      "--input is for a model file")
    assert_user_error(*run(capsys, "inspect", str(tmp_path))[::2], "without pyproject.toml")


def test_user_errors_exit_2_without_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert_user_error(*run(capsys, "inspect", str(tmp_path / "missing.onnx"))[::2], "no such file")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\x01 this is not protobuf \xff" * 10)
    assert_user_error(
        *run(capsys, "compile", str(garbage), "-o", str(tmp_path / "g.so"))[::2], "garbage.onnx"
    )
    assert_user_error(*run(capsys, "compile", str(DIGITS_MODEL), "--input", "image")[::2], "NAME=DIM")
    assert_user_error(*run(capsys, "compile", str(DIGITS_MODEL), "--input", "image=0,1")[::2], "dim '0'")
    assert_user_error(
        *run(capsys, "compile", str(DIGITS_MODEL), "--target", "sparc-solaris")[::2], "unknown target"
    )
    assert_user_error(*run(capsys, "build", str(tmp_path))[::2], "no pyproject.toml")
    assert not list(tmp_path.glob("*.so"))


# ----------------------------------------------------------------------------- init


def test_init_scaffolds_a_valid_project_and_refuses_to_overwrite(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from cuvil.config import load_project

    project = tmp_path / "my-digits"
    code, out, _ = run(capsys, "init", str(project), "--model", str(DIGITS_MODEL))
    assert code == 0, out
    assert (project / "models" / "classifier.onnx").read_bytes() == DIGITS_MODEL.read_bytes()
    data = tomllib.loads((project / "pyproject.toml").read_text())
    assert data["build-system"]["build-backend"] == "cuvil.build_backend"
    assert data["project"]["name"] == "my-digits-cuvil"
    # the model's declared input dims, symbolic ones by the model's own names
    model = onnx.load(str(DIGITS_MODEL))
    declared = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert data["tool"]["cuvil"]["models"]["classifier"]["inputs"]["image"] == declared
    config = load_project(project)
    assert config.package == "my_digits" and [m.name for m in config.models] == ["classifier"]

    before = (project / "pyproject.toml").read_bytes()
    code, _, err = run(capsys, "init", str(project), "--model", str(DIGITS_MODEL))
    assert_user_error(code, err, "refusing to overwrite", "pyproject.toml")
    assert (project / "pyproject.toml").read_bytes() == before


def test_init_rejects_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert_user_error(
        *run(capsys, "init", str(tmp_path / "a"), "--model", str(tmp_path / "none.onnx"))[::2],
        "no such model file",
    )
    assert_user_error(
        *run(capsys, "init", str(tmp_path / "b"), "--model", str(DIGITS_MODEL), "--name", "2fast")[::2],
        "C identifier",
    )
    assert not (tmp_path / "b" / "pyproject.toml").exists()
    # a folder named like a standard-library module: refused before anything is written
    assert_user_error(*run(capsys, "init", str(tmp_path / "json"), "--model", str(DIGITS_MODEL))[::2],
                      "package 'json' is the import name of a module of Python's standard library",
                      "--package NAME")
    assert not (tmp_path / "json").exists()


def test_build_all_targets_needs_targets(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, _ = run(capsys, "init", str(tmp_path), "--model", str(DIGITS_MODEL))
    assert code == 0
    pyproject = tmp_path / "pyproject.toml"
    text = pyproject.read_text()
    start = text.index("targets = [")
    pyproject.write_text(text[:start] + "targets = []" + text[text.index("\n", start) :])
    assert_user_error(
        *run(capsys, "build", str(tmp_path), "--all-targets")[::2], "tool.cuvil.targets is empty"
    )


# --------------------------------------------------------------- check and publish refusal


def test_check_and_publish_refuse_a_broken_wheel(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "digits_cuvil-1.0.0-py3-none-manylinux_2_17_x86_64.whl"
    broken.write_bytes(b"PK\x03\x04 truncated")
    code, out, _ = run(capsys, "check", str(broken))
    assert code == 1 and "FAIL archive" in out
    code, out, err = run(capsys, "publish", "--dry-run", str(broken))
    assert code == 1 and "FAIL archive" in out and "refusing to upload" in err
    assert "would run" not in out
    assert_user_error(*run(capsys, "publish", str(tmp_path / "x.tar.gz"))[::2], "not a .whl")


# ------------------------------------------------------------------- slow: compile


def _load_c_abi(library: Path, name: str) -> tuple[ctypes.CDLL, str]:
    lib = ctypes.CDLL(str(library))
    run_fn = getattr(lib, f"cuvil_{name}_run")
    run_fn.restype = ctypes.c_int32
    run_fn.argtypes = [ctypes.c_void_p] * 4
    size_fn = getattr(lib, f"cuvil_{name}_workspace_size")
    size_fn.restype = ctypes.c_int64
    size_fn.argtypes = [ctypes.c_void_p]
    checksum = (ctypes.c_char * 64).in_dll(lib, f"cuvil_{name}_abi_checksum").value.decode()
    return lib, checksum


@pytest.mark.slow
@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64", reason="loads an x86_64 Linux library"
)
def test_compile_writes_a_library_and_header_callable_through_the_c_abi(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import onnxruntime as ort
    from elftools.elf.elffile import ELFFile

    out = tmp_path / "lib" / "digits.so"
    code, stdout, err = run(
        capsys,
        "-v",
        "compile",
        str(DIGITS_MODEL),
        "-o",
        str(out),
        "--input",
        "image=batch,1,8,8",
        "--name",
        "classifier",
    )
    assert code == 0, err
    assert "cuvil: " in err  # --verbose progress lines
    header = (tmp_path / "lib" / "digits.h").read_text()
    assert "cuvil_classifier_run" in header and "digits.so" in header
    assert "input  image: float32[batch, 1, 8, 8]" in stdout
    with open(out, "rb") as f:
        dynamic = ELFFile(f).get_section_by_name(".dynamic")
        assert [t.soname for t in dynamic.iter_tags() if t.entry.d_tag == "DT_SONAME"] == ["digits.so"]

    lib, checksum = _load_c_abi(out, "classifier")
    assert f'CUVIL_CLASSIFIER_ABI_CHECKSUM "{checksum}"' in header
    images = np.load(DIGITS / "data" / "samples.npz")["images"][:5]
    probabilities = np.empty((5, 10), dtype=np.float32)
    dims = (ctypes.c_int64 * 1)(5)
    size = lib.cuvil_classifier_workspace_size(dims)
    workspace = np.empty(size + 64, dtype=np.uint8)
    address = workspace.ctypes.data + (-workspace.ctypes.data) % 64
    inputs = (ctypes.c_void_p * 1)(images.ctypes.data)
    outputs = (ctypes.c_void_p * 1)(probabilities.ctypes.data)
    assert lib.cuvil_classifier_run(inputs, outputs, dims, ctypes.c_void_p(address)) == 0
    expected = ort.InferenceSession(str(DIGITS_MODEL), providers=["CPUExecutionProvider"]).run(
        None, {"image": images}
    )[0]
    np.testing.assert_allclose(probabilities, expected, rtol=1e-4, atol=1e-5)


def test_compile_reuses_the_compile_cache(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import cuvil.compiler.driver as driver
    from cuvil.build_backend.cache import CompileCache, default_cache_dir
    from cuvil.errors import CuvilError

    monkeypatch.chdir(tmp_path)  # no pyproject.toml here: the cache settings come from the environment
    first = tmp_path / "a" / "digits.so"
    code, out, err = run(capsys, "compile", str(DIGITS_MODEL), "-o", str(first), "--target", "x86_64-linux")
    assert code == 0 and "compiled in" in out, err
    assert CompileCache(default_cache_dir(), 10**9).stats().entries == 1

    def compiles(*args: object, **kwargs: object) -> None:
        raise CuvilError("the model was compiled")

    monkeypatch.setattr(driver, "compile_model", compiles)
    again = tmp_path / "b" / "digits.so"
    code, out, err = run(capsys, "compile", str(DIGITS_MODEL), "-o", str(again), "--target", "x86_64-linux")
    assert code == 0 and "from the compile cache" in out, err
    assert again.read_bytes() == first.read_bytes()
    assert again.with_suffix(".h").read_text() == first.with_suffix(".h").read_text()
    # another file name is another SONAME; other options, another library; --no-cache and
    # CUVIL_CACHE=0 skip the cache: each compiles
    for extra in (["-o", str(tmp_path / "c" / "other.so")], ["-o", str(again), "-O", "2"],
                  ["-o", str(again), "--no-cache"]):
        code, _, err = run(capsys, "compile", str(DIGITS_MODEL), "--target", "x86_64-linux", *extra)
        assert_user_error(code, err, "the model was compiled")
    monkeypatch.setenv("CUVIL_CACHE", "0")
    assert_user_error(*run(capsys, "compile", str(DIGITS_MODEL), "-o", str(again), "--target",
                           "x86_64-linux")[::2], "the model was compiled")


@pytest.mark.slow
def test_compile_cross_target(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from elftools.elf.elffile import ELFFile

    out = tmp_path / "classifier.so"
    code, stdout, err = run(
        capsys, "compile", str(DIGITS_MODEL), "-o", str(out), "--target", "aarch64-linux", "-O", "2"
    )
    assert code == 0, err
    assert err == ""  # no progress lines without --verbose
    with open(out, "rb") as f:
        assert ELFFile(f).header.e_machine == "EM_AARCH64"
    assert "for aarch64-linux" in stdout and (tmp_path / "classifier.h").is_file()


# --------------------------------------------------------------------- slow: build


@pytest.mark.slow
def test_build_check_inspect_and_publish_dry_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "proj"
    assert run(capsys, "init", str(project), "--model", str(DIGITS_MODEL))[0] == 0
    pyproject = project / "pyproject.toml"
    text = pyproject.read_text()
    start = text.index("targets = [")
    pyproject.write_text(
        text[:start] + 'targets = ["x86_64-linux", "aarch64-linux"]' + text[text.index("\n", start) :]
    )
    dist = tmp_path / "dist"
    cwd = os.getcwd()
    code, out, err = run(
        capsys,
        "build",
        str(project),
        "--all-targets",
        "--sdist",
        "-o",
        str(dist),
        "-C",
        f"build-dir={tmp_path / 'build'}",
    )
    assert code == 0, err
    assert os.getcwd() == cwd
    # off a terminal the backend's progress lines pass through, without the commands it runs
    assert "cuvil: model 1 of 1: classifier\n" in err and "cuvil: $ " not in err
    assert err.count("cuvil: built model classifier: 8 nodes (") == 2  # one per target
    wheels = sorted(dist.glob("*.whl"))
    assert [w.name for w in wheels] == [
        "proj_cuvil-0.1.0-py3-none-manylinux_2_17_aarch64.whl",
        "proj_cuvil-0.1.0-py3-none-manylinux_2_17_x86_64.whl",
    ]
    assert (dist / "proj_cuvil-0.1.0.tar.gz").is_file()
    for wheel in wheels:
        assert f"built {wheel}" in out

    code, out, _ = run(capsys, "check", *map(str, wheels))
    assert code == 0, out
    assert "FAIL" not in out and out.count("OK: all") == 2

    code, out, _ = run(capsys, "inspect", str(wheels[0]))
    assert code == 0
    assert "target aarch64-linux" in out and "model classifier: proj/_classifier.so" in out

    code, out, _ = run(
        capsys, "publish", "--dry-run", "--repository-url", "http://127.0.0.1:9/legacy/", *map(str, wheels)
    )
    assert code == 0
    assert "would run: twine upload --repository-url http://127.0.0.1:9/legacy/" in out

    # without twine, a clear message instead of an upload
    monkeypatch.setattr(cli, "_twine_command", lambda: None)
    assert_user_error(*run(capsys, "publish", str(wheels[1]))[::2], "twine", "not installed")

    # a wheel whose RECORD no longer matches is refused before any upload
    broken = tmp_path / "broken" / wheels[1].name
    broken.parent.mkdir()
    with zipfile.ZipFile(wheels[1]) as src, zipfile.ZipFile(broken, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "proj/__init__.py":
                data += b"\nprint('changed')\n"
            dst.writestr(info, data)
    code, out, err = run(capsys, "publish", "--dry-run", str(wheels[0]), str(broken))
    assert code == 1 and "refusing to upload" in err and "FAIL RECORD" in out
    assert "would run" not in out


@pytest.mark.slow
def test_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "bench", str(DIGITS_MODEL), "--batch", "2", "--runs", "3", "--warmup", "1",
                         "--threads", "1")
    assert code == 0, err
    assert "cuvil" in out and "onnxruntime" in out and "ratio" in out
    assert "image[2, 1, 8, 8]" in out


def test_bench_refuses_zero_threads(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "bench", str(DIGITS_MODEL), "--threads", "0")
    assert code == 2 and "--threads" in err
