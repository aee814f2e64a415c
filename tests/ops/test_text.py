"""TfIdfVectorizer against onnxruntime: seeded random pools (1- to 4-grams, negative and large
token ids, lengths loaded or skipped by min/max_gram_length), every mode with and without
weights, skip counts 0 to 3, 1-D and 2-D int32/int64 input with symbolic dims at several
sizes (one-token rows included); onnx's backend node tests; the errors a model can cause.

Tokens come from a small vocabulary so that most pool n-grams occur. Cases are batched (one
compile per test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import TensorProto, helper

import cuvil
from cuvil.errors import ModelError, UnsupportedOpError

VOCAB = np.array([-3, 0, 1, 2, 5, 7, 2**40])
#: token ids spread too far apart for a table indexed by token (the trie's root is searched)
SPARSE = np.array([-(2**40), -7, 0, 3, 2**33, 2**40, 11])
SIZES = ({"_n": 3, "_c": 12}, {"_n": 1, "_c": 5}, {"_n": 2, "_c": 1}, {"_n": 4, "_c": 31})


def _tokens(rng, dtype, shape):
    vocab = VOCAB if np.dtype(dtype) == np.int64 else VOCAB[:-1]
    return rng.choice(vocab, size=shape).astype(dtype)


def _sparse_tokens(rng, dtype, shape):
    return rng.choice(SPARSE, size=shape).astype(dtype)


def _pool(rng, max_len, vocab=VOCAB[:5]):
    """ngram_counts and pool_int64s: a few distinct n-grams of each length up to max_len (some
    lengths empty), of tokens from `vocab`."""
    counts, pool = [], []
    for size in range(1, max_len + 1):
        counts.append(len(pool))
        number = int(rng.integers(0, 5)) if size > 1 else int(rng.integers(1, 5))
        seen = set()
        for _ in range(number):
            gram = tuple(int(t) for t in rng.choice(vocab, size=size))
            if gram not in seen:
                seen.add(gram)
                pool += gram
    return counts, pool


def tfidf_case(rng, two_d, dtype="int64", sparse=False):
    max_len = int(rng.integers(1, 5))
    counts, pool = _pool(rng, max_len, SPARSE[:6] if sparse else VOCAB[:5])
    # the number of n-grams over all lengths (loaded or not)
    grams = sum(((counts[i + 1] if i + 1 < len(counts) else len(pool)) - counts[i]) // (i + 1)
                for i in range(len(counts)))
    min_gram = int(rng.integers(1, max_len + 1))
    max_gram = int(rng.integers(min_gram, max_len + 1))
    mode = str(rng.choice(["TF", "IDF", "TFIDF"]))
    if rng.random() < 0.3:
        # columns shared by several n-grams, and unused ones
        indexes = [int(i) for i in rng.integers(0, grams + 2, grams)]
    else:
        indexes = [int(i) for i in rng.permutation(grams)]
    attrs = {"mode": mode, "min_gram_length": min_gram, "max_gram_length": max_gram,
             "max_skip_count": int(rng.integers(0, 4)), "ngram_counts": counts,
             "ngram_indexes": indexes, "pool_int64s": pool}
    if mode != "TF" and rng.random() < 0.7:
        attrs["weights"] = [float(w) for w in rng.uniform(-2, 3, grams).astype(np.float32)]
    shape = ["_n", "_c"] if two_d else ["_c"]
    return Case("TfIdfVectorizer", ["x"], attrs, feeds={"x": (dtype, shape)},
                data=_sparse_tokens if sparse else _tokens)


def test_random_pools_every_mode():
    rng = np.random.default_rng(0)
    cases = [tfidf_case(rng, two_d=i % 2 == 0, dtype="int64" if i % 3 else "int32")
             for i in range(40)]
    cases += [tfidf_case(rng, two_d=i % 2 == 0, sparse=True) for i in range(12)]
    check_cases(cases, sizes=SIZES, opset=9, rtol=1e-6, atol=0)


def test_each_mode_and_skip_count():
    """The ONNX example pool (4 unigrams, 3 bigrams) in every mode and skip count, with and
    without weights, on a 2-D and a 1-D input."""
    pool = [2, 3, 5, 4, 5, 6, 7, 8, 6, 7]
    cases = []
    for mode in ("TF", "IDF", "TFIDF"):
        for skip in range(4):
            for lengths in ((1, 1), (1, 2), (2, 2)):
                attrs = {"mode": mode, "min_gram_length": lengths[0],
                         "max_gram_length": lengths[1], "max_skip_count": skip,
                         "ngram_counts": [0, 4], "ngram_indexes": list(range(7)),
                         "pool_int64s": pool}
                if mode != "TF" and skip % 2:
                    attrs["weights"] = [0.5, 1.0, 2.0, -1.0, 3.0, 0.25, 4.0]
                shape = ["_n", "_c"] if skip % 2 else ["_c"]
                cases.append(Case("TfIdfVectorizer", ["x"], attrs,
                                  feeds={"x": ("int32", shape)},
                                  data=lambda rng, dtype, shape: rng.integers(2, 9, shape).astype(dtype)))
    check_cases(cases, sizes=SIZES, opset=9, rtol=1e-6, atol=0)


def test_backend_node_tests():
    tests = backend_cases("tfidfvectorizer", ["TfIdfVectorizer"])
    assert len(tests) == 7
    check_backend_cases(tests)


# -- errors ----------------------------------------------------------------------------------

BASE = {"mode": "TF", "min_gram_length": 1, "max_gram_length": 2, "max_skip_count": 0,
        "ngram_counts": [0, 2], "ngram_indexes": [0, 1, 2], "pool_int64s": [1, 2, 1, 2]}


def _model(dtype=TensorProto.INT64, shape=(2, 5), **attrs):
    graph = helper.make_graph(
        [helper.make_node("TfIdfVectorizer", ["x"], ["y"], name="tv",
                          **{k: v for k, v in {**BASE, **attrs}.items() if v is not None})], "bad",
        [helper.make_tensor_value_info("x", dtype, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    graph.output[0].type.tensor_type.shape.SetInParent()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 8
    return model


def test_errors():
    with pytest.raises(UnsupportedOpError, match=r"'tv' \(TfIdfVectorizer\): X holds strings"):
        cuvil.compile(_model(TensorProto.STRING, pool_int64s=None, pool_strings=["a", "b", "a", "b"]))
    with pytest.raises(UnsupportedOpError, match=r"'tv' \(TfIdfVectorizer\).*pool_strings"):
        cuvil.compile(_model(pool_int64s=None, pool_strings=["a", "b", "a", "b"]))
    with pytest.raises(ModelError, match=r"'tv' \(TfIdfVectorizer\): mode 'BM25'"):
        cuvil.compile(_model(mode="BM25"))
    with pytest.raises(ModelError, match=r"the 1-gram \[1\] appears twice"):
        cuvil.compile(_model(ngram_counts=[0, 3], pool_int64s=[1, 2, 1, 1, 2]))
    with pytest.raises(ModelError, match=r"do not make whole 2-grams"):
        cuvil.compile(_model(pool_int64s=[1, 2, 1, 2, 3]))
    with pytest.raises(ModelError, match=r"ngram_indexes has 2 entries"):
        cuvil.compile(_model(ngram_indexes=[0, 1]))
    with pytest.raises(ModelError, match=r"weights has 2 entries"):
        cuvil.compile(_model(mode="TFIDF", weights=[1.0, 2.0]))
    with pytest.raises(ModelError, match=r"min_gram_length <= max_gram_length"):
        cuvil.compile(_model(min_gram_length=3))
    with pytest.raises(ModelError, match=r"must be \[C\] or \[N, C\]"):
        cuvil.compile(_model(shape=(2, 3, 4)))
    with pytest.raises(ModelError, match=r"X has dtype float32"):
        cuvil.compile(_model(TensorProto.FLOAT))
