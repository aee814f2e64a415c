"""How cuvil and onnxruntime scale with threads, measured in one process per thread count.

Each model is compiled once (the toolchain file's CPU variants, as a wheel ships it); then a
fresh interpreter per thread count loads the library and an onnxruntime session, both limited
to that many threads (CUVIL_NUM_THREADS, intra_op_num_threads), and times them alternately.

    python benchmarks/scaling.py                         # light squeezenet and resnet50
    python benchmarks/scaling.py model.onnx --threads 1 2 4
    python benchmarks/scaling.py --keep DIR ...          # keep the built libraries in DIR
    python benchmarks/scaling.py --libraries DIR ...     # time libraries kept earlier

Figures vary with the machine and its load; they belong in notes, not in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import LIGHT, input_feeds, static_batch

DEFAULT_MODELS = [LIGHT / "light_squeezenet.onnx", LIGHT / "light_resnet50.onnx"]


def worker(library: str, signature: str, model_path: str, threads: int, seconds: float) -> None:
    import onnxruntime as ort

    from cuvil.runtime._loader import Model

    model = onnx.load(model_path)
    feeds = input_feeds(model, static_batch(model) or 1)
    cuvil_model = Model(library, json.loads(Path(signature).read_text()))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])
    expected = sess.run(None, feeds)
    got = cuvil_model.run(feeds)
    err = max(float(np.max(np.abs(got[o.name] - e))) for o, e in zip(cuvil_model.outputs, expected))
    runs = {"cuvil": (lambda: cuvil_model.run(feeds)), "ort": (lambda: sess.run(None, feeds))}
    times: dict[str, list[float]] = {k: [] for k in runs}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times["ort"]) < 10:
        for key, fn in runs.items():  # alternate, so both see the same load of the machine
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
    result = {k: float(np.median(v) * 1000) for k, v in times.items()}
    result["max_abs_diff"] = err
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", type=Path, default=DEFAULT_MODELS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seconds", type=float, default=10.0, help="timing per configuration")
    parser.add_argument("--keep", type=Path, help="write the built libraries here")
    parser.add_argument("--libraries", type=Path, help="use libraries kept with --keep")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        lib, sig, path, threads, seconds = args.worker
        worker(lib, sig, path, int(threads), float(seconds))
        return
    from cuvil.compiler.driver import compile_model

    with tempfile.TemporaryDirectory() as tmp:
        store = args.libraries or args.keep or Path(tmp)
        for path in args.models:
            stem = path.stem
            lib, sig = store / f"{stem}.so", store / f"{stem}.json"
            if not args.libraries:
                compiled = compile_model(str(path), stem, store / f"{stem}.build")
                lib.write_bytes(compiled.library.read_bytes())
                sig.write_text(json.dumps(compiled.signature))
            line = [f"{stem}:"]
            for threads in args.threads:
                env = {**os.environ, "CUVIL_NUM_THREADS": str(threads)}
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", str(lib), str(sig), str(path),
                     str(threads), str(args.seconds)],
                    env=env, check=True, capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                line.append(f"{threads} thr: cuvil {r['cuvil']:.2f} ms, ort {r['ort']:.2f} ms "
                            f"(ratio {r['cuvil'] / r['ort']:.2f}, |diff| {r['max_abs_diff']:.1e});")
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
