"""The compile cache: linked model libraries (with their signatures), keyed by content.

A model's library depends only on what `model_key` hashes: the model's files (source,
external data, calibration) by content and project-relative name, its table (name, inputs,
quantize with the calibration method, keep-float, the feeds of a calibration entry point and
onnxruntime's version), the project's ops (each decomposition registered with
`cuvil.register_op`, with a digest of its module's source), the code-shaping build settings
(cpu, with "native" resolved to this machine's CPU, and opt-level), the resolved target
(arches, CPU variants, zig targets: so an adjusted
MACOSX_DEPLOYMENT_TARGET is a different key), and the compiler: cuvil's version, a digest of
the cuvil sources that shape the library (so an edit of an editable install invalidates) and the
llvmlite and ziglang versions. Neither the project's folder nor the Python running the build is
part of it, so a copy of the project and a build for another Python hit the same entries.
A setting that starts to reach `compile_model` must be added to `model_key`.

The level is the linked library, not the objects: a hit skips the frontend, passes, codegen
and the link, so a rebuild costs the wheel writing and checking only. Below it, the compiler
keeps each kernel's object code (`CompileCache.kernels`, `<cache-dir>/kernels-v1/`): GEMM
kernels are most of a small model's LLVM time and the same for every model of a target, so a
new model compiles only its own code.

Each entry is one file `<key>.entry` in `<cache-dir>/libraries-v1/`: a magic line, the SHA-256
of the rest, a JSON line (key and signature) and the library's bytes. It is
written to a temporary file in the same folder and renamed into place, so readers see a whole
entry or none, and a killed build leaves at most a temporary file (removed once stale). An entry
whose digest does not match (truncated, edited) is removed and the model compiled again. A hit
touches the entry's mtime; after each store the least recently used entries are removed until
both folders together are within the size limit. Nothing here can fail a build: a cache
folder that cannot be used is reported and the build goes on without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import cuvil

if TYPE_CHECKING:
    from cuvil.config import BuildSettings, CompileOptions, ModelConfig, ProjectConfig
    from cuvil.toolchains import Target

__all__ = ["CacheStats", "CompileCache", "KernelObjects", "cache_dir", "default_cache_dir",
           "file_key", "model_key", "open_cache", "sources_digest"]

Log = Callable[[str], None]

_FOLDER = "libraries-v1"  # a new entry layout gets a new folder
_KERNELS_FOLDER = "kernels-v1"
_MAGIC = b"cuvil compile cache entry 1\n"
_SUFFIX = ".entry"
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_SECONDS = 3600  # a temporary file this old belongs to a killed build
# the cuvil sources a library's bytes depend on (relative to the package)
_SHAPING_SOURCES = ("compiler", "runtime", "toolchains", "config.py",
                    "build_backend/_package.py", "build_backend/cache.py")


def default_cache_dir() -> Path:
    """The user cache folder for cuvil: $XDG_CACHE_HOME/cuvil or ~/.cache/cuvil on Linux,
    ~/Library/Caches/cuvil on macOS, %LOCALAPPDATA%\\cuvil\\Cache on Windows."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("cuvil", appauthor=False))


def cache_dir(settings: BuildSettings) -> Path:
    return settings.cache_dir if settings.cache_dir is not None else default_cache_dir()


@functools.cache
def sources_digest() -> str:
    root = Path(cuvil.__file__).parent
    digest = hashlib.sha256()
    for name in _SHAPING_SOURCES:
        base = root / name
        files = [base] if base.is_file() else sorted(
            p for p in base.rglob("*") if p.suffix in (".py", ".c", ".h") and p.is_file())
        for path in files:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(functools.partial(f.read, 1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_key(project: ProjectConfig, model: ModelConfig, target: Target, *,
              feeds_digest: str | None = None) -> str:
    """The hex SHA-256 of everything the model's library and signature are made from: the
    compiler, the target, the project's custom ops, the model's files and every field of its
    CompileOptions (config.py), with "native" spelled out as this machine's CPU.

    A quantized model adds onnxruntime's version (its quantizer makes the QDQ model) and, for
    a calibration entry point, `feeds_digest`: the digest of the feeds it gave (an .npz file is
    among the model's files, hashed by content)."""
    from cuvil.build_backend._custom_ops import ops_state
    from cuvil.build_backend._sdist import model_files

    files = [[role, Path(os.path.relpath(path, project.root)).as_posix(), _file_digest(path)]
             for role, path in model_files(project.root, model)]
    return _key(model.name, files, project.compile_options(model), target, ops_state(project),
                feeds_digest)


def file_key(source: Path, name: str, options: CompileOptions, target: Target,
             library_file: str) -> str | None:
    """The key of `cuvil compile`'s library of the model file `source`: as `model_key`'s, with
    the library's file name (its SONAME or install name), and the ops of installed packages
    alone (there is no project). None for a calibration entry point, whose feeds only the
    compile reads: that compile is not cached."""
    from cuvil.build_backend._custom_ops import ops_state
    from cuvil.build_backend._sdist import _external_data

    if options.quantize != "none" and not Path(options.calibration).is_file():
        return None
    files = [["source", source.name, _file_digest(source)]]
    files += [["external data", Path(os.path.relpath(path, source.parent)).as_posix(),
               _file_digest(path)] for path in _external_data(source)]
    if options.quantize != "none":
        files.append(["calibration", "", _file_digest(Path(options.calibration))])
    return _key(name, files, options, target, ops_state(None), None, library_file)


def _key(name: str, files: list[list[str]], compile_options: CompileOptions, target: Target,
         ops: dict[str, Any], feeds_digest: str | None, library_file: str | None = None) -> str:
    options = compile_options.key_state()
    if options["cpu"] == "native":
        from cuvil.toolchains import host_cpu

        options["cpu"] = ["native", *host_cpu()]
    shape = dataclasses.asdict(target)
    shape.pop("source")  # where the toolchain file lies does not matter, only what it says
    shape.pop("description")
    state = {
        "compiler": {"cuvil": cuvil.__version__, "sources": sources_digest(),
                     "llvmlite": _version("llvmlite"), "ziglang": _version("ziglang")},
        "target": shape,
        "ops": ops,
        "model": name,
        "files": files,
        "options": options,
    }
    if library_file is not None:  # else the backend's name, "_<model><suffix>"
        state["library file"] = library_file
    if compile_options.quantize != "none":
        state["quantization"] = {"feeds": feeds_digest, "onnxruntime": _version("onnxruntime")}
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class CacheStats:
    folder: Path
    entries: int
    size: int  # bytes, with temporary files of builds still running (or killed)


@dataclass(frozen=True)
class CompileCache:
    folder: Path  # the cache-dir setting
    max_size: int  # bytes of libraries and kernels together
    _kernels: bool = False  # entries are kernels' object code (`kernels`), not libraries

    @property
    def entries(self) -> Path:
        return self.folder / _FOLDER

    @property
    def kernel_entries(self) -> Path:
        return self.folder / _KERNELS_FOLDER

    def _path(self, key: str) -> Path:
        return (self.kernel_entries if self._kernels else self.entries) / f"{key}{_SUFFIX}"

    def kernels(self, log: Log) -> KernelObjects:
        """Kernel object code for the compiler (compiler/llvm_jobs.py), in this cache."""
        return KernelObjects(dataclasses.replace(self, _kernels=True), log)

    def load(self, key: str, log: Log) -> tuple[bytes, dict[str, Any]] | None:
        """(library bytes, signature) of the entry `key`, else None."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log(f"cuvil: warning: cannot read the compile cache entry {path} ({exc}); compiling")
            return None
        found = _parse(data, key)
        if found is None:
            log(f"cuvil: warning: compile cache entry {path} is damaged (its digest does not "
                "match); removing it and compiling again")
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):  # least recently used: the mtime says when
            os.utime(path)
        return found

    def store(self, key: str, library: bytes, signature: dict[str, Any], log: Log) -> None:
        meta = json.dumps({"key": key, "signature": signature},
                          sort_keys=True).encode()
        payload = meta + b"\n" + library
        data = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
        folder = self._path(key).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=_SUFFIX, dir=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(temp, self._path(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
        except OSError as exc:
            # on Windows a concurrent reader can hold the same entry open: it is complete anyway
            if not self._path(key).is_file():
                log(f"cuvil: warning: cannot write to the compile cache {self.folder} ({exc}); "
                    "set cache-dir to a writable folder, or cache = false")
            return
        self.evict(log, keep=key)

    def _files(self) -> Iterator[tuple[Path, os.stat_result]]:
        """Library and kernel entries alike: one size limit holds for both."""
        for folder in (self.entries, self.kernel_entries):
            try:
                children = list(folder.iterdir())
            except OSError:
                continue
            for path in children:
                if path.name.endswith(_SUFFIX):
                    with contextlib.suppress(OSError):  # a concurrent eviction removed it
                        yield path, path.stat()

    def evict(self, log: Log, keep: str | None = None) -> None:
        """Remove stale temporary files, then the least recently used entries until the
        cache is within its size limit (the entry `keep` last)."""
        now = time.time()
        live = []
        for path, st in self._files():
            if path.name.startswith(_TEMP_PREFIX) and now - st.st_mtime > _STALE_TEMP_SECONDS:
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            live.append((path.name == f"{keep}{_SUFFIX}", st.st_mtime, st.st_size, path))
        total = sum(size for _, _, size, _ in live)
        for _, _, size, path in sorted(live):
            if total <= self.max_size:
                break
            if path.name.startswith(_TEMP_PREFIX):
                continue  # a build is writing it
            with contextlib.suppress(OSError):
                path.unlink()
                log(f"cuvil: compile cache over {self.max_size} bytes: removed {path.name}")
            total -= size

    def stats(self) -> CacheStats:
        files = list(self._files())
        entries = sum(not p.name.startswith(_TEMP_PREFIX) for p, _ in files)
        return CacheStats(self.folder, entries, sum(st.st_size for _, st in files))

    def clear(self) -> int:
        """Remove every entry (and temporary file); return how many bytes were freed."""
        freed = 0
        for path, st in self._files():
            with contextlib.suppress(OSError):
                path.unlink()
                freed += st.st_size
        for folder in (self.entries, self.kernel_entries):
            with contextlib.suppress(OSError):
                folder.rmdir()
        return freed


@dataclass(frozen=True)
class KernelObjects:
    """The compiler's KernelCache (compiler/llvm_jobs.py) in a compile cache: a kernel's
    object code by its symbol (which names its code and target) and the compiler that made it
    (cuvil's version and shaping sources, llvmlite's version), as `model_key` names it."""

    cache: CompileCache
    log: Log

    def _key(self, symbol: str) -> str:
        state = [symbol, cuvil.__version__, sources_digest(), _version("llvmlite")]
        return hashlib.sha256(json.dumps(state).encode()).hexdigest()

    def load(self, symbol: str) -> bytes | None:
        hit = self.cache.load(self._key(symbol), self.log)
        return hit[0] if hit is not None else None

    def store(self, symbol: str, code: bytes) -> None:
        self.cache.store(self._key(symbol), code, {"kernel": symbol}, self.log)


def _parse(data: bytes, key: str) -> tuple[bytes, dict[str, Any]] | None:
    if not data.startswith(_MAGIC):
        return None
    digest, _, payload = data[len(_MAGIC):].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        return None
    meta, _, library = payload.partition(b"\n")
    try:
        info = json.loads(meta)
    except ValueError:
        return None
    if info.get("key") != key:
        return None
    return library, info["signature"]


def open_cache(settings: BuildSettings) -> CompileCache | None:
    """The compile cache the settings name, or None when it is turned off."""
    if not settings.cache:
        return None
    return CompileCache(cache_dir(settings), settings.cache_max_size)
