"""The profiler: `Model.profile`, CUVIL_PROFILE=1 in a generated package, `cuvil bench --profile`.

FLOPs are checked against counts computed here by formula from the ONNX shapes; outputs of
profiled runs against onnxruntime. Times are checked for what they must be (positive, adding
up to the compiled code's total, inside the time the call takes seen from Python).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from oracle import make_model, run_ort

from cuvil import build_backend, cli
from cuvil.check import check_wheel
from cuvil.compiler.driver import compile_model
from cuvil.config import CompileOptions
from cuvil.runtime._loader import Model, Profile

RNG = np.random.default_rng(7)
CONV_W = RNG.standard_normal((32, 3, 3, 3)).astype(np.float32)
MATMUL_B = RNG.standard_normal((48, 20)).astype(np.float32)
HEIGHT, WIDTH = 40, 48
#: one value per row of the MatMul's output: an Add the epilogue fusion leaves as a node
BIAS = RNG.standard_normal((HEIGHT, 1)).astype(np.float32)


def conv_relu_matmul() -> onnx.ModelProto:
    """x[n, 3, 40, 48] -> Conv 3x3 (32 channels, same padding) -> Relu -> MatMul [48, 20] -> Add
    (of a [40, 1] column, which stays a node of its own)."""
    return make_model(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["r"], name="relu"),
         helper.make_node("MatMul", ["r", "b"], ["m"], name="matmul"),
         helper.make_node("Add", ["m", "bias"], ["y"], name="add")],
        {"x": (np.float32, ["n", 3, HEIGHT, WIDTH])}, {"y": np.float32},
        {"w": CONV_W, "b": MATMUL_B, "bias": BIAS})


def expected_flops(n: int) -> dict[str, int]:
    """2 x multiply-adds per node, from the shapes above: Conv sums C x kh x kw products per
    output element; MatMul sums K products per output element."""
    conv_out = n * 32 * HEIGHT * WIDTH
    matmul_out = n * 32 * HEIGHT * 20
    return {"conv": 2 * conv_out * 3 * 3 * 3, "matmul": 2 * matmul_out * 48, "add": 0}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory):
    return compile_model(conv_relu_matmul(), "small", tmp_path_factory.mktemp("small"),
                         CompileOptions(cpu="native"))


@pytest.fixture(scope="module")
def model(compiled) -> Model:
    return Model(compiled.library, compiled.signature)


def feeds(n: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(n).standard_normal((n, 3, HEIGHT, WIDTH)).astype(np.float32)}


def test_profile_lists_every_node_once_with_its_op_type(model: Model) -> None:
    profile = model.profile(feeds(2), runs=3)
    assert isinstance(profile, Profile) and profile.runs == 3
    # the Relu runs inside the Conv's kernel: the profile names it there, not as a node
    assert [(n.name, n.op) for n in profile.nodes] == [
        ("conv", "Conv+Relu"), ("matmul", "MatMul"), ("add", "Add")]
    assert {t.op: t.count for t in profile.ops} == {"Conv+Relu": 1, "MatMul": 1, "Add": 1}


def test_times_are_positive_and_add_up_to_the_total(model: Model) -> None:
    profile = model.profile(feeds(2), runs=5)
    assert all(n.time_ns > 0 for n in profile.nodes)
    assert sum(n.time_ns for n in profile.nodes) + profile.copies_ns == profile.time_ns
    # the compiled code's time lies inside the call's time seen from Python and is most of it
    # (the Python side checks the inputs and allocates: tens of microseconds per call)
    assert 0.5 * profile.wall_ns < profile.time_ns <= profile.wall_ns
    ops = profile.ops
    assert [t.time_ns for t in ops] == sorted((t.time_ns for t in ops), reverse=True)


@pytest.mark.parametrize("n", [1, 3])
def test_flops_match_the_formula_for_each_batch_size(model: Model, n: int) -> None:
    runs = 2
    profile = model.profile(feeds(n), runs=runs, warmup=0)
    want = expected_flops(n)
    assert {node.name: node.flops for node in profile.nodes} == {k: runs * v for k, v in want.items()}
    assert profile.flops == runs * sum(want.values())
    conv = profile.nodes[0]
    assert conv.gflops == pytest.approx(conv.flops / conv.time_ns)
    assert profile.nodes[2].gflops is None  # Add: not counted


def test_the_table_names_every_node_and_op_type(model: Model) -> None:
    text = str(model.profile(feeds(1), runs=2))
    assert text.startswith("cuvil profile of model small: 2 runs")
    for word in ("by op type:", "by node:", "Conv+Relu", "conv (Conv+Relu)", "matmul (MatMul)",
                 "add (Add)", "GFLOP/s", "share"):
        assert word in text, text
    assert str(model.profile(feeds(1), runs=1)).count("Conv+Relu") == 2  # one per section
    # the data input and the weights tell nodes of one op type apart
    assert f"nx3x{HEIGHT}x{WIDTH}, 32x3x3x3 -> nx32x{HEIGHT}x{WIDTH}" in text, text


def test_profiled_calls_give_onnxruntimes_results(compiled, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUVIL_PROFILE", "1")
    profiled = Model(compiled.library, compiled.signature)
    atexit.unregister(profiled._print_session)
    x = feeds(2)
    got = profiled.run(x)["y"]
    np.testing.assert_allclose(got, run_ort(conv_relu_matmul(), x)[0], rtol=1e-4, atol=1e-4)
    assert profiled._process_profile is not None and profiled._process_profile.runs == 1


def test_flops_of_conv_transpose_gemm_einsum_and_lstm(tmp_path: Path) -> None:
    hidden = 5
    weights = {
        "wt": RNG.standard_normal((4, 3, 3, 3)).astype(np.float32),  # C=4, M/group=3, 3x3
        "gb": RNG.standard_normal((6, 5)).astype(np.float32),  # transB: N=6, K=5
        "lw": RNG.standard_normal((1, 4 * hidden, 4)).astype(np.float32),
        "lr": RNG.standard_normal((1, 4 * hidden, hidden)).astype(np.float32),
    }
    onnx_model = make_model(
        [helper.make_node("ConvTranspose", ["x", "wt"], ["ct"], name="ct", group=2, strides=[2, 2]),
         helper.make_node("Gemm", ["a", "gb"], ["g"], name="gemm", transA=1, transB=1),
         helper.make_node("Einsum", ["p", "q"], ["e"], name="einsum", equation="bij,bjk->bik"),
         helper.make_node("LSTM", ["s", "lw", "lr"], ["ly"], name="lstm", hidden_size=hidden)],
        {"x": (np.float32, [1, 4, 5, 5]), "a": (np.float32, [5, 7]),
         "p": (np.float32, [2, 3, 4]), "q": (np.float32, [2, 4, 6]),
         "s": (np.float32, [3, 2, 4])},
        {"ct": np.float32, "g": np.float32, "e": np.float32, "ly": np.float32}, weights)
    compiled = compile_model(onnx_model, "mixed", tmp_path, CompileOptions(cpu="native"))
    m = Model(compiled.library, compiled.signature)
    rng = np.random.default_rng(0)
    x = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in m.inputs}
    flops = {n.name: n.flops for n in m.profile(x, runs=1, warmup=0).nodes}
    assert flops == {
        "ct": 2 * (1 * 4 * 5 * 5) * 3 * 3 * 3,  # each input element: M/group x kh x kw outputs
        "gemm": 2 * 7 * 6 * 5,  # M x N outputs, K products each
        "einsum": 2 * 2 * 3 * 6 * 4,  # b x i x k outputs, j products each
        "lstm": 2 * 3 * 2 * 4 * hidden * (4 + hidden),  # seq x batch x gates x (input + hidden)
    }


def test_flops_of_integer_convs_and_products(tmp_path: Path) -> None:
    """QLinearConv on the int8 kernel (its weight packed), a grouped ConvInteger and a
    QLinearMatMul: their integer multiply-adds counted as the float ones are."""
    w = RNG.integers(-100, 100, (16, 8, 3, 3), dtype=np.int8)
    wg = RNG.integers(-100, 100, (6, 4, 3, 3), dtype=np.int8)  # 2 groups of 4 input channels
    b = RNG.integers(-100, 100, (10, 12), dtype=np.int8)
    scalars = {"s": np.float32(0.05), "zu": np.uint8(3), "zi": np.int8(0), "ws": np.float32(0.02)}
    onnx_model = make_model(
        [helper.make_node("QLinearConv", ["x", "s", "zu", "w", "ws", "zi", "s", "zu"], ["qc"],
                          name="qconv", pads=[1, 1, 1, 1]),
         helper.make_node("ConvInteger", ["x", "wg"], ["ci"], name="convint", group=2),
         helper.make_node("QLinearMatMul", ["a", "s", "zu", "b", "ws", "zi", "s", "zu"], ["qm"],
                          name="qmatmul")],
        {"x": (np.uint8, [1, 8, 6, 6]), "a": (np.uint8, [5, 10])},
        {"qc": np.uint8, "ci": np.int32, "qm": np.uint8}, {"w": w, "wg": wg, "b": b, **scalars})
    compiled = compile_model(onnx_model, "integer", tmp_path, CompileOptions(cpu="native"))
    m = Model(compiled.library, compiled.signature)
    rng = np.random.default_rng(0)
    x = {i.name: rng.integers(0, 255, i.shape).astype(np.uint8) for i in m.inputs}
    profile = m.profile(x, runs=1, warmup=0)
    assert {n.name: n.op for n in profile.nodes}["qconv"] == "QLinearConv(int8 kernel)"
    assert {n.name: n.flops for n in profile.nodes} == {
        "qconv": 2 * (16 * 6 * 6) * 8 * 3 * 3,  # each output element: C x kh x kw products
        "convint": 2 * (6 * 4 * 4) * 4 * 3 * 3,  # C/group x kh x kw (no padding: 4x4 out)
        "qmatmul": 2 * 5 * 12 * 10,
    }


def test_bench_profile_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "small.onnx"
    onnx.save(conv_relu_matmul(), path)
    code = cli.main(["bench", str(path), "--runs", "2", "--warmup", "1", "--profile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "onnxruntime" in out and "by op type:" in out and "conv (Conv+Relu)" in out
    assert out.index("ratio") < out.index("cuvil profile of model")


# ------------------------------------------------------------------ a generated package

PYPROJECT = """\
[build-system]
requires = ["cuvil"]
build-backend = "cuvil.build_backend"

[project]
name = "small-cuvil"
version = "1.0.0"

[tool.cuvil]
package = "small"

[tool.cuvil.models.net]
source = "net.onnx"
"""

# runs in a fresh interpreter that cannot import cuvil, like a user's
SCRIPT = """\
import sys
sys.modules["cuvil"] = None
import numpy as np
import small
np.save(sys.argv[2], small.net(np.load(sys.argv[1])))
np.save(sys.argv[2], small.net(np.load(sys.argv[1])))
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="builds and imports an x86_64 Linux wheel")
def test_generated_package_prints_the_profile_at_exit_and_passes_check(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    onnx.save(conv_relu_matmul(), project / "net.onnx")
    (project / "pyproject.toml").write_text(PYPROJECT)
    cwd = os.getcwd()
    os.chdir(project)
    try:  # the host target: every CPU variant and the dispatcher that exports run_profiled
        wheel = tmp_path / "dist" / build_backend.build_wheel(str(tmp_path / "dist"))
    finally:
        os.chdir(cwd)
    report = check_wheel(wheel, auditwheel=False)
    assert report.ok, report.format()
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    manifest = json.loads((site / "small" / "_models.json").read_text())
    assert [p["op"] for p in manifest["models"][0]["node_profile"]] == ["Conv+Relu", "MatMul", "Add"]
    assert "cuvil_net_run_profiled" in (site / "small" / "net.h").read_text()

    x = feeds(2)["x"]
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "use.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(site), "CUVIL_PROFILE": "1"}
    proc = subprocess.run([sys.executable, str(tmp_path / "use.py"), str(tmp_path / "x.npy"),
                           str(tmp_path / "y.npy")], env=env, capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), run_ort(conv_relu_matmul(), {"x": x})[0],
                               rtol=1e-4, atol=1e-4)
    err = proc.stderr
    assert err.count("cuvil profile of model net: 2 runs") == 1, err  # once, at exit
    for word in ("conv (Conv+Relu)", "matmul (MatMul)", "add (Add)"):
        assert word in err, err
    quiet = subprocess.run([sys.executable, str(tmp_path / "use.py"), str(tmp_path / "x.npy"),
                            str(tmp_path / "y.npy")], env={**env, "CUVIL_PROFILE": "0"},
                           capture_output=True, text=True, cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_header_declares_run_profiled_as_c(compiled, tmp_path: Path) -> None:
    from cuvil.compiler.codegen.header import render_header
    from cuvil.toolchains import get_target, zig

    text = render_header(compiled.signature, compiled.signature["library"])
    assert f"timestamps_ns[{len(compiled.signature['nodes']) + 2}]" in text
    (tmp_path / "small.h").write_text(text)
    (tmp_path / "use.c").write_text(
        '#include "small.h"\n'
        "int32_t call(const void *const *i, void *const *o, void *ws, uint64_t *t) {\n"
        "    return cuvil_small_run_profiled(i, o, 0, ws, t);\n}\n")
    zig.compile_c(tmp_path / "use.c", tmp_path / "use.o", get_target(None).arches[0],
                  extra_args=["-Werror"])
