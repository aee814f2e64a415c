"""Hypothesis strategies for call specs (see fuzz_calls.py) of the two call-boundary models."""

from __future__ import annotations

from typing import Any

from fuzz_calls import CONTAINERS, LAYOUTS, OUT_KINDS, VALUES
from hypothesis import strategies as st

#: each model's inputs: name -> (dtype, shape with "N" for the batch)
SIGNATURES = {"static": {"pixels": ("float32", (2, 3, 4)), "scale": ("float32", (4,))},
              "symbolic": {"features": ("float32", ("N", 3)), "counts": ("int64", ("N",))}}
OUTPUTS = {"static": ["scaled", "total"], "symbolic": ["scores", "totals"]}
DTYPES = ["float32", "float64", "float16", "int64", "int32", "uint8", "bool"]


@st.composite
def input_spec(draw: Any, dtype: str, shape: tuple[Any, ...], batch: int) -> Any:
    """The right dtype, shape and container in any layout and with any values, or (one time
    in three) one thing wrong: missing, another dtype, container, rank or size."""
    wrong = draw(st.sampled_from(["nothing"] * 20 + ["missing", "dtype", "container", "bigger",
                                                     "rank+1", "rank-1", "zero"]))
    if wrong == "missing":
        return "missing"
    right = tuple(batch if d == "N" else d for d in shape)
    if wrong == "bigger" and right:
        right = (right[0] + 1, *right[1:])
    elif wrong == "rank+1":
        right = (1, *right)
    elif wrong == "rank-1":
        right = right[1:]
    elif wrong == "zero" and right:
        right = (0, *right[1:])
    if wrong == "dtype":
        dtype = draw(st.sampled_from(DTYPES))
    container = draw(st.sampled_from(CONTAINERS[1:])) if wrong == "container" else "array"
    return (container, dtype, right, draw(st.sampled_from(LAYOUTS)), draw(st.sampled_from(VALUES)))


@st.composite
def call_spec(draw: Any, key: str) -> dict[str, Any]:
    batch = draw(st.sampled_from([1, 2, 5, 0] if key == "symbolic" else [2]))
    outs = draw(st.none() | st.fixed_dictionaries(
        {n: st.sampled_from(["alloc"] * 8 + OUT_KINDS) for n in OUTPUTS[key]}))
    return {"form": draw(st.sampled_from(["positional", "keywords", "run"])),
            "inputs": {n: draw(input_spec(t, s, batch)) for n, (t, s) in SIGNATURES[key].items()},
            "extra": draw(st.integers(0, 14)) == 0, "out": outs,
            "seed": draw(st.integers(0, 2**16))}


def valid_spec(key: str, batch: int) -> dict[str, Any]:
    return {"form": "run", "extra": False, "out": None, "seed": 0,
            "inputs": {n: ("array", t, tuple(batch if d == "N" else d for d in s), "c", "normal")
                       for n, (t, s) in SIGNATURES[key].items()}}
