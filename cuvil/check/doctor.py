"""`cuvil doctor WHEEL_OR_PACKAGE`: can this machine run these models, and if not, why and
what to do.

It looks in this order, because each step needs the one before: the files are intact (for a
wheel, every check of `cuvil check`; for an installed package, the manifest and each library
read as `cuvil check` reads them), they were built by one cuvil build (the package's runtime
speaks the manifest's ABI), they are for this machine (OS, architecture, glibc or macOS
version, as pip's tags say), and finally each model loads and runs once in a child process,
so that a CPU without the instructions the library needs (SIGILL) kills the child, not the
caller, and the loader's own error (ABI checksum, missing CPU flags) is reported as it is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuvil.check._archive import read_wheel
from cuvil.check._elf import read_elf
from cuvil.check._macho import is_macho, parse_macho
from cuvil.check._pe import is_pe, read_pe
from cuvil.check._platform import macos_version, manylinux_glibc, tag_arches, tag_libc, tag_os
from cuvil.errors import CheckError, not_a_regular_file

__all__ = ["Diagnosis", "diagnose"]

_HOST_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


@dataclass
class Diagnosis:
    """What `cuvil doctor` found: (ok, what, how to fix) lines, in the order they were found."""

    subject: str
    findings: list[tuple[bool, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(ok for ok, _, _ in self.findings)

    def good(self, what: str) -> None:
        self.findings.append((True, what, ""))

    def bad(self, what: str, fix: str) -> None:
        self.findings.append((False, what, fix))

    def text(self) -> str:
        lines = [self.subject]
        for ok, what, fix in self.findings:
            lines.append(f"  {'OK  ' if ok else 'FAIL'} {what}")
            if fix:
                lines.append(f"       fix: {fix}")
        verdict = "this machine can run it" if self.ok else "this machine cannot run it as it is"
        lines.append(f"{'OK' if self.ok else 'FAIL'}: {verdict}")
        return "\n".join(lines)


def diagnose(target: str) -> Diagnosis:
    """Diagnose a wheel file, a package folder (one holding `_models.json`) or the name of an
    installed package."""
    path = Path(target)
    kind = not_a_regular_file(path)
    if path.suffix == ".whl" and kind not in (None, "missing", "a directory"):
        found = Diagnosis(target)
        found.bad(f"it is {kind}, not a wheel file", "give the path of the .whl file itself")
        return found
    if path.suffix == ".whl" and kind is None:
        return _diagnose_wheel(path)
    if path.is_dir():
        return _diagnose_folder(path, Diagnosis(str(path)), tag=None)
    spec = importlib.util.find_spec(target) if re.fullmatch(r"[A-Za-z_][\w.]*", target) else None
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations)))
        return _diagnose_folder(folder, Diagnosis(f"{target} ({folder})"), tag=None)
    found = Diagnosis(target)
    found.bad("no such wheel file, package folder or installed package",
              "give the path of a .whl file, of a generated package's folder, or an importable "
              "package name")
    return found


def _diagnose_wheel(path: Path) -> Diagnosis:
    from cuvil.check import check_wheel

    found = Diagnosis(str(path))
    report = check_wheel(path, auditwheel=False)
    failures = report.failures
    if failures:
        for result in failures:
            found.bad(f"the wheel is damaged: {result.name}: {result.message}",
                      "rebuild the wheel, or download it again; `cuvil check` lists every problem")
        return found
    found.good(f"the wheel is intact ({sum(r.ok for r in report.results)} checks of cuvil check passed)")
    with tempfile.TemporaryDirectory(prefix="cuvil-doctor-") as tmp:
        folder = _extract_package(path, Path(tmp))
        if folder is None:
            found.bad("the wheel holds no generated package (_models.json)",
                      "this is not a wheel built by cuvil")
            return found
        return _diagnose_folder(folder, found, tag=_platform_tag(path))


def load_test(path: Path) -> tuple[bool | None, str]:
    """`cuvil check --load`: import the package of the wheel at `path` (already checked) in a
    fresh interpreter and call each model once on zeros. (True, what ran), (False, why not), or
    (None, why this machine cannot try). A call that raises (inputs of zeros may break a
    model's own constraints) does not fail the test: loading and answering is what it asks."""
    with tempfile.TemporaryDirectory(prefix="cuvil-load-") as tmp:
        folder = _extract_package(path, Path(tmp))
        if folder is None:
            return None, "the wheel holds no generated package (_models.json): nothing to load"
        found = Diagnosis(str(path))
        manifest = _manifest(folder, found)
        if manifest is not None and _same_build(folder, manifest, found) and \
                _libraries_intact(folder, manifest, found):
            if not _for_this_machine(manifest, _platform_tag(path), folder, found):
                return None, f"not run: {found.findings[-1][1]}"
            _runs_here(folder, manifest, found, calls_must_succeed=False)
    ok, what, _ = found.findings[-1]
    # the wheel is for another CPU, or this interpreter has no numpy to load it with: the
    # library is not at fault, and this machine cannot tell
    if not ok and ("needs CPU features this machine lacks" in what
                   or "No module named 'numpy'" in what):
        return None, f"not run: {what.removeprefix('loading or calling a model fails: ')}"
    return ok, what


def _platform_tag(path: Path) -> str:
    return path.name[:-4].split("-")[-1]


def _extract_package(path: Path, into: Path) -> Path | None:
    """The wheel's generated package (the folder with `_models.json`) unpacked into `into`."""
    wheel = read_wheel(path)
    package = next((name.split("/")[0] for name in wheel.members
                    if name.endswith("/_models.json") and name.count("/") == 1), None)
    if package is None:
        return None
    import zipfile

    with zipfile.ZipFile(path) as archive:  # safe: read_wheel vetted every member
        archive.extractall(into, [n for n in wheel.members if n.startswith(package + "/")])
    return into / package


def _diagnose_folder(folder: Path, found: Diagnosis, tag: str | None) -> Diagnosis:
    manifest = _manifest(folder, found)
    if manifest is None:
        return found
    if not _same_build(folder, manifest, found) or not _libraries_intact(folder, manifest, found):
        return found
    if not _for_this_machine(manifest, tag, folder, found):
        return found
    _runs_here(folder, manifest, found)
    return found


def _manifest(folder: Path, found: Diagnosis) -> dict[str, Any] | None:
    """The package's manifest, read as the loader reads it (an ABI other than this cuvil's is
    left for `_same_build` to explain)."""
    from cuvil.runtime import ABI_VERSION, Manifest, ManifestError

    try:
        manifest = json.loads((folder / "_models.json").read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or manifest.get("abi_version") != ABI_VERSION:
            models = manifest["models"]
            assert isinstance(models, list) and all("library" in m and "name" in m for m in models)
        else:
            for i, model in enumerate(Manifest.from_json(manifest).models):
                model.check_expressions(f"models[{i}]")
    except FileNotFoundError:
        found.bad(f"{folder} holds no _models.json: it is not a package generated by cuvil",
                  "point cuvil doctor at the generated package (the folder with _models.json)")
        return None
    except ManifestError as exc:
        found.bad(f"{folder}/_models.json breaks the manifest's schema: {exc}",
                  "reinstall the package: its files are damaged")
        return None
    except (OSError, ValueError, KeyError, TypeError, AssertionError, RecursionError) as exc:
        found.bad(f"{folder}/_models.json is unreadable or incomplete ({type(exc).__name__})",
                  "reinstall the package: its files are damaged")
        return None
    models = manifest["models"]
    names = ", ".join(m["name"] for m in models)
    found.good(f"package {manifest.get('package', folder.name)!r} with models {names}, built by "
               f"cuvil {manifest.get('cuvil_version', '?')} for {manifest.get('target', '?')}")
    return manifest


def _same_build(folder: Path, manifest: dict[str, Any], found: Diagnosis) -> bool:
    runtime = folder / "_cuvil_runtime.py"
    try:
        m = re.search(r"^ABI_VERSION = (\d+)", runtime.read_text(encoding="utf-8"), re.M)
    except OSError:
        m = None
    if m is None:
        found.bad(f"{runtime.name} is missing or damaged", "reinstall the package")
        return False
    if int(m.group(1)) != manifest.get("abi_version"):
        found.bad(f"the package mixes files of different cuvil builds: its runtime speaks ABI "
                  f"{m.group(1)}, its libraries were built for ABI {manifest.get('abi_version')}",
                  "reinstall the package from one wheel (pip install --force-reinstall), or "
                  "rebuild it with one cuvil version")
        return False
    return True


def _libraries_intact(folder: Path, manifest: dict[str, Any], found: Diagnosis) -> bool:
    intact = True
    for model in manifest["models"]:
        path = folder / model["library"]
        try:
            data = path.read_bytes()
        except OSError:
            found.bad(f"model {model['name']}: its library {path.name} is missing",
                      "reinstall the package: pip install --force-reinstall <the wheel>")
            intact = False
            continue
        try:
            if is_macho(data):
                parse_macho(data, path.name)
            elif is_pe(data):
                read_pe(data)
            else:
                read_elf(data)
        except CheckError as exc:
            found.bad(f"model {model['name']}: its library {path.name} is truncated or damaged "
                      f"({exc})", "reinstall the package: pip install --force-reinstall <the wheel>")
            intact = False
    if intact:
        found.good("every library is present and readable")
    return intact


def _host() -> tuple[str, str]:
    system = {"Linux": "linux", "Darwin": "macos", "Windows": "windows"}.get(
        platform.system(), platform.system().lower())
    return system, _HOST_ARCHES.get(platform.machine().lower(), platform.machine())


def _for_this_machine(manifest: dict[str, Any], tag: str | None, folder: Path, found: Diagnosis) -> bool:
    host_os, host_arch = _host()
    target = str(manifest.get("target", ""))
    want_arch, _, want_os = target.partition("-")
    want_os = want_os.split("-")[0]  # x86_64-linux-musl: linux
    arches = {"universal2": {"x86_64", "aarch64"}, "arm64": {"aarch64"}}.get(want_arch, {want_arch})
    if tag is not None and tag_os(tag) is not None:
        want_os, arches = tag_os(tag) or want_os, set(tag_arches(tag) or arches)
        arches = {_HOST_ARCHES.get(a, a) for a in arches}
    here = f"this machine is {host_arch} {host_os}"
    if want_os != host_os or host_arch not in arches:
        found.bad(f"built for {target}{f' ({tag})' if tag else ''}; {here}",
                  f"install the wheel built for this machine (pip picks it by its tag), or build "
                  f"one: pip wheel . on this machine, or -C target={host_arch}-{host_os} elsewhere")
        return False
    if host_os == "linux":
        needed = manylinux_glibc(tag) if tag else _glibc_needed(folder, manifest)
        have = _host_glibc()
        if have is not None and ((tag and tag_libc(tag) == "musl") or target.endswith("-musl")):
            found.bad(f"built for {target}{f' ({tag})' if tag else ''}, whose libraries need "
                      f"musl; this system's C library is glibc {have[0]}.{have[1]}",
                      "install the manylinux wheel of the package (pip picks it by its tag), "
                      f"or build one: -C target={host_arch}-linux")
            return False
        if needed and have is None:
            found.bad(f"the libraries need glibc {needed[0]}.{needed[1]}, and this system has "
                      "none (musl?)", "build for musllinux, or use a glibc-based system")
            return False
        if needed and have is not None and have < needed:
            found.bad(f"the libraries need glibc {needed[0]}.{needed[1]}; this system has "
                      f"{have[0]}.{have[1]}", "build on (or for) an older glibc, or upgrade the "
                      "system")
            return False
    if host_os == "macos" and tag:
        oldest = macos_version(tag)
        release = tuple(int(p) for p in (platform.mac_ver()[0] or "0").split(".")[:2])
        if oldest and release < oldest:
            found.bad(f"the wheel needs macOS {oldest[0]}.{oldest[1]}; this is macOS "
                      f"{'.'.join(map(str, release))}",
                      "build with an older deployment target (MACOSX_DEPLOYMENT_TARGET)")
            return False
    found.good(f"built for {target}; {here}")
    return True


def _glibc_needed(folder: Path, manifest: dict[str, Any]) -> tuple[int, int] | None:
    newest: tuple[int, ...] = ()
    for model in manifest["models"]:
        data = (folder / model["library"]).read_bytes()
        if data[:4] == b"\x7fELF":
            versions = [v for v, _ in read_elf(data).glibc_versions()]
            newest = max([newest, *versions])
    return (newest[0], newest[1] if len(newest) > 1 else 0) if newest else None


def _host_glibc() -> tuple[int, int] | None:
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return None
    m = re.match(r"glibc (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


# loads the package from a copy of its folder and calls each model once on zeros. "strict"
# (the doctor) imports the package itself; "lenient" (the load test, also run inside isolated
# builds, where a mixed project's own imports may be missing) loads the models through the
# package's runtime module alone, and reports a call that raises instead of failing
_PROBE = """
import importlib, importlib.util, os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
if sys.argv[3] == "lenient":
    folder = os.path.join(sys.argv[1], sys.argv[2])
    runtime_file = os.path.join(folder, "_cuvil_runtime.py")
    spec = importlib.util.spec_from_file_location("_cuvil_load_test", runtime_file)
    runtime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runtime)
    models = runtime.load_models(folder)
else:
    package = importlib.import_module(sys.argv[2])
    models = {name: getattr(package, name) for name in sys.argv[4:]}
for name in sys.argv[4:]:
    model = models[name]
    feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], i.dtype)
             for i in model.inputs}
    try:
        model.run(feeds)
    except Exception as exc:
        if sys.argv[3] != "lenient":
            raise
        print("raised", name, type(exc).__name__, flush=True)
        continue
    print("ran", name, flush=True)
"""


def _runs_here(folder: Path, manifest: dict[str, Any], found: Diagnosis,
               calls_must_succeed: bool = True) -> None:
    names = [m["name"] for m in manifest["models"]]
    package = str(manifest.get("package", folder.name))
    mode = "strict" if calls_must_succeed else "lenient"
    with tempfile.TemporaryDirectory(prefix="cuvil-doctor-") as tmp:
        shutil.copytree(folder, Path(tmp) / package)
        # the load test keeps PYTHONPATH: inside an isolated build (pip's) it is how this
        # interpreter finds the build's packages, numpy among them
        dropped = ("PYTHONPATH", "CUVIL_PROFILE") if calls_must_succeed else ("CUVIL_PROFILE",)
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        try:
            done = subprocess.run([sys.executable, "-c", _PROBE, tmp, package, mode, *names],
                                  env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            found.bad("loading and calling the models took over 5 minutes", "")
            return
    if done.returncode == 0:
        raised = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("raised ")]
        found.good(f"every model loads and runs here ({', '.join(names)})" if not raised else
                   f"every model loads here ({', '.join(names)}); on inputs of zeros "
                   + ", ".join(f"{n} raised {e}" for n, e, *_ in raised))
        return
    if done.returncode == -signal.SIGILL:
        found.bad("the library uses instructions this CPU does not have: the process died of "
                  "SIGILL on the first call",
                  "rebuild for an older CPU (-C cpu=x86-64 on x86_64), or run on a newer machine")
        return
    if done.returncode < 0:
        found.bad(f"loading or calling a model killed the process "
                  f"({signal.Signals(-done.returncode).name})",
                  "report it with the wheel: a cuvil library must never crash")
        return
    last = [line for line in done.stderr.strip().splitlines() if line.strip()]
    message = last[-1] if last else f"exit status {done.returncode}"
    found.bad(f"loading or calling a model fails: {message}", _fix_for(message))


def _fix_for(message: str) -> str:
    if "needs CPU features this machine lacks" in message:
        return "rebuild for a lower CPU (-C cpu=x86-64 on x86_64), or run on a machine with them"
    if "ABI checksum" in message:
        return "reinstall the package from one wheel: its libraries and manifest come from different builds"
    if "GLIBC" in message:
        return "build on (or for) an older glibc, or upgrade the system"
    if "No module named 'numpy'" in message:
        return "install numpy, the packages' one runtime dependency"
    return "rebuild and reinstall the package; if it persists, report it with the wheel"
