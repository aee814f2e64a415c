"""Graph-level fuzzing: small valid models with wrong attributes, dangling names, cycles,
duplicate outputs, zero and huge dims, wrong dtypes, missing initializers and odd opsets.
Every mutant either compiles and matches onnxruntime on random inputs, or raises a CuvilError;
compiles run in a child process, so a crash fails the example instead of the test run."""

from __future__ import annotations

import pytest
from conftest import budget
from fuzz_check import check
from fuzz_seeds import MUTATIONS, SEEDS, mutated
from hypothesis import example, given, settings
from hypothesis import strategies as st

mutation = st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 2**16 - 1),
                     st.integers(0, 2**16 - 1))


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_every_seed_compiles_and_matches_onnxruntime(worker, seed: str) -> None:
    assert check(worker, "compile_and_compare", mutated(seed, []))[0] == "match"


# findings of the fuzzer, kept as cases: models onnxruntime refuses that cuvil compiles
# an If branch's output declared with another dtype than it computes (also Loop bodies)
@example(seed="if_else", mutations=[("dtype", 39671, 17448)])
# a Loop body listing one output twice
@example(seed="loop", mutations=[("duplicate_output", 27547, 8176)])
# two opset imports for the default domain (17 and 99)
@example(seed="elementwise", mutations=[("opset", 65136, 64057)])
# a Concat input that is the empty name (an absent optional input, which Concat has not)
@example(seed="reshape_transpose", mutations=[("op_type", 34529, 27532),
                                              ("dangling_input", 27458, 53151)])
@settings(max_examples=budget(200))
@given(seed=st.sampled_from(sorted(SEEDS)), mutations=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_graphs_compile_and_match_or_raise_cuvil_errors(worker, seed: str,
                                                                mutations: list) -> None:
    check(worker, "compile_and_compare", mutated(seed, mutations))
