"""The fp32 peak of one core: a register-only loop of independent vector FMAs.

The loop is written in LLVM IR (llvm.fma on <lanes x float>), compiled by llvmlite for this
machine's CPU and called through ctypes on the calling thread. Independent accumulator chains
(16 with AVX-512's 32 registers, 12 with AVX2's 16: more would spill to the stack, and AVX2
then read as 54 instead of 93 GFLOP/s on a Zen 3) keep two FMA ports busy through a latency of
four cycles, so the figure is the core's throughput rather than the FMA latency. The loop is
timed in this thread's CPU time, not wall time, so that other processes sharing the core do
not lower the figure.

    python benchmarks/peak.py
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

_IR = """
declare <{n} x float> @llvm.fma.v{n}f32(<{n} x float>, <{n} x float>, <{n} x float>)

define float @fma_loop(i64 %iterations) {{
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
{phis}
{fmas}
  %next = add i64 %i, 1
  %more = icmp ult i64 %next, %iterations
  br i1 %more, label %loop, label %done
done:
{reduce}
  %r = extractelement <{n} x float> %sum{last}, i32 0
  ret float %r
}}
"""


def _ir(lanes: int, chains: int) -> str:
    vec = f"<{lanes} x float>"
    start = f"<{', '.join(['float 1.0'] * lanes)}>"
    # a * 0.5 + 0.5 tends to 1: no overflow and no denormals, whose slow path would skew it
    mul = f"<{', '.join(['float 0.5'] * lanes)}>"
    add = f"<{', '.join(['float 0.5'] * lanes)}>"
    phis = "\n".join(f"  %a{c} = phi {vec} [{start}, %entry], [%b{c}, %loop]" for c in range(chains))
    fmas = "\n".join(f"  %b{c} = call {vec} @llvm.fma.v{lanes}f32({vec} %a{c}, {vec} {mul}, {vec} {add})"
                     for c in range(chains))
    reduce = [f"  %sum0 = fadd {vec} %b0, %b1"]
    reduce += [f"  %sum{c - 1} = fadd {vec} %sum{c - 2}, %b{c}" for c in range(2, chains)]
    return _IR.format(n=lanes, phis=phis, fmas=fmas, reduce="\n".join(reduce), last=chains - 2)


def _host_isas() -> list[tuple[str, int, int]]:
    """The vector widths this CPU runs FMAs at, widest first: (name, fp32 lanes, chains)."""
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    isas = []
    if features.get("avx512f"):
        isas.append(("AVX-512", 16, 16))
    if features.get("avx2") and features.get("fma"):
        isas.append(("AVX2+FMA", 8, 12))
    return isas


def _compiled_loop(lanes: int, chains: int) -> tuple[Any, Any]:
    """(the JIT engine, which must outlive the loop; the loop as a ctypes function)."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = llvm.parse_assembly(_ir(lanes, chains))
    module.verify()
    target = llvm.Target.from_default_triple()
    machine = target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                           features=llvm.get_host_cpu_features().flatten(), opt=2)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    loop = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int64)(engine.get_function_address("fma_loop"))
    return engine, loop


def measure_peak(seconds: float = 0.3) -> dict[str, float]:
    """GFLOP/s of one core for each vector ISA of this CPU (best of a few timed runs)."""
    results = {}
    for name, lanes, chains in _host_isas():
        engine, loop = _compiled_loop(lanes, chains)
        flops_per_iteration = chains * lanes * 2
        iterations = 1 << 20
        best = 0.0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.thread_time()
            loop(iterations)
            elapsed = time.thread_time() - start
            if elapsed < 0.02:  # too short to time: grow the loop
                iterations *= 2
                continue
            best = max(best, flops_per_iteration * iterations / elapsed / 1e9)
        results[name] = best
        del engine  # holds the module
    return results


def fma_scaling(threads: int = 2, seconds: float = 0.05) -> float:
    """How many cores' worth of FMAs `threads` threads get now: the loop's wall time alone
    against the same loop on `threads` threads at once (ctypes lets go of the GIL). About
    `threads` when the CPUs are cores of their own; near 1 when a virtual machine's CPUs
    share a core on the host (SMT siblings) or another process holds one, and then the
    multi-thread rows of a run say more about the host than about the engines."""
    import threading

    _, lanes, chains = _host_isas()[0]
    engine, loop = _compiled_loop(lanes, chains)
    iterations = 1 << 16
    while True:  # a loop of about `seconds` on one thread
        start = time.perf_counter()
        loop(iterations)
        if time.perf_counter() - start >= seconds:
            break
        iterations *= 2

    def wall(count: int) -> float:
        workers = [threading.Thread(target=loop, args=(iterations,)) for _ in range(count)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    ratios = sorted(threads * wall(1) / wall(threads) for _ in range(3))
    del engine
    return ratios[1]


if __name__ == "__main__":
    for isa, gflops in measure_peak(1.0).items():
        print(f"{isa}: {gflops:.1f} GFLOP/s fp32 on one core")
    print(f"2 threads at once get {fma_scaling(2):.2f} cores' worth of FMAs")
