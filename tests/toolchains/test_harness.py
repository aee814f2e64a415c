"""Run what we build: a C program (tests/harness/run_model.c), compiled by zig for the target,
loads the library of a built wheel through the public C ABI of its header, checks the CPU,
runs the model and prints the outputs, which must match onnxruntime's on the host.

x86_64-linux runs on the host and under qemu-user CPU models spanning the baseline and each
variant: Conroe (Core 2, below x86-64-v2) must get a clean refusal naming the missing flags,
never SIGILL; Nehalem runs the baseline copy, Haswell the AVX2 copy, the host (if it has
AVX-512; qemu 7.2 emulates none) the AVX-512 copy. aarch64-linux runs under qemu-aarch64 on
cortex-a53, cortex-a72 and max; pinned to cortex-a76 it is refused on the first two; an int8
QDQ model runs on each of its int8 kernels (I8MM on max, the dot product on neoverse-n1, NEON on
cortex-a72) within one quantization step of onnxruntime. The
Python loader is checked the same way: on a CPU below a
library's baseline, importing the package raises ImportError naming what is missing.

x86_64-linux-musl runs under musl's dynamic loader, on the host and under qemu-x86_64 on the
same CPU models; x86_64-windows runs under wine on the host. Debian has no musl for arm64
(its `musl` package is built for the host architecture only, and no cross package exists),
so aarch64-linux-musl is checked structurally, as aarch64-windows is (no runner for Windows
on Arm): `cuvil check` passes and the harness builds for them.

Needs Debian's qemu-user-static, libc6-arm64-cross, musl and wine64 (CI installs them:
.ci/run); a test skips before building anything, naming the package, when one it needs is
missing, except in CI (CI=true), where a missing tool fails the test (tests/host_tools.py)."""

from __future__ import annotations

import os
import platform
import struct
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from host_tools import AARCH64_LOADER, AARCH64_SYSROOT, MUSL_LOADER, QEMU_AARCH64, WINE, needs, tool
from onnx import TensorProto, helper, numpy_helper
from oracle import run_ort

from cuvil.toolchains import Arch, bundled_toolchain_dir, get_target, list_targets, zig

pytestmark = [
    pytest.mark.slow,  # a wheel built for each target, run under emulators
    pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
                       reason="cross-runs from an x86-64 Linux host (as CI is)")]

HARNESS = Path(__file__).parents[1] / "harness" / "run_model.c"
#: x86-64-v2's flags that a Core 2 (Conroe) lacks: SSE4.1, SSE4.2, POPCNT (Intel SDM). qemu's
#: Conroe model also leaves out CMPXCHG16B, which real ones have: "Conroe,+cx16" is the real one
CONROE_LACKS = {"sse4.1", "sse4.2", "popcnt"}
QEMU_CONROE_LACKS = CONROE_LACKS | {"cx16"}
#: what x86-64-v2 adds to x86-64 (the psABI's levels)
X86_V2 = ("sse3", "ssse3", "cx16", "sse4.1", "sahf", "sse4.2", "popcnt")
AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
#: what a Cortex-A76 (Armv8.2-A) has beyond qemu's cortex-a53 and cortex-a72 models (Armv8.0-A
#: with CRC32 and the crypto extension), per Arm's technical reference manuals: LSE atomics,
#: half-precision arithmetic, RDM, LRCPC and the dot product
A76_OVER_A53 = {"lse", "fullfp16", "rdm", "rcpc", "dotprod"}


def _tiny_model() -> onnx.ModelProto:
    """Conv + Relu + Gemm, plus a strided Conv down to one position (the GEMM kernel's
    narrow_panel, vectors of 12 floats) into a second Gemm added on: vector code in every
    copy, one output of 2 x 10 floats."""
    rng = np.random.default_rng(7)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in [("w", (16, 8, 3, 3)), ("b", (16,)), ("g", (1024, 10)),
                                   ("w2", (30, 8, 3, 3)), ("g2", (30, 10))]]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Gemm", ["f", "g"], ["y1"]),
             helper.make_node("Conv", ["x", "w2"], ["c2"], strides=[8, 8]),
             helper.make_node("Flatten", ["c2"], ["f2"]),
             helper.make_node("Gemm", ["f2", "g2"], ["y2"]),
             helper.make_node("Add", ["y1", "y2"], ["y"])]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class Built:
    """A wheel built for one target, unpacked, with the harness compiled for it."""

    def __init__(self, root: Path, target: str, cpu: str | None = None,
                 model: onnx.ModelProto | None = None) -> None:
        import cuvil.build_backend as backend

        project = root / "project"
        (project / "models").mkdir(parents=True)
        onnx.save(model or _tiny_model(), project / "models" / "net.onnx")
        (project / "pyproject.toml").write_text(textwrap.dedent("""
            [project]
            name = "tiny-cuvil"
            version = "1.0.0"

            [tool.cuvil]
            package = "tiny"

            [tool.cuvil.models.net]
            source = "models/net.onnx"
            """))
        settings = {"target": target, **({"cpu": cpu} if cpu else {})}
        cwd = os.getcwd()
        os.chdir(project)
        try:
            self.wheel = root / backend.build_wheel(str(root), settings)
        finally:
            os.chdir(cwd)
        self.site = root / "site"
        with zipfile.ZipFile(self.wheel) as zf:
            zf.extractall(self.site)
        self.library = next((self.site / "tiny").glob("_net.*"))
        arch = get_target(target).arches[0]
        self.harness = compile_harness(arch, self.site / "tiny",
                                       root / ("run_model.exe" if arch.os == "windows" else "run_model"))


def compile_harness(arch: Arch, include: Path, output: Path) -> Path:
    """The harness for `arch`, for model "net" whose header lies in `include`, compiled for
    the plain architecture (it must run on CPUs below the library's baseline). Not on
    Windows: wine runs it on the host's CPU only, and zig builds MinGW's C runtime once for
    each CPU model a program or DLL is compiled for, which takes minutes on a fresh cache."""
    plain = arch if arch.os == "windows" else arch.plain
    mcpu = zig.zig_mcpu(plain)
    # musl: a dynamic executable (zig links musl statically by default), run by musl's loader
    linux = ["-ldl", *(["-dynamic"] if plain.libc == "musl" else [])] if plain.os == "linux" else []
    proc = subprocess.run([*zig.zig_command(), "cc", "-target", plain.zig_target,
                           *([f"-mcpu={mcpu}"] if mcpu else []), "-O2", "-std=c99", "-Wall",
                           "-Werror", "-DCUVIL_MODEL=net", "-DCUVIL_MODEL_UPPER=NET",
                           '-DCUVIL_HEADER="net.h"', f"-I{include}", str(HARNESS), "-o",
                           str(output), *linux],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"compiling the harness for {plain.zig_target}: {proc.stderr}"
    return output


@pytest.fixture(scope="module")
def feeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """The input file the harness reads, and onnxruntime's output for it."""
    x = np.random.default_rng(3).standard_normal((2, 8, 8, 8)).astype(np.float32)
    (want,) = run_ort(_tiny_model(), {"x": x})
    path = tmp_path_factory.mktemp("feeds") / "inputs.bin"
    data = x.tobytes()
    path.write_bytes(struct.pack("<Q", len(data)) + data + b"\0" * (-len(data) % 8))
    return path, want


@pytest.fixture(scope="module")
def x86(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("x86_64"), "x86_64-linux")


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("aarch64"), "aarch64-linux")


@pytest.fixture(scope="module")
def arm_a76(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("aarch64_a76"), "aarch64-linux", cpu="cortex-a76")


@pytest.fixture(scope="module")
def arm_dotprod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    # aarch64-linux with a second copy of the model code for CPUs with the dot product
    root = tmp_path_factory.mktemp("aarch64_dotprod")
    text = (bundled_toolchain_dir() / "aarch64-linux.toml").read_text()
    text = text.replace('name = "aarch64-linux"', 'name = "aarch64-linux-dotprod"', 1)
    text += '\n[[arch.variant]]\ncpu = "generic"\nfeatures = "+neon,+dotprod"\nrequires = ["dotprod"]\n'
    (root / "toolchains").mkdir()
    (root / "toolchains" / "aarch64-linux-dotprod.toml").write_text(text)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUVIL_TOOLCHAIN_PATH", str(root / "toolchains"))
        yield Built(root, "aarch64-linux-dotprod")


@pytest.fixture(scope="module")
def musl_x86(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("x86_64_musl"), "x86_64-linux-musl")


@pytest.fixture(scope="module")
def musl_arm(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("aarch64_musl"), "aarch64-linux-musl")


@pytest.fixture(scope="module")
def win_x86(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("x86_64_windows"), "x86_64-windows")


@pytest.fixture(scope="module")
def win_arm(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("aarch64_windows"), "aarch64-windows")


def _run(built: Built, feeds: tuple[Path, np.ndarray], *emulator: str,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path, want = feeds
    return subprocess.run([*emulator, str(built.harness), str(built.library), str(path),
                           str(want.size)], capture_output=True, text=True, timeout=300, env=env)


def _outputs(proc: subprocess.CompletedProcess[str], want: np.ndarray) -> int:
    """The copy run() used; asserts the run succeeded and its output matches onnxruntime's."""
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}"
    lines = proc.stdout.splitlines()  # "\r\n" from a Windows program
    assert lines[0].startswith("cpu_check: copy "), proc.stdout[:200]
    assert lines[1] == "output 0"
    got = np.array([float(v) for v in lines[2:2 + want.size]], np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    return int(lines[0].rsplit(" ", 1)[1])


def _host_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("target", [t.name for t in list_targets()])
def test_harness_compiles_for_every_target(x86: Built, tmp_path: Path, target: str) -> None:
    # macOS ones are not run here, but the same C builds for them
    for arch in get_target(target).arches:
        assert compile_harness(arch, x86.site / "tiny", tmp_path / f"run_{arch.name}").stat().st_size


def test_x86_64_on_the_host(x86: Built, feeds: tuple[Path, np.ndarray]) -> None:
    assert _outputs(_run(x86, feeds), feeds[1]) == _expected_host_copy()


@needs("qemu-x86_64-static")
@pytest.mark.parametrize(("model", "copy"), [("Nehalem", 0), ("Haswell", 1),
                                             # qemu 7.2 emulates no AVX-512: the AVX2 copy
                                             ("Skylake-Server", 1)])
def test_x86_64_under_qemu_runs_each_copy(x86: Built, feeds: tuple[Path, np.ndarray],
                                          model: str, copy: int) -> None:
    qemu = tool("qemu-x86_64-static")
    assert _outputs(_run(x86, feeds, qemu, "-cpu", model), feeds[1]) == copy


@needs("qemu-x86_64-static")
@pytest.mark.parametrize(("model", "lacks"), [
    # the first x86-64 CPUs (AMD K8 rev. C/D): none of v2's extensions, so the check and all
    # that runs before it use plain x86-64 code only (qemu's model adds SSE3, "pni": removed)
    ("Opteron_G1,-pni", set(X86_V2)),
    ("Conroe", QEMU_CONROE_LACKS),
                                              ("Conroe,+cx16", CONROE_LACKS),
                                              ("Penryn", CONROE_LACKS - {"sse4.1"})])
def test_x86_64_below_the_baseline_is_refused_cleanly(x86: Built, feeds: tuple[Path, np.ndarray],
                                                      model: str, lacks: set[str]) -> None:
    proc = _run(x86, feeds, tool("qemu-x86_64-static"), "-cpu", model)
    # 3: cpu_check named the flags and run() returned CPU_UNSUPPORTED; a SIGILL would be -4
    assert proc.returncode == 3, f"exit {proc.returncode}: {proc.stderr}"
    missing = proc.stderr.split("lacks ", 1)[1].split(";", 1)[0].split()
    assert set(missing) == lacks
    assert "run() returned -1" in proc.stderr and proc.stdout == ""


@needs("qemu-x86_64-static")
def test_core2_build_runs_on_a_core2(tmp_path: Path, feeds: tuple[Path, np.ndarray]) -> None:
    # the macOS x86-64 baseline (core2) on the oldest x86-64 Mac CPU: runs, never SIGILL
    qemu = tool("qemu-x86_64-static")
    built = Built(tmp_path, "x86_64-linux", cpu="core2")
    assert _outputs(_run(built, feeds, qemu, "-cpu", "Conroe,+cx16"), feeds[1]) == 0


@needs(*QEMU_AARCH64)
@pytest.mark.parametrize("model", ["cortex-a53", "cortex-a72", "max"])
def test_aarch64_under_qemu(arm: Built, feeds: tuple[Path, np.ndarray], model: str) -> None:
    qemu = tool("qemu-aarch64-static")
    tool(str(AARCH64_LOADER))
    proc = _run(arm, feeds, qemu, "-L", str(AARCH64_SYSROOT), "-cpu", model)
    assert _outputs(proc, feeds[1]) == 0


@needs(*QEMU_AARCH64)
@pytest.mark.parametrize(("model", "lacks"), [("cortex-a53", A76_OVER_A53),
                                             ("cortex-a72", A76_OVER_A53), ("max", set())])
def test_aarch64_pinned_cpu_is_checked(arm_a76: Built, feeds: tuple[Path, np.ndarray], model: str,
                                       lacks: set[str]) -> None:
    # a library pinned to a newer cpu (-C cpu=cortex-a76) asks the OS (getauxval) what the
    # CPU has: an older one gets the missing flags named and run() refused, never SIGILL
    qemu = tool("qemu-aarch64-static")
    proc = _run(arm_a76, feeds, qemu, "-L", str(AARCH64_SYSROOT), "-cpu", model)
    if not lacks:
        assert _outputs(proc, feeds[1]) == 0
        return
    assert proc.returncode == 3, f"exit {proc.returncode}: {proc.stderr}"
    assert set(proc.stderr.split("lacks ", 1)[1].split(";", 1)[0].split()) == lacks
    assert "run() returned -1" in proc.stderr and proc.stdout == ""


@needs(*QEMU_AARCH64)
@pytest.mark.parametrize(("model", "copy"), [("cortex-a72", 0), ("max", 1)])
def test_aarch64_variant_runs_where_the_cpu_has_its_flags(arm_dotprod: Built,
                                                          feeds: tuple[Path, np.ndarray],
                                                          model: str, copy: int) -> None:
    qemu = tool("qemu-aarch64-static")
    proc = _run(arm_dotprod, feeds, qemu, "-L", str(AARCH64_SYSROOT), "-cpu", model)
    assert _outputs(proc, feeds[1]) == copy


def _qdq_mlp(tmp_path: Path, activations: str) -> onnx.ModelProto:
    """MatMul-Add-Relu-MatMul-Add-Sigmoid of odd sizes (5 x 37 -> 29 -> 11), quantized by
    onnxruntime (QDQ, per-channel int8 weights, activations of the given type): its products
    run on the int8 kernel, whose AArch64 form the CPU model picks at run time, the Sigmoid
    between its Q/DQ pairs as a table lookup (the byte-at-a-time kernel there)."""
    quantization = pytest.importorskip("onnxruntime.quantization")
    rng = np.random.default_rng(11)
    inits = {"w1": rng.standard_normal((37, 29)) / 6, "b1": rng.standard_normal(29) / 10,
             "w2": rng.standard_normal((29, 11)) / 5, "b2": rng.standard_normal(11) / 10}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]), helper.make_node("Relu", ["hb"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["o"]), helper.make_node("Add", ["o", "b2"], ["ob"]),
             helper.make_node("Sigmoid", ["ob"], ["y"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 37])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 11])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    float_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    float_model.ir_version = 8

    class Feeds(quantization.CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([{"x": rng.standard_normal((5, 37)).astype(np.float32)}
                               for _ in range(8)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    onnx.save(float_model, tmp_path / "float.onnx")
    kind = {"uint8": quantization.QuantType.QUInt8, "int8": quantization.QuantType.QInt8}
    quantization.quantize_static(str(tmp_path / "float.onnx"), str(tmp_path / "qdq.onnx"), Feeds(),
                                 quant_format=quantization.QuantFormat.QDQ, per_channel=True,
                                 activation_type=kind[activations],
                                 weight_type=quantization.QuantType.QInt8)
    model = onnx.load(str(tmp_path / "qdq.onnx"))
    from cuvil.compiler.frontend import import_model
    from cuvil.compiler.passes import run_passes

    ops = [n.op_type for n in run_passes(import_model(model)).nodes]
    assert ops.count("QLinearMatMul") == 2 and "MatMul" not in ops, ops  # both on integers
    assert "LookupTable" in ops, ops
    return model


@pytest.fixture(scope="module", params=["uint8", "int8"])
def arm_qdq(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Built, tuple[Path, np.ndarray], float]:
    """A QDQ model built for aarch64-linux, its input file, onnxruntime's output for it and
    the output's quantization step."""
    root = tmp_path_factory.mktemp(f"aarch64_qdq_{request.param}")
    model = _qdq_mlp(root, request.param)
    x = np.random.default_rng(5).standard_normal((5, 37)).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    path = root / "inputs.bin"
    path.write_bytes(struct.pack("<Q", x.nbytes) + x.tobytes() + b"\0" * (-x.nbytes % 8))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    (last,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "y"]
    return Built(root, "aarch64-linux", model=model), (path, want), float(inits[last.input[1]])


@needs(*QEMU_AARCH64)
@pytest.mark.parametrize("model", ["max", "neoverse-n1", "cortex-a72"])
def test_aarch64_int8_model_under_qemu(arm_qdq: tuple[Built, tuple[Path, np.ndarray], float],
                                       model: str) -> None:
    # I8MM's USMMLA/SMMLA on max, UDOT/SDOT on neoverse-n1, widening NEON on cortex-a72
    # (tests/kernels/test_int8_gemm_kernel.py checks each kernel exactly): each within one
    # step of the output's quantization of onnxruntime's result on the host
    built, feeds, step = arm_qdq
    qemu = tool("qemu-aarch64-static")
    tool(str(AARCH64_LOADER))
    proc = _run(built, feeds, qemu, "-L", str(AARCH64_SYSROOT), "-cpu", model)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}"
    lines = proc.stdout.splitlines()
    want = feeds[1]
    assert lines[1] == "output 0"
    got = np.array([float(v) for v in lines[2:2 + want.size]], np.float32).reshape(want.shape)
    assert np.abs(got - want).max() <= step * 1.001, (np.abs(got - want).max(), step)


@needs("qemu-x86_64-static")
def test_python_import_below_the_baseline_raises_import_error(tmp_path: Path) -> None:
    # Python and numpy 2.4 need x86-64-v2 themselves, so the CPU below the library's
    # baseline is a v2 one (Nehalem) and the library is pinned to x86-64-v3
    qemu = tool("qemu-x86_64-static")
    built = Built(tmp_path, "x86_64-linux", cpu="x86-64-v3")
    script = "import tiny\nprint('imported')\n"
    proc = subprocess.run([qemu, "-cpu", "Nehalem", sys.executable, "-c", script],
                          env={**os.environ, "PYTHONPATH": str(built.site)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("ImportError: model 'net'"), error
    for flag in ("avx", "avx2", "fma", "bmi2", "movbe"):
        assert f" {flag}," in error or f" {flag}." in error, (flag, error)
    assert "'x86-64-v3'" in error and "-C cpu=x86-64" in error
    assert "imported" not in proc.stdout


def _expected_host_copy() -> int:
    flags = _host_flags()
    return 2 if flags >= AVX512 else 1 if "avx2" in flags else 0


def _musl_loader(arch: str) -> str:
    return tool(str(MUSL_LOADER[arch]))


@needs(str(MUSL_LOADER["x86_64"]))
def test_x86_64_musl_under_the_musl_loader(musl_x86: Built, feeds: tuple[Path, np.ndarray]) -> None:
    loader = _musl_loader("x86_64")
    assert _outputs(_run(musl_x86, feeds, loader), feeds[1]) == _expected_host_copy()


@needs("qemu-x86_64-static", str(MUSL_LOADER["x86_64"]))
@pytest.mark.parametrize(("model", "copy"), [("Nehalem", 0), ("Haswell", 1)])
def test_x86_64_musl_under_qemu_runs_each_copy(musl_x86: Built, feeds: tuple[Path, np.ndarray],
                                               model: str, copy: int) -> None:
    qemu, loader = tool("qemu-x86_64-static"), _musl_loader("x86_64")
    assert _outputs(_run(musl_x86, feeds, qemu, "-cpu", model, loader), feeds[1]) == copy


@needs("qemu-x86_64-static", str(MUSL_LOADER["x86_64"]))
def test_x86_64_musl_below_the_baseline_is_refused_cleanly(musl_x86: Built,
                                                           feeds: tuple[Path, np.ndarray]) -> None:
    qemu, loader = tool("qemu-x86_64-static"), _musl_loader("x86_64")
    proc = _run(musl_x86, feeds, qemu, "-cpu", "Conroe,+cx16", loader)
    assert proc.returncode == 3, f"exit {proc.returncode}: {proc.stderr}"
    assert set(proc.stderr.split("lacks ", 1)[1].split(";", 1)[0].split()) == CONROE_LACKS


def _elf_interpreter(path: Path) -> str | None:
    from cuvil.check._elf import read_elf

    return read_elf(path.read_bytes()).interpreter


def test_aarch64_musl_structurally(musl_arm: Built, feeds: tuple[Path, np.ndarray]) -> None:
    from cuvil.check import check_wheel
    from cuvil.check._elf import read_elf

    report = check_wheel(musl_arm.wheel)
    assert report.ok, report.format()
    elf = read_elf(musl_arm.library.read_bytes())
    assert (elf.arch, elf.needed, elf.interpreter) == ("aarch64", ["libc.so"], None)
    assert _elf_interpreter(musl_arm.harness) == str(MUSL_LOADER["aarch64"])
    if MUSL_LOADER["aarch64"].is_file():  # a multiarch musl:arm64: run it too
        proc = _run(musl_arm, feeds, tool("qemu-aarch64-static"), "-cpu", "cortex-a53")
        assert _outputs(proc, feeds[1]) == 0


@pytest.fixture(scope="module")
def wine_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """wine64 with a fresh prefix of its own, quiet, without the Mono/Gecko installers."""
    tool(str(WINE))
    return {**os.environ, "WINEPREFIX": str(tmp_path_factory.mktemp("wineprefix")),
            "WINEDEBUG": "-all", "WINEDLLOVERRIDES": "mscoree,mshtml="}


@needs(str(WINE))
def test_x86_64_windows_dll_under_wine(win_x86: Built, feeds: tuple[Path, np.ndarray],
                                       wine_env: dict[str, str]) -> None:
    proc = _run(win_x86, feeds, str(WINE), env=wine_env)
    assert _outputs(proc, feeds[1]) == _expected_host_copy()


def test_aarch64_windows_structurally(win_arm: Built) -> None:
    from cuvil.check import check_wheel
    from cuvil.check._pe import read_pe

    report = check_wheel(win_arm.wheel)
    assert report.ok, report.format()
    assert read_pe(win_arm.library.read_bytes()).machine == 0xAA64  # IMAGE_FILE_MACHINE_ARM64
    assert read_pe(win_arm.harness.read_bytes()).machine == 0xAA64
