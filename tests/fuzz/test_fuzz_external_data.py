"""External-data fuzzing: seed models saved with their weights in one data file or one file per
tensor, with their `external_data` entries edited (offsets and lengths negative, huge, past the
end, unaligned, not numbers or missing; locations missing, folders, absolute, escaping, empty,
with NUL, control bytes or bytes not UTF-8, another tensor's file; wrong checksums; duplicate
keys; `data_location` flipped) and their data files truncated, extended, flipped, or replaced
by a FIFO, a folder or a symlink (out of the folder, to another file, to itself). Each either
compiles and matches onnxruntime reading the same folder, or raises a CuvilError naming the
model's file, a tensor or a node; and cuvil opens nothing outside the model's folder. Compiles
run in a child process.

Where onnxruntime refuses the folder (a Reshape's shape in external data, which its shape
inference cannot read; a key the ONNX spec does not define, which cuvil ignores), cuvil is
compared with onnxruntime running the bytes onnx's own reader finds (outcome "bytes-match").
One case has no such reference and counts as "ort-refuses": a Reshape's shape in a shared file
without a length, which cuvil reads at the tensor's size as onnxruntime does for every other
seed, and onnx's reader reads to the end of the file."""

from __future__ import annotations

import pytest
from conftest import budget
from fuzz_check import check
from fuzz_external import MUTATIONS, SEED_NAMES, mutated_folder
from hypothesis import example, given, settings
from hypothesis import strategies as st

mutation = st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 2**16 - 1),
                     st.integers(0, 2**16 - 1))


@pytest.mark.parametrize("seed", SEED_NAMES)
def test_every_seed_compiles_and_matches_onnxruntime(worker, seed: str) -> None:
    # onnxruntime's shape inference reads no Reshape shape from external data: that seed is
    # compared with onnxruntime running the bytes onnx's reader loads
    want = "bytes-match" if seed.startswith("reshape_transpose/") else "match"
    assert check(worker, "compile_folder_and_compare", mutated_folder(seed, []))[0] == want


@pytest.mark.slow
# found by the fuzzer: a data file replaced by a symlink to itself gave a raw RuntimeError
@example(seed="constant/one-file", mutations=[("replace", 0, 199)])
# an absolute location of a file inside the model's folder: compiled (onnxruntime and onnx's
# reader refuse it), now refused
@example(seed="matmul/per-tensor", mutations=[("location", 0, 3)])
# a location out of the folder and back in ('../model/w'): cuvil and onnxruntime read it
@example(seed="reshape_transpose/one-file", mutations=[("location", 0, 5)])
@settings(max_examples=budget(100))
@given(seed=st.sampled_from(SEED_NAMES), mutations=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_external_data_compiles_and_matches_or_raises_cuvil_errors(
        worker, seed: str, mutations: list) -> None:
    check(worker, "compile_folder_and_compare", mutated_folder(seed, mutations))
