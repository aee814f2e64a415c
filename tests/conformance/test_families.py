"""The report's section on ai.onnx.ml and com.microsoft (tests/conformance/families.py): every
operator cuvil compiles in these families is named by one of the family's test files, and the
section renders from the sources alone, the same each time."""

from __future__ import annotations

from conformance import families
from cuvil.compiler.ops import registered_ops


def test_every_compiled_operator_of_a_family_is_named_by_its_tests() -> None:
    for family in families.FAMILIES:
        covered = families.covering_files(family)
        compiled = [op for (domain, op), impls in registered_ops().items()
                    if domain == family.domain and not impls[-1].not_compiled]
        assert compiled, family.domain
        untested = sorted(op for op in compiled if not covered.get(op))
        assert not untested, f"{family.domain}: no test file in {family.tests} names {untested}"


def test_section_renders_without_a_run_and_counts_node_tests_when_given() -> None:
    section = families.render()
    assert section == families.render()
    text = "\n".join(section)
    assert "| TreeEnsembleClassifier | yes (opset 1, `ml_trees`) | - | `tests/ops/test_ml_sklearn.py`" in text
    assert "| ZipMap | refused: " in text
    assert "| CategoryMapper | no |" in text
    assert "| SkipLayerNormalization | yes (opset 1, `contrib`) | `tests/ops/test_contrib.py` |" in text
    results = [{"kind": "node", "name": f"test_ai_onnx_ml_binarizer{i}", "op": "Binarizer",
                "status": status} for i, status in enumerate(["pass", "pass", "fail"])]
    assert "| Binarizer | yes (opset 1, `ml_linear`) | 2 / 1 / 0 |" in "\n".join(families.render(results))
