"""Fold what follows a float32 Conv, Gemm or MatMul into the GEMM kernel's epilogue, applied
while the tile is still in registers: y = act(product + bias + residual) in one pass over
memory instead of up to three (see ops/gemm.py `node_epilogue`, kernels/gemm.py).

Rules (passes/rewrite.py), each folding one node into the product before it, whose output
must be read by that node only and not be a graph output:

- bias: MatMul (or Gemm without C) then Add of a constant row vector [N] (a MatMul keeps it
  in its input slot `MATMUL_BIAS_SLOT`, a Gemm as C);
- residual: then Add (or a two-input Sum) of another tensor of exactly the product's type,
  computed before the product (input slot `RESIDUAL_SLOT`);
- activation: then Relu, Clip with constant bounds (ReLU6), LeakyRelu, HardSigmoid,
  HardSwish, Sigmoid, Tanh, Gelu, or x * Sigmoid(x) (SiLU); also after cuvil's
  DynamicQuantizeMatMul (the int8 kernel's float epilogue);
- gelu: the Erf form of Gelu, 0.5 * x * (1 + erf(x / sqrt 2)) in the orders exporters write
  it, becomes one Gelu node (fused by the previous rule, or run alone).

Each step needs the ones after it undone: no bias after a residual or an activation, no
residual after an activation (the order of the epilogue is fixed).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.ops.gemm import (
    ACTIVATION_PARAMS,
    FUSED_ACTIVATION,
    RESIDUAL_SLOT,
)
from cuvil.compiler.passes.rewrite import (
    Rule,
    apply_rules,
    const_operand,
    pattern,
    producer,
    scalar_operand,
    sole_reader,
)

__all__ = ["RULES", "fuse_epilogue"]


def _has_activation(node: Node) -> bool:
    return FUSED_ACTIVATION in node.attrs


def _has_residual(node: Node) -> bool:
    return node.input(RESIDUAL_SLOT) is not None


def _matrices(node: Node) -> bool:
    """MatMul of matrices (batched or not): 1-D operands are promoted, which the fused inputs'
    layout does not follow."""
    return node.op_type != "MatMul" or all(v is not None and v.type.rank >= 2
                                            for v in node.inputs[:2])


#: a product open to a residual (and then an activation)
OPEN_FOR_RESIDUAL = pattern("Conv", "Gemm", "MatMul", where=lambda n: _matrices(n)
                            and not _has_residual(n) and not _has_activation(n))
#: a product open to an activation (a float32 ConvTranspose applies it to each task's planes
#: once they are complete: ops/_conv_transpose.py)
OPEN_FOR_ACTIVATION = pattern("Conv", "Gemm", "MatMul", "ConvTranspose",
                              where=lambda n: _matrices(n) and not _has_activation(n))
#: a product open to a bias
OPEN_FOR_BIAS = pattern("Gemm", "MatMul", where=lambda n: _matrices(n) and n.input(2) is None
                        and not _has_residual(n) and not _has_activation(n)
                        and (n.op_type == "MatMul" or float(n.attrs.get("beta", 1.0)) == 1.0))


def _binary_operands(node: Node) -> list[tuple[Value, Value]]:
    """(x, other) for both orders of a commutative two-input node's operands."""
    if len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return []
    a, b = node.inputs
    return [(a, b), (b, a)]  # type: ignore[list-item]


# -- bias ------------------------------------------------------------------------------------


def fuse_bias(graph: Graph, add: Node) -> Node | None:
    for x, other in _binary_operands(add):
        prod = producer(graph, x, OPEN_FOR_BIAS, add)
        c = const_operand(other)
        if prod is None or c is None or add.outputs[0].type != x.type:
            continue
        n = x.type.shape[-1]
        if c.ndim > x.type.rank or c.shape[-1:] != (n,) or c.size != n:
            continue
        # Gemm's C and MatMul's fused bias are both input 2
        graph.set_input(prod, 2, graph.constant(c.reshape(n), f"{other.name}_bias"))
        if prod.op_type == "Gemm":
            prod.attrs = {**prod.attrs, "beta": 1.0}
        graph.absorb(prod, add)
        return prod
    return None


# -- residual --------------------------------------------------------------------------------


def fuse_residual(graph: Graph, add: Node) -> Node | None:
    if add.op_type == "Sum" and len(add.inputs) != 2:
        return None
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    for x, r in _binary_operands(add):
        prod = producer(graph, x, OPEN_FOR_RESIDUAL, add)
        if prod is None or r is x or r.type != x.type or add.outputs[0].type != x.type:
            continue
        # the fused node runs where the product does: the residual must be ready by then
        if r.producer is not None and position.get(id(r.producer), len(position)) > position[id(prod)]:
            continue
        graph.set_input(prod, RESIDUAL_SLOT, r)
        graph.absorb(prod, add)
        return prod
    return None


# -- activations -----------------------------------------------------------------------------


def _f32(node: Node, name: str, default: float) -> float:
    """A float attribute as ONNX stores it (float32, defaults included)."""
    return float(np.float32(node.attrs.get(name, default)))


def _clip_bounds(node: Node) -> tuple[float, ...] | None:
    big = float(np.finfo(np.float32).max)
    if node.opset < 11:
        return (_f32(node, "min", -big), _f32(node, "max", big))
    bounds = []
    for i, default in ((1, -big), (2, big)):
        v = node.input(i)
        if v is None:
            bounds.append(default)
            continue
        c = const_operand(v)
        if c is None or c.size != 1:
            return None  # bounds computed at run time stay a Clip node
        bounds.append(float(c.reshape(())))
    return tuple(bounds)


def _gelu_kind(node: Node) -> str | None:
    return {"none": "Gelu", "tanh": "GeluTanh"}.get(node.attrs.get("approximate", "none"))


#: op type -> (its parameters, or None when it cannot be fused; the activation's name)
ACTIVATION_OPS: dict[str, Callable[[Node], tuple[tuple[float, ...] | None, str | None]]] = {
    "Relu": lambda n: ((), "Relu"),
    "Clip": lambda n: (_clip_bounds(n), "Clip"),
    "LeakyRelu": lambda n: ((_f32(n, "alpha", 0.01),), "LeakyRelu"),
    "HardSigmoid": lambda n: ((_f32(n, "alpha", 0.2), _f32(n, "beta", 0.5)), "HardSigmoid"),
    "HardSwish": lambda n: ((), "HardSwish"),
    "Sigmoid": lambda n: ((), "Sigmoid"),
    "Tanh": lambda n: ((), "Tanh"),
    "Gelu": lambda n: ((), _gelu_kind(n)),
}


def _set_activation(prod: Node, name: str, params: tuple[float, ...]) -> None:
    prod.attrs = {**prod.attrs, FUSED_ACTIVATION: name, ACTIVATION_PARAMS: params}


def _dynamic_int8_product(graph: Graph, v: Value | None, reader: Node) -> Node | None:
    """cuvil's DynamicQuantizeMatMul (ops/dynamic_matmul.py) producing v for `reader` only:
    its int8 kernel's float epilogue applies an activation too."""
    p = v.producer if v is not None else None
    if (p is None or (p.domain, p.op_type) != ("cuvil", "DynamicQuantizeMatMul")
            or _has_activation(p) or not sole_reader(graph, v, reader)):  # type: ignore[arg-type]
        return None
    return p


def fuse_activation(graph: Graph, act: Node) -> Node | None:
    prod = (producer(graph, act.input(0), OPEN_FOR_ACTIVATION, act)
            or _dynamic_int8_product(graph, act.input(0), act))
    params, name = ACTIVATION_OPS[act.op_type](act)
    if prod is None or params is None or name is None or len(act.outputs) != 1:
        return None
    graph.absorb(prod, act)
    _set_activation(prod, name, params)
    return prod


def fuse_silu(graph: Graph, mul: Node) -> Node | None:
    """product -> x; Sigmoid(x) -> s; Mul(x, s) (x read by those two only)."""
    for x, s in _binary_operands(mul):
        sig = s.producer
        prod = x.producer
        if (sig is None or sig.op_type != "Sigmoid" or sig.domain or sig.inputs[0] is not x
                or s.users != [mul] or s in graph.outputs or prod is None
                or not OPEN_FOR_ACTIVATION.matches(prod) or x in graph.outputs
                or sorted(map(id, x.users)) != sorted((id(sig), id(mul)))):
            continue
        graph.set_input(mul, mul.inputs.index(s), x)
        graph.remove_nodes([sig])
        graph.absorb(prod, mul)
        _set_activation(prod, "SiLU", ())
        return prod
    return None


# -- Gelu in Erf form ------------------------------------------------------------------------


def _close(a: float | None, b: float) -> bool:
    return a is not None and abs(a - b) <= 1e-5 * abs(b)


def _single(graph: Graph, v: Value, reader: Node, op_type: str) -> Node | None:
    """v's producer, of `op_type`, when `reader` is its only reader."""
    p = v.producer
    if p is None or p.op_type != op_type or p.domain or v in graph.outputs or v.users != [reader]:
        return None
    return p


def _scaled(graph: Graph, v: Value, reader: Node, factor: float) -> tuple[Value, Node] | None:
    """(x, node) when v = x * factor (a Mul by it, or a Div by 1/factor) read by `reader` only."""
    p = v.producer
    if p is None or p.domain or v in graph.outputs or v.users != [reader]:
        return None
    if p.op_type == "Mul":
        for x, c in _binary_operands(p):
            if _close(scalar_operand(c), factor):
                return x, p
    if p.op_type == "Div" and len(p.inputs) == 2 and p.inputs[0] is not None \
            and _close(scalar_operand(p.inputs[1]), 1 / factor):
        return p.inputs[0], p
    return None


def _one_plus_erf(graph: Graph, v: Value, reader: Node) -> tuple[Value, list[Node]] | None:
    """(x, nodes) when v = 1 + erf(x / sqrt 2) read by `reader` only."""
    add = _single(graph, v, reader, "Add")
    if add is None:
        return None
    for e, one in _binary_operands(add):
        erf = _single(graph, e, add, "Erf") if _close(scalar_operand(one), 1.0) else None
        if erf is None or erf.inputs[0] is None:
            continue
        inner = _scaled(graph, erf.inputs[0], erf, np.sqrt(0.5))
        if inner is not None:
            return inner[0], [add, erf, inner[1]]
    return None


def _gelu_of(graph: Graph, mul: Node) -> tuple[Value, list[Node]] | None:
    """(x, inner nodes) when `mul` computes 0.5 * x * (1 + erf(x / sqrt 2)), as
    (x * (1 + erf)) * 0.5 or (x * 0.5) * (1 + erf), operands in either order."""
    for p, q in _binary_operands(mul):
        if _close(scalar_operand(q), 0.5):  # (x * (1 + erf)) * 0.5
            inner = _single(graph, p, mul, "Mul")
            for x, t in _binary_operands(inner) if inner is not None else []:
                found = _one_plus_erf(graph, t, inner)  # type: ignore[arg-type]
                if found is not None and found[0] is x:
                    return x, [inner, *found[1]]  # type: ignore[list-item]
        half = _scaled(graph, p, mul, 0.5)
        found = _one_plus_erf(graph, q, mul) if half is not None else None
        if half is not None and found is not None and found[0] is half[0]:
            return half[0], [half[1], *found[1]]
    return None


def recognize_gelu(graph: Graph, mul: Node) -> Node | None:
    found = _gelu_of(graph, mul)
    if found is None:
        return None
    x, inner = found
    gelu = Node("Gelu", [x], [], {}, name=mul.name, opset=20)
    graph.replace_node(mul, gelu)
    graph.remove_nodes(inner)
    return gelu


ACTIVATIONS = pattern(*ACTIVATION_OPS)

RULES = (
    Rule("gelu-erf", pattern("Mul"), recognize_gelu),
    Rule("bias", pattern("Add"), fuse_bias),
    Rule("residual", pattern("Add", "Sum"), fuse_residual),
    Rule("activation", ACTIVATIONS, fuse_activation),
    Rule("silu", pattern("Mul"), fuse_silu),
)


def fuse_epilogue(graph: Graph) -> Graph:
    return apply_rules(graph, RULES)
