"""fuse_epilogue: which nodes each pattern leaves after the passes (fused into one product,
or left alone), and the compiled model against onnxruntime running the unfused model, at two
values of the symbolic batch."""

from __future__ import annotations

import numpy as np
import pytest
import sympy
from onnx import helper
from oracle import assert_matches_ort, make_model

from cuvil.compiler.driver import _node_profile
from cuvil.compiler.frontend import import_model
from cuvil.compiler.ir import symbol
from cuvil.compiler.passes import run_passes
from cuvil.compiler.passes.plan_memory import plan_memory

rng = np.random.default_rng(11)
F32 = np.float32


def weights(*shape: int, scale: float = 0.3) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(F32)


def scalar(v: float) -> np.ndarray:
    return np.array(v, F32)


def ops(model) -> list[str]:
    """The op of each node after the passes, fused steps included (as the profiler names it)."""
    return [_node_profile(n)["op"] for n in run_passes(import_model(model)).nodes]


def check(model, shape: tuple[int, ...], **tol) -> None:
    """cuvil against onnxruntime at batch shape[0] and at batch 1 (one compiled model)."""
    feeds = {"x": rng.standard_normal(shape).astype(F32)}
    compiled = assert_matches_ort(model, feeds, **tol)
    feeds = {"x": rng.standard_normal((1, *shape[1:])).astype(F32)}
    assert_matches_ort(model, feeds, compiled=compiled, **tol)


# -- convolutions ----------------------------------------------------------------------------

CONV_X = (3, 8, 9, 7)  # 63 positions: a masked last vector, rows not a multiple of a tile


def conv_model(tail: list, extra_inputs=None, inits=None, c: int = 8, opset: int = 17,
               outputs=("y",)):
    """x -> Conv (3x3, pads 1, bias) -> c, then `tail` (nodes reading c, x, ...) -> y."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), *tail]
    return make_model(nodes, {"x": (F32, ["batch", c, 9, 7]), **(extra_inputs or {})},
                      dict.fromkeys(outputs, F32),
                      {"w": weights(8, c, 3, 3), "b": weights(8), **(inits or {})}, opset=opset)


def act(op: str, src: str = "c", out: str = "y", inputs=(), **attrs):
    return helper.make_node(op, [src, *inputs], [out], **attrs)


FUSED_CONV = [
    ("relu", [act("Relu")], {}, 17, "Conv+Relu"),
    ("relu6", [act("Clip", inputs=("lo", "hi"))], {"lo": scalar(0), "hi": scalar(6)}, 17, "Conv+Clip"),
    ("clip-max-only", [act("Clip", inputs=("", "hi"))], {"hi": scalar(0.5)}, 17, "Conv+Clip"),
    ("clip-attrs", [act("Clip", min=-0.5, max=0.25)], {}, 6, "Conv+Clip"),
    ("leaky", [act("LeakyRelu", alpha=0.1)], {}, 17, "Conv+LeakyRelu"),
    ("hardsigmoid", [act("HardSigmoid", alpha=0.3, beta=0.4)], {}, 17, "Conv+HardSigmoid"),
    ("hardswish", [act("HardSwish")], {}, 17, "Conv+HardSwish"),
    ("sigmoid", [act("Sigmoid")], {}, 17, "Conv+Sigmoid"),
    ("tanh", [act("Tanh")], {}, 17, "Conv+Tanh"),
    ("gelu", [act("Gelu")], {}, 20, "Conv+Gelu"),
    ("silu", [act("Sigmoid", out="s"), helper.make_node("Mul", ["c", "s"], ["y"])], {}, 17,
     "Conv+SiLU"),
    ("silu-swapped", [act("Sigmoid", out="s"), helper.make_node("Mul", ["s", "c"], ["y"])], {}, 17,
     "Conv+SiLU"),
    ("residual", [helper.make_node("Add", ["c", "x"], ["y"])], {}, 17, "Conv+Add"),
    ("residual-relu", [helper.make_node("Add", ["x", "c"], ["s"]), act("Relu", "s")], {}, 17,
     "Conv+Add+Relu"),
    ("sum-residual-relu", [helper.make_node("Sum", ["c", "x"], ["s"]), act("Relu", "s")], {}, 7,
     "Conv+Add+Relu"),
    ("residual-hardswish", [helper.make_node("Add", ["c", "x"], ["s"]), act("HardSwish", "s")], {},
     17, "Conv+Add+HardSwish"),
]


#: the cases the fast test run (-m "not slow") keeps: an activation, SiLU's two orders, residuals
FAST_FUSED_CONV = ("relu", "silu", "silu-swapped", "residual-relu", "sum-residual-relu")


@pytest.mark.parametrize("tail,inits,opset,fused", [
    pytest.param(*c[1:], id=c[0], marks=() if c[0] in FAST_FUSED_CONV else pytest.mark.slow)
    for c in FUSED_CONV])
def test_conv_epilogue_is_fused(tail, inits, opset, fused) -> None:
    model = conv_model(tail, inits=inits, opset=opset)
    assert ops(model) == [fused]
    check(model, CONV_X)


def test_residual_from_the_other_branch() -> None:
    """ResNet's downsampling block: two convs of x, added; the later conv takes the earlier
    one's output as its residual."""
    nodes = [helper.make_node("Conv", ["x", "w2"], ["d"]),
             helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["d", "c"], ["s"]), act("Relu", "s")]
    model = make_model(nodes, {"x": (F32, ["batch", 8, 9, 7])}, {"y": F32},
                       {"w": weights(8, 8, 3, 3), "b": weights(8), "w2": weights(8, 8, 1, 1)})
    assert ops(model) == ["Conv", "Conv+Add+Relu"]
    check(model, CONV_X)


def test_residual_over_several_blocks_of_k() -> None:
    """64 channels x 3x3 taps = 576 sums per output: the kernel runs three blocks of K, and
    only the last may add the residual and apply the activation."""
    model = conv_model([helper.make_node("Add", ["c", "r"], ["s"]), act("Sigmoid", "s")],
                       extra_inputs={"r": (F32, ["batch", 8, 9, 7])}, c=64)
    assert ops(model) == ["Conv+Add+Sigmoid"]
    feeds = {"x": rng.standard_normal((2, 64, 9, 7)).astype(F32),
             "r": rng.standard_normal((2, 8, 9, 7)).astype(F32)}
    assert_matches_ort(model, feeds)


def test_chunked_conv_reads_the_residual_of_its_chunk() -> None:
    """A large output is unfolded and multiplied by chunks of rows over the threads."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["s"]), act("Relu", "s")]
    model = make_model(nodes, {"x": (F32, ["batch", 4, 40, 33])}, {"y": F32},
                       {"w": weights(4, 4, 3, 3), "b": weights(4)})
    assert ops(model) == ["Conv+Add+Relu"]
    check(model, (2, 4, 40, 33))


# -- Gemm and MatMul ---------------------------------------------------------------------------


def gemm_model(tail: list, c_input: bool = True, extra=None, inits=None, opset=17, trans_b=1):
    w = weights(6, 11) if trans_b else weights(11, 6)
    ins = ["x", "w", "b"] if c_input else ["x", "w"]
    nodes = [helper.make_node("Gemm", ins, ["g"], transB=trans_b), *tail]
    return make_model(nodes, {"x": (F32, ["batch", 11]), **(extra or {})}, {"y": F32},
                      {"w": w, "b": weights(6), "bias": weights(6), **(inits or {})}, opset=opset)


def matmul_model(tail: list, x_shape=("batch", 5, 16), w_shape=(16, 24), extra=None, inits=None,
                 opset=17):
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]), *tail]
    return make_model(nodes, {"x": (F32, list(x_shape)), **(extra or {})}, {"y": F32},
                      {"W": weights(*w_shape), "B": weights(w_shape[-1]),
                       "B2": weights(1, w_shape[-1]), **(inits or {})}, opset=opset)


def gelu_erf(src: str, order: int) -> list:
    """0.5 * x * (1 + erf(x / sqrt 2)) as exporters write it."""
    if order == 0:  # torch: Div, Erf, Add, Mul(x, .), Mul(., 0.5)
        return [helper.make_node("Div", [src, "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", [src, "a"], ["m"]),
                helper.make_node("Mul", ["m", "half"], ["y"])]
    # HF: x * 0.5 * (1 + erf(x * 0.7071)), products written the other way round
    return [helper.make_node("Mul", ["rsqrt2", src], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["one", "e"], ["a"]), helper.make_node("Mul", ["half", src], ["m"]),
            helper.make_node("Mul", ["a", "m"], ["y"])]


GELU_CONSTS = {"sqrt2": scalar(np.sqrt(2)), "rsqrt2": scalar(np.sqrt(0.5)), "one": scalar(1),
               "half": scalar(0.5)}


def test_gemm_relu() -> None:
    model = gemm_model([act("Relu", "g")])
    assert ops(model) == ["Gemm+Relu"]
    check(model, (7, 11))


def test_gemm_bias_add_relu() -> None:
    """Gemm without C, then Add of a constant row: the row becomes C."""
    model = gemm_model([helper.make_node("Add", ["g", "bias"], ["s"]), act("Relu", "s")],
                       c_input=False, trans_b=0)
    assert ops(model) == ["Gemm+Relu"]
    check(model, (7, 11))


def test_gemm_residual_tanh() -> None:
    model = gemm_model([helper.make_node("Add", ["r", "g"], ["s"]), act("Tanh", "s")],
                       extra={"r": (F32, ["batch", 6])})
    assert ops(model) == ["Gemm+Add+Tanh"]
    for batch in (5, 1):
        assert_matches_ort(model, {"x": rng.standard_normal((batch, 11)).astype(F32),
                                   "r": rng.standard_normal((batch, 6)).astype(F32)})


@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("x_shape", [("batch", 16), ("batch", 5, 16)], ids=["2d", "batched"])
def test_matmul_bias_gelu_erf(x_shape, order) -> None:
    model = matmul_model([helper.make_node("Add", ["mm", "B"], ["h"]), *gelu_erf("h", order)],
                         x_shape=x_shape, inits=GELU_CONSTS)
    # a 2-D MatMul's bias folds into a Gemm (fold_batchnorm), which carries its own bias
    assert ops(model) == ["Gemm+Gelu" if len(x_shape) == 2 else "MatMul+Bias+Gelu"]
    check(model, (3, *x_shape[1:]))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_matmul_bias_gelu_op(approximate) -> None:
    model = matmul_model([helper.make_node("Add", ["B2", "mm"], ["h"]),
                          act("Gelu", "h", approximate=approximate)], opset=20)
    assert ops(model) == [f"MatMul+Bias+{'Gelu' if approximate == 'none' else 'GeluTanh'}"]
    check(model, (3, 5, 16))


def test_matmul_bias_residual_silu() -> None:
    """Batched activations against shared weights (the weights' batch dims broadcast)."""
    tail = [helper.make_node("Add", ["mm", "B"], ["h"]), helper.make_node("Add", ["h", "r"], ["s"]),
            act("Sigmoid", "s", out="sg"), helper.make_node("Mul", ["s", "sg"], ["y"])]
    model = matmul_model(tail, extra={"r": (F32, ["batch", 5, 24])})
    assert ops(model) == ["MatMul+Bias+Add+SiLU"]
    for batch in (4, 1):
        assert_matches_ort(model, {"x": rng.standard_normal((batch, 5, 16)).astype(F32),
                                   "r": rng.standard_normal((batch, 5, 24)).astype(F32)})


def test_matmul_off_the_kernel_applies_the_epilogue_too() -> None:
    """x @ y^T with y transposed at run time is summed as dot products, not on the kernel: the
    fused residual and activation are applied after it."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "kt"], ["mm"]),
             helper.make_node("Add", ["mm", "r"], ["s"]), act("Relu", "s")]
    model = make_model(nodes, {"x": (F32, ["batch", 4, 8]), "k": (F32, ["batch", 6, 8]),
                               "r": (F32, ["batch", 4, 6])}, {"y": F32})
    assert [o for o in ops(model) if o != "Transpose"] == ["MatMul+Add+Relu"]
    feeds = {"x": rng.standard_normal((3, 4, 8)).astype(F32),
             "k": rng.standard_normal((3, 6, 8)).astype(F32),
             "r": rng.standard_normal((3, 4, 6)).astype(F32)}
    assert_matches_ort(model, feeds)


# -- what stays unfused ----------------------------------------------------------------------
# (out of the product's epilogue: elementwise nodes left after it run as one loop of their own,
# passes/fuse_elementwise.py)

UNFUSED = [
    # the product's output has another reader
    ("two-users", conv_model([act("Relu", out="y"), act("Neg", out="n")], outputs=("y", "n")),
     ["Conv", "Relu", "Neg"]),
    # ... or is a graph output itself
    ("graph-output", conv_model([helper.make_node("Add", ["c", "x"], ["y"])], outputs=("y", "c")),
     ["Conv", "Add"]),
    # Sigmoid(x) read by another node too: no SiLU
    ("silu-shared-sigmoid", conv_model([act("Sigmoid", out="s"), helper.make_node("Mul", ["c", "s"], ["y"]),
                                        act("Neg", "s", out="n")], outputs=("y", "n")),
     ["Conv", "Sigmoid", "Mul", "Neg"]),
    # a residual that broadcasts (one value per channel), not of the output's shape
    ("broadcast-residual", conv_model([helper.make_node("Add", ["c", "r"], ["y"])],
                                      extra_inputs={"r": (F32, [1, 8, 1, 1])}), ["Conv", "Add"]),
    # the residual is computed after the product
    ("late-residual", conv_model([act("Neg", "x", out="n"), helper.make_node("Add", ["c", "n"], ["y"])]),
     ["Conv", "Fused(Neg+Add)"]),
    # Clip bounds computed at run time
    ("runtime-clip", conv_model([act("Clip", inputs=("lo",))], extra_inputs={"lo": (F32, [])}),
     ["Conv", "Clip"]),
    # an activation, then a residual: the epilogue's order is bias, residual, activation
    ("relu-then-add", conv_model([act("Relu", out="rl"), helper.make_node("Add", ["rl", "x"], ["y"])]),
     ["Conv+Relu", "Add"]),
    # not Gelu: divided by 2, not sqrt 2
    ("not-gelu", matmul_model(gelu_erf("mm", 0), inits={**GELU_CONSTS, "sqrt2": scalar(2.0)}),
     ["MatMul", "Fused(Div+Erf+Add+Mul+Mul)"]),
    # a bias that is not one value per column
    ("matmul-bias-per-row", matmul_model([helper.make_node("Add", ["mm", "Bc"], ["y"])],
                                         inits={"Bc": weights(5, 1)}), ["MatMul", "Add"]),
    # a 1-D right operand is promoted to a column: its output has no columns to bias
    ("matmul-vector", matmul_model([helper.make_node("Add", ["mm", "b5"], ["y"])], w_shape=(16,),
                                   inits={"b5": weights(5), "B": weights(1), "B2": weights(1, 1)}),
     ["MatMul", "Add"]),
]


@pytest.mark.parametrize("model,expected", [c[1:] for c in UNFUSED], ids=[c[0] for c in UNFUSED])
def test_stays_unfused_and_correct(model, expected) -> None:
    assert ops(model) == expected
    feeds = {}
    for inp in model.graph.input:
        dims = [d.dim_value or 2 for d in inp.type.tensor_type.shape.dim]
        feeds[inp.name] = rng.standard_normal(dims).astype(F32)
    assert_matches_ort(model, feeds)


def test_float64_stays_unfused() -> None:
    w = rng.standard_normal((11, 6))
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["m"]),
                        helper.make_node("Add", ["m", "r"], ["s"]), act("Relu", "s")],
                       {"x": (np.float64, ["batch", 11]), "r": (np.float64, ["batch", 6])},
                       {"y": np.float64}, {"w": w})
    assert ops(model) == ["MatMul", "Fused(Add+Relu)"]
    assert_matches_ort(model, {"x": rng.standard_normal((3, 11)), "r": rng.standard_normal((3, 6))})


# -- memory ------------------------------------------------------------------------------------


def test_residual_stays_alive_until_the_fused_node() -> None:
    """x -> a = Relu(x) -> Conv -> Conv + a -> Relu -> Neg: `a` is read last by the fused
    conv, so the conv's output must not take a's workspace block (it would overwrite the
    residual while the kernel reads it)."""
    nodes = [act("Relu", "x", out="a"),
             helper.make_node("Conv", ["a", "w"], ["b"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["b", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "a"], ["s"]), act("Relu", "s", out="r"),
             act("Neg", "r", out="y")]
    model = make_model(nodes, {"x": (F32, ["batch", 8, 9, 7])}, {"y": F32}, {"w": weights(8, 8, 3, 3)})
    graph = run_passes(import_model(model))
    assert [_node_profile(n)["op"] for n in graph.nodes] == ["Relu", "Conv", "Conv+Add+Relu", "Neg"]
    graph.verify()
    plan = plan_memory(graph)
    fused = graph.nodes[2]
    a, r = fused.inputs[3], fused.outputs[0]
    assert a is graph.nodes[0].outputs[0]
    sa, sr = plan.storage[a], plan.storage[r]
    assert sa.kind == sr.kind == "workspace"

    def at_batch_2(d) -> int:
        return int(sympy.sympify(d).subs(symbol("batch"), 2))

    size = at_batch_2(a.type.nbytes)
    lo_a, lo_r = at_batch_2(sa.offset), at_batch_2(sr.offset)
    assert lo_a + size <= lo_r or lo_r + size <= lo_a, "the fused output overlaps its residual"
    check(model, CONV_X)
