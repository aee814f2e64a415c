"""Graph-level fuzzing: small valid models with wrong attributes, dangling names, cycles,
duplicate outputs, zero and huge dims, wrong dtypes, missing initializers and odd opsets.
Every mutant either compiles and matches onnxruntime on random inputs, or raises a CuvilError;
compiles run in a child process, so a crash fails the example instead of the test run."""

from __future__ import annotations

import pytest
from conftest import budget
from fuzz_check import check
from fuzz_seeds import MUTATIONS, SEEDS, mutated
from hypothesis import given, settings
from hypothesis import strategies as st

mutation = st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 2**16 - 1),
                     st.integers(0, 2**16 - 1))


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_every_seed_compiles_and_matches_onnxruntime(worker, seed: str) -> None:
    assert check(worker, "compile_and_compare", mutated(seed, []))[0] == "match"


@settings(max_examples=budget(120))
@given(seed=st.sampled_from(sorted(SEEDS)), mutations=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_graphs_compile_and_match_or_raise_cuvil_errors(worker, seed: str,
                                                                mutations: list) -> None:
    check(worker, "compile_and_compare", mutated(seed, mutations))
