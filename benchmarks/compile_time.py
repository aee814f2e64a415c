"""Where compile time goes: times each phase of `compile_model` on large generated graphs.

    python benchmarks/compile_time.py                       # relu and mixed, 2000 nodes
    python benchmarks/compile_time.py --graphs relu --nodes 500 --profile 25
    python benchmarks/compile_time.py --graphs path/to/model.onnx

Graphs: `relu` is a chain of Relu nodes; `mixed` repeats a block of small MatMul (distinct
weights per block), Add, Relu and Reshape nodes. Phases follow the driver for the host's
toolchain target with every CPU variant (the `cuvil build` case): frontend (import),
passes, memory plan, then per variant building the LLVM IR in Python, parsing it, the LLVM
optimisation pipeline and code generation, and at the end the full `compile_model` (zig
included) for the total. `--profile N` prints cProfile's N most expensive functions of the
full compile.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def relu_chain(n: int) -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(n)]
    graph = helper.make_graph(
        nodes, "relu_chain",
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, ["batch", 64])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def mixed_chain(n: int, seed: int = 0) -> onnx.ModelProto:
    """n nodes (rounded down to blocks of 4): MatMul 16x16, Add bias, Relu, Reshape."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], [numpy_helper.from_array(np.array([-1, 16], np.int64), "shape")]
    x = "x"
    for b in range(n // 4):
        w, bias = f"w{b}", f"b{b}"
        inits += [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) / 4, w),
                  numpy_helper.from_array(rng.standard_normal(16).astype(np.float32) / 4, bias)]
        nodes += [helper.make_node("MatMul", [x, w], [f"m{b}"]),
                  helper.make_node("Add", [f"m{b}", bias], [f"a{b}"]),
                  helper.make_node("Relu", [f"a{b}"], [f"r{b}"]),
                  helper.make_node("Reshape", [f"r{b}", "shape"], [f"y{b}"])]
        x = f"y{b}"
    graph = helper.make_graph(
        nodes, "mixed_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


GRAPHS: dict[str, Callable[[int], onnx.ModelProto]] = {"relu": relu_chain, "mixed": mixed_chain}


def timed(phases: dict[str, float], name: str, fn: Callable[..., Any], *args: Any,
          **kwargs: Any) -> Any:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
    return result


def phases_of(model: Any, name: str) -> dict[str, float]:
    import llvmlite.binding as llvm

    from cuvil.compiler.codegen import module as codegen
    from cuvil.compiler.driver import signature_of
    from cuvil.compiler.frontend import import_model
    from cuvil.compiler.passes import run_passes
    from cuvil.compiler.passes.plan_memory import plan_memory
    from cuvil.toolchains import get_target, target_machine

    phases: dict[str, float] = {}
    graph = timed(phases, "import", import_model, model, None, name)
    graph = timed(phases, "passes", run_passes, graph)
    plan = timed(phases, "plan_memory", plan_memory, graph)
    sig = timed(phases, "signature", signature_of, graph, name, "lib")
    arch = get_target(None).arches[0]
    levels = [(arch.cpu, arch.features), *[(v.cpu, v.features) for v in arch.variants]]
    texts: list[str] = []
    for index, (cpu, features) in enumerate(levels):
        tm = target_machine(arch, cpu=cpu, features=features)
        text = timed(phases, "build IR (python)", codegen.build_module, graph, plan, name,
                     sig["checksum"], arch.llvm_triple, str(tm.target_data),
                     features=features, variant=index)
        texts.append(text)
        mod = timed(phases, "parse+verify", llvm.parse_assembly, text)
        timed(phases, "parse+verify", mod.verify)
        pto = llvm.PipelineTuningOptions(speed_level=3)
        pto.loop_vectorization = pto.slp_vectorization = True
        pb = llvm.create_pass_builder(tm, pto)
        timed(phases, "llvm optimise", pb.getModulePassManager().run, mod, pb)
        timed(phases, "llvm codegen", tm.emit_object, mod)
    phases["ir functions"] = sum(t.count("\ndefine ") for t in texts) / len(texts)
    return phases


def full_compile(model: Any, name: str, profile: int) -> float:
    from cuvil.compiler.driver import compile_model

    with tempfile.TemporaryDirectory() as tmp:
        prof = cProfile.Profile() if profile else None
        start = time.perf_counter()
        if prof:
            prof.enable()
        compile_model(model, name, Path(tmp))
        if prof:
            prof.disable()
        total = time.perf_counter() - start
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--graphs", default="relu,mixed", help="relu, mixed or .onnx paths")
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--no-total", action="store_true", help="skip the full compile_model")
    args = ap.parse_args()
    for g in args.graphs.split(","):
        model: Any = GRAPHS[g](args.nodes) if g in GRAPHS else g
        name = g if g in GRAPHS else "m_" + Path(g).stem.replace("-", "_").replace(".", "_")
        phases = phases_of(model, name)
        funcs = phases.pop("ir functions")
        print(f"== {g}: {funcs:.0f} LLVM functions per variant")
        for phase, seconds in phases.items():
            print(f"  {phase:20s} {seconds:7.2f} s")
        print(f"  {'sum':20s} {sum(phases.values()):7.2f} s")
        if not args.no_total:
            print(f"  {'compile_model':20s} {full_compile(model, name, args.profile):7.2f} s")


if __name__ == "__main__":
    main()
