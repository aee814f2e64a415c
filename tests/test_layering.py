"""The part order of docs/architecture.md holds: every import in cuvil/ (module-level,
function-level and TYPE_CHECKING ones alike) reaches only its own part or parts before it, and
never another part's private module or name. What generated wheels ship imports only the
standard library and numpy.

`PARTS` is the rule table; docs/architecture.md must list the same parts, in the same order,
with the same paths.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "cuvil"

#: (part, paths it owns) from the bottom up: a part may import itself and the parts above it in
#: this list. A file belongs to the part with the longest path that contains it.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("runtime", ("cuvil/runtime/",)),
    ("errors", ("cuvil/errors.py",)),
    ("config", ("cuvil/config.py",)),
    ("toolchains", ("cuvil/toolchains/",)),
    ("ir", ("cuvil/compiler/ir.py", "cuvil/compiler/symbolic.py", "cuvil/compiler/memory.py",
            "cuvil/compiler/verify.py")),
    ("kernels", ("cuvil/compiler/kernels/",)),
    ("ops", ("cuvil/compiler/ops/",)),
    ("frontend", ("cuvil/compiler/frontend/",)),
    ("passes", ("cuvil/compiler/passes/",)),
    ("codegen", ("cuvil/compiler/codegen/",)),
    ("driver", ("cuvil/compiler/driver.py", "cuvil/compiler/llvm_jobs.py")),
    ("api", ("cuvil/__init__.py", "cuvil/onnx_backend.py")),
    ("check", ("cuvil/check/",)),
    ("backend", ("cuvil/build_backend/",)),
    ("cli", ("cuvil/cli.py", "cuvil/__main__.py", "cuvil/scaffold.py", "cuvil/progress.py")),
]
RANK = {name: i for i, (name, _) in enumerate(PARTS)}


def part_of(path: str) -> str | None:
    """The part owning repository path `path` (``cuvil/compiler/ops/conv.py``), or None."""
    best: tuple[int, str] | None = None
    for name, paths in PARTS:
        for p in paths:
            if (path == p or (p.endswith("/") and path.startswith(p))) and (
                    best is None or len(p) > best[0]):
                best = (len(p), name)
    return best[1] if best else None


def module_path(module: str, root: Path = REPO) -> str | None:
    """The repository path of module `module` (``cuvil.x.y``), or None if it is no module."""
    base = Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if (root / candidate).is_file():
            return candidate.as_posix()
    return None


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    importer: str
    imported: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported} ({self.what})"


def _imports(tree: ast.AST, path: str) -> list[tuple[int, str, str | None]]:
    """(line, module, imported name or None) for every import in `tree`, relative ones resolved
    against `path`; `from pkg import mod` names the module pkg.mod when that is one."""
    package = Path(path).parent.parts  # a module's package; an __init__.py's own package
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for a in node.names:
                sub = f"{module}.{a.name}"
                if module_path(sub) is not None:
                    found.append((node.lineno, sub, None))
                else:
                    found.append((node.lineno, module, a.name))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(path: str, source: str) -> list[Violation]:
    """Every import in `source` (the text of repository file `path`) against the part order."""
    importer = part_of(path)
    assert importer is not None, f"{path} belongs to no part: add it to PARTS in {__file__}"
    out = []
    for line, module, name in _imports(ast.parse(source, path), path):
        if module != "cuvil" and not module.startswith("cuvil."):
            continue
        target = module_path(module)
        assert target is not None, f"{path}:{line}: {module} is not a module of cuvil"
        imported = part_of(target)
        assert imported is not None, f"{target} belongs to no part: add it to PARTS in {__file__}"
        if RANK[imported] > RANK[importer]:
            out.append(Violation(path, line, importer, imported,
                                 f"{module}: a part imports only itself and the parts before it"))
        elif imported != importer:
            hidden = [p for p in module.split(".") if _private(p)] + (
                [name] if name and _private(name) else [])
            if hidden:
                out.append(Violation(path, line, importer, imported,
                                     f"{module}{'.' + name if name else ''}: private to "
                                     f"{imported}; import what its package exports"))
    # one line per import statement and module, in file order
    return sorted({str(v): v for v in out}.values(), key=lambda v: (v.line, v.imported, v.what))


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _is_empty(tree: ast.Module) -> bool:
    """Only a docstring, if anything: an empty package marker that imports nothing."""
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in tree.body)


# -- the checker itself -------------------------------------------------------------------------


def test_the_checker_names_file_line_and_parts_of_an_import_against_the_order() -> None:
    source = ("from cuvil.compiler.ir import Graph\n"
              "def f():\n"
              "    from typing import TYPE_CHECKING\n"
              "    if TYPE_CHECKING:\n"
              "        from cuvil.compiler.passes.plan_memory import plan_memory\n")
    found = violations("cuvil/compiler/ops/control.py", source)
    assert [(v.path, v.line, v.importer, v.imported) for v in found] == [
        ("cuvil/compiler/ops/control.py", 5, "ops", "passes")]
    assert "cuvil/compiler/ops/control.py:5: ops imports passes" in str(found[0])


def test_the_checker_resolves_relative_and_submodule_imports() -> None:
    # `from .. import passes` in ops is cuvil.compiler.passes; `import cuvil.cli` is the cli
    found = violations("cuvil/compiler/ops/conv.py", "from .. import passes\nimport cuvil.cli\n")
    assert [(v.line, v.imported) for v in found] == [(1, "passes"), (2, "cli")]
    assert violations("cuvil/compiler/ops/conv.py", "from . import _window\n") == []


def test_the_checker_refuses_another_parts_private_module_or_name() -> None:
    found = violations("cuvil/cli.py", "from cuvil.check._archive import read_wheel\n"
                                       "from cuvil.toolchains import _targets\n"
                                       "from cuvil.toolchains.zig import _zig_target\n"
                                       "from cuvil.build_backend import _reproducible\n")
    assert [v.line for v in found] == [1, 2, 3, 4]
    assert all("private to" in v.what for v in found)
    # inside its own part a private module is fine, and dunders are not private
    assert violations("cuvil/toolchains/zig.py", "from cuvil.toolchains._targets import Arch\n") == []
    assert violations("cuvil/build_backend/_wheel.py", "from cuvil import __version__\n") == []


# -- the tree -----------------------------------------------------------------------------------


def test_every_module_belongs_to_a_part_and_every_path_of_the_table_exists() -> None:
    for path in _modules():
        rel = path.relative_to(REPO).as_posix()
        if part_of(rel) is None:
            assert _is_empty(ast.parse(path.read_text(encoding="utf-8"))), \
                f"{rel} belongs to no part: add it to PARTS in {__file__}"
    for name, paths in PARTS:
        for p in paths:
            assert (REPO / p).exists(), f"part {name}: {p} does not exist"


def test_every_import_follows_the_part_order() -> None:
    found = []
    for path in _modules():
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if part_of(rel) is not None or not _is_empty(tree):
            found += violations(rel, path.read_text(encoding="utf-8"))
    assert not found, "imports against docs/architecture.md:\n" + "\n".join(map(str, found))


# -- what wheels ship ---------------------------------------------------------------------------


def _foreign_imports(source: str, name: str) -> list[str]:
    """Top-level modules `source` imports that are neither the standard library nor numpy
    (relative imports, of the generated package's own modules, are allowed)."""
    # _sha2: the standard library's SHA-256 from CPython 3.12 on (_sha256 before); the list
    # is this interpreter's, and the loader tries both
    allowed = set(sys.stdlib_module_names) | {"numpy", "__future__", "_sha2"}
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append(node.module or "")
    return sorted({m for m in found if m.split(".")[0] not in allowed})


def test_the_shipped_loader_imports_only_the_standard_library_and_numpy() -> None:
    from cuvil.runtime import LOADER_SOURCE, SESSION_SOURCE

    assert LOADER_SOURCE == PACKAGE / "runtime" / "_loader.py"
    assert SESSION_SOURCE == PACKAGE / "runtime" / "_cuvil_session.py"
    # the backend copies exactly these files into every package
    package_source = (PACKAGE / "build_backend" / "_package.py").read_text(encoding="utf-8")
    assert "LOADER_SOURCE.read_bytes()" in package_source
    assert "SESSION_SOURCE.read_bytes()" in package_source
    for source in (LOADER_SOURCE, SESSION_SOURCE):
        assert _foreign_imports(source.read_text(encoding="utf-8"), source.name) == []


def test_the_generated_package_imports_only_the_standard_library_numpy_and_its_loader() -> None:
    from cuvil.build_backend._package import render_init, render_stub

    sig = {"name": "m", "inputs": [{"name": "x", "dtype": "float32", "shape": ["n", 3]}],
           "outputs": [{"name": "y", "dtype": "float32", "shape": ["n", 3]}]}
    assert _foreign_imports(render_init("pkg", [sig], "x86_64-linux"), "__init__.py") == []
    assert _foreign_imports(render_stub([sig]), "__init__.pyi") == []


def test_the_foreign_import_check_can_fail() -> None:
    assert _foreign_imports("import numpy as np\nfrom onnx import helper\nimport cuvil.errors\n"
                            "from . import _cuvil_runtime\n", "x.py") == ["cuvil.errors", "onnx"]


# -- the documentation --------------------------------------------------------------------------


def _documented_parts() -> list[tuple[str, tuple[str, ...]]]:
    """The rows of docs/architecture.md's order table: `| n | part | `path`, ... | owns |`."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rows.append((cells[1], tuple(re.findall(r"`([^`]+)`", cells[2]))))
    return rows


def test_docs_list_the_parts_of_the_rule_table_in_its_order() -> None:
    assert _documented_parts() == PARTS, (
        "docs/architecture.md's order table and PARTS in tests/test_layering.py differ")


def test_readme_and_architecture_name_existing_paths() -> None:
    for name in ("README.md", "docs/architecture.md"):
        text = (REPO / name).read_text(encoding="utf-8")
        for path in re.findall(r"`(cuvil/[^`*]*)`", text):
            assert (REPO / path).exists(), f"{name} names {path}, which does not exist"
