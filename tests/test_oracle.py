"""The oracle itself: a missing, extra or renamed output fails the comparison (it used to
pass silently, `zip` stopping at the shorter list)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from onnx import helper
from oracle import assert_matches_ort, make_model

X = np.arange(6, dtype=np.float32).reshape(2, 3)


def two_outputs():
    return make_model([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Abs", ["x"], ["b"])],
                      {"x": (np.float32, [2, 3])}, {"a": np.float32, "b": np.float32})


class Fake:
    """Stands in for a compiled model that returns `results` for outputs named `declared`."""

    def __init__(self, declared, results) -> None:
        self.outputs = [SimpleNamespace(name=n) for n in declared]
        self.results = results

    def run(self, feeds):
        return dict(self.results)


def test_right_outputs_pass() -> None:
    assert_matches_ort(two_outputs(), {"x": X}, compiled=Fake(["a", "b"], {"a": -X, "b": np.abs(X)}))


@pytest.mark.parametrize(("declared", "results"), [
    (["a"], {"a": -X}),  # b missing
    (["a", "b"], {"a": -X}),  # declared but not returned
    (["a", "b", "c"], {"a": -X, "b": np.abs(X), "c": X}),  # extra
    (["a", "c"], {"a": -X, "c": np.abs(X)}),  # renamed
], ids=["missing", "not-returned", "extra", "renamed"])
def test_wrong_outputs_fail(declared, results) -> None:
    with pytest.raises(AssertionError, match="outputs|returns"):
        assert_matches_ort(two_outputs(), {"x": X}, compiled=Fake(declared, results))


def test_wrong_values_fail() -> None:
    with pytest.raises(AssertionError):
        assert_matches_ort(two_outputs(), {"x": X}, compiled=Fake(["a", "b"], {"a": X, "b": X}))
