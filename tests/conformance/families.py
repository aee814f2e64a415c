"""The operator families that onnx's node tests barely reach: the classical-ML domain
(ai.onnx.ml) and onnxruntime's contrib operators (com.microsoft). What compiles comes from
cuvil's op registry (and, for ai.onnx.ml, onnx's schemas of the domain); which tests cover an
operator comes from the family's test files: a file covers an operator when one of its string
constants (a node built with onnx.helper, an `ops=` list the test checks against the
converted model, a docstring) names it. So the report's section needs no conformance run, and
the same sources give the same text.
"""

from __future__ import annotations

import ast
import collections
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx.defs

from cuvil.compiler.ops import registered_ops

__all__ = ["FAMILIES", "Family", "covering_files", "render", "trained_classes"]

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class Family:
    domain: str
    title: str
    intro: str
    #: glob patterns (from the repository root) of the test files that test the family
    tests: tuple[str, ...]
    #: onnx's node tests of the family are named with this prefix ("" if onnx has none)
    node_prefix: str = ""
    #: operators the family's tools write that onnx has no schema of (listed when missing)
    written: tuple[str, ...] = ()


FAMILIES: tuple[Family, ...] = (
    Family(
        "ai.onnx.ml",
        "Classical ML (ai.onnx.ml)",
        "The operators scikit-learn's converters (skl2onnx) and onnxmltools (LightGBM, XGBoost) "
        "write. The tests train models on scikit-learn's bundled data sets, convert them and "
        "compare cuvil with onnxruntime and with the framework itself (labels equal, "
        "probabilities within 1e-5); onnx.helper graphs cover the node modes, aggregates and "
        "transforms converters do not write. How each operator compiles, and what is refused, "
        "is in `ml.md`.",
        ("tests/ops/test_ml_*.py", "tests/test_example_sklearn.py"),
        node_prefix="test_ai_onnx_ml_",
    ),
    Family(
        "com.microsoft",
        "onnxruntime contrib operators (com.microsoft)",
        "The operators onnxruntime's transformer optimizer writes into BERT-style models, "
        "compiled as graphs of standard operators. The tests run the optimizer on an encoder "
        "built in the tests, check that it fused, and compare cuvil with onnxruntime on the "
        "optimized model, then on single-node models for the attributes and input forms the "
        "optimizer does not write (against numpy for BiasSoftmax and BiasAdd, which have no "
        "CPU kernel in onnxruntime). The quantization ones that onnxruntime's quantizers and "
        "its session optimizer write (quantize_dynamic, quantize_static in QOperator format) "
        "are compiled the same way, their integer products on the int8 kernel, and compared "
        "with onnxruntime on models those tools made. So are the ops of decoder-only language "
        "models: MatMulNBits as MatMulNBitsQuantizer writes it, and onnxruntime-genai's "
        "GroupQueryAttention, RotaryEmbedding and SimplifiedLayerNormalization (the last in the "
        "default domain), compared with onnxruntime on single-node models; a GPT-style model "
        "exported from torch (as exported, after the transformer optimizer, int4) and a "
        "Llama-style model in the builder's form (float32, int4) generate onnxruntime's tokens "
        "(`tests/test_decoder.py`). What is refused is in `ops.md`.",
        ("tests/ops/test_contrib.py", "tests/ops/test_contrib_quantized.py",
         "tests/ops/test_contrib_decoder.py"),
        # onnxruntime's quantizers (quantize_dynamic, quantize_static in QOperator format)
        written=("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention", "QGemm",
                 "QLinearAdd", "QLinearAveragePool", "QLinearConcat", "QLinearGlobalAveragePool",
                 "QLinearLeakyRelu", "QLinearMul", "QLinearSigmoid", "QLinearSoftmax"),
    ),
)


def _test_files(family: Family) -> list[Path]:
    return sorted({p for pattern in family.tests for p in ROOT.glob(pattern)})


def _strings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def covering_files(family: Family) -> dict[str, list[str]]:
    """Operator -> the family's test files (relative paths) whose string constants name it."""
    found: dict[str, list[str]] = collections.defaultdict(list)
    for path in _test_files(family):
        words = {w for s in _strings(path) for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", s)}
        for op in sorted(words):
            found[op].append(path.relative_to(ROOT).as_posix())
    return found


def trained_classes(family: Family) -> list[str]:
    """The estimator classes the family's tests train: CamelCase names imported from
    scikit-learn, and LGBM*/XGB* classes taken from lightgbm and xgboost."""
    names: set[str] = set()
    for path in _test_files(family):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sklearn."):
                names.update(a.name for a in node.names if a.name[:1].isupper())
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in ("lightgbm", "xgboost") and node.attr[:1].isupper()):
                names.add(node.attr)
    return sorted(names)


def _operators(family: Family) -> list[tuple[str, str]]:
    """(operator, how it compiles) for the registry's operators of the family's domain, then
    onnx's schemas of the domain and the family's `written` operators it has none of."""
    domain = family.domain
    rows: dict[str, str] = {}
    for (d, op_type), impls in registered_ops().items():
        if d == domain:
            latest = impls[-1]
            module = type(latest).__module__.rsplit(".", 1)[-1]
            since = ", ".join(str(i.since) for i in impls)
            rows[op_type] = (f"refused: {latest.not_compiled}" if latest.not_compiled
                             else f"yes (opset {since}, `{module}`)")
    for schema in onnx.defs.get_all_schemas():
        if schema.domain == domain and schema.name not in rows and not schema.deprecated:
            rows[schema.name] = "no"
    for op_type in family.written:
        rows.setdefault(op_type, "no")
    return sorted(rows.items(), key=lambda kv: kv[0].lower())


def _node_results(family: Family, results: Iterable[dict[str, Any]] | None) -> dict[str, collections.Counter]:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    if family.node_prefix:
        for r in results or ():
            if r["kind"] == "node" and r["name"].startswith(family.node_prefix):
                counts[r["op"]][r["status"]] += 1
    return counts


def render(results: Iterable[dict[str, Any]] | None = None) -> list[str]:
    """The report's section on these families (markdown lines). With a run's `results`, the
    ai.onnx.ml rows also count onnx's node tests of each operator."""
    results = list(results or [])
    md = ["## Operator families beyond the node tests", "",
          ("onnx's node tests hold a handful of ai.onnx.ml cases and no com.microsoft ones, so "
           "these families are tested by cuvil's own tests against onnxruntime. The tables come "
           "from the op registry and the test files (`tests/conformance/families.py`), not from "
           "a conformance run: *tests* lists the test files that name each operator."), ""]
    for family in FAMILIES:
        files = covering_files(family)
        nodes = _node_results(family, results)
        ops = _operators(family)
        compiled = sum(1 for _, how in ops if how.startswith("yes"))
        md += [f"### {family.title}", "", family.intro, "",
               f"{compiled} of the {len(ops)} operators listed compile.", ""]
        node_column = bool(family.node_prefix)
        md.append("| operator | compiles | " + ("onnx node tests (pass / fail / out of scope) | "
                                                if node_column else "") + "tests |")
        md.append("| --- | --- | " + ("---: | " if node_column else "") + "--- |")
        for op, how in ops:
            c = nodes.get(op)
            cell = f"{c['pass']} / {c['fail']} / {c['out-of-scope']} | " if c else "- | "
            tests = ", ".join(f"`{f}`" for f in files.get(op, [])) or "-"
            md.append(f"| {op} | {how} | " + (cell if node_column else "") + f"{tests} |")
        md.append("")
        classes = trained_classes(family)
        if classes:
            md += ["Trained models and pipeline steps the tests convert: " + ", ".join(classes) + ".",
                   ""]
        md += ["Test files: " + ", ".join(f"`{p.relative_to(ROOT).as_posix()}` "
                                          f"({_tests(p)})"
                                          for p in _test_files(family)) + ".", ""]
    return md


def _tests(path: Path) -> str:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    n = sum(1 for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_"))
    return f"{n} test function" + ("" if n == 1 else "s")
