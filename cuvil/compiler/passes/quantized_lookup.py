"""Replace a QDQ model's elementwise chains on one 8-bit tensor by a table of their results.

`quantize_static` leaves the activations between its integer products in float, each op
between a DequantizeLinear and a QuantizeLinear. Where such a chain reads a single 8-bit
tensor x (through DequantizeLinear with one scale and zero point), and otherwise only
one-element constants, up to a QuantizeLinear that gives 8 bits again, its result is a
function of x's byte alone: 256 possible values. A BERT's Gelu (DequantizeLinear, Div, Erf,
QuantizeLinear, DequantizeLinear, Add, ..., Mul, QuantizeLinear: 7 divisions and an erf per
element) or a MobileNet's HardSwish becomes cuvil's LookupTable (ops/quantize.py), on a
kernel that looks up 64 bytes in three instructions where the CPU has AVX-512 VBMI.

The table is the chain run on all 256 bytes by onnx's reference evaluator, which folds
constants too (frontend/fold_constants.py): each op's float32 arithmetic as the spec states
it, each QuantizeLinear rounding half to even. Runs before fuse_qdq, whose integer products
then read the table's output as they read the QuantizeLinear's.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.ops import lookup
from cuvil.compiler.ops.quantize import LOOKUP_TABLE, PRODUCT_DTYPES
from cuvil.compiler.passes.eliminate_dead_code import eliminate_dead_code

__all__ = ["quantized_lookup"]


def quantized_lookup(graph: Graph) -> Graph:
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    starts = [*graph.inputs, *(v for n in graph.nodes for v in n.outputs)]
    changed = False
    for x in starts:
        if x.type.dtype.name not in PRODUCT_DTYPES or x.const is not None:
            continue
        # x may start several chains (a HardSwish and a Sigmoid of one tensor)
        while (chain := _chain(x, order)) is not None:
            table = _table(x, chain)
            if table is None:
                break
            last = chain[-1]
            graph.replace_node(last, Node("LookupTable", [x], [], {LOOKUP_TABLE: table},
                                          name=last.name, domain="cuvil", opset=1))
            for n in reversed(chain[:-1]):  # what nothing else reads any more
                if not n.outputs[0].users and n.outputs[0] not in graph.outputs:
                    graph.remove_node(n)
            changed = True
    return eliminate_dead_code(graph) if changed else graph


def _scalar_constant(v: Value) -> bool:
    """A one-element constant, or a DequantizeLinear of one (the frontend keeps those as
    nodes for fuse_qdq)."""
    if v.const is not None:
        return v.const.size == 1
    n = v.producer
    return (n is not None and n.op_type == "DequantizeLinear" and not n.domain
            and all(i is None or (i.const is not None and i.const.size == 1) for i in n.inputs))


def _elementwise(node: Node) -> bool:
    op = lookup(node.domain, node.op_type, node.opset)
    return len(node.outputs) == 1 and op is not None and op.fusable(node)


def _chain(x: Value, order: dict[int, int]) -> list[Node] | None:
    """The longest chain (in graph order) of elementwise nodes computed from x alone that
    ends in a QuantizeLinear of x's shape; None if there is none. Its nodes whose values
    other nodes read too stay in the graph beside the table."""
    # every elementwise node whose inputs are x, results of such nodes, or scalar constants
    reached: list[Node] = []
    known = {id(x)}
    pending = sorted({id(u): u for u in x.users}.values(), key=lambda n: order.get(id(n), -1))
    seen: set[int] = set()
    while pending:
        node = pending.pop(0)
        if id(node) in seen or id(node) not in order:
            continue
        seen.add(id(node))
        if not _elementwise(node) or not all(
                v is None or id(v) in known or _scalar_constant(v) for v in node.inputs):
            continue
        reached.append(node)
        out = node.outputs[0]
        known.add(id(out))
        pending.extend(u for u in out.users if id(u) not in seen)
        pending.sort(key=lambda n: order.get(id(n), -1))
    best: list[Node] | None = None
    for end in reversed(reached):
        y = end.outputs[0]
        if (end.op_type != "QuantizeLinear" or y.type.dtype.name not in PRODUCT_DTYPES
                or y.type.shape != x.type.shape):
            continue
        chain = _ancestors(end, reached)
        if len(chain) > 1 and (best is None or len(chain) > len(best)):
            best = chain
    return best


def _ancestors(end: Node, reached: list[Node]) -> list[Node]:
    """`end` and the nodes of `reached` it depends on, in graph order."""
    members = {id(n) for n in reached}
    need = {id(end)}
    for n in reversed(reached):
        if id(n) in need:
            need.update(id(v.producer) for v in n.inputs
                        if v is not None and v.producer is not None and id(v.producer) in members)
    return [n for n in reached if id(n) in need]


def _table(x: Value, chain: list[Node]) -> np.ndarray | None:
    """The chain's result for each byte of x (index x for uint8, x + 128 for int8), by onnx's
    reference evaluator; None when it cannot run the chain."""
    names: dict[int, str] = {}

    def name(v: Value) -> str:
        return names.setdefault(id(v), f"v{len(names)}")

    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    made = {id(n) for n in chain}
    for n in chain:
        for v in n.inputs:
            if v is None or v is x or id(v) in names:
                continue
            if v.const is not None:
                inits.append(numpy_helper.from_array(v.const, name(v)))
            elif v.producer is not None and id(v.producer) not in made:  # DequantizeLinear
                nodes.append(_proto(v.producer, name))
                inits.extend(numpy_helper.from_array(i.const, name(i))
                             for i in v.producer.inputs if i is not None and i.const is not None)
        nodes.append(_proto(n, name))
    dtype = x.type.dtype
    bytes_ = (np.arange(256) - (128 if dtype == np.dtype("int8") else 0)).astype(dtype)
    y = chain[-1].outputs[0]
    model = helper.make_model(
        helper.make_graph(
            nodes, "lookup",
            [helper.make_tensor_value_info(name(x), helper.np_dtype_to_tensor_dtype(dtype), [256])],
            [helper.make_value_info(name(y), onnx.TypeProto())], inits),
        opset_imports=[helper.make_opsetid(d, max(n.opset for n in chain if n.domain == d))
                       for d in {n.domain for n in chain}])
    from onnx.reference import ReferenceEvaluator

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            evaluator = ReferenceEvaluator(model, new_ops=[_dequantize_linear()])
            (result,) = evaluator.run(None, {name(x): bytes_})
    except Exception:
        return None  # the chain compiles as it is
    result = np.asarray(result).reshape(-1)
    return result if result.size == 256 and result.dtype == y.type.dtype else None


@functools.cache
def _dequantize_linear() -> type:
    """onnx's reference DequantizeLinear for every opset: it implements the op from opset 19
    on, and for 8-bit inputs with one scale the op computed the same from opset 10 on. (Its
    newest version, which takes every attribute the schema lists.)"""
    from onnx.reference.ops import op_dequantize_linear

    newest = max((c for n, c in vars(op_dequantize_linear).items()
                  if n.startswith("DequantizeLinear_")), key=lambda c: int(c.__name__[17:]))
    return type("DequantizeLinear", (newest,), {"op_domain": ""})


def _proto(node: Node, name: Callable[[Value], str]) -> onnx.NodeProto:
    return helper.make_node(node.op_type, [name(v) if v is not None else "" for v in node.inputs],
                            [name(v) for v in node.outputs], domain=node.domain or None,
                            **node.attrs)
