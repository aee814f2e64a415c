"""The compile cache (cuvil/build_backend/cache.py) with real builds: a rebuild, also of a copy
of the project elsewhere, takes the libraries from the cache and writes the same wheel bytes;
a change of the model, a setting or the target compiles again; damaged entries are rebuilt,
never used; the size limit holds; turned off, the cache is neither read nor written.

The project is a small real model (Gemm + Relu), so that each cold build costs a few seconds;
conftest.py gives every test an empty cache folder of its own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from projects import write_model

import cuvil.build_backend as backend
import cuvil.compiler.driver as driver
import cuvil.compiler.llvm_jobs as llvm_jobs
import cuvil.toolchains.llvm as llvm
from cuvil import cli
from cuvil.build_backend.cache import CompileCache, model_key
from cuvil.config import load_project
from cuvil.errors import ConfigError
from cuvil.toolchains import get_target

ROOT = Path(__file__).resolve().parents[2]
EPOCH = "1700000000"

PYPROJECT = """\
[build-system]
requires = ["cuvil"]
build-backend = "cuvil.build_backend"

[project]
name = "tiny-cuvil"
version = "1.0.0"

[tool.cuvil]
package = "tiny"
{extra}
[tool.cuvil.models.net]
source = "models/net.onnx"
inputs = {{ x = ["batch", 4] }}
"""


def make_project(root: Path, extra: str = "", seed: int = 0) -> Path:
    write_model(root / "models" / "net.onnx", seed)
    (root / "pyproject.toml").write_text(PYPROJECT.format(extra=extra))
    return root


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the models compile_model compiles (it is still called for real)."""
    calls: list[str] = []
    real = driver.compile_model

    def counting(source: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return real(source, name, *args, **kwargs)

    monkeypatch.setattr(driver, "compile_model", counting)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    return calls


def build(root: Path, out: Path, monkeypatch: pytest.MonkeyPatch, **settings: str) -> bytes:
    """The wheel a build of `root` writes into `out`, as bytes."""
    with monkeypatch.context() as m:
        m.chdir(root)
        name = backend.build_wheel(str(out), dict(settings))
    return (out / name).read_bytes()


def entries(folder: Path) -> list[Path]:
    """The library entries (kernels' object code has a folder of its own)."""
    return sorted(folder.glob("libraries-v1/*.entry"))


def library_of(wheel: bytes, out: Path) -> bytes:
    path = out / "w.whl"
    path.write_bytes(wheel)
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(n for n in archive.namelist() if "/_net." in n))


@pytest.mark.slow
def test_a_rebuild_and_a_copy_elsewhere_take_the_library_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: list[str],
        _private_compile_cache: Path, capfd: pytest.CaptureFixture[str]) -> None:
    project = make_project(tmp_path / "a" / "tiny")
    cold = build(project, tmp_path / "cold", monkeypatch)
    assert compiles == ["net"]
    assert len(entries(_private_compile_cache)) == 1
    capfd.readouterr()

    again = build(project, tmp_path / "again", monkeypatch, verbose="true")
    assert compiles == ["net"]  # not compiled again
    assert again == cold
    log = capfd.readouterr().err
    assert "net: _net" in log and "taken from the compile cache" in log
    assert "cuvil: model 1 of 1: net\n" in log
    assert re.search(r"^cuvil: built model net: 1 nodes \(1 Gemm\), _net\.so \d+ KiB, from the "
                     r"compile cache$", log, re.M), log
    assert str(_private_compile_cache) in log

    copy = tmp_path / "b" / "elsewhere"
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns("build"))
    assert build(copy, tmp_path / "copy", monkeypatch) == cold
    assert compiles == ["net"]
    assert len(entries(_private_compile_cache)) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "settings"),
    [
        ("model", {}),
        ("inputs", {}),
        ("opt-level", {"opt-level": "1"}),
        ("target", {"target": "aarch64-linux"}),
    ],
)
def test_a_change_of_model_settings_or_target_compiles_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: list[str],
        _private_compile_cache: Path, change: str, settings: dict[str, str]) -> None:
    project = make_project(tmp_path / "tiny")
    first = build(project, tmp_path / "first", monkeypatch)
    if change == "model":
        write_model(project / "models" / "net.onnx", seed=1)
    if change == "inputs":
        text = (project / "pyproject.toml").read_text()
        (project / "pyproject.toml").write_text(text.replace('["batch", 4]', "[2, 4]"))
    changed = build(project, tmp_path / "changed", monkeypatch, **settings)
    assert compiles == ["net", "net"]
    assert len(entries(_private_compile_cache)) == 2
    assert library_of(changed, tmp_path) != library_of(first, tmp_path)
    # both stay cached: going back is a hit
    assert build(project, tmp_path / "again", monkeypatch, **settings) == changed
    assert compiles == ["net", "net"]


@pytest.mark.slow
def test_damaged_entries_are_detected_and_rebuilt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: list[str],
        _private_compile_cache: Path, capfd: pytest.CaptureFixture[str]) -> None:
    project = make_project(tmp_path / "tiny")
    good = build(project, tmp_path / "good", monkeypatch)
    (entry,) = entries(_private_compile_cache)
    whole = entry.read_bytes()
    flipped = bytearray(whole)
    flipped[-100] ^= 0x01  # same size, one bit of the library changed
    for damaged in (whole[: len(whole) // 2], bytes(flipped), b""):
        entry.write_bytes(damaged)
        capfd.readouterr()
        assert build(project, tmp_path / f"out{len(compiles)}", monkeypatch) == good
        assert "is damaged" in capfd.readouterr().err
        assert entry.read_bytes() == whole  # stored again, whole
    assert compiles == ["net"] * 4


@pytest.mark.slow
def test_a_new_model_takes_its_kernels_from_the_cache_and_links_the_same_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _private_compile_cache: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(llvm_jobs, "_kernels", {})  # none compiled (for no cache) before
    build(make_project(tmp_path / "first"), tmp_path / "first-out", monkeypatch)
    kernels = sorted((_private_compile_cache / "kernels-v1").glob("*.entry"))
    assert kernels  # a GEMM and matrix-vector kernels per CPU copy
    uncached = build(make_project(tmp_path / "solo", seed=1), tmp_path / "solo-out", monkeypatch,
                     cache="false")

    jobs: list[str] = []
    real = llvm.emit_object_isolated

    def counting(ir_text: str, machine: dict[str, Any], optimize: bool = True) -> bytes:
        jobs.append(ir_text.split("\n", 1)[0])  # the ModuleID: the model's or the kernel's name
        return real(ir_text, machine, optimize)

    monkeypatch.setattr(llvm, "emit_object_isolated", counting)
    # as a new process would: none of this one's kernels in memory
    monkeypatch.setattr(llvm_jobs, "_kernels", {})
    other = build(make_project(tmp_path / "other", seed=1), tmp_path / "other-out", monkeypatch,
                  verbose="true")
    assert jobs and all('"net"' in job for job in jobs), jobs  # the model's own code only
    assert f"{len(kernels)} kernels from the kernel cache" in capfd.readouterr().err
    assert library_of(other, tmp_path) == library_of(uncached, tmp_path)

    # a damaged kernel entry is compiled again, never linked
    kernels[0].write_bytes(kernels[0].read_bytes()[:-10])
    for entry in entries(_private_compile_cache):  # so that the model compiles again
        entry.unlink()
    monkeypatch.setattr(llvm_jobs, "_kernels", {})
    jobs.clear()
    again = build(make_project(tmp_path / "again", seed=1), tmp_path / "again-out", monkeypatch)
    assert "is damaged" in capfd.readouterr().err
    assert sum('"net"' not in job for job in jobs) == 1
    assert library_of(again, tmp_path) == library_of(uncached, tmp_path)


@pytest.mark.slow
def test_concurrent_builds_sharing_the_cache_give_the_wheels_of_solo_builds(
        tmp_path: Path, _private_compile_cache: Path) -> None:
    script = ("import sys\nfrom cuvil.build_backend import build_wheel\n"
              "print(build_wheel(sys.argv[1], {'opt-level': sys.argv[2], 'cache': sys.argv[3]}))\n")
    project = make_project(tmp_path / "tiny")
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, "CUVIL_CACHE_DIR": str(_private_compile_cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def start(out: Path, level: str, cache: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", script, str(out), level, cache], cwd=project,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(proc: subprocess.Popen[str], out: Path) -> bytes:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        return (out / stdout.strip().splitlines()[-1]).read_bytes()

    solo = {level: finish(start(tmp_path / f"solo{level}", level, "false"), tmp_path / f"solo{level}")
            for level in ("3", "0")}
    assert not entries(_private_compile_cache)
    runs = [(tmp_path / f"run{i}", level) for i, level in enumerate(("3", "0", "3", "0"))]
    procs = [start(out, level, "true") for out, level in runs]  # cold cache, all at once
    for proc, (out, level) in zip(procs, runs):
        assert finish(proc, out) == solo[level]
    assert len(entries(_private_compile_cache)) == 2  # whole entries only, no temporary files
    for out, level in runs[:2]:  # and warm
        assert finish(start(out, level, "true"), out) == solo[level]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["-C", "environment", "pyproject"])
def test_a_disabled_cache_is_neither_read_nor_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: list[str],
        _private_compile_cache: Path, how: str) -> None:
    project = make_project(tmp_path / "tiny")
    build(project, tmp_path / "filled", monkeypatch)
    before = {p: p.read_bytes() for p in entries(_private_compile_cache)}
    settings = {"cache": "false"} if how == "-C" else {}
    if how == "environment":
        monkeypatch.setenv("CUVIL_CACHE", "0")
    if how == "pyproject":
        make_project(project, extra="cache = false\n")
    write_model(project / "models" / "net.onnx", seed=2)  # a miss would write an entry
    build(project, tmp_path / "off1", monkeypatch, **settings)
    write_model(project / "models" / "net.onnx", seed=0)  # a hit would skip the compile
    build(project, tmp_path / "off2", monkeypatch, **settings)
    assert compiles == ["net"] * 3
    assert {p: p.read_bytes() for p in entries(_private_compile_cache)} == before
    assert [p.name for p in _private_compile_cache.rglob("*") if p.is_file()] == [
        p.name for p in before]


def test_the_key_names_everything_the_library_is_made_of(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cuvil.build_backend.cache as cache

    def key(root: Path, settings: dict[str, str] | None = None, target: str = "x86_64-linux") -> str:
        project = load_project(root, settings or {}, {})
        return model_key(project, project.models[0], get_target(target))

    base_root = make_project(tmp_path / "a")
    base = key(base_root)
    assert key(shutil.copytree(base_root, tmp_path / "b" / "c")) == base  # the folder is not in it
    differ = {
        "model": key(make_project(tmp_path / "m", seed=5)),
        "inputs": key(_with_text(tmp_path / "i", '["batch", 4]', '["n", 4]')),
        "opt-level": key(base_root, {"opt-level": "2"}),
        "cpu": key(base_root, {"cpu": "haswell"}),
        "target": key(base_root, target="aarch64-linux"),
    }
    monkeypatch.setattr(cache, "sources_digest", lambda: "edited")
    differ["cuvil sources"] = key(base_root)
    monkeypatch.undo()
    monkeypatch.setattr(cache, "_version", lambda name: "9.9" if name == "llvmlite" else "1")
    differ["llvmlite"] = key(base_root)
    assert len({base, *differ.values()}) == len(differ) + 1, differ


def _with_text(root: Path, old: str, new: str) -> Path:
    make_project(root)
    text = (root / "pyproject.toml").read_text()
    (root / "pyproject.toml").write_text(text.replace(old, new))
    return root


def test_an_edit_of_the_compiler_sources_changes_the_digest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cuvil
    import cuvil.build_backend.cache as cache

    package = tmp_path / "cuvil"
    shutil.copytree(Path(cuvil.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cuvil, "__file__", str(package / "__init__.py"))
    digests = []
    for edit in ("", "# edited\n"):
        with open(package / "compiler" / "driver.py", "a") as f:
            f.write(edit)
        cache.sources_digest.cache_clear()
        digests.append(cache.sources_digest())
    cache.sources_digest.cache_clear()
    assert digests[0] != digests[1]


def fill(cache: CompileCache, keys: list[str], size: int) -> None:
    for k in keys:
        cache.store(k, b"\0" * size, {"library": f"_{k}.so"}, print)


def test_eviction_keeps_the_cache_under_its_limit_least_recently_used_first(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "cache", max_size=10**9)
    fill(cache, ["a", "b", "c", "d"], 10_000)
    per_entry = cache.stats().size // 4
    old = time.time() - 1000
    for i, k in enumerate("abcd"):  # a is the oldest
        os.utime(cache.entries / f"{k}.entry", (old + i, old + i))
    assert cache.load("a", print) is not None  # now a is the most recently used
    small = CompileCache(cache.folder, max_size=int(per_entry * 3.5))
    fill(small, ["e"], 10_000)
    assert small.stats().size <= small.max_size
    assert sorted(p.stem for p in entries(cache.folder)) == ["a", "d", "e"]  # b and c went
    # an entry larger than the whole limit is not kept
    tiny = CompileCache(cache.folder, max_size=100)
    fill(tiny, ["f"], 10_000)
    assert tiny.stats().size <= 100


def test_temporary_files_of_killed_builds_are_never_read_and_removed_once_stale(
        tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "cache", max_size=10**9)
    fill(cache, ["k"], 100)
    whole = (cache.entries / "k.entry").read_bytes()
    partial = cache.entries / ".tmp-x1.entry"
    partial.write_bytes(whole[:50])
    fresh = cache.entries / ".tmp-x2.entry"
    fresh.write_bytes(whole[:60])
    os.utime(partial, (time.time() - 7200, time.time() - 7200))
    assert cache.load("k", print) is not None
    cache.evict(print)
    assert not partial.exists() and fresh.exists()  # a running build may still write the fresh one
    assert cache.stats().entries == 1


def test_an_interrupted_store_leaves_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = CompileCache(tmp_path / "cache", max_size=10**9)

    def interrupted(src: str, dst: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fill(cache, ["k"], 100)
    monkeypatch.undo()
    assert list(cache.entries.iterdir()) == []
    assert cache.load("k", print) is None


def test_cli_cache_info_and_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "cache"
    fill(CompileCache(folder, 10**9), ["a", "b"], 1000)
    assert cli.main(["cache", "info", "--project", str(tmp_path), "-C", f"cache-dir={folder}"]) == 0
    out = capsys.readouterr().out
    assert str(folder) in out and "entries: 2" in out and "limit:   2.0 GiB" in out
    assert cli.main(["cache", "clear", "--project", str(tmp_path), "-C", f"cache-dir={folder}"]) == 0
    assert "removed" in capsys.readouterr().out
    assert CompileCache(folder, 10**9).stats().entries == 0
    (folder / "mine.txt").write_text("not cuvil's")  # clear removes only cache entries
    cli.main(["cache", "clear", "-C", f"cache-dir={folder}"])
    assert (folder / "mine.txt").exists()


@pytest.mark.parametrize(("text", "size"), [("2 GiB", 2 << 30), ("500MB", 500 * 10**6),
                                            ("1.5k", 1500), ("4096", 4096), ("0", 0)])
def test_cache_max_size_reads_units(tmp_path: Path, text: str, size: int) -> None:
    root = make_project(tmp_path)
    assert load_project(root, {"cache-max-size": text}, {}).settings.cache_max_size == size
    assert load_project(root, {}, {"CUVIL_CACHE_MAX_SIZE": text}).settings.cache_max_size == size


def test_a_bad_cache_setting_names_the_key(tmp_path: Path) -> None:
    root = make_project(tmp_path, extra='cache-max-size = "lots"\n')
    with pytest.raises(ConfigError, match=r"tool.cuvil.cache-max-size.*expected a size"):
        load_project(root, {}, {})
    with pytest.raises(ConfigError, match=r"CUVIL_CACHE=maybe.*not a boolean"):
        load_project(make_project(tmp_path / "b"), {}, {"CUVIL_CACHE": "maybe"})


def test_the_default_folder_is_the_user_cache_folder_and_tests_never_use_it(
        _private_compile_cache: Path, tmp_path: Path) -> None:
    import platformdirs

    import cuvil.build_backend.cache as cache

    assert os.environ["CUVIL_CACHE_DIR"] == str(_private_compile_cache)
    assert cache.default_cache_dir() == _private_compile_cache
    root = make_project(tmp_path)
    assert load_project(root, {}, {}).settings.cache_dir is None  # unset: the default folder
    assert Path(platformdirs.user_cache_dir("cuvil", appauthor=False)).name in ("cuvil", "Cache")
