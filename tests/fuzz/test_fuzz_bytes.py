"""Byte-level fuzzing: the seed models' files with flipped, overwritten, deleted, inserted and
repeated bytes, or truncated. Each either compiles and matches onnxruntime, or raises a
CuvilError; compiles run in a child process, so a crash fails the example, not the test run."""

from __future__ import annotations

import pytest
from conftest import budget
from fuzz_check import check
from fuzz_seeds import BYTE_MUTATIONS, SEEDS, mutated, mutated_bytes
from hypothesis import example, given, settings
from hypothesis import strategies as st

SEED_BYTES = {name: mutated(name, []) for name in SEEDS}
edit = st.tuples(st.sampled_from(BYTE_MUTATIONS), st.integers(0, 2**20), st.integers(0, 2**16 - 1))


@pytest.mark.slow
# found by the fuzzer: a name that is not UTF-8 (a dim's, an input's) gave a TypeError
@example(seed="elementwise", edits=[("flip", 967428, 25799)])
@example(seed="elementwise", edits=[("flip", 9, 7)])
# a trip count of 2**31 + 3: compiles, is not run (it would take minutes in both runtimes)
@example(seed="loop", edits=[("flip", 715448, 42447)])
@settings(max_examples=budget(300))
@given(seed=st.sampled_from(sorted(SEEDS)), edits=st.lists(edit, min_size=1, max_size=4))
def test_mutated_files_compile_and_match_or_raise_cuvil_errors(worker, seed: str, edits: list) -> None:
    check(worker, "compile_and_compare", mutated_bytes(SEED_BYTES[seed], edits))
