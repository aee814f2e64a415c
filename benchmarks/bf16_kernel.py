"""The bf16 GEMM kernel alone, on one thread: each side on the shapes given, in GFLOP/s.

Where `conv_layers.py --precision bf16` times whole conv layers (im2col, packing, epilogue,
the model's memory), this times the kernel (kernels/bf16_gemm.py) on warm operands, so
that a change to its tiles or packing can be measured by itself. The kernel is compiled for
this machine's AVX-512 BF16 copy (AMX where the CPU has it: the copy picks at run time),
linked with the runtime as the kernel tests link it (tests/kernel_library.py), and called
through ctypes with bias, residual and ReLU in the epilogue (a conv's), timed in this
thread's CPU time; the median and the best of `--runs` calls.

    python benchmarks/bf16_kernel.py                        # ResNet-50's 7x7 and 14x14 shapes
    python benchmarks/bf16_kernel.py a:512x49x4608 bt:49x512x4608 b:64x1000x2048

A shape is SIDE:MxNxK, SIDE one of the kernel's forms: "a" (a conv's W @ X': M output
channels, N positions), "bt" (the transposed product of a small map: M positions, N
channels, the activations read by columns) or "b" (Gemm/MatMul: M rows of activations).
Needs a CPU with AVX-512 BF16 or AMX.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernel_library import FEATURES, host_module, link_modules

from cuvil.compiler.kernels.bf16_gemm import SIDES, emit_parallel_bf16_gemm, pack_l, pack_r
from cuvil.compiler.kernels.emitter import I32, I64, PTR, Emitter
from cuvil.compiler.kernels.gemm import Epilogue

#: ResNet-50's 7x7 layers either way, and a 14x14 one
DEFAULT = ["a:512x49x4608", "bt:49x512x4608", "a:2048x49x512", "bt:49x2048x512",
           "a:512x49x2048", "bt:49x512x2048", "a:256x196x1024", "bt:196x256x1024",
           "a:128x784x1152", "a:64x224x147"]
EPILOGUE = Epilogue("row", residual=True, activation="Relu")


def build(tmp: Path) -> ctypes.CDLL:
    """`int32 bf16_<side>(dims[M, N, K], L, R, C, bias, residual)` per side, one thread each
    (the pool is left at one thread: CUVIL_NUM_THREADS=1)."""
    module, tm = host_module(FEATURES["avx512"])
    for side in SIDES:
        fn = ir.Function(module, ir.FunctionType(I32, [PTR] * 6), f"bf16_{side}")
        k = Emitter(module, fn, fn.args[0], [], {})
        m, n, kk = (k.b.load(k.b.gep(fn.args[0], [k.i64(i)], source_etype=I64), typ=I64)
                    for i in range(3))
        left, right, c, bias, residual = fn.args[1:]
        epilogue = EPILOGUE if side == "a" else Epilogue("col", residual=True, activation="Relu")
        emit_parallel_bf16_gemm(k, m, n, kk, left, m if side == "bt" else kk, right, n, c, n,
                                side=side, bias=bias, residual=residual, epilogue=epilogue)
        k.b.ret(ir.Constant(I32, 0))
    return link_modules(tmp, [(module, tm)])


def measure(lib: ctypes.CDLL, spec: str, runs: int) -> tuple[float, float]:
    """(median, best) seconds of one call."""
    side, dims = spec.split(":")
    m, n, kk = map(int, dims.split("x"))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, kk)).astype(np.float32)
    b = rng.standard_normal((kk, n)).astype(np.float32)
    c = np.zeros((m, n), np.float32)
    bias = rng.standard_normal(max(m, n)).astype(np.float32)
    residual = rng.standard_normal((m, n)).astype(np.float32)
    left, right = ((pack_l(a), b) if side == "a" else
                   (np.ascontiguousarray(a.T) if side == "bt" else a, pack_r(b)))
    fn = getattr(lib, f"bf16_{side}")
    fn.argtypes = [ctypes.c_void_p] * 6
    args = ((ctypes.c_int64 * 3)(m, n, kk), left.ctypes.data, right.ctypes.data, c.ctypes.data,
            bias.ctypes.data, residual.ctypes.data)
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(runs):
        start = time.thread_time()
        fn(*args)
        times.append(time.thread_time() - start)
    return float(np.median(times)), min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shapes", nargs="*", default=DEFAULT, help="SIDE:MxNxK (module docstring)")
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    for spec in args.shapes:
        side = spec.split(":")[0]
        if side not in SIDES or len(spec.split(":")[1].split("x")) != 3:
            p.error(f"{spec!r}: expected SIDE:MxNxK with SIDE one of {', '.join(SIDES)}")
    flags = llvm.get_host_cpu_features().flatten().split(",")
    if "+avx512bf16" not in flags and "+amx-bf16" not in flags:
        sys.exit("this CPU has neither AVX-512 BF16 nor AMX: the bf16 kernel does not run here")
    os.environ["CUVIL_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="cuvil-bf16-kernel-") as tmp:
        lib = build(Path(tmp))
        print(f"{'shape':24s} {'ms':>8s} {'GFLOP/s':>8s} {'best':>8s}")
        for spec in args.shapes:
            m, n, kk = map(int, spec.split(":")[1].split("x"))
            median, best = measure(lib, spec, args.runs)
            flop = 2.0 * m * n * kk
            print(f"{spec:24s} {median * 1e3:8.3f} {flop / median / 1e9:8.1f} "
                  f"{flop / best / 1e9:8.1f}")


if __name__ == "__main__":
    main()
