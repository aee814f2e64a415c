"""Einsum: the equation is parsed at compile time into one label per operand axis.

float32 contractions of two operands over one summed label become MatMul between Transposes
before this lowering sees them (passes/einsum_as_matmul.py). Other two-operand contractions
without labels private to one operand (several summed labels, outer products, other dtypes)
run on the matrix kernel of `gemm.py`: one label of
each kind (rows, contraction, columns) becomes the matrix, every other label an outer loop.
Everything else (transposes, reductions, diagonals and traces, three or more operands,
float16, integers) runs as one loop nest over the output with the contraction summed in a
register. Sizes broadcast as onnxruntime and numpy do (a dim of 1 against any size).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from cuvil.compiler.ir import Dim, Node, TensorType
from cuvil.compiler.kernels.emitter import Emitter, View
from cuvil.compiler.ops import (
    UNCHECKED,
    InferContext,
    Op,
    attr,
    broadcast_shapes,
    compute_dtype,
    register,
    required_input,
)
from cuvil.compiler.ops._window import entry_alloca
from cuvil.compiler.ops.gemm import emit_matmul, emit_matmul_dot, prefers_dot
from cuvil.errors import ModelError

_TERM = re.compile(r"^[A-Za-z]*(\.\.\.)?[A-Za-z]*$")


@dataclass(frozen=True)
class Equation:
    """Labels per operand axis and of the output. Letters are their own labels; the dims an
    ellipsis stands for are labelled "...0", "...1"... right-aligned across operands."""

    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]

    @property
    def labels(self) -> list[str]:
        """Output labels first, then the summed ones in order of appearance."""
        seen = list(self.output)
        for term in self.inputs:
            for lab in term:
                if lab not in seen:
                    seen.append(lab)
        return seen

    @property
    def summed(self) -> list[str]:
        return [lab for lab in self.labels if lab not in self.output]


def parse_equation(node: Node, ranks: list[int]) -> Equation:
    text = str(attr(node, "equation"))
    eq = text.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ModelError(f"{node.describe()}: equation {text!r} has {len(terms)} input terms but "
                         f"the node has {len(ranks)} inputs")
    if not all(_TERM.match(t) for t in terms) or (arrow and not _TERM.match(rhs)):
        raise ModelError(f"{node.describe()}: equation {text!r} is malformed: each term is letters "
                         "a-z, A-Z with at most one '...'")
    ellipsis_rank = 0
    spans = []
    for i, (term, rank) in enumerate(zip(terms, ranks)):
        n_letters = len(term.replace("...", ""))
        extra = rank - n_letters
        if extra < 0 or (extra and "..." not in term):
            raise ModelError(f"{node.describe()}: term {term!r} of equation {text!r} names "
                             f"{n_letters} axes but input {i} has rank {rank}")
        spans.append(extra)
        ellipsis_rank = max(ellipsis_rank, extra)

    def expand(term: str, extra: int) -> tuple[str, ...]:
        head, dots, tail = term.partition("...")
        middle = [f"...{ellipsis_rank - extra + j}" for j in range(extra)] if dots else []
        return (*head, *middle, *tail)

    inputs = tuple(expand(t, e) for t, e in zip(terms, spans))
    if arrow:
        output = expand(rhs, ellipsis_rank) if "..." in rhs else tuple(rhs)
        letters = [lab for lab in output if not lab.startswith("...")]
        if len(set(letters)) != len(letters):
            raise ModelError(f"{node.describe()}: the output of equation {text!r} repeats a label")
        known = {lab for term in inputs for lab in term}
        missing = [lab for lab in letters if lab not in known]
        if missing:
            raise ModelError(f"{node.describe()}: output labels {missing} of equation {text!r} "
                             "appear in no input")
    else:
        # implicit output: the ellipsis dims, then the letters used once, in ASCII order (numpy's)
        counts: dict[str, int] = {}
        for labels in inputs:
            for lab in labels:
                counts[lab] = counts.get(lab, 0) + 1
        once = sorted(lab for lab, c in counts.items() if c == 1 and not lab.startswith("..."))
        output = (*[f"...{j}" for j in range(ellipsis_rank) if any("..." in t for t in terms)],
                  *once)
    return Equation(inputs, tuple(output))


def label_sizes(node: Node, ctx: InferContext, eq: Equation) -> dict[str, Dim]:
    """The size of every label: its dims in all operands, broadcast (1 against any size)."""
    dims: dict[str, list[Dim]] = {}
    for term, v in zip(eq.inputs, node.inputs):
        assert v is not None
        for lab, d in zip(term, v.type.shape):
            dims.setdefault(lab, []).append(d)
    return {lab: broadcast_shapes(node, ctx, *[(d,) for d in ds])[0] for lab, ds in dims.items()}


@register
class Einsum(Op):
    op_type = "Einsum"
    since = 12
    dtypes = ("float32", "float64", "float16", "int32", "int64")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        if any(v is None for v in node.inputs) or not node.inputs:
            raise ModelError(f"{node.describe()}: Einsum needs at least one input, none empty")
        dtypes = {v.type.dtype for v in node.inputs if v is not None}
        if len(dtypes) > 1:
            raise ModelError(f"{node.describe()}: inputs have different dtypes "
                             f"({', '.join(sorted(str(d) for d in dtypes))}); they must match")
        eq = parse_equation(node, [v.type.rank for v in node.inputs if v is not None])
        sizes = label_sizes(node, ctx, eq)
        x = required_input(node, 0)
        return [TensorType(x.type.dtype, tuple(sizes[lab] for lab in eq.output))]

    def lower(self, node: Node, k: Emitter) -> None:
        eq = parse_equation(node, [v.type.rank for v in node.inputs if v is not None])
        sizes = label_sizes(node, UNCHECKED, eq)
        labels = eq.labels
        ops = [label_view(k, k.view(v), term, labels, sizes)
               for v, term in zip(node.inputs, eq.inputs) if v is not None]
        y = label_view(k, k.view(node.outputs[0]), eq.output, labels, sizes)
        if _matmul_like(eq) and y.dtype.kind == "f" and compute_dtype(y.dtype) == y.dtype:
            _emit_contraction(k, eq, labels, ops[0], ops[1], y, node.outputs[0].type.nbytes)
        else:
            _emit_loops(k, eq, labels, ops, y)


def label_view(k: Emitter, view: View, axes: tuple[str, ...], labels: list[str],
               sizes: dict[str, Dim]) -> View:
    """`view` indexed by `labels` instead of its axes: a label the tensor lacks, or holds as a
    broadcast dim of 1, gets stride 0; a label on several axes (a diagonal) the sum of theirs."""
    zero = k.i64(0)
    strides = []
    for lab in labels:
        s = zero
        for axis, a_lab in enumerate(axes):
            d = view.shape[axis]
            if a_lab != lab or (isinstance(d, int) and d == 1):
                continue
            s = view.strides[axis] if s is zero else k.b.add(s, view.strides[axis])
        strides.append(s)
    return replace(view, dims=tuple(k.dim(sizes[lab]) for lab in labels), strides=tuple(strides),
                   shape=tuple(sizes[lab] for lab in labels))


def _matmul_like(eq: Equation) -> bool:
    if len(eq.inputs) != 2:
        return False
    a, b = eq.inputs
    if len(set(a)) != len(a) or len(set(b)) != len(b):
        return False
    # a label summed within one operand needs its own reduction first
    return all((lab in a) + (lab in b) + (lab in eq.output) >= 2 for lab in eq.labels)


def _emit_contraction(k: Emitter, eq: Equation, labels: list[str], a: View, b: View, y: View,
                      nbytes: Dim) -> None:
    """y = a . b as matrix products: the last row, column and contraction labels form the
    matrices, the other labels are loops around them."""
    ta, tb = eq.inputs
    rows = [lab for lab in eq.output if lab in ta and lab not in tb]
    cols = [lab for lab in eq.output if lab in tb and lab not in ta]
    inner = eq.summed
    outer = [lab for lab in eq.output if lab not in rows[-1:] + cols[-1:]]
    outer_sum = inner[:-1]
    pos = {lab: i for i, lab in enumerate(labels)}
    one, zero = k.i64(1), k.i64(0)

    def matrix(v: View, r: str | None, c: str | None) -> View:
        dims = (v.dims[pos[r]] if r else one, v.dims[pos[c]] if c else one)
        strides = (v.strides[pos[r]] if r else zero, v.strides[pos[c]] if c else zero)
        return replace(v, dims=dims, strides=strides,
                       shape=(v.shape[pos[r]] if r else 1, v.shape[pos[c]] if c else 1))

    row = rows[-1] if rows else None
    col = cols[-1] if cols else None
    red = inner[-1] if inner else None
    if outer_sum:
        # the extra contraction labels accumulate into y across matrix products
        k.memset(y.ptr, 0, k.dim(nbytes))
    loop_labels = outer + outer_sum
    with k.loops([a.dims[pos[lab]] for lab in loop_labels], name="l") as idx:
        index = dict(zip(loop_labels, idx))

        def at(v: View) -> View:
            off = k.offset(replace(v, strides=tuple(v.strides[pos[lab]] for lab in loop_labels)),
                           [index[lab] for lab in loop_labels])
            return replace(v, ptr=k.element_ptr(v, off))

        a2, b2, y2 = matrix(at(a), row, red), matrix(at(b), red, col), matrix(at(y), row, col)
        if prefers_dot(a2, b2):
            emit_matmul_dot(k, a2, b2, y2, c=y2 if outer_sum else None)
        else:
            emit_matmul(k, a2, b2, y2, accumulate=bool(outer_sum))


def _emit_loops(k: Emitter, eq: Equation, labels: list[str], ops: list[View], y: View) -> None:
    """One loop nest: for each output element, the sum over the summed labels of the product
    of the operands, accumulated in a register of the compute dtype."""
    dtype = y.dtype
    ct = compute_dtype(dtype)
    b = k.b
    acc = entry_alloca(k, k.const(ct, 0).type, "acc")
    n_out = len(eq.output)
    with k.loops(y.dims[:n_out], name="o") as oidx:
        b.store(k.const(ct, 0), acc)
        with k.loops(y.dims[n_out:], name="s") as sidx:
            idx = [*oidx, *sidx]
            prod = None
            for v in ops:
                x = k.convert(k.load(v, idx), v.dtype, ct)
                prod = x if prod is None else k.mul(ct, prod, x)
            assert prod is not None
            cur = b.load(acc)
            b.store(k.fadd_reduce(cur, prod) if ct.kind == "f" else b.add(cur, prod), acc)
        k.store(y, [*oidx, *[k.i64(0)] * (len(labels) - n_out)],
                k.convert(b.load(acc), ct, dtype))


__all__ = ["Einsum", "Equation", "label_sizes", "label_view", "parse_equation"]
