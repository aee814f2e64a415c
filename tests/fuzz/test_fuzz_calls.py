"""The call boundary, fuzzed: dtypes, ranks, shapes, strides (transposed, reversed, strided
views), byte order, read-only, misaligned and broadcast arrays, NaN/inf, zero-size batches,
lists, scalars, missing and extra names, and `out=` arrays of the wrong shape or dtype,
read-only, strided or aliasing an input. Every call either returns onnxruntime's outputs for
the inputs as converted to the model's dtypes, or raises a ValueError/TypeError that names an
input or output; a valid call is never refused. Calls run in a child process (see
fuzz_worker.py), which compiles each model once."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import budget
from fuzz_calls import MODELS
from fuzz_check import check
from fuzz_strategies import call_spec, valid_spec
from hypothesis import given, settings


@pytest.mark.parametrize(("key", "batch"), [*((k, 3) for k in sorted(MODELS)), ("symbolic", 0)])
def test_a_plain_call_matches_onnxruntime(worker, key: str, batch: int) -> None:
    assert check(worker, "call", key, valid_spec(key, batch))[0] == "match"


@pytest.mark.parametrize("key", sorted(MODELS))
def test_a_call_with_a_wrong_dtype_is_refused(worker, key: str) -> None:
    spec = valid_spec(key, 2)
    name = next(iter(spec["inputs"]))
    spec["inputs"][name] = ("array", "float64", *spec["inputs"][name][2:])
    assert check(worker, "call", key, spec)[0] == "refused"


@settings(max_examples=budget(500))
@given(spec=call_spec("static"))
def test_fuzzed_calls_to_a_static_model(worker, spec: dict[str, Any]) -> None:
    check(worker, "call", "static", spec)


@settings(max_examples=budget(500))
@given(spec=call_spec("symbolic"))
def test_fuzzed_calls_to_a_symbolic_batch_model(worker, spec: dict[str, Any]) -> None:
    check(worker, "call", "symbolic", spec)

