"""precision = "bf16" against float32 on ResNet-50, on each of bf16's paths, in one process.

The model is benchmarks/quantized.py's light_resnet50 with random weights (the onnx package's
has every weight 0.02, so its outputs tell nothing of accuracy). Compiled twice, float32 and
bf16, for every CPU (the default: the dispatcher picks the copy) or for one `--cpu`; the bf16
library is loaded twice from copies of its file, so that each asks the CPU at its first product:
once as the CPU allows (AMX or AVX-512 BF16 where it has them) and once with CUVIL_BF16=0 (the
float32 path of CPUs without: float32 kernels on float32 panels derived from the bf16 weights).
Then the three are called in turn, CPU time per call (`time.thread_time`), batch 1.

    python benchmarks/bf16.py                      # 1 thread, 20 calls each
    python benchmarks/bf16.py --cpu x86-64-v3      # the AVX2 copy: the float32 path only

Printed: the first call's wall time (the float32 path derives its panels then), the median and
range of ms per call, each one's ratio to float32, and each bf16 path's largest error relative
to the largest float32 output and top-1 agreement on `--agree` random inputs. The model is
compiled without its final Softmax: the random weights' logits saturate it, so probabilities
would agree to float32's rounding and say nothing of bf16's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quantized

from cuvil.compiler.driver import compile_model
from cuvil.config import CompileOptions
from cuvil.runtime._loader import Model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", default=None, help="one copy for this CPU (default: every copy)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=20, help="timed calls of each (default: 20)")
    p.add_argument("--agree", type=int, default=8, help="inputs compared (default: 8)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="cuvil-bf16-") as tmp_name:
        tmp = Path(tmp_name)
        source = quantized.light_resnet50(Path(tempfile.gettempdir()) / "cuvil-bench-cache")
        logits = without_softmax(source.path, tmp / "logits.onnx")
        built = {precision: compile_model(logits, "resnet50", tmp / precision,
                                          CompileOptions(cpu=args.cpu, precision=precision))
                 for precision in ("float32", "bf16")}
        x = source.feeds(0)
        models: dict[str, Model] = {}
        first: dict[str, float] = {}
        for label, precision, env in (("float32", "float32", None), ("bf16", "bf16", None),
                                      ("bf16, CUVIL_BF16=0", "bf16", "0")):
            lib = built[precision]
            path = tmp / f"{len(models)}_{lib.library.name}"
            shutil.copy(lib.library, path)
            if env is not None:
                os.environ["CUVIL_BF16"] = env
            models[label] = Model(path, lib.signature, num_threads=args.threads)
            start = time.perf_counter()
            models[label].run(x)
            first[label] = time.perf_counter() - start
            os.environ.pop("CUVIL_BF16", None)
        times: dict[str, list[float]] = {label: [] for label in models}
        for _ in range(args.runs):
            for label, model in models.items():
                start = time.thread_time()
                model.run(x)
                times[label].append((time.thread_time() - start) * 1e3)
        base = statistics.median(times["float32"])
        load = os.getloadavg()
        print(f"ResNet-50 batch 1, {args.threads} thread(s), cpu {args.cpu or 'every copy'}, "
              f"{args.runs} calls each, load average {load[0]:.2f} {load[1]:.2f}")
        for label, ms in times.items():
            med = statistics.median(ms)
            print(f"  {label:20s} first call {first[label] * 1e3:7.1f} ms wall; "
                  f"{med:6.1f} ms ({min(ms):.1f}-{max(ms):.1f}), float32 / this {base / med:.2f}x")
        for label in list(models)[1:]:
            errs, agree = [], 0
            for seed in range(args.agree):
                feeds = source.feeds(100 + seed)
                want = next(iter(models["float32"].run(feeds).values()))
                got = next(iter(models[label].run(feeds).values()))
                errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
                agree += int(np.argmax(got) == np.argmax(want))
            print(f"  {label:20s} vs float32: max rel. error {max(errs):.2e}, "
                  f"top-1 {agree}/{args.agree}")


def without_softmax(path: Path, out: Path) -> Path:
    """The model with its last node, a Softmax, removed: its input becomes the output."""
    model = onnx.load(str(path))
    last = model.graph.node[-1]
    assert last.op_type == "Softmax", last.op_type
    model.graph.node.remove(last)
    model.graph.output[0].name = last.input[0]
    onnx.save(model, str(out))
    return out


if __name__ == "__main__":
    main()
