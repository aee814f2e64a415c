"""The import hook of an editable install: it finds the package and rebuilds it when stale.

`render_finder` (`_editable.py`) copies this module's source into site-packages as
`_cuvil_editable_<dist>.py`, which the install's `.pth` file imports at start-up; so it imports
nothing but the standard library (cuvil may be absent where the package is imported), and the
backend uses the same functions to write the record the hook reads.

The record (`RECORD` in the build folder, written with each build) lists the inputs the
models were built from: the [tool.cuvil] table and every file a model's build reads, each
with its mtime, size and SHA-256. At the package's first import in a process the hook stats
them; only a file whose mtime or size differs is hashed, so an import where nothing changed
costs a few stats. What a change leads to is the `editable-rebuild` setting: "auto" calls
cuvil's `rebuild_editable` (whose fingerprint decides whether anything is compiled), "error"
raises ImportError naming what changed, "off" skips the check.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import time
from typing import Any

RECORD = ".cuvil-editable-inputs.json"
# the build's fingerprint, written last into the build folder (it marks it as cuvil's, too)
MARKER = ".cuvil-editable"
MODES = ("auto", "error", "off")
# the label of the [tool.cuvil] table in the record; any other entry is a file's bytes
TABLE = "[tool.cuvil]"
_ENV = "CUVIL_EDITABLE_REBUILD"


def table_digest(pyproject: str) -> str:
    """SHA-256 of the [tool.cuvil] table of `pyproject`: edits elsewhere in the file (the
    [project] table, comments) change nothing the models are built from."""
    with open(pyproject, "rb") as f:
        data = f.read()
    if sys.version_info >= (3, 11):
        import tomllib as toml
    else:
        try:
            import tomli as toml
        except ImportError:  # the whole file's bytes, then (cuvil needs tomli; this may not)
            return hashlib.sha256(data).hexdigest()
    try:
        table = toml.loads(data.decode("utf-8")).get("tool", {}).get("cuvil", {})
    except (ValueError, UnicodeDecodeError):  # broken TOML: a change the rebuild reports
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha256(json.dumps(table, sort_keys=True, default=str).encode()).hexdigest()


def _digest(label: str, path: str) -> str:
    if label == TABLE:
        return table_digest(path)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def snapshot(inputs: list[tuple[str, str]], mode: str) -> dict[str, Any]:
    """The record of (label, path) inputs: stat first, then hash, so that an edit made
    meanwhile shows as a changed mtime at the next import."""
    entries = []
    for label, path in inputs:
        st = os.stat(path)
        entries.append([label, path, st.st_mtime_ns, st.st_size, _digest(label, path)])
    return {"mode": mode, "inputs": entries}


def write_record(folder: str, record: dict[str, Any]) -> None:
    """Write `record` into `folder` atomically (a reader sees the old one or the new one)."""
    path = os.path.join(folder, RECORD)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(temporary, path)


def read_record(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, RECORD), encoding="utf-8") as f:
            record: dict[str, Any] = json.load(f)
            return record
    except (OSError, ValueError):
        return None


def changed_inputs(record: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
    """What changed since `record`, as "label (path)" texts; and when nothing did but some
    stats moved (a touch, a checkout of the same bytes), the record with the new stats, to
    spare the next imports the hashing. A stat is taken before its file is hashed, so an edit
    made meanwhile moves the mtime again."""
    changed, entries, moved = [], [], False
    for label, path, mtime, size, digest in record["inputs"]:
        try:
            st = os.stat(path)
        except OSError:
            changed.append(f"{label} ({path}, now missing)")
            continue
        entries.append([label, path, st.st_mtime_ns, st.st_size, digest])
        if (st.st_mtime_ns, st.st_size) == (mtime, size):
            continue
        moved = True
        try:
            now = _digest(label, path)
        except OSError:
            now = None
        if now != digest:
            changed.append(f"{label} ({path})")
    return changed, ({**record, "inputs": entries} if moved and not changed else None)


def _stamp(tree: str) -> str | None:
    try:
        with open(os.path.join(tree, MARKER), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


class CuvilEditableFinder:
    """First on sys.meta_path: at the package's first import, checks the build (`check`);
    for a mixed project, gives the package its two folders (source first, then build)."""

    def __init__(self, package: str, project: str, tree: str, folders: list[str] | None,
                 config_settings: dict[str, Any]) -> None:
        self.package, self.project, self.tree = package, project, tree
        self.folders, self.config_settings = folders, config_settings
        self.checked = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.package:
            return None  # submodules are found in the package's __path__
        if not self.checked:
            self.check()
            self.checked = True  # only once it passed: a failed check fails every import
        if self.folders is None:
            return None  # a models-only project: its build folder is on sys.path
        init = next((os.path.join(f, "__init__.py") for f in self.folders
                     if os.path.isfile(os.path.join(f, "__init__.py"))), None)
        if init is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=list(self.folders))

    def invalidate_caches(self) -> None:
        pass

    def check(self) -> None:
        env = os.environ.get(_ENV, "").strip()
        if env == "off":
            return
        record = read_record(self.tree)
        if record is None:
            raise ImportError(
                f"cuvil: the editable install of {self.package!r} has no build in {self.tree} "
                f"(deleted?); reinstall it: {self._command()}", name=self.package)
        mode = env or record.get("mode", "auto")
        if mode not in MODES:
            raise ImportError(f"cuvil: {_ENV}={mode!r} is not one of {', '.join(MODES)}",
                              name=self.package)
        if mode == "off":
            return
        changed, refreshed = changed_inputs(record)
        if not changed:
            if refreshed is not None:
                with contextlib.suppress(OSError):  # a read-only build folder: hash next time
                    write_record(self.tree, refreshed)
            return
        what = "; ".join(changed)
        if mode == "error":
            raise ImportError(
                f"cuvil: the editable install of {self.package!r} is out of date: {what} changed "
                f"since it was built. Rebuild it with {self._command()}, or set "
                f'editable-rebuild = "auto" in [tool.cuvil] to rebuild at import',
                name=self.package)
        self.rebuild(what)

    def rebuild(self, what: str) -> None:
        try:
            backend = importlib.import_module("cuvil.build_backend")
        except ImportError as error:
            raise ImportError(
                f"cuvil: {what} changed since the editable install of {self.package!r}, but "
                f"cuvil, which rebuilds it, is not installed in this environment "
                f"({sys.executable}): install it here (pip install cuvil), or rebuild with "
                f"{self._command()} where it is; {_ENV}=off imports the old build",
                name=self.package) from error
        print(f"cuvil: {what} changed since the editable install of {self.package!r}; "
              "rebuilding", file=sys.stderr, flush=True)
        start, before = time.perf_counter(), _stamp(self.tree)
        try:
            tree = backend.rebuild_editable(self.project, self.config_settings)
        except Exception as error:  # the previous build stays, but is not imported
            # cuvil's own errors say what and where: their traceback would only add noise
            ours = isinstance(error, importlib.import_module("cuvil.errors").CuvilError)
            raise ImportError(
                f"cuvil: rebuilding the editable install of {self.package!r} failed ({what} "
                f"changed): {error}\nThe previous build in {self.tree} is kept but not "
                f"imported; fix the project and import again, or set {_ENV}=off to import "
                f"the previous build", name=self.package) from (None if ours else error)
        if os.path.normcase(os.path.abspath(tree)) != os.path.normcase(self.tree):
            raise ImportError(
                f"cuvil: the editable install of {self.package!r} now builds into {tree}, not "
                f"{self.tree} (build-dir changed); reinstall it: {self._command()}",
                name=self.package)
        importlib.invalidate_caches()
        done = "rebuilt" if _stamp(self.tree) != before else "nothing to recompile: checked"
        print(f"cuvil: {done} {self.package!r} in {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)

    def _command(self) -> str:
        settings = "".join(f" -C {k}={v}" for k, values in sorted(self.config_settings.items())
                           for v in (values if isinstance(values, list) else [values]))
        return f"`cuvil develop {self.project}{settings}` (or `pip install -e {self.project}`)"


def install(package: str, project: str, tree: str, folders: list[str] | None,
            config_settings: dict[str, Any]) -> None:
    """Put the package's finder first on sys.meta_path, once."""
    if not any(type(f).__name__ == CuvilEditableFinder.__name__
               and getattr(f, "package", None) == package for f in sys.meta_path):
        sys.meta_path.insert(
            0, CuvilEditableFinder(package, project, tree, folders, config_settings))
