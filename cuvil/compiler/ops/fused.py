"""cuvil's Fused: a chain of elementwise nodes computed in one loop (passes/fuse_elementwise.py).

Each member reads its operands and writes one element per output element (`Op.fusable`,
`Op.element`): the fused loop loads the chain's operands from outside once per element and
passes each member's result to the members that read it in registers, where the nodes alone
wrote and read back a tensor each (a QDQ model's Gelu, DequantizeLinear -> Div -> Erf ->
QuantizeLinear ..., streamed 1.5 MB per step through a cache that no longer held them).

The node's inputs are what the chain reads from outside; its attribute `STEPS` lists the
members in order, each as (op_type, domain, opset, attributes, operand references): a
reference i >= 0 is input i of the Fused node, -(j + 1) the result of member j, None an
absent optional input. Every member's output has the Fused node's shape (the pass checks), so
the loop runs over it once. The members are rebuilt from `STEPS` (`members`) for their own
shape rules and lowerings: the result is theirs, bit for bit.
"""

from __future__ import annotations

import math

from llvmlite import ir

from cuvil.compiler.ir import Node, TensorType, Value
from cuvil.compiler.kernels.emitter import Emitter
from cuvil.compiler.ops import UNCHECKED, InferContext, Op, lookup, register
from cuvil.compiler.ops.elementwise import emit_elementwise
from cuvil.errors import ModelError

#: the Fused node's members (module docstring)
STEPS = "cuvil.steps"
#: vector iterations the loop runs side by side: a chain's steps depend on each other, and
#: LLVM, seeing a long body, interleaves none; a QDQ BERT's Gelu (12 steps, 7 divisions) took
#: 513 us a layer so, 446 with 2, 331 with 4 (343 as 12 loops), one thread of a Zen 4
INTERLEAVE = 4


def members(node: Node, ctx: InferContext) -> list[tuple[Node, Op]]:
    """The member nodes `STEPS` describes and their ops, the outputs typed by the members' own
    shape rules (outside any graph: their outputs are new values, read by the later members)."""
    made: list[tuple[Node, Op]] = []
    for j, (op_type, domain, opset, attrs, refs) in enumerate(node.attrs[STEPS]):
        inputs = [None if r is None else node.inputs[r] if r >= 0 else made[-r - 1][0].outputs[0]
                  for r in refs]
        member = Node(op_type, inputs, [], dict(attrs), name=f"{node.name}/{op_type}_{j}",
                      domain=domain, opset=opset)
        op = lookup(domain, op_type, opset)
        if op is None or not op.fusable(member):  # pragma: no cover - the pass made them
            raise ModelError(f"{node.describe()}: member {j} ({op_type}) is not elementwise")
        (out,) = op.infer(member, ctx)
        member.outputs = [Value(f"{node.name}.{j}", out)]
        made.append((member, op))
    return made


def _scalar(v: Value) -> float | int | None:
    """A constant of one finite element, which the loop gets as an immediate: every pointer it
    reads is one more overlap check before LLVM vectorizes it, and past 8 it does not (a QDQ
    Gelu reads some 20 scales and zero points)."""
    if v.const is None or v.const.size != 1:
        return None
    x = v.const.reshape(-1)[0].item()
    return x if not isinstance(x, float) or math.isfinite(x) else None


@register
class Fused(Op):
    op_type = "Fused"
    domain = "cuvil"
    dtypes = ()  # its members check theirs

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        return [members(node, ctx)[-1][0].outputs[0].type]

    def path(self, node: Node) -> str:
        return "+".join(step[0] for step in node.attrs[STEPS])

    def lower(self, node: Node, k: Emitter) -> None:
        chain = members(node, UNCHECKED)
        results = {id(m.outputs[0]): j for j, (m, _) in enumerate(chain)}
        loaded: list[Value] = []  # what the loop reads, each once
        slots: dict[int, int] = {}
        bodies = []
        cost = 0
        for m, op in chain:
            form = op.element(m, k)
            refs: list[int | ir.Value] = []  # >= 0: loaded; < 0: member -(j + 1)'s result
            for v in form.operands:
                if id(v) in results:
                    refs.append(-results[id(v)] - 1)
                elif (scalar := _scalar(v)) is not None:
                    refs.append(k.const(v.type.dtype, scalar))
                else:
                    if id(v) not in slots:
                        slots[id(v)] = len(loaded)
                        loaded.append(v)
                    refs.append(slots[id(v)])
            bodies.append((form.fn, refs))
            cost += form.cost

        def fn(k: Emitter, xs: list[ir.Value]) -> ir.Value:
            done: list[ir.Value] = []
            for body, refs in bodies:
                done.append(body(k, [r if isinstance(r, ir.Value) else xs[r] if r >= 0
                                     else done[-r - 1] for r in refs]))
            return done[-1]

        emit_elementwise(k, node.outputs[0], loaded, fn, cost, interleave=INTERLEAVE)
