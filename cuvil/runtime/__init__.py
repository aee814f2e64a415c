"""What generated wheels carry or link, and nothing else: the Python caller every package ships
and the C thread pool and clock every library links. The rest of cuvil reaches them through this module.

`_loader.py` and `_cuvil_session.py` are copied into each generated package, so they import the
standard library and numpy only (tests/test_layering.py checks it).
"""

from __future__ import annotations

from pathlib import Path

from cuvil.runtime._loader import (
    ABI_DTYPES,
    ABI_VERSION,
    EXPORTED_PARTS,
    STATUS_CPU_UNSUPPORTED,
    STATUS_CUSTOM_OP_FAILED,
    STATUS_INDEX_OUT_OF_RANGE,
    STATUS_OK,
    Manifest,
    ManifestError,
    Model,
    ModelSignature,
    TensorInfo,
    TensorSignature,
    abi_checksum,
    exported_symbol,
)

__all__ = ["ABI_DTYPES", "ABI_VERSION", "CLOCK_SOURCE", "CUSTOM_OP_HEADER", "EXPORTED_PARTS", "LOADER_SOURCE",
           "SESSION_SOURCE", "STATUS_CPU_UNSUPPORTED", "STATUS_CUSTOM_OP_FAILED", "STATUS_INDEX_OUT_OF_RANGE",
           "STATUS_OK", "THREADPOOL_SOURCE", "Manifest", "ManifestError", "Model", "ModelSignature",
           "TensorInfo", "TensorSignature", "abi_checksum", "exported_symbol"]

#: the ctypes/numpy caller, copied verbatim into every generated package
LOADER_SOURCE = Path(__file__).with_name("_loader.py")
#: the onnxruntime-style session (`Model.session()`), copied under its own name beside it
SESSION_SOURCE = Path(__file__).with_name("_cuvil_session.py")
#: the thread pool behind `Emitter.parallel_loop`, compiled for the target and linked into every
#: model library
THREADPOOL_SOURCE = Path(__file__).with_name("threadpool.c")
#: the monotonic clock `run_profiled` reads (codegen.module.CLOCK_NS), linked likewise
CLOCK_SOURCE = Path(__file__).with_name("clock.c")
#: the C ABI of custom-op kernels (docs/custom-ops.md); its folder is on their include path
CUSTOM_OP_HEADER = Path(__file__).with_name("cuvil_op.h")
