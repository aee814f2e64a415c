"""Generated documentation stays in step with the code it is generated from."""

from __future__ import annotations

import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ops_table_is_current() -> None:
    render = runpy.run_path(str(REPO / "scripts" / "gen_ops_docs.py"))["render"]
    current = (REPO / "docs" / "ops.md").read_text(encoding="utf-8")
    assert current == render(), "docs/ops.md is stale: run python scripts/gen_ops_docs.py"


def test_ops_table_lists_every_operator_of_the_first_slice() -> None:
    text = (REPO / "docs" / "ops.md").read_text(encoding="utf-8")
    for op in ("Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Softmax",
               "Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "BatchNormalization",
               "Flatten", "Reshape", "Transpose", "Concat", "Clip", "Identity", "Constant",
               "Dropout"):
        assert f"| {op} |" in text, op


def test_targets_table_is_current() -> None:
    render = runpy.run_path(str(REPO / "scripts" / "gen_targets_docs.py"))["render"]
    current = (REPO / "docs" / "targets.md").read_text(encoding="utf-8")
    assert current == render(), "docs/targets.md is stale: run python scripts/gen_targets_docs.py"
