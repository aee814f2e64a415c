"""Gemm, MatMul and Einsum against onnxruntime: every transA/transB/C-broadcast combination
with alpha and beta (0 included), constant and run-time B; MatMul at ranks 1 to 5 on either
side with batch broadcasting both ways; Einsum equations as exporters write them (batched
matmuls, attention, transposes, reductions, diagonals, ellipses, implicit outputs, three
operands); symbolic dims checked at several sizes; float16, float64 and int32/int64 Einsum;
the errors a model can cause; onnx's backend node tests.

Cases are batched (one compile per test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper

import cuvil
from cuvil.errors import ModelError

F16 = {"rtol": 5e-3, "atol": 5e-3}
F64 = {"rtol": 1e-10, "atol": 1e-10}
C_SHAPES = {"none": None, "scalar": [], "[1]": [1], "[N]": ["N"], "[1,N]": [1, "N"],
            "[M,1]": ["M", 1], "[M,N]": ["M", "N"]}


def gemm_case(rng: np.random.Generator, trans_a: int, trans_b: int, c_shape: str,
              const_b: bool, dtype: str = "float32", m: int | str = "m") -> Case:
    kk, n = (int(x) for x in rng.integers(1, 9, 2))
    attrs: dict = {}
    if trans_a:
        attrs["transA"] = 1
    if trans_b:
        attrs["transB"] = 1
    if rng.random() < 0.6:
        attrs["alpha"] = float(rng.choice([0.5, -2.0, 0.0, 1.0]))
    if rng.random() < 0.6:
        attrs["beta"] = float(rng.choice([0.5, -1.5, 0.0, 1.0]))
    b_shape = [n, kk] if trans_b else [kk, n]
    c = C_SHAPES[c_shape]
    case = Case("Gemm", ["a", "b"] + ([] if c is None else ["c"]), attrs,
                feeds={"a": (dtype, [kk, m] if trans_a else [m, kk])},
                label=f"Gemm C={c_shape} const_b={const_b}")
    if const_b:
        case.consts["b"] = rng.standard_normal(b_shape).astype(dtype)
    else:
        case.feeds["b"] = (dtype, b_shape)
    if c is not None:
        shape = [m if d == "M" else n if d == "N" else d for d in c]
        if "M" in c or rng.random() < 0.5:
            case.feeds["c"] = (dtype, shape)
        else:
            case.consts["c"] = rng.standard_normal(shape).astype(dtype)
    return case


def test_gemm_every_transpose_and_c_broadcast():
    rng = np.random.default_rng(1)
    cases = [gemm_case(rng, ta, tb, c, const_b=(i % 2 == 0))
             for i, (ta, tb, c) in enumerate(itertools.product([0, 1], [0, 1], C_SHAPES))]
    check_cases(cases, sizes=[{"m": 1}, {"m": 6}, {"m": 17}])


def test_gemm_float16_and_float64():
    rng = np.random.default_rng(2)
    combos = [(0, 0, "[M,N]"), (1, 0, "[N]"), (0, 1, "none"), (1, 1, "[M,1]")]
    f16 = [gemm_case(rng, *c, const_b=bool(i % 2), dtype="float16") for i, c in enumerate(combos)]
    f64 = [gemm_case(rng, *c, const_b=bool(i % 2), dtype="float64") for i, c in enumerate(combos)]
    check_cases(f16, sizes=[{"m": 3}, {"m": 9}], **F16)
    check_cases(f64, sizes=[{"m": 3}, {"m": 9}], **F64)


def matmul_case(rng: np.random.Generator, rank_a: int, rank_b: int, dtype: str = "float32") -> Case:
    m, kk, n = (int(x) for x in rng.integers(1, 7, 3))
    batch = [int(x) for x in rng.integers(1, 4, max(rank_a, rank_b) - 2)] if max(rank_a, rank_b) > 2 \
        else []

    def batch_of(rank: int) -> list[int]:
        own = batch[len(batch) - (rank - 2):] if rank > 2 else []
        return [d if rng.random() < 0.6 else 1 for d in own]  # broadcast either side

    a = [kk] if rank_a == 1 else [*batch_of(rank_a), m, kk]
    b = [kk] if rank_b == 1 else [*batch_of(rank_b), kk, n]
    case = Case("MatMul", ["a", "b"], {}, feeds={"a": (dtype, a)})
    if rng.random() < 0.5:
        case.feeds["b"] = (dtype, b)
    else:
        case.consts["b"] = rng.standard_normal(b).astype(dtype)
    return case


def test_matmul_ranks_1_to_5_with_batch_broadcasting():
    rng = np.random.default_rng(3)
    check_cases([matmul_case(rng, ra, rb) for ra in range(1, 6) for rb in range(1, 6)])


def test_matmul_symbolic_dims():
    cases = [
        Case("MatMul", ["a", "b"], {}, feeds={"a": ("float32", ["b", "s", 8])},
             consts={"b": np.random.default_rng(4).standard_normal([8, 5]).astype(np.float32)}),
        Case("MatMul", ["a", "b"], {}, feeds={"a": ("float32", ["b", 3, "s", 4]),
                                               "b": ("float32", ["b", 3, 4, "s"])}),
        Case("MatMul", ["a", "b"], {}, feeds={"a": ("float32", [1, "s", 4]),
                                               "b": ("float32", ["b", 4, 2])}),
        Case("MatMul", ["a", "b"], {}, feeds={"a": ("float32", ["s"]),
                                               "b": ("float32", ["b", "s", 3])}),
        Case("MatMul", ["a", "b"], {}, feeds={"a": ("float32", ["b", 2, "s"]),
                                               "b": ("float32", ["s"])}),
    ]
    check_cases(cases, sizes=[{"b": 1, "s": 1}, {"b": 2, "s": 7}, {"b": 3, "s": 20}])


def test_matmul_float16_and_float64():
    rng = np.random.default_rng(5)
    pairs = [(1, 2), (2, 2), (3, 2), (2, 1), (4, 3), (1, 1)]
    check_cases([matmul_case(rng, *p, dtype="float16") for p in pairs], **F16)
    check_cases([matmul_case(rng, *p, dtype="float64") for p in pairs], **F64)


EINSUMS = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),  # attention scores
    ("bhqk,bhkd->bhqd", [(2, 3, 4, 6), (2, 3, 6, 5)]),  # attention output
    ("bqhd,bkhd->bhqk", [(2, 4, 3, 5), (2, 6, 3, 5)]),
    ("bhqk,bkhd->bqhd", [(2, 3, 4, 6), (2, 6, 3, 5)]),
    ("bij,jk->bik", [(2, 3, 4), (4, 5)]),
    ("abcd,cdef->abef", [(2, 3, 4, 5), (4, 5, 2, 3)]),  # two contraction labels
    ("ijk,jil->kl", [(2, 3, 4), (3, 2, 5)]),
    ("ij,kj->ik", [(3, 4), (5, 4)]),
    ("ji,jk->ik", [(4, 3), (4, 5)]),
    ("ij,jk->ki", [(3, 4), (4, 5)]),
    ("ij,j->i", [(3, 4), (4,)]),
    ("i,ij->j", [(3,), (3, 4)]),
    ("i,i", [(5,), (5,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij,ik->", [(3, 4), (3, 5)]),
    ("bhd,bhd->bh", [(2, 3, 4), (2, 3, 4)]),
    ("ij,ij->ij", [(3, 4), (3, 4)]),
    ("ij,ij->ij", [(1, 4), (3, 4)]),  # a dim of 1 broadcasts
    ("ijk,ikl->ijl", [(2, 1, 4), (2, 4, 3)]),
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit output
    ("ba", [(3, 4)]),
    ("ij->ji", [(3, 4)]),
    ("ijk->kji", [(2, 3, 4)]),
    ("ij->i", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("ii->i", [(4, 4)]),  # diagonal
    ("ii", [(4, 4)]),  # trace
    ("bii->bi", [(2, 3, 3)]),
    ("ij,ji->", [(3, 3), (3, 3)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk", [(2, 1, 3, 4), (1, 5, 4, 2)]),
    ("ij...,jk...->ik...", [(2, 3, 4), (3, 5, 4)]),
    ("bn,anm,bm->ba", [(2, 3), (4, 3, 5), (2, 5)]),  # three operands
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    (" b i d , b j d -> b i j ", [(2, 3, 4), (2, 5, 4)]),  # spaces
    ("Ab,bc->Ac", [(2, 3), (3, 4)]),
]


def einsum_cases(dtype: str, equations=EINSUMS) -> list[Case]:
    return [Case("Einsum", [f"x{i}" for i in range(len(shapes))], {"equation": eq},
                 feeds={f"x{i}": (dtype, list(s)) for i, s in enumerate(shapes)}, label=eq)
            for eq, shapes in equations]


def test_einsum_equations():
    cases = einsum_cases("float32")
    # implicit output with both cases of letters: numpy's ASCII order (onnxruntime rejects it)
    cases.append(Case("Einsum", ["x0"], {"equation": "aB"}, feeds={"x0": ("float32", [2, 3])},
                      oracle="reference"))
    check_cases(cases, opset=12)


def test_einsum_dtypes():
    picks = [e for e in EINSUMS if e[0] in ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd", "ii->i", "ij->i",
                                              "bn,anm,bm->ba", "...ij,...jk", "i,i")]
    check_cases(einsum_cases("float16", picks), opset=12, **F16)
    check_cases(einsum_cases("float64", picks) + einsum_cases("int32", picks)
                + einsum_cases("int64", picks), opset=12, **F64)


def test_einsum_symbolic_dims():
    cases = [
        Case("Einsum", ["q", "k"], {"equation": "bhqd,bhkd->bhqk"},
             feeds={"q": ("float32", ["b", 2, "s", 4]), "k": ("float32", ["b", 2, "t", 4])}),
        Case("Einsum", ["p", "v"], {"equation": "bhqk,bhkd->bhqd"},
             feeds={"p": ("float32", ["b", 2, "s", "t"]), "v": ("float32", ["b", 2, "t", 4])}),
        Case("Einsum", ["x"], {"equation": "bsd->bd"}, feeds={"x": ("float32", ["b", "s", 3])}),
        Case("Einsum", ["x", "w"], {"equation": "...d,de->...e"},
             feeds={"x": ("float32", ["b", "s", 4]), "w": ("float32", [4, 3])}),
    ]
    check_cases(cases, opset=12, sizes=[{"b": 1, "s": 1, "t": 3}, {"b": 2, "s": 5, "t": 1},
                                        {"b": 3, "s": 9, "t": 17}])


def test_einsum_as_matmul_batch_axes():
    # passes/einsum_as_matmul.py: symbolic batch axes, extra row and column
    # labels, a weight, vectors, permuted outputs
    rng = np.random.default_rng(3)
    cases = [
        Case("Einsum", ["q", "k"], {"equation": "bhqd,bhkd->bkhq"},
             feeds={"q": ("float32", ["b", 3, "s", 8]), "k": ("float32", ["b", 3, "t", 8])}),
        Case("Einsum", ["x", "w"], {"equation": "bld,dn->bln"},
             feeds={"x": ("float32", ["b", "s", 16])},
             consts={"w": rng.standard_normal((16, 24)).astype(np.float32)}),
        Case("Einsum", ["p", "r"], {"equation": "bik,bkef->ebif"},
             feeds={"p": ("float32", ["b", 5, 7]), "r": ("float32", ["b", 7, 3, 6])}),
        Case("Einsum", ["a", "v"], {"equation": "...ij,j->...i"},
             feeds={"a": ("float32", ["b", "s", 9]), "v": ("float32", [9])}),
        Case("Einsum", ["v", "a"], {"equation": "j,bjk->kb"},
             feeds={"v": ("float32", [6]), "a": ("float32", ["b", 6, 5])}),
    ]
    check_cases(cases, opset=12, sizes=[{"b": 1, "s": 1, "t": 4}, {"b": 3, "s": 17, "t": 9}],
                threads=(1, None))


def test_backend_node_tests():
    tests = backend_cases("gemm", ["Gemm"]) + backend_cases("matmul", ["MatMul"])
    # bfloat16 is not a cuvil dtype
    tests += [t for t in backend_cases("einsum", ["Einsum"]) if "bfloat16" not in t.name]
    assert len(tests) >= 24
    check_backend_cases(tests)


# -- errors a model can cause -----------------------------------------------------------------


def _model(op, inputs, **attrs):
    graph = helper.make_graph(
        [helper.make_node(op, list(inputs), ["y"], **attrs)], "bad",
        [helper.make_tensor_value_info(n, 1, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info("y", 1, [None, None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(("op", "inputs", "attrs", "message"), [
    ("Gemm", {"a": [2, 3], "b": [4, 5]}, {}, "inner dims"),
    ("Gemm", {"a": [2, 3, 1], "b": [3, 5]}, {}, "2-D"),
    ("Gemm", {"a": [2, 3], "b": [3, 5], "c": [3, 5]}, {}, "broadcast"),
    ("Gemm", {"a": [2, 3], "b": [3, 5], "c": [1, 2, 5]}, {}, "rank <= 2"),
    ("MatMul", {"a": [2, 3], "b": [4, 5]}, {}, "inner dims"),
    ("MatMul", {"a": [2, 2, 3], "b": [3, 3, 5]}, {}, "broadcast"),
    ("Einsum", {"a": [2, 3]}, {"equation": "ij,jk->ik"}, "2 input terms"),
    ("Einsum", {"a": [2, 3]}, {"equation": "ijk->i"}, "names 3 axes"),
    ("Einsum", {"a": [2, 3]}, {"equation": "ij->k"}, "appear in no input"),
    ("Einsum", {"a": [2, 3]}, {"equation": "ij->ii"}, "repeats"),
    ("Einsum", {"a": [2, 3]}, {"equation": "i1->i"}, "malformed"),
    ("Einsum", {"a": [2, 3], "b": [4, 5]}, {"equation": "ij,jk->ik"}, "broadcast"),
])
def test_errors(op, inputs, attrs, message):
    with pytest.raises(ModelError, match=message):
        cuvil.compile(_model(op, inputs, **attrs))
