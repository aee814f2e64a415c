"""Ops that move data without arithmetic: Flatten, Reshape, Squeeze, Unsqueeze, Transpose,
Concat, and Constant."""

from __future__ import annotations

import numpy as np
import sympy

from cuvil.compiler.codegen.emitter import Emitter
from cuvil.compiler.ir import Dim, Node, TensorType, numel, simplify_dim
from cuvil.compiler.ops import InferContext, Op, const_input, normalize_axis, register
from cuvil.compiler.ops.elementwise import Copy
from cuvil.errors import ModelError

ALL_DTYPES = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "bool")


@register
class Flatten(Copy):
    op_type = "Flatten"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        assert x is not None
        axis = normalize_axis(node, int(node.attrs.get("axis", 1)), x.type.rank + 1)
        shape = x.type.shape
        return [TensorType(x.type.dtype, (numel(shape[:axis]), numel(shape[axis:])))]


@register
class Reshape(Copy):
    op_type = "Reshape"
    since = 5

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        assert x is not None
        target = const_input(node, 1, "shape")
        assert target is not None
        allowzero = int(node.attrs.get("allowzero", 0))
        out: list[Dim | None] = []
        for i, d in enumerate(int(t) for t in target.reshape(-1)):
            if d == 0 and not allowzero:
                if i >= x.type.rank:
                    raise ModelError(f"{node.describe()}: shape entry {i} is 0 (copy) but the "
                                     f"input has rank {x.type.rank}")
                out.append(x.type.shape[i])
            elif d == -1:
                out.append(None)
            elif d < 0:
                raise ModelError(f"{node.describe()}: invalid shape entry {d}")
            else:
                out.append(d)
        if out.count(None) > 1:
            raise ModelError(f"{node.describe()}: more than one -1 in shape {target.tolist()}")
        total = x.type.numel
        known = numel(d for d in out if d is not None)
        if None in out:
            inferred = simplify_dim(sympy.sympify(total) / known)
            denominator = sympy.fraction(sympy.together(sympy.sympify(inferred)))[1]
            if not denominator.is_Integer:
                raise ModelError(f"{node.describe()}: cannot infer -1 in {target.tolist()} "
                                 f"from input {x.type}")
            out[out.index(None)] = inferred
            ctx.require(node, sympy.Eq(sympy.Mod(total, known), 0) if not isinstance(
                total, int) or not isinstance(known, int) else total % known == 0,
                f"input {x.type} does not reshape to {target.tolist()}")
        else:
            ctx.dims_equal(node, total, known, f"element count of {x.type} vs shape {target.tolist()}")
        return [TensorType(x.type.dtype, tuple(out))]  # type: ignore[arg-type]


@register
class Squeeze(Copy):
    op_type = "Squeeze"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        assert x is not None
        axes_raw = (const_input(node, 1, "axes") if node.opset >= 13
                    else node.attrs.get("axes"))
        shape = x.type.shape
        if axes_raw is None:
            axes = {a for a, d in enumerate(shape) if d == 1}
        else:
            axes = {normalize_axis(node, int(a), len(shape)) for a in np.reshape(axes_raw, -1)}
        for a in axes:
            ctx.dims_equal(node, shape[a], 1, f"squeezed axis {a}")
        return [TensorType(x.type.dtype, tuple(d for a, d in enumerate(shape) if a not in axes))]


@register
class Unsqueeze(Copy):
    op_type = "Unsqueeze"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        assert x is not None
        axes_raw = const_input(node, 1, "axes") if node.opset >= 13 else node.attrs.get("axes")
        if axes_raw is None:
            raise ModelError(f"{node.describe()}: axes are required")
        rank = x.type.rank + len(np.reshape(axes_raw, -1))
        axes = sorted(normalize_axis(node, int(a), rank) for a in np.reshape(axes_raw, -1))
        shape = list(x.type.shape)
        for a in axes:
            shape.insert(a, 1)
        return [TensorType(x.type.dtype, tuple(shape))]


@register
class Transpose(Op):
    op_type = "Transpose"
    dtypes = ALL_DTYPES

    def _perm(self, node: Node, rank: int) -> list[int]:
        perm = [int(p) for p in node.attrs.get("perm", range(rank - 1, -1, -1))]
        if sorted(perm) != list(range(rank)):
            raise ModelError(f"{node.describe()}: perm {perm} is not a permutation of 0..{rank - 1}")
        return perm

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        assert x is not None
        perm = self._perm(node, x.type.rank)
        return [TensorType(x.type.dtype, tuple(x.type.shape[p] for p in perm))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = node.inputs[0]
        assert x_val is not None
        perm = self._perm(node, x_val.type.rank)
        x, y = k.view(x_val), k.view(node.outputs[0])
        with k.loops(y.dims) as idx:
            src = [None] * len(perm)
            for out_axis, in_axis in enumerate(perm):
                src[in_axis] = idx[out_axis]
            k.store(y, idx, k.load(x, src))  # type: ignore[arg-type]


@register
class Concat(Op):
    op_type = "Concat"
    dtypes = ALL_DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        ins = [v for v in node.inputs if v is not None]
        if not ins:
            raise ModelError(f"{node.describe()}: needs at least one input")
        rank = ins[0].type.rank
        axis = normalize_axis(node, int(node.attrs["axis"]), rank)
        shape = list(ins[0].type.shape)
        for v in ins[1:]:
            if v.type.rank != rank or v.type.dtype != ins[0].type.dtype:
                raise ModelError(f"{node.describe()}: inputs {ins[0].type} and {v.type} differ "
                                 "in rank or dtype")
            for a in range(rank):
                if a != axis:
                    ctx.dims_equal(node, shape[a], v.type.shape[a], f"axis {a}")
            shape[axis] = simplify_dim(shape[axis] + v.type.shape[axis])
        return [TensorType(ins[0].type.dtype, tuple(shape))]

    def lower(self, node: Node, k: Emitter) -> None:
        y_val = node.outputs[0]
        rank = y_val.type.rank
        axis = normalize_axis(node, int(node.attrs["axis"]), rank)
        outer = numel(y_val.type.shape[:axis])
        inner_y = numel(y_val.type.shape[axis:])
        itemsize = y_val.type.dtype.itemsize
        offset: Dim = 0
        for v in node.inputs:
            if v is None:
                continue
            chunk = numel(v.type.shape[axis:])
            src = k.contiguous(k.buffers[v], np.uint8, (outer, chunk * itemsize))
            dst = k.contiguous(k.buffers[y_val], np.uint8, (outer, inner_y * itemsize))
            with k.loop(k.dim(outer), name="outer") as o:
                s = k.element_ptr(src, k.offset(src, [o, k.i64(0)]))
                d = k.element_ptr(dst, k.b.add(k.offset(dst, [o, k.i64(0)]),
                                               k.dim(offset * itemsize)))
                k.memcpy(d, s, k.dim(chunk * itemsize))
            offset = simplify_dim(offset + chunk)


@register
class Constant(Op):
    """Constant nodes become constant values in the frontend; this rule types them."""

    op_type = "Constant"
    dtypes = ALL_DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        value = node.outputs[0].const
        if value is None:
            raise ModelError(f"{node.describe()}: the Constant node has no supported value")
        return [TensorType(value.dtype, value.shape)]
