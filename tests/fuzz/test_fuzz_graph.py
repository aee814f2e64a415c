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


# findings of the fuzzer: models onnxruntime refuses that cuvil compiled; now refused
FINDINGS = {
    # an If branch's output declared with another dtype than it computes (also Loop bodies)
    "If branch output dtype": ("if_else", [("dtype", 39671, 17448)]),
    # a Loop body listing one output twice
    "Loop body output twice": ("loop", [("duplicate_output", 27547, 8176)]),
    # two opset imports for the default domain (17 and 99)
    "two default-domain opsets": ("elementwise", [("opset", 65136, 64057)]),
    # a Concat input that is the empty name (an absent optional input, which Concat has not)
    "Concat empty input": ("reshape_transpose", [("op_type", 34529, 27532),
                                                 ("dangling_input", 27458, 53151)]),
}


@pytest.mark.parametrize(("seed", "mutations"), FINDINGS.values(), ids=FINDINGS.keys())
def test_findings_are_refused(worker, seed: str, mutations: list) -> None:
    outcome, detail = check(worker, "compile_and_compare", mutated(seed, mutations))
    assert (outcome, detail.split(":")[0]) == ("refused", "ModelError")


@pytest.mark.slow
@settings(max_examples=budget(200))
@given(seed=st.sampled_from(sorted(SEEDS)), mutations=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_graphs_compile_and_match_or_raise_cuvil_errors(worker, seed: str,
                                                                mutations: list) -> None:
    check(worker, "compile_and_compare", mutated(seed, mutations))
